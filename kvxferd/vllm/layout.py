"""vLLM's KV cache, described as a kvxferd geometry. Pure: no vLLM, no torch.

The worker reads each layer's cache tensor (shape, strides, where it starts in its backing
allocation) and each cache group's spec, and this module turns them into the `Geometry`
the daemon plans with. Nothing here is per-model transfer code: once described, every
family (full and sliding-window attention, MLA, Mamba2/GDN state) is moved by the one planner.

vLLM 0.32 hands every attention layer, on every backend, a 4-D view `[B, H, N, C]` of one
shared buffer (blocks, KV heads, tokens per kernel page, bytes of content per token: K|V, or an
MLA latent), with strides set by the engine's `KVCacheLayout`:

    LBHNC (head-major, what the connector asks for): page = | head 0: tok 0 .. tok N-1 | head 1: ... |
          each head's area contiguous: heads are the TP sharding unit, tokens are rows of C bytes
    LBNHC (token-major):  page = | tok 0: head 0 .. head H-1 | tok 1: ... |    same heads on both sides only
    BLHNC / BLNHC (block-outermost): the same pages, spaced wider (other layers' pages between them)
    LHBNC / BHLNC: a head's pages are not together with the block's other heads: refused by name

    layer l, block b:  buffer + layer offset + b * stride[B]          (kernel page b)
                       + h * stride[H] + n * stride[N]                 (head h, token n)

vLLM's CPU attention splits a head's area in two, K then V (`kv_split`, found by the worker
with the kernel itself), each N x D/2 elements of C = K|V:

    head h: | K: element 0 of tok 0..N-1 | element 1 ... |  V: tok 0 | tok 1 | ... tok N-1 |
            k_transposed: one lane per K element (token-addressable, so blocks translate)
            k_rows: K in token rows like V;  sealed: an order not confirmed, the head moves whole

A Mamba/GDN layer's view is `[B, 1, 1, state bytes]` (int8), its page padded to the
attention page; the states follow one another from byte 0 (`state_segments`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan import dtypes
from ..plan.geometry import (
    ATTENTION,
    STATE,
    TOKEN_MAJOR,
    UNIT_MAJOR,
    UNIT_SEALED,
    CacheGroup,
    Geometry,
    GeometryError,
    Region,
    Segment,
    SegmentLayout,
    View,
    shard,
    validate,
)

KV_SPLITS = ("k_transposed", "k_rows", "sealed")  # how CPU attention orders K inside a head's K area


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache tensor as the worker found it (strides in elements)."""

    name: str
    group: int  # index of its KV cache group
    buffer: int  # index of its backing allocation
    offset: int  # bytes from the buffer's start to element [0, 0, 0, 0]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int  # bytes per element of this tensor (vLLM views state caches as bytes)


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a Mamba-style layer, per rank, as vLLM's MambaSpec gives it."""

    shape: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class GroupSpec:
    """What vLLM's KV cache spec says of one cache group."""

    kind: str  # "attention" or "state"
    block_size: int  # tokens per block as the scheduler counts them
    spec_name: str = ""  # vLLM's spec class, for error messages
    total_kv_heads: int = 0  # attention: across all TP ranks (1 for an MLA latent)
    head_bytes: int = 0  # attention: bytes of one token of one head (K|V, or the latent)
    kv_split: str = ""  # attention: "" (a token's K|V together), or CPU's K-then-V heads (KV_SPLITS)
    mamba_type: str = ""  # state: "mamba2", "gdn", "mamba1", or another (sharded by first dim)
    states: tuple[StateTensor, ...] = ()  # state: conv state first, then the temporal (SSM) state
    conv_layout: str = "DS"  # state: "DS" (channels, width) or "SD" (width, channels)
    replicated: bool = False  # state: every rank holds the whole state (vLLM's tp_replicated)


