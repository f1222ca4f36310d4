"""How one tensor-parallel rank's KV memory is laid out.

Vocabulary (one for every model kind):

    buffer   a block of memory the engine shares with the daemon (one shm file,
             one CUDA allocation); the daemon learns its base address at mapping time
    region   a contiguous byte range inside a buffer: one layer, or one layer's K or V
    view     how one cache group sees a region: `num_pages` pages of `page_stride` bytes
             (an SSM group may see the same region with pages spanning several
             attention kernel pages)
    segment  a fixed byte range inside every page of a view, sharded across TP ranks

    page of a unit-major (HND) segment, this rank holding units [start, stop):

      offset
      v
      | unit start            | unit start+1          | ... | unit stop-1           |
      | tok0 | tok1 | ... tokT| tok0 | tok1 | ... tokT|     |                       |
        <--->  token_bytes
        <---------------------> unit_bytes = tokens * token_bytes

    page of a token-major (NHD) segment: | tok0: units... | tok1: units... | ...

    a unit of several lanes (vLLM's CPU attention keeps a head's K transposed: one lane per
    element of the head dimension, each lane the page's tokens), units `unit_stride` apart
    (K and V of one head side by side, two segments interleaved):

      | unit start                              | (V of unit start) | unit start+1 ...
      | lane 0: tok0..tokT | lane 1: tok0..tokT | ...               |
        <--> token_bytes (one element)
      <----------------------- unit_stride ------------------------->

    page of a sealed unit-major segment: units back to back as above, but the bytes inside
    a unit are the engine's own order, which kvxferd could not confirm: a unit moves whole,
    its tokens cannot be addressed one by one.

A state segment (Mamba conv / SSM state) is a segment with one "token" per page.
Nothing in this module does I/O; it crosses the wire as msgspec structs.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

SegmentLayout = Literal["unit_major", "token_major", "unit_sealed"]
GroupKind = Literal["attention", "state"]

UNIT_MAJOR: Final = "unit_major"
TOKEN_MAJOR: Final = "token_major"
UNIT_SEALED: Final = "unit_sealed"
LAYOUTS: Final[tuple[SegmentLayout, ...]] = (UNIT_MAJOR, TOKEN_MAJOR, UNIT_SEALED)
ATTENTION: Final = "attention"
STATE: Final = "state"


class GeometryError(ValueError):
    """A geometry that cannot describe real memory; the message names the field."""


class Segment(msgspec.Struct, frozen=True):
    name: str
    offset: int  # byte offset inside the page
    total_units: int  # units across all ranks (kv heads, conv channels, ssm heads, 1 for MLA)
    unit_start: int  # this rank holds units [unit_start, unit_stop)
    unit_stop: int
    tokens: int  # tokens per page (1 for state segments)
    token_bytes: int  # bytes of one token of one unit (of one lane)
    layout: SegmentLayout = UNIT_MAJOR
    lanes: int = 1  # unit-major: runs of `tokens` tokens per unit, back to back
    stride: int = 0  # unit-major: bytes from one unit to the next; 0: units back to back

    @property
    def local_units(self) -> int:
        return self.unit_stop - self.unit_start

    @property
    def lane_bytes(self) -> int:
        return self.tokens * self.token_bytes

    @property
    def unit_bytes(self) -> int:
        return self.lanes * self.lane_bytes

    @property
    def unit_stride(self) -> int:
        return self.stride or self.unit_bytes

    @property
    def nbytes(self) -> int:
        """The bytes this rank holds in one page."""
        return self.local_units * self.unit_bytes

    @property
    def extent(self) -> int:
        """From the segment's offset to the end of its last unit (other segments may lie between)."""
        return (self.local_units - 1) * self.unit_stride + self.unit_bytes


class View(msgspec.Struct, frozen=True):
    name: str  # layer name, stable across TP sizes
    region: int
    page_stride: int
    num_pages: int
    segments: tuple[Segment, ...]


class CacheGroup(msgspec.Struct, frozen=True):
    name: str
    kind: GroupKind
    tokens_per_block: int  # logical block; 0 for state groups
    pages_per_block: int  # kernel pages per logical block
    views: tuple[View, ...]

    @property
    def tokens_per_page(self) -> int:
        return self.tokens_per_block // self.pages_per_block if self.kind == ATTENTION else 1

    @property
    def num_blocks(self) -> int:
        return min(v.num_pages for v in self.views) // self.pages_per_block


class Region(msgspec.Struct, frozen=True):
    buffer: int
    offset: int
    length: int


