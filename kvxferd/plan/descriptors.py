"""From plans to NIXL inputs: descriptor arrays and per-request descriptor indices.

Descriptor ids of one side of a PeerPlan, piece-major:

    piece 0: phase 0: page 0 .. pages-1 | phase 1: page 0 .. | ...
    piece 1: ...
    desc_id = base[t] + phase * pages[t] + page     (t: the piece's index)

Everything is vectorized numpy; a 70B-class layout has millions of descriptors per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .geometry import ATTENTION, Geometry
from .planner import GroupColumns, GroupPairing, PeerPlan, PlanError, RankPlan


def region_addresses(geo: Geometry, buffer_bases: list[int] | tuple[int, ...]) -> np.ndarray:
    """Absolute address of every region, given where each buffer is mapped."""
    if len(buffer_bases) != len(geo.buffers):
        raise PlanError(f"{len(buffer_bases)} buffer addresses for {len(geo.buffers)} buffers")
    return np.array([buffer_bases[r.buffer] + r.offset for r in geo.regions], dtype=np.int64)


def descriptor_array(region_addr: np.ndarray, region: np.ndarray, offset: np.ndarray, length: np.ndarray,
                     step: np.ndarray, stride: np.ndarray, pages: np.ndarray, phases: np.ndarray,
                     device: int = 0) -> np.ndarray:
    """(N, 3) int64 [addr, len, dev] rows for all (piece, phase, page), in desc-id order.

    Row base[t] + phase * pages[t] + page, for piece t (base[t]: the rows of the pieces before it):

        addr = region_addr[region[t]] + page * stride[t] + offset[t] + phase * step[t]
        len  = length[t]
        dev  = device

    region_addr[r] is where region r starts (`region_addresses`: buffer base + region offset).
    One region, a piece with 2 phases:

        region_addr[region[t]]
        v
        | page 0                          | page 1                          | ...
        |     [ phase 0  ][ phase 1  ]    |     [ phase 0  ][ phase 1  ]    |
        <---->                                    offset[t]
              <---------->                        length[t]; step[t] is phase 0 to phase 1 (equal here)
        <-------------------------------->        stride[t] (page to page)
    """
    rows_per = phases * pages
    total = int(rows_per.sum())
    out = np.empty((total, 3), dtype=np.int64)
    out[:, 2] = device
    # Pieces sharing (pages, phases) -- the usual case -- are filled as one 3-D broadcast.
    start = 0
    for t0, t1 in _runs(pages, phases):
        n_pages, n_phases = int(pages[t0]), int(phases[t0])
        base = (region_addr[region[t0:t1]] + offset[t0:t1])[:, None, None]
        ph = np.arange(n_phases, dtype=np.int64)[None, :, None] * step[t0:t1, None, None]
        pg = np.arange(n_pages, dtype=np.int64)[None, None, :] * stride[t0:t1, None, None]
        n = (t1 - t0) * n_phases * n_pages
        out[start:start + n, 0].reshape(t1 - t0, n_phases, n_pages)[...] = base + ph + pg
        out[start:start + n, 1].reshape(t1 - t0, n_phases * n_pages)[...] = length[t0:t1, None]
        start += n
    return out


def _runs(pages: np.ndarray, phases: np.ndarray) -> list[tuple[int, int]]:
    """Maximal index runs with equal (pages, phases)."""
    key = pages * 1_000_003 + phases
    cuts = np.flatnonzero(np.diff(key)) + 1
    bounds = np.concatenate(([0], cuts, [len(key)])).tolist()
    return list(itertools.pairwise(bounds))


def descriptor_rows(ids: np.ndarray, base: np.ndarray, region_addr: np.ndarray, region: np.ndarray,
                    offset: np.ndarray, length: np.ndarray, step: np.ndarray, stride: np.ndarray,
                    pages: np.ndarray, device: int = 0) -> np.ndarray:
    """The rows `descriptor_array` has at `ids`, computed for those ids alone.

    An id's piece t is the last whose base is <= id; the rest of the id is phase-major within
    the piece (id = base[t] + phase * pages[t] + page), hence the same address formula.
    """
    ids = np.asarray(ids, dtype=np.int64)
    t = np.searchsorted(base, ids, side="right") - 1
    phase, page = np.divmod(ids - base[t], pages[t])
    out = np.empty((len(ids), 3), dtype=np.int64)
    out[:, 0] = region_addr[region[t]] + page * stride[t] + offset[t] + phase * step[t]
    out[:, 1] = length[t]
    out[:, 2] = device
    return out


def local_rows(peer: PeerPlan, ids: np.ndarray, region_addr: np.ndarray, device: int = 0) -> np.ndarray:
    """`local_descs(...)[ids]` without building the whole array."""
    return descriptor_rows(ids, peer.local_base, region_addr, peer.local_region, peer.local_offset, peer.length,
                           peer.local_step, peer.local_stride, peer.local_pages, device)


def remote_rows(peer: PeerPlan, ids: np.ndarray, region_addr: np.ndarray, device: int = 0) -> np.ndarray:
    """`remote_descs(...)[ids]` without building the whole array."""
    return descriptor_rows(ids, peer.remote_base, region_addr, peer.remote_region, peer.remote_offset, peer.length,
                           peer.remote_step, peer.remote_stride, peer.remote_pages, device)


def local_descs(peer: PeerPlan, region_addr: np.ndarray, device: int = 0) -> np.ndarray:
    return descriptor_array(region_addr, peer.local_region, peer.local_offset, peer.length, peer.local_step,
                            peer.local_stride, peer.local_pages, peer.local_phases, device)


def remote_descs(peer: PeerPlan, region_addr: np.ndarray, device: int = 0) -> np.ndarray:
    return descriptor_array(region_addr, peer.remote_region, peer.remote_offset, peer.length, peer.remote_step,
                            peer.remote_stride, peer.remote_pages, peer.remote_phases, device)


@dataclass(frozen=True)
class RequestBlocks:
    """One read: the prompt length and, per cache group, the block ids on each side.

    Attention groups: each list covers the *last* blocks of the prompt on its side (block
    k of a list of n is prompt block ceil(num_tokens / tokens_per_block) - n + k), so a
    partial prefix hit passes only the missing local blocks and a sliding window only
    its window. State groups: blocks pair one to one.
    """

    num_tokens: int
    local: tuple[np.ndarray, ...]
    remote: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, num_tokens: int, local: Iterable[npt.ArrayLike], remote: Iterable[npt.ArrayLike]) -> RequestBlocks:
        return cls(num_tokens, tuple(np.asarray(b, dtype=np.int64) for b in local),
                   tuple(np.asarray(b, dtype=np.int64) for b in remote))


@dataclass(frozen=True)
class Chunks:
    """Per chunk of a group: the kernel page and phase on each side (phase None: all 0)."""

    local_page: np.ndarray
    local_phase: np.ndarray | None
    remote_page: np.ndarray
    remote_phase: np.ndarray | None


def group_chunks(p: GroupPairing, num_tokens: int, local: np.ndarray, remote: np.ndarray) -> Chunks:
    """The chunks one group moves for a request, validated against the group's block counts."""
    _check_ids(p.name, "local", local, p.local_num_blocks)
    _check_ids(p.name, "remote", remote, p.remote_num_blocks)
    if p.kind != ATTENTION:
        if len(local) != len(remote):
            raise PlanError(f"state group {p.name}: {len(local)} local blocks but {len(remote)} remote blocks")
        return Chunks(local, None, remote, None)
    if num_tokens < 0:
        raise PlanError(f"num_tokens {num_tokens} is negative")
    lt, rt, c = p.local_tokens_per_block, p.remote_tokens_per_block, p.chunk_tokens
    local_total, remote_total = -(-num_tokens // lt), -(-num_tokens // rt)
    if len(local) > local_total or len(remote) > remote_total:
        raise PlanError(f"group {p.name}: {num_tokens} tokens fill {local_total} local / {remote_total} remote "
                        f"blocks, got {len(local)} local / {len(remote)} remote block ids")
    local_start = (local_total - len(local)) * lt
    remote_start = (remote_total - len(remote)) * rt
    end = -(-num_tokens // c) * c
    if local_start >= end:
        empty = np.zeros(0, dtype=np.int64)
        return Chunks(empty, None, empty, None)
    if not len(remote) or remote_start >= end:
        raise PlanError(f"group {p.name}: local blocks from token {local_start} but no remote block holds a token "
                        f"before {num_tokens}")
    if remote_start >= local_start + lt:
        raise PlanError(f"group {p.name}: remote blocks start at token {remote_start}, past the first "
                        f"listed local block (tokens {local_start} to {local_start + lt - 1})")
    if lt == rt and p.local_pages_per_block == p.remote_pages_per_block == 1:  # the common case
        skip = (local_start - remote_start) // rt
        return Chunks(local, None, remote[skip:skip + len(local)], None)
    # A sliding window held in smaller blocks there may start inside the first local block: its
    # tokens before the window are read from nowhere (the window never looks at them).
    tokens = np.arange(max(local_start, remote_start), end, c, dtype=np.int64)
    lpage, lphase = _pages(tokens - local_start, local, lt // p.local_pages_per_block, p.local_pages_per_block, c)
    rpage, rphase = _pages(tokens - remote_start, remote, rt // p.remote_pages_per_block,
                           p.remote_pages_per_block, c)
    return Chunks(lpage, lphase, rpage, rphase)


def _pages(offsets: np.ndarray, blocks: np.ndarray, tokens_per_page: int, pages_per_block: int,
           chunk: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Kernel page and phase of each token offset (relative to the first listed block)."""
    page_pos = offsets // tokens_per_page
    page = blocks[page_pos // pages_per_block] * pages_per_block + page_pos % pages_per_block
    return page, (offsets % tokens_per_page) // chunk if tokens_per_page > chunk else None


def _check_ids(group: str, side: str, ids: np.ndarray, limit: int) -> None:
    if ids.ndim != 1 or ids.dtype != np.int64:
        raise PlanError(f"group {group}: {side} block ids must be a flat int64 list")
    if len(ids) and ids.view(np.uint64).max() >= limit:  # negatives wrap to huge values
        bad = ids[(ids < 0) | (ids >= limit)]
        raise PlanError(f"group {group}: {side} block ids {bad[:8].tolist()} out of range 0..{limit - 1}")


def request_chunks(plan: RankPlan, req: RequestBlocks) -> list[Chunks]:
    if len(req.local) != len(plan.groups) or len(req.remote) != len(plan.groups):
        raise PlanError(f"request names {len(req.local)} local / {len(req.remote)} remote block lists "
                        f"for {len(plan.groups)} cache groups")
    return [group_chunks(p, req.num_tokens, lo, re) for p, lo, re in zip(plan.groups, req.local, req.remote)]


def _groups_read(peer: PeerPlan, chunks: list[Chunks]) -> Iterator[tuple[int, GroupColumns, Chunks]]:
    """The cache groups a request reads from this peer, in descriptor order: the one order
    `peer_indices` and `row_blocks` both follow, so their outputs line up row for row."""
    for g, cols in peer.by_group.items():
        if len(chunks[g].local_page):
            yield g, cols, chunks[g]


def peer_indices(peer: PeerPlan, chunks: list[Chunks]) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote descriptor ids of one request on one peer; NIXL pairs them by position."""
    local_parts: list[np.ndarray] = []
    remote_parts: list[np.ndarray] = []
    for _, cols, ch in _groups_read(peer, chunks):
        local_parts.append(_ids(cols.local_base, cols.local_pages, ch.local_page, ch.local_phase))
        remote_parts.append(_ids(cols.remote_base, cols.remote_pages, ch.remote_page, ch.remote_phase))
    if not local_parts:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty
    if len(local_parts) == 1:
        return local_parts[0], remote_parts[0]
    return np.concatenate(local_parts), np.concatenate(remote_parts)


def row_blocks(plan: RankPlan, peer: PeerPlan, chunks: list[Chunks]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each descriptor pair `peer_indices` gives, in its order: the cache group, the local
    block and the remote block (ids are piece-major, so a chunk's page repeats once per piece)."""
    groups: list[np.ndarray] = []
    local: list[np.ndarray] = []
    remote: list[np.ndarray] = []
    for g, cols, ch in _groups_read(peer, chunks):
        pieces = cols.local_base.shape[0]
        p = plan.groups[g]
        local.append(np.tile(ch.local_page // p.local_pages_per_block, pieces))
        remote.append(np.tile(ch.remote_page // p.remote_pages_per_block, pieces))
        groups.append(np.full(len(local[-1]), g, dtype=np.int64))
    if not groups:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(groups), np.concatenate(local), np.concatenate(remote)


def _ids(base: np.ndarray, pages: np.ndarray, page: np.ndarray, phase: np.ndarray | None) -> np.ndarray:
    """base[t] + phase[q] * pages[t] + page[q], flattened piece-major. base/pages are (pieces, 1) int32.

    int32 is what NIXL takes for indices; plans keep every id below 2**31.
    """
    page = page.astype(np.int32, copy=False)
    ids = base + page
    if phase is not None:
        ids += phase.astype(np.int32) * pages
    return ids.ravel()


def peer_bytes(peer: PeerPlan, chunks: list[Chunks]) -> int:
    """Bytes the descriptors `peer_indices` gives cover: each chunk of a group moves one
    descriptor per piece, so a group's chunks times the sum of its pieces' lengths."""
    return sum(len(ch.local_page) * cols.chunk_bytes for _, cols, ch in _groups_read(peer, chunks))


def request_reads(plan: RankPlan, req: RequestBlocks) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Per remote rank read from: (rank, local ids, remote ids, bytes). Ranks with nothing to
    read are left out."""
    chunks = request_chunks(plan, req)
    for rank, peer in plan.peers.items():
        lids, rids = peer_indices(peer, chunks)
        if len(lids):
            yield rank, lids, rids, peer_bytes(peer, chunks)


def request_indices(plan: RankPlan, req: RequestBlocks) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per remote rank read from: (local ids, remote ids). Ranks with nothing to read are left out."""
    return {rank: (lids, rids) for rank, lids, rids, _ in request_reads(plan, req)}
