"""Synthetic engine: KV memory whose every byte encodes the *logical* model state.

A byte's value is a hash of (sequence, cache group, layer, segment, global unit, token
position or state slot, byte within the token) -- independent of TP size, rank, page
layout and block size. So what a decode rank should hold after a transfer can be written
down directly ("what it would hold had it computed the cache itself") and compared byte
for byte with what arrived, without looking at the prefill side's memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ...plan.geometry import ATTENTION, TOKEN_MAJOR, CacheGroup, Geometry, Segment

POISON = 0xEE  # what untouched decode memory holds
_STATE_SLOT = 1 << 24  # token coordinate of state blocks: slot + list position

_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * _M1
    x = x ^ (x >> np.uint64(33))
    x = x * _M2
    return x ^ (x >> np.uint64(33))


def logical_bytes(seq: int, key: str, units: np.ndarray, tokens: np.ndarray, token_bytes: int) -> np.ndarray:
    """uint8 array (units, tokens, token_bytes) of the model state at those coordinates."""
    base = np.uint64((seq * 0x9E3779B97F4A7C15 + zlib.crc32(key.encode()) * 0x632BE59BD9B4E019) % (1 << 64))
    u = units.astype(np.uint64)[:, None, None] * np.uint64(0x100000001B3)
    t = tokens.astype(np.uint64)[None, :, None] * np.uint64(0x9FB21C651E98DF25)
    b = np.arange(token_bytes, dtype=np.uint64)[None, None, :] * np.uint64(0xD6E8FEB86659FD93)
    with np.errstate(over="ignore"):
        return (_mix(base + u + t + b) & np.uint64(0xFF)).astype(np.uint8)


def allocate(geo: Geometry) -> list[np.ndarray]:
    """Host buffers for a rank, filled with POISON."""
    return [np.full(size, POISON, dtype=np.uint8) for size in geo.buffers]


def _segment_view(buf: np.ndarray, geo: Geometry, group: CacheGroup, view_idx: int, seg: Segment,
                  page: int) -> np.ndarray:
    """The segment's bytes in one page, as (units, tokens, token_bytes)."""
    view = group.views[view_idx]
    region = geo.regions[view.region]
    at = region.offset + page * view.page_stride + seg.offset
    flat = buf[at:at + seg.nbytes]
    if seg.layout == TOKEN_MAJOR:
        return flat.reshape(seg.tokens, seg.local_units, seg.token_bytes).transpose(1, 0, 2)
    return flat.reshape(seg.local_units, seg.tokens, seg.token_bytes)


def _key(group: CacheGroup, view_idx: int, seg: Segment) -> str:
    return f"{group.name}/{group.views[view_idx].name}.{seg.name}"


def write_tokens(bufs: list[np.ndarray], geo: Geometry, group_idx: int, seq: int, blocks: Iterable[int],
                 first_block: int, lo: int, hi: int) -> None:
    """Write the state of tokens [lo, hi) into the attention blocks listed.

    `blocks[k]` holds prompt block `first_block + k` (in this group's tokens per block).
    """
    group = geo.groups[group_idx]
    assert group.kind == ATTENTION
    tpp = group.tokens_per_page
    for k, block in enumerate(blocks):
        for j in range(group.pages_per_block):
            page = int(block) * group.pages_per_block + j
            first = (first_block + k) * group.tokens_per_block + j * tpp
            t0, t1 = max(lo, first), min(hi, first + tpp)
            if t0 >= t1:
                continue
            tokens = np.arange(t0, t1)
            for vi, view in enumerate(group.views):
                buf = bufs[geo.regions[view.region].buffer]
                for seg in view.segments:
                    units = np.arange(seg.unit_start, seg.unit_stop)
                    dst = _segment_view(buf, geo, group, vi, seg, page)
                    dst[:, t0 - first:t1 - first, :] = logical_bytes(seq, _key(group, vi, seg), units, tokens,
                                                                     seg.token_bytes)


def write_state(bufs: list[np.ndarray], geo: Geometry, group_idx: int, seq: int, blocks: Iterable[int]) -> None:
    """Write the SSM/conv state of a sequence into the state blocks listed (slot k = list position)."""
    group = geo.groups[group_idx]
    for k, block in enumerate(blocks):
        for vi, view in enumerate(group.views):
            buf = bufs[geo.regions[view.region].buffer]
            for seg in view.segments:
                units = np.arange(seg.unit_start, seg.unit_stop)
                dst = _segment_view(buf, geo, group, vi, seg, int(block))
                dst[...] = logical_bytes(seq, _key(group, vi, seg), units, np.array([_STATE_SLOT + k]),
                                         seg.token_bytes)


