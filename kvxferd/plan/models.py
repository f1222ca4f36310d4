"""Geometry builders: from a model shape, a TP size and a rank to that rank's Geometry.

Every builder lays out one buffer holding all regions back to back. Real engines hand
their own layout to the daemon; these builders give the synthetic engine, the tests and
`kvxferd plan` the layouts vLLM uses:

  dense HND     per layer a K region and a V region, page = [heads, tokens, head_dim]
  dense NHD     same regions, page = [tokens, heads, head_dim]
  blocks-first  per layer one region, page = [K heads | V heads] (FlashInfer)
  mla           per layer one region, page = [tokens, latent], replicated on every rank
  mamba2 / gdn  attention (blocks-first) and SSM layers share regions; an SSM page spans
                `phys` attention kernel pages and holds [conv x | conv B | conv C | ssm]
                (GDN: [conv q | conv k | conv v | ssm])
  gemma4        sliding-window and full attention groups with different KV heads and
                head dims; the full group's tokens per block follow from equal page sizes
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from . import dtypes
from .geometry import (
    ATTENTION,
    STATE,
    TOKEN_MAJOR,
    UNIT_MAJOR,
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


class ModelShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Literal["dense", "mla", "mamba2", "gdn", "gemma4"] = "dense"
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    block_size: int = 16  # tokens per logical block
    kernel_block_size: int = 0  # tokens per kernel page; 0: same as block_size
    # hnd, nhd, blocks-first: the layouts above; LBHNC ... BHLNC: vLLM 0.32's KVCacheLayout, as its
    # allocator lays out every backend's cache (dense and mla only; described by the connector's code)
    layout: Literal["hnd", "nhd", "blocks-first", "LBHNC", "LBNHC", "BLHNC", "BLNHC"] = "hnd"
    num_blocks: int = 64
    latent_dim: int = 576  # MLA: kv_lora_rank + rope dim
    ssm_layers: int = 2  # hybrid: SSM layers (attention layers are `layers`)
    ssm_heads: int = 8  # mamba2: heads; gdn: value heads
    ssm_head_dim: int = 16
    ssm_state: int = 16
    ssm_groups: int = 2  # mamba2: B/C groups; gdn: key heads
    conv_kernel: int = 4
    full_layers: int = 1  # gemma4: full-attention layers (sliding-window ones are `layers`)
    full_kv_heads: int = 2
    full_head_dim: int = 256

    @property
    def dtype_bytes(self) -> int:
        return dtypes.itemsize(self.dtype)

    def identity(self) -> str:
        """A TP-independent name for the model: the fields of its kind, not per-engine choices."""
        fields = {k: dtypes.canonical(self.dtype) if k == "dtype" else getattr(self, k) for k in _IDENTITY[self.kind]}
        return self.kind + ":" + ",".join(f"{k}={v}" for k, v in fields.items())


_ATTN = ("layers", "kv_heads", "head_dim", "dtype")
_SSM = ("ssm_layers", "ssm_heads", "ssm_head_dim", "ssm_state", "ssm_groups", "conv_kernel")
_IDENTITY = {
    "dense": _ATTN,
    "mla": ("layers", "latent_dim", "dtype"),
    "mamba2": _ATTN + _SSM,
    "gdn": _ATTN + _SSM,
    "gemma4": (*_ATTN, "full_layers", "full_kv_heads", "full_head_dim"),
}

PRESETS: dict[str, ModelShape] = {
    "dense": ModelShape(),
    "mla": ModelShape(kind="mla", layers=4, kv_heads=1, block_size=16),
    "mamba2": ModelShape(kind="mamba2", layers=2, ssm_layers=2, kv_heads=4, head_dim=32,
                         block_size=16, layout="blocks-first"),
    "gdn": ModelShape(kind="gdn", layers=2, ssm_layers=2, kv_heads=4, head_dim=32,
                      ssm_heads=8, ssm_groups=4, layout="blocks-first"),
    "gemma4": ModelShape(kind="gemma4", layers=2, full_layers=1, kv_heads=8, head_dim=32,
                         full_kv_heads=2, full_head_dim=64, layout="blocks-first"),
}


def build(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    """The geometry of rank `tp_rank` of an engine running `shape` at TP `tp_size`."""
    if shape.block_size < 1 or shape.num_blocks < 1 or shape.layers < 1:
        raise GeometryError("block_size, num_blocks and layers must be positive")
    if shape.layout.isupper():
        return _vllm_layout(shape, tp_size, tp_rank)
    builder = {"dense": _dense, "mla": _mla, "mamba2": _hybrid, "gdn": _hybrid,
               "gemma4": _gemma4}[shape.kind]
    return validate(builder(shape, tp_size, tp_rank))


def _vllm_layout(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    """A dense or MLA cache as vLLM 0.32 allocates it for a GPU backend (FlashAttention,
    FlashInfer, Triton; FlashMLA, Triton MLA), described by the vLLM connector's layout code."""
    from ..vllm import layout as vllm

    if shape.kind not in ("dense", "mla"):
        raise GeometryError(f"layout {shape.layout} is built for dense and mla models, not {shape.kind}")
    kernel, phys = _kernel_pages(shape)
    mla = shape.kind == "mla"
    total = 1 if mla else shape.kv_heads
    start, stop = shard(total, tp_size, tp_rank, "kv heads") if not mla else (0, 1)
    content = shape.latent_dim if mla else 2 * shape.head_dim  # K|V of a token side by side, or the latent
    nbytes, caches = vllm.layer_caches(shape.layout, shape.layers, shape.num_blocks * phys, stop - start, kernel,
                                       content, shape.dtype_bytes)
    spec = vllm.GroupSpec("attention", shape.block_size, "MLAAttentionSpec" if mla else "FullAttentionSpec",
                          total_kv_heads=total, head_bytes=content * shape.dtype_bytes)
    geo = vllm.geometry(shape.identity(), shape.dtype, tp_size, tp_rank, [nbytes], [spec], caches)
    return msgspec.structs.replace(geo, groups=tuple(msgspec.structs.replace(g, name="attn" if not mla else "mla")
                                                     for g in geo.groups))


