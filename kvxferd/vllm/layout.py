"""vLLM's KV cache, described as a kvxferd geometry. Pure: no vLLM, no torch.

The worker reads each layer's cache tensor (shape, strides, where it starts in its backing
allocation) and each cache group's spec, and this module turns them into the `Geometry`
the daemon plans with. Nothing here is vLLM-specific transfer code: once described, every
layout is moved by the one planner.

vLLM's CPU backend (layout LBHNC) views layer l of a backing buffer as
`[num_blocks, kv_heads, 2 * block_size, head_size]`:

    buffer: | layer 0: block 0 | block 1 | ... | layer 1: block 0 | ...
    block:  | head 0: K rows (bs x hd, stored as the ISA likes) | V rows (bs x hd) | head 1: ... |
            <---------------- unit_bytes = 2 * bs * hd * itemsize ----------------->

A head's K|V area is contiguous, so heads are the sharding unit (heterogeneous TP, GQA
replicas); its interior is the backend's own, so the segment is `unit_sealed`: a unit moves
whole, and a block-size mismatch between the two engines is refused at planning time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import dtypes
from ..plan.geometry import (
    ATTENTION,
    UNIT_SEALED,
    CacheGroup,
    Geometry,
    GeometryError,
    Region,
    Segment,
    View,
    shard,
    validate,
)


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache tensor as the worker found it (strides in elements)."""

    name: str
    group: int  # index of its KV cache group
    buffer: int  # index of its backing allocation
    offset: int  # bytes from the buffer's start to element [0, 0, 0, 0]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int  # bytes per element of this tensor (vLLM may view the cache as bytes)


@dataclass(frozen=True)
class GroupSpec:
    """What vLLM's KV cache spec says of one cache group."""

    kind: str  # "attention"; anything else is refused by name
    block_size: int  # tokens per block as the scheduler counts them
    total_kv_heads: int  # across all TP ranks
    head_size: int
    spec_name: str = ""  # vLLM's spec class, for error messages


def geometry(model: str, dtype: str, tp_size: int, tp_rank: int, buffers: list[int],
             groups: list[GroupSpec], layers: list[LayerCache], weights: str = "") -> Geometry:
    """The geometry of one vLLM worker's KV cache. Raises GeometryError naming what it cannot describe."""
    itemsize = dtypes.itemsize(dtype)
    regions: list[Region] = []
    seen: set[tuple[int, int]] = set()
    views: dict[int, list[View]] = {g: [] for g in range(len(groups))}
    for layer in layers:
        if not 0 <= layer.group < len(groups):
            raise GeometryError(f"layer {layer.name}: cache group {layer.group} does not exist")
        spec = groups[layer.group]
        if spec.kind != ATTENTION:
            raise GeometryError(f"layer {layer.name}: cache group {layer.group} is {spec.spec_name or spec.kind}; "
                                "kvxferd's vLLM connector moves attention caches only (no Mamba/GDN state yet)")
        key = (layer.buffer, layer.offset)
        if key in seen:  # a layer sharing another's cache (cross-layer KV sharing)
            continue
        seen.add(key)
        view, length = _attention_view(layer, spec, len(regions), tp_size, tp_rank, itemsize)
        regions.append(Region(layer.buffer, layer.offset, length))
        views[layer.group].append(view)
    cache_groups = tuple(CacheGroup(f"g{g}", ATTENTION, groups[g].block_size, 1, tuple(vs))
                         for g, vs in views.items() if vs)
    if not cache_groups:
        raise GeometryError("no attention layers found in the KV caches vLLM registered")
    return validate(Geometry(model, dtypes.canonical(dtype), tp_size, tp_rank, tuple(buffers), tuple(regions),
                             cache_groups, weights))


def _attention_view(layer: LayerCache, spec: GroupSpec, region: int, tp_size: int, tp_rank: int,
                    kv_itemsize: int) -> tuple[View, int]:
    """One layer's view of region `region`, and the byte length that region needs."""
    where = f"layer {layer.name}"
    if len(layer.shape) != 4 or len(layer.stride) != 4:
        raise GeometryError(f"{where}: cache shaped {layer.shape}; kvxferd describes per-layer "
                            "[blocks, heads, rows, columns] views (vLLM's LBHNC layout, the CPU backend)")
    blocks, heads, rows, cols = layer.shape
    s_block, s_head, s_row, s_col = layer.stride
    if (s_col, s_row, s_head) != (1, cols, rows * cols) or s_block < heads * rows * cols:
        raise GeometryError(f"{where}: strides {layer.stride} for shape {layer.shape} do not keep each head's "
                            "K|V area contiguous inside a block; set VLLM_KV_CACHE_LAYOUT to LBHNC")
    head_bytes = rows * cols * layer.itemsize
    if head_bytes != spec.block_size * 2 * spec.head_size * kv_itemsize:
        raise GeometryError(f"{where}: a head's area of {head_bytes} B is not K and V of {spec.block_size} "
                            f"tokens of head size {spec.head_size} ({kv_itemsize} B per element)")
    start, stop = shard(spec.total_kv_heads, tp_size, tp_rank, f"{where} kv heads")
    if stop - start != heads:
        raise GeometryError(f"{where}: holds {heads} kv heads, but {spec.total_kv_heads} heads over TP {tp_size} "
                            f"give rank {tp_rank} {stop - start}")
    seg = Segment("kv", 0, spec.total_kv_heads, start, stop, spec.block_size, head_bytes // spec.block_size,
                  UNIT_SEALED)
    page_stride = s_block * layer.itemsize
    length = (blocks - 1) * page_stride + seg.nbytes
    return View(layer.name, region, page_stride, blocks, (seg,)), length