@dataclass(frozen=True)
class Sequence:
    """A prompt as one engine holds it: per cache group, its block ids from the first block."""

    seq: int
    num_tokens: int
    blocks: tuple[tuple[int, ...], ...]


def blocks_needed(geo: Geometry, num_tokens: int) -> list[int]:
    """Blocks each group needs for a prompt (one state block per state group)."""
    return [-(-num_tokens // g.tokens_per_block) if g.kind == ATTENTION else 1 for g in geo.groups]


def fill_sequence(bufs: list[np.ndarray], geo: Geometry, s: Sequence, upto_block: list[int] | None = None) -> None:
    """Write a prompt's state into its blocks, as the engine that computed it would hold it.

    `upto_block[g]`: only the first that many blocks of attention group g (a prefix cache
    hit on the decode side); state groups are written only when `upto_block` is None.
    """
    for gi, group in enumerate(geo.groups):
        blocks = s.blocks[gi]
        if group.kind == ATTENTION:
            n = len(blocks) if upto_block is None else upto_block[gi]
            write_tokens(bufs, geo, gi, s.seq, blocks[:n], 0, 0, n * group.tokens_per_block)
        elif upto_block is None:
            write_state(bufs, geo, gi, s.seq, blocks)


def expect_after_read(before: list[np.ndarray], geo: Geometry, s: Sequence, first_missing: list[int],
                      chunk_tokens: list[int], in_place: bool = False) -> list[np.ndarray]:
    """What a decode rank holds after reading a prompt's missing blocks.

    Attention group g: tokens from block `first_missing[g]` up to the prompt length rounded
    up to the group's transfer chunk are written; everything else is as it was.
    """
    want = before if in_place else [b.copy() for b in before]
    for gi, group in enumerate(geo.groups):
        blocks = s.blocks[gi]
        if group.kind == ATTENTION:
            start = first_missing[gi]
            end = -(-s.num_tokens // chunk_tokens[gi]) * chunk_tokens[gi]
            write_tokens(want, geo, gi, s.seq, blocks[start:], start, start * group.tokens_per_block, end)
        else:
            write_state(want, geo, gi, s.seq, blocks)
    return want


@dataclass(frozen=True)
class Mismatch:
    buffer: int
    offset: int  # first differing byte
    count: int  # differing bytes in this buffer
    where: str


def check(actual: list[np.ndarray], expected: list[np.ndarray], geo: Geometry) -> list[Mismatch]:
    """Per buffer, where the bytes differ (empty when they are identical)."""
    out: list[Mismatch] = []
    for bi, (a, e) in enumerate(zip(actual, expected)):
        diff = np.flatnonzero(a != e)
        if len(diff):
            out.append(Mismatch(bi, int(diff[0]), len(diff), locate(geo, bi, int(diff[0]))))
    return out


def locate(geo: Geometry, buffer: int, offset: int) -> str:
    """Name the group/view/page/segment/unit/token a byte belongs to (first match)."""
    for ri, reg in enumerate(geo.regions):
        if reg.buffer != buffer or not reg.offset <= offset < reg.offset + reg.length:
            continue
        rel = offset - reg.offset
        for group in geo.groups:
            for view in group.views:
                if view.region != ri:
                    continue
                page, inpage = divmod(rel, view.page_stride)
                for seg in view.segments:
                    if seg.offset <= inpage < seg.offset + seg.extent:
                        x = inpage - seg.offset
                        if seg.layout == TOKEN_MAJOR:
                            tok, rest = divmod(x, seg.local_units * seg.token_bytes)
                            unit = rest // seg.token_bytes
                        else:
                            unit, rest = divmod(x, seg.unit_stride)
                            if rest >= seg.unit_bytes:
                                continue  # between this segment's units: another segment's
                            tok = rest % seg.lane_bytes // seg.token_bytes
                        return (f"group {group.name} view {view.name} page {page} segment {seg.name} "
                                f"unit {seg.unit_start + unit} token {tok}")
                return f"region {ri} page {page} byte {inpage} (padding)"
    return f"buffer {buffer} byte {offset} (outside every region)"