class _Layout:
    """Accumulates regions in one buffer."""

    def __init__(self) -> None:
        self.regions: list[Region] = []
        self.size = 0

    def region(self, length: int) -> int:
        self.regions.append(Region(buffer=0, offset=self.size, length=length))
        self.size += length
        return len(self.regions) - 1

    def geometry(self, shape: ModelShape, tp_size: int, tp_rank: int, groups: list[CacheGroup]) -> Geometry:
        return Geometry(model=shape.identity(), dtype=dtypes.canonical(shape.dtype), tp_size=tp_size, tp_rank=tp_rank,
                        buffers=(self.size,), regions=tuple(self.regions), groups=tuple(groups))


def _kernel_pages(shape: ModelShape) -> tuple[int, int]:
    """(tokens per kernel page, kernel pages per logical block)."""
    kernel = shape.kernel_block_size or shape.block_size
    if shape.block_size % kernel:
        raise GeometryError(f"block_size {shape.block_size} is not a multiple of "
                            f"kernel_block_size {kernel}")
    return kernel, shape.block_size // kernel


def _kv_segments(name_k: str, name_v: str, heads: tuple[int, int], total: int, tokens: int,
                 token_bytes: int, layout: str, v_offset: int) -> tuple[Segment, Segment]:
    seg_layout: SegmentLayout = TOKEN_MAJOR if layout == "nhd" else UNIT_MAJOR
    k = Segment(name_k, 0, total, heads[0], heads[1], tokens, token_bytes, seg_layout)
    v = Segment(name_v, v_offset, total, heads[0], heads[1], tokens, token_bytes, seg_layout)
    return k, v


def _attention_views(lay: _Layout, layer: str, heads: tuple[int, int], total: int, tokens: int,
                     token_bytes: int, layout: str, num_pages: int) -> list[View]:
    """K and V of one layer: two regions (HND/NHD) or one joint K|V region (blocks-first)."""
    half = (heads[1] - heads[0]) * tokens * token_bytes
    if layout == "blocks-first":
        k, v = _kv_segments("k", "v", heads, total, tokens, token_bytes, layout, half)
        return [View(layer, lay.region(2 * half * num_pages), 2 * half, num_pages, (k, v))]
    k, v = _kv_segments("k", "v", heads, total, tokens, token_bytes, layout, 0)
    return [View(layer, lay.region(half * num_pages), half, num_pages, (k,)),
            View(layer, lay.region(half * num_pages), half, num_pages, (v,))]