def geometry(model: str, dtype: str, tp_size: int, tp_rank: int, buffers: list[int],
             groups: list[GroupSpec], layers: list[LayerCache], weights: str = "") -> Geometry:
    """The geometry of one vLLM worker's KV cache. Raises GeometryError naming what it cannot describe.

    Groups may overlay the same bytes (vLLM's hybrid allocator: each group owns other block
    ids of one buffer): each keeps its own views of the shared regions. Within one group, a
    layer at the same place as another shares its cache (cross-layer KV sharing): one view.
    """
    regions: list[Region] = []
    region_at: dict[tuple[int, int, int], int] = {}
    seen: dict[tuple[int, int, int], LayerCache] = {}
    views: dict[int, list[View]] = {g: [] for g in range(len(groups))}
    pages_per_block: dict[int, int] = {}
    for layer in layers:
        if not 0 <= layer.group < len(groups):
            raise GeometryError(f"layer {layer.name}: cache group {layer.group} does not exist")
        first = seen.setdefault((layer.group, layer.buffer, layer.offset), layer)
        if first is not layer:  # sharing another layer's cache: the same view, or a cache we misread
            if (first.shape, first.stride, first.itemsize) != (layer.shape, layer.stride, layer.itemsize):
                raise GeometryError(f"layer {layer.name} starts where {first.name} does but is shaped "
                                    f"{layer.shape} strides {layer.stride}, not {first.shape} {first.stride}")
            continue
        spec = groups[layer.group]
        if spec.kind == ATTENTION:
            stride, segments, num_pages, per_block = _attention_layout(layer, spec, tp_size, tp_rank)
            if pages_per_block.setdefault(layer.group, per_block) != per_block:
                raise GeometryError(f"layer {layer.name}: {per_block} kernel pages per block, other layers of "
                                    f"group {layer.group} have {pages_per_block[layer.group]}")
        elif spec.kind == STATE:
            stride, segments, num_pages = _state_layout(layer, spec, tp_size, tp_rank)
        else:
            raise GeometryError(f"layer {layer.name}: cache group {layer.group} is {spec.spec_name or spec.kind}, "
                                "neither attention nor state")
        extent = max(s.offset + s.extent for s in segments)
        key = (layer.buffer, layer.offset, (num_pages - 1) * stride + extent)
        if key not in region_at:
            region_at[key] = len(regions)
            regions.append(Region(*key))
        views[layer.group].append(View(layer.name, region_at[key], stride, num_pages, tuple(segments)))
    cache_groups = []
    for g, vs in views.items():
        if not vs:  # requests name every group's blocks: a group with no layers could not be read
            raise GeometryError(f"cache group {g} ({groups[g].spec_name or groups[g].kind}) has no layers among "
                                "the caches vLLM registered")
        spec = groups[g]
        per_block = pages_per_block.get(g, 1)
        tokens = spec.block_size if spec.kind == ATTENTION else 0
        cache_groups.append(CacheGroup(f"g{g}", ATTENTION if spec.kind == ATTENTION else STATE, tokens, per_block,
                                       tuple(vs)))
    if not cache_groups:
        raise GeometryError("no KV cache groups in the caches vLLM registered")
    return validate(Geometry(model, dtypes.canonical(dtype), tp_size, tp_rank, tuple(buffers), tuple(regions),
                             tuple(cache_groups), weights))


def _attention_layout(layer: LayerCache, spec: GroupSpec, tp_size: int,
                      tp_rank: int) -> tuple[int, list[Segment], int, int]:
    """(page stride, segments, kernel pages, kernel pages per block) of one attention layer's view."""
    where = f"layer {layer.name}"
    shape, stride = _squeeze_to_bhnc(layer)
    pages, heads, tokens, content = shape
    s_page, s_head, s_token, s_content = stride
    item = layer.itemsize
    if s_content != 1:
        raise GeometryError(f"{where}: strides {layer.stride} for shape {layer.shape}: a token's content is not "
                            "contiguous")
    token_bytes = content * item
    if spec.head_bytes and token_bytes != spec.head_bytes:
        raise GeometryError(f"{where}: a token of one head holds {token_bytes} B, the cache spec says "
                            f"{spec.head_bytes} B")
    if spec.block_size % tokens:
        raise GeometryError(f"{where}: {tokens} tokens per kernel page do not divide the block of "
                            f"{spec.block_size} tokens")
    start, stop = shard(spec.total_kv_heads, tp_size, tp_rank, f"{where} kv heads")
    if stop - start != heads:
        raise GeometryError(f"{where}: holds {heads} kv heads, but {spec.total_kv_heads} heads over TP {tp_size} "
                            f"give rank {tp_rank} {stop - start}")
    layout: SegmentLayout
    if s_token == content and (heads == 1 or s_head == tokens * content):
        layout = UNIT_MAJOR  # LBHNC, BLHNC (and any layout when H = 1)
    elif s_head == content and s_token == heads * content:
        layout = TOKEN_MAJOR  # LBNHC, BLNHC
    else:
        raise GeometryError(f"{where}: strides {layer.stride} for shape {layer.shape} spread one block's heads "
                            "apart (LHBNC/BHLNC); run vLLM with VLLM_KV_CACHE_LAYOUT=LBHNC (the connector's "
                            "default)")
    if s_page * item < heads * tokens * token_bytes:
        raise GeometryError(f"{where}: pages of {s_page * item} B overlap (a page holds "
                            f"{heads * tokens * token_bytes} B)")
    if spec.kv_split and layout == UNIT_MAJOR:
        segments = _split_heads(spec, (start, stop), tokens, token_bytes, item, where)
    else:
        segments = [Segment("kv", 0, spec.total_kv_heads, start, stop, tokens, token_bytes, layout)]
    return s_page * item, segments, pages, spec.block_size // tokens