class Geometry(msgspec.Struct, frozen=True):
    model: str  # a model identity string; part of the compatibility hash
    dtype: str
    tp_size: int
    tp_rank: int
    buffers: tuple[int, ...]  # byte size of each buffer
    regions: tuple[Region, ...]
    groups: tuple[CacheGroup, ...]
    # Which weights filled the cache (model name or path, revision). Compared only when both
    # engines name theirs: an engine that leaves it empty accepts caches of the same geometry
    # computed by other weights (vLLM's enforce_handshake_compat=false).
    weights: str = ""


def shard(total_units: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    """The unit range [start, stop) that `tp_rank` of `tp_size` holds.

    tp_size <= total: contiguous equal slices. tp_size > total: every rank holds one
    unit, neighbouring ranks share it (replicas are contiguous, as vLLM lays them out).
    """
    if total_units < 1:
        raise GeometryError(f"{what}: total units must be >= 1, got {total_units}")
    if not 0 <= tp_rank < tp_size:
        raise GeometryError(f"{what}: tp_rank {tp_rank} out of range for tp_size {tp_size}")
    if tp_size <= total_units:
        if total_units % tp_size:
            raise GeometryError(f"{what}: {total_units} units do not divide over TP {tp_size}")
        per = total_units // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % total_units:
        raise GeometryError(f"{what}: TP {tp_size} is not a multiple of {total_units} units")
    unit = tp_rank * total_units // tp_size
    return unit, unit + 1


def validate(geo: Geometry) -> Geometry:
    """Check that every page and segment lies inside its region; raise GeometryError naming it."""
    if not 0 <= geo.tp_rank < geo.tp_size:
        raise GeometryError(f"tp_rank {geo.tp_rank} out of range for tp_size {geo.tp_size}")
    for i, reg in enumerate(geo.regions):
        if not 0 <= reg.buffer < len(geo.buffers):
            raise GeometryError(f"region {i}: buffer {reg.buffer} does not exist")
        if reg.offset < 0 or reg.length <= 0 or reg.offset + reg.length > geo.buffers[reg.buffer]:
            raise GeometryError(f"region {i}: [{reg.offset}, +{reg.length}) outside buffer {reg.buffer}")
    for g in geo.groups:
        if g.kind not in (ATTENTION, STATE):
            raise GeometryError(f"group {g.name}: unknown kind {g.kind!r}")
        if g.pages_per_block < 1 or not g.views:
            raise GeometryError(f"group {g.name}: needs pages_per_block >= 1 and at least one view")
        if g.kind == ATTENTION and (g.tokens_per_block < 1 or g.tokens_per_block % g.pages_per_block):
            raise GeometryError(f"group {g.name}: tokens_per_block {g.tokens_per_block} "
                                f"not a multiple of pages_per_block {g.pages_per_block}")
        for v in g.views:
            where = f"group {g.name} view {v.name}"
            if not 0 <= v.region < len(geo.regions):
                raise GeometryError(f"{where}: region {v.region} does not exist")
            if v.page_stride <= 0 or v.num_pages <= 0:
                raise GeometryError(f"{where}: page_stride and num_pages must be positive")
            # The last page need only hold its segments: pages may be spaced wider than they are
            # long (blocks-outermost layouts interleave other layers' pages between them).
            extent = max((s.offset + s.extent for s in v.segments), default=0)
            if (v.num_pages - 1) * v.page_stride + extent > geo.regions[v.region].length:
                raise GeometryError(f"{where}: {v.num_pages} pages of {v.page_stride} B exceed the region")
            for s in v.segments:
                _validate_segment(s, g, v, where)
    return geo


def _validate_segment(s: Segment, g: CacheGroup, v: View, where: str) -> None:
    where = f"{where} segment {s.name}"
    if not 0 <= s.unit_start < s.unit_stop <= s.total_units:
        raise GeometryError(f"{where}: unit range [{s.unit_start}, {s.unit_stop}) outside 0..{s.total_units}")
    if s.token_bytes <= 0 or s.tokens != g.tokens_per_page:
        raise GeometryError(f"{where}: tokens {s.tokens} must equal the group's tokens per page "
                            f"{g.tokens_per_page}, token_bytes must be positive")
    if s.layout not in LAYOUTS:
        raise GeometryError(f"{where}: unknown layout {s.layout!r}")
    if s.lanes < 1 or (s.lanes > 1 and s.layout != UNIT_MAJOR):
        raise GeometryError(f"{where}: {s.lanes} lanes per unit (only unit-major segments have several)")
    if s.stride and (s.stride < s.unit_bytes or s.layout == TOKEN_MAJOR):
        raise GeometryError(f"{where}: units {s.stride} B apart, each {s.unit_bytes} B long")
    if s.offset < 0 or s.offset + s.extent > v.page_stride:
        raise GeometryError(f"{where}: [{s.offset}, +{s.extent}) outside the {v.page_stride} B page")