def _dense(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    kernel, phys = _kernel_pages(shape)
    heads = shard(shape.kv_heads, tp_size, tp_rank, "kv heads")
    lay = _Layout()
    views: list[View] = []
    for layer in range(shape.layers):
        views += _attention_views(lay, f"L{layer}", heads, shape.kv_heads, kernel,
                                  shape.head_dim * shape.dtype_bytes, shape.layout,
                                  shape.num_blocks * phys)
    group = CacheGroup("attn", ATTENTION, shape.block_size, phys, tuple(views))
    return lay.geometry(shape, tp_size, tp_rank, [group])


def _mla(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    kernel, phys = _kernel_pages(shape)
    lay = _Layout()
    token_bytes = shape.latent_dim * shape.dtype_bytes
    views = []
    for layer in range(shape.layers):
        latent = Segment("latent", 0, 1, 0, 1, kernel, token_bytes)
        page = kernel * token_bytes
        views.append(View(f"L{layer}", lay.region(page * shape.num_blocks * phys), page,
                          shape.num_blocks * phys, (latent,)))
    group = CacheGroup("mla", ATTENTION, shape.block_size, phys, tuple(views))
    return lay.geometry(shape, tp_size, tp_rank, [group])


def _state_segments(shape: ModelShape, tp_size: int, tp_rank: int) -> list[Segment]:
    """Conv state in DS layout (channels, conv_kernel-1) then SSM state, per SSM layer.

    Each segment is sharded on its own: conv x / SSM state by head, B/C by group
    (mamba2); q/k by key head, v and SSM state by value head (GDN).
    """
    dt, rows = shape.dtype_bytes, shape.conv_kernel - 1
    hd, st = shape.ssm_head_dim, shape.ssm_state
    if shape.kind == "mamba2":
        parts = [("conv_x", shape.ssm_heads, hd * rows * dt), ("conv_B", shape.ssm_groups, st * rows * dt),
                 ("conv_C", shape.ssm_groups, st * rows * dt), ("ssm", shape.ssm_heads, hd * st * dt)]
    else:
        parts = [("conv_q", shape.ssm_groups, hd * rows * dt), ("conv_k", shape.ssm_groups, hd * rows * dt),
                 ("conv_v", shape.ssm_heads, hd * rows * dt), ("ssm", shape.ssm_heads, hd * hd * dt)]
    segments, offset = [], 0
    for name, total, unit_bytes in parts:
        start, stop = shard(total, tp_size, tp_rank, name)
        segments.append(Segment(name, offset, total, start, stop, 1, unit_bytes))
        offset += (stop - start) * unit_bytes
    return segments


def state_pages(state_bytes: int, kernel_page_bytes: int) -> int:
    """Attention kernel pages one SSM state page spans."""
    return math.ceil(state_bytes / kernel_page_bytes)


def _hybrid(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    """Attention and SSM layers sharing regions (vLLM's hybrid KV cache manager).

    region i, as the attention group sees it (kernel pages) and as the SSM group does:

      attention: | kp0 | kp1 | kp2 | kp3 | kp4 | kp5 | ...      kernel pages
      ssm:       | page 0 (phys=3)   | page 1            | ...  [conv x|B|C|ssm|pad]
    """
    kernel, _ = _kernel_pages(shape)
    heads = shard(shape.kv_heads, tp_size, tp_rank, "kv heads")
    token_bytes = shape.head_dim * shape.dtype_bytes
    kernel_page = 2 * (heads[1] - heads[0]) * kernel * token_bytes
    segments = _state_segments(shape, tp_size, tp_rank)
    state_bytes = sum(s.nbytes for s in segments)
    phys = state_pages(state_bytes, kernel_page)
    n_shared = max(shape.layers, shape.ssm_layers)
    lay = _Layout()
    regions = [lay.region(kernel_page * phys * shape.num_blocks) for _ in range(n_shared)]
    attn_views = []
    for layer in range(shape.layers):
        half = kernel_page // 2
        k, v = _kv_segments("k", "v", heads, shape.kv_heads, kernel, token_bytes, "blocks-first", half)
        attn_views.append(View(f"L{layer}", regions[layer], kernel_page, phys * shape.num_blocks, (k, v)))
    ssm_views = [View(f"S{layer}", regions[layer], kernel_page * phys, shape.num_blocks, tuple(segments))
                 for layer in range(shape.ssm_layers)]
    groups = [CacheGroup("attn", ATTENTION, kernel * phys, phys, tuple(attn_views)),
              CacheGroup("ssm", STATE, 0, 1, tuple(ssm_views))]
    return lay.geometry(shape, tp_size, tp_rank, groups)


def _gemma4(shape: ModelShape, tp_size: int, tp_rank: int) -> Geometry:
    """Sliding-window and full attention groups with one page size per rank.

    The full group's tokens per block follow from the page size, so they can differ
    between prefill and decode engines of other TP sizes (vLLM's hybrid allocator).
    """
    dt = shape.dtype_bytes
    swa = shard(shape.kv_heads, tp_size, tp_rank, "sliding-window kv heads")
    full = shard(shape.full_kv_heads, tp_size, tp_rank, "full-attention kv heads")
    page = 2 * (swa[1] - swa[0]) * shape.block_size * shape.head_dim * dt
    full_token = 2 * (full[1] - full[0]) * shape.full_head_dim * dt
    if page % full_token:
        raise GeometryError(f"gemma4: page of {page} B holds no whole number of full-attention tokens "
                            f"of {full_token} B")
    full_tokens = page // full_token
    lay = _Layout()
    swa_views, full_views = [], []
    for layer in range(shape.layers):
        swa_views += _attention_views(lay, f"W{layer}", swa, shape.kv_heads, shape.block_size,
                                      shape.head_dim * dt, "blocks-first", shape.num_blocks)
    for layer in range(shape.full_layers):
        full_views += _attention_views(lay, f"F{layer}", full, shape.full_kv_heads, full_tokens,
                                       shape.full_head_dim * dt, "blocks-first", shape.num_blocks)
    groups = [CacheGroup("swa", ATTENTION, shape.block_size, 1, tuple(swa_views)),
              CacheGroup("full", ATTENTION, full_tokens, 1, tuple(full_views))]
    return lay.geometry(shape, tp_size, tp_rank, groups)