def _split_heads(spec: GroupSpec, units: tuple[int, int], tokens: int, token_bytes: int, item: int,
                 where: str) -> list[Segment]:
    """CPU attention's heads: K (`kv_split`) then V, two segments interleaved head by head."""
    half, head = token_bytes // 2, tokens * token_bytes  # K or V of one token; one head's area
    total = spec.total_kv_heads
    if spec.kv_split == "sealed":
        return [Segment("kv", 0, total, *units, tokens, token_bytes, UNIT_SEALED)]
    if spec.kv_split == "k_transposed":
        k = Segment("k", 0, total, *units, tokens, item, lanes=half // item, stride=head)
    elif spec.kv_split == "k_rows":
        k = Segment("k", 0, total, *units, tokens, half, stride=head)
    else:
        raise GeometryError(f"{where}: kv_split {spec.kv_split!r} is none of {', '.join(KV_SPLITS)}")
    return [k, Segment("v", tokens * half, total, *units, tokens, half, stride=head)]


def _squeeze_to_bhnc(layer: LayerCache) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """[B, H, N, C] as vLLM hands it; MLA backends may squeeze the single head away ([B, N, C])."""
    if len(layer.shape) == 4 and len(layer.stride) == 4:
        return layer.shape, layer.stride
    if len(layer.shape) == 3 and len(layer.stride) == 3:
        b, n, c = layer.shape
        sb, sn, sc = layer.stride
        return (b, 1, n, c), (sb, n * sn, sn, sc)
    raise GeometryError(f"layer {layer.name}: cache shaped {layer.shape}; kvxferd describes vLLM's "
                        "[blocks, heads, tokens, content] views")


def _state_layout(layer: LayerCache, spec: GroupSpec, tp_size: int,
                  tp_rank: int) -> tuple[int, list[Segment], int]:
    """(page stride, segments, pages) of one Mamba-style layer's view [B, 1, 1, bytes]."""
    where = f"layer {layer.name}"
    if len(layer.shape) != 4 or layer.shape[1:3] != (1, 1) or layer.stride[3] != 1:
        raise GeometryError(f"{where}: state cache shaped {layer.shape} strides {layer.stride}; kvxferd "
                            "describes vLLM's [blocks, 1, 1, state bytes] views")
    segments = state_segments(spec, tp_size, tp_rank, where)
    used = max(s.offset + s.nbytes for s in segments)
    if used > layer.shape[3] * layer.itemsize:
        raise GeometryError(f"{where}: the states take {used} B, the page holds {layer.shape[3] * layer.itemsize} B")
    return layer.stride[0] * layer.itemsize, segments, layer.shape[0]


def state_segments(spec: GroupSpec, tp_size: int, tp_rank: int, where: str = "state") -> list[Segment]:
    """One state page as segments, each sharded on its own across TP, one "token" per page.

    The conv state holds, per rank, the local channels of several projections back to back
    (Mamba2: x | B | C; GDN: q | k | v), each sharded over TP on its own; the temporal (SSM)
    state is sharded by heads. DS stores the conv state channel by channel, so each part is
    one run of channels; SD stores it row by row (one row per conv tap), so each part is one
    run per row:

        DS page: | x ch 0 .. | B ch .. | C ch .. | ssm head 0 | head 1 | ... |   padding |
        SD page: | row 0: x | B | C | row 1: x | B | C | ... | ssm heads ... |   padding |
    """
    if len(spec.states) < 2:
        raise GeometryError(f"{where}: {spec.spec_name or 'state spec'} with {len(spec.states)} state tensors; "
                            "kvxferd describes a conv state followed by a temporal state")
    conv, temporal = spec.states[0], spec.states[1]
    if len(conv.shape) != 2:
        raise GeometryError(f"{where}: conv state shaped {conv.shape}; expected two dimensions")
    channels, width = conv.shape if spec.conv_layout == "DS" else conv.shape[::-1]
    parts = _conv_parts(spec, channels, temporal.shape, where)
    out: list[Segment] = []
    offset = 0

    def add(name: str, local_units: int, unit_bytes: int) -> None:
        nonlocal offset
        total = local_units if spec.replicated else local_units * tp_size
        start, stop = (0, total) if spec.replicated else shard(total, tp_size, tp_rank, f"{where} {name}")
        out.append(Segment(name, offset, total, start, stop, 1, unit_bytes))
        offset += local_units * unit_bytes

    if spec.conv_layout == "DS":
        for name, units, channels_per_unit in parts:
            add(f"conv_{name}", units, channels_per_unit * width * conv.itemsize)
    elif spec.conv_layout == "SD":
        for row in range(width):
            for name, units, channels_per_unit in parts:
                add(f"conv_{name}@{row}", units, channels_per_unit * conv.itemsize)
    else:
        raise GeometryError(f"{where}: conv state layout {spec.conv_layout!r}; vLLM's are DS and SD")
    heads = temporal.shape[0]
    add("ssm", heads, math.prod(temporal.shape[1:]) * temporal.itemsize)
    for extra_state in spec.states[2:]:  # further states (none in Mamba2/GDN): whole, by first dim
        add(f"state{len(out)}", extra_state.shape[0], math.prod(extra_state.shape[1:]) * extra_state.itemsize)
    return out


def _conv_parts(spec: GroupSpec, channels: int, temporal: tuple[int, ...],
                where: str) -> list[tuple[str, int, int]]:
    """(name, local units, channels per unit) of the projections the conv state concatenates.

    Mamba2 (x | B | C) and GDN (q | k | v) alike: one projection has the temporal state's heads
    (heads x head_dim channels), the other two are equal runs of whole units of its last dimension.
    """
    if spec.mamba_type not in ("mamba2", "gdn") or len(temporal) != 3:
        return [("x", channels, 1)]  # one projection (Mamba1 and others): channels shard as they are
    heads, head_dim, unit = temporal
    pair = channels - heads * head_dim
    if pair < 0 or pair % (2 * unit):
        raise GeometryError(f"{where}: {'Mamba2' if spec.mamba_type == 'mamba2' else 'GDN'} conv state of "
                            f"{channels} channels does not split into {heads} heads x {head_dim} and two "
                            f"projections of whole units of {unit}")
    units = pair // 2 // unit
    if spec.mamba_type == "mamba2":
        return [("x", heads, head_dim), ("B", units, unit), ("C", units, unit)]
    return [("q", units, unit), ("k", units, unit), ("v", heads, head_dim)]


KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM 0.32's KVCacheLayout


def layer_caches(order: str, layers: int, blocks: int, heads: int, tokens: int, content: int, itemsize: int,
                 group: int = 0, prefix: str = "model.layers") -> tuple[int, list[LayerCache]]:
    """How vLLM 0.32 lays out one group's attention layers in one buffer for a KVCacheLayout
    (`order`, outermost dimension first), as its allocator does for every backend: dense strides
    in [L, B, H, N, C] stored in that order, one [B, H, N, C] view per layer.

    Returns (buffer bytes, the layers' caches) with strides in elements of `itemsize`.
    """
    if sorted(order) != sorted("LBHNC") or order not in KV_CACHE_LAYOUTS:
        raise GeometryError(f"KV cache layout {order!r}; vLLM's are {', '.join(KV_CACHE_LAYOUTS)}")
    sizes = {"L": layers, "B": blocks, "H": heads, "N": tokens, "C": content}
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    caches = [LayerCache(f"{prefix}.{i}.attn", group, 0, i * strides["L"] * itemsize,
                         tuple(sizes[d] for d in "BHNC"), tuple(strides[d] for d in "BHNC"), itemsize)
              for i in range(layers)]
    return step * itemsize, caches
