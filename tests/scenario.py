"""Test scenario: a prompt prefilled by every prefill rank, read by every decode rank.

The read is executed by copying bytes between numpy buffers exactly as NIXL pairs
descriptors (local_ids[i] <- remote_ids[i]); the result is compared with what the decode
rank would hold had it computed the cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.integrity import block_rows
from kvxferd.lab.synthetic import testing
from kvxferd.plan.descriptors import (
    RequestBlocks,
    local_descs,
    local_rows,
    region_addresses,
    remote_descs,
    remote_rows,
    request_chunks,
    request_reads,
    row_blocks,
)
from kvxferd.plan.geometry import ATTENTION, Geometry
from kvxferd.plan.models import ModelShape, build
from kvxferd.plan.planner import RankPlan, plan_rank


def allocate_blocks(geo: Geometry, num_tokens: int, rng: np.random.Generator) -> tuple[tuple[int, ...], ...]:
    """Distinct block ids for every group, drawn from one pool (groups may share regions)."""
    need = testing.blocks_needed(geo, num_tokens)
    pool_size = min(g.num_blocks for g in geo.groups)
    assert sum(need) <= pool_size, "scenario needs more blocks than the geometry has"
    pool = rng.permutation(pool_size)
    out, at = [], 0
    for n in need:
        out.append(tuple(int(b) for b in pool[at:at + n]))
        at += n
    return tuple(out)


def execute(plan: RankPlan, req: RequestBlocks, local_geo: Geometry, local_bufs: list[np.ndarray],
            remote_geos: dict[int, Geometry], remote_bufs: dict[int, list[np.ndarray]]) -> int:
    """Copy bytes as NIXL would for one decode rank; return the bytes moved."""
    assert len(local_bufs) == 1, "scenario geometries use one buffer per rank"
    local_addr = region_addresses(local_geo, [0])
    moved = 0
    for rank, lids, rids, nbytes in request_reads(plan, req):
        peer = plan.peers[rank]
        ldesc = local_descs(peer, local_addr)
        rdesc = remote_descs(peer, region_addresses(remote_geos[rank], [0]))
        assert len(ldesc) == peer.num_local_descs and len(rdesc) == peer.num_remote_descs
        assert lids.max() < len(ldesc) and rids.max() < len(rdesc)
        assert nbytes == int(ldesc[lids, 1].sum()), "the bytes a read counts are its descriptors' lengths"
        # what a posting lane computes for a slice of a read, checked against the whole arrays
        remote_addr = region_addresses(remote_geos[rank], [0])
        assert np.array_equal(local_rows(peer, lids, local_addr), ldesc[lids])
        assert np.array_equal(remote_rows(peer, rids, remote_addr), rdesc[rids])
        # what an audit blames a differing row on: the blocks it lies in, on both sides
        group, lblock, rblock = row_blocks(plan, peer, request_chunks(plan, req))
        assert_rows_in_blocks(ldesc[lids], group, lblock, local_geo, local_addr)
        assert_rows_in_blocks(rdesc[rids], group, rblock, remote_geos[rank], remote_addr)
        dst, src = local_bufs[0], remote_bufs[rank][0]
        for li, ri in zip(lids.tolist(), rids.tolist()):
            la, ln, _ = ldesc[li]
            ra, rn, _ = rdesc[ri]
            assert ln == rn, "NIXL pairs descriptors of equal length only"
            dst[la:la + ln] = src[ra:ra + rn]
            moved += int(ln)
    return moved


def assert_rows_in_blocks(rows: np.ndarray, group: np.ndarray, block: np.ndarray, geo: Geometry,
                          region_addr: np.ndarray) -> None:
    """Every descriptor row lies inside the bytes of the block (of its cache group) it is blamed on."""
    assert len(rows) == len(group) == len(block)
    for g in np.unique(group).tolist():
        ids = [[] for _ in geo.groups]
        ids[g] = np.unique(block[group == g]).tolist()
        spans, _, owner = block_rows(geo, region_addr, ids)  # one group: its blocks' spans never overlap
        order = np.argsort(spans[:, 0])
        starts, ends, owner = spans[order, 0], spans[order, 0] + spans[order, 1], owner[order]
        # a merged piece covers adjacent segments of one page (blocks-first K then V): join them
        joined = np.flatnonzero((starts[1:] == ends[:-1]) & (owner[1:] == owner[:-1])) + 1
        keep = np.ones(len(starts), dtype=bool)
        keep[joined] = False
        run_end = np.maximum.reduceat(ends, np.flatnonzero(keep))
        starts, ends, owner = starts[keep], run_end, owner[keep]
        sel = group == g
        at = np.searchsorted(starts, rows[sel, 0], side="right") - 1
        assert (at >= 0).all(), "a row starts before every block of its group"
        assert (rows[sel, 0] + rows[sel, 1] <= ends[at]).all(), "a row leaves the block span it starts in"
        assert (owner[at] == block[sel]).all(), "a row is blamed on a block it does not lie in"


@dataclass
class Outcome:
    plans: list[RankPlan]
    moved: int
    notifications: dict[int, int]  # prefill rank -> notifications received


def run(p_shape: ModelShape, p_tp: int, d_shape: ModelShape, d_tp: int, num_tokens: int,
        hit_tokens: int = 0, remote_tail_only: bool = False, seed: int = 0, merge: bool = True) -> Outcome:
    """Prefill, plan, read, verify every decode rank byte for byte; raise AssertionError on a mismatch."""
    rng = np.random.default_rng(seed)
    p_geos = {r: build(p_shape, p_tp, r) for r in range(p_tp)}
    d_geos = [build(d_shape, d_tp, r) for r in range(d_tp)]
    p_blocks = allocate_blocks(p_geos[0], num_tokens, rng)
    p_bufs = {}
    for r, geo in p_geos.items():
        p_bufs[r] = testing.allocate(geo)
        testing.fill_sequence(p_bufs[r], geo, testing.Sequence(7, num_tokens, p_blocks))
    d_blocks = allocate_blocks(d_geos[0], num_tokens, rng)
    seq = testing.Sequence(7, num_tokens, d_blocks)
    outcome = Outcome([], 0, {r: 0 for r in range(p_tp)})
    for geo in d_geos:
        bufs = testing.allocate(geo)
        hit = [min(hit_tokens // g.tokens_per_block, len(d_blocks[gi])) if g.kind == ATTENTION else 0
               for gi, g in enumerate(geo.groups)]
        testing.fill_sequence(bufs, geo, seq, upto_block=hit)
        before = [b.copy() for b in bufs]
        plan = plan_rank(geo, {t: p_geos[t] for t in _targets(geo, p_tp)}, merge=merge)
        local = [np.array(d_blocks[gi][hit[gi]:]) for gi in range(len(geo.groups))]
        remote = [np.array(b) for b in p_blocks]
        if remote_tail_only:
            remote = [_needed_tail(g, pg, p_geos[0].groups[gi], num_tokens, hit[gi])
                      for gi, (g, pg) in enumerate(zip(geo.groups, remote))]
        req = RequestBlocks.of(num_tokens, local, remote)
        outcome.moved += execute(plan, req, geo, bufs, p_geos, p_bufs)
        for t in plan.targets:
            outcome.notifications[t] += 1
        expected = testing.expect_after_read(before, geo, seq, hit, [p.chunk_tokens for p in plan.groups])
        bad = testing.check(bufs, expected, geo)
        assert not bad, f"decode rank {geo.tp_rank}: {bad}"
        outcome.plans.append(plan)
    return outcome


def _targets(geo: Geometry, p_tp: int) -> tuple[int, ...]:
    from kvxferd.plan.planner import targets
    return targets(geo.tp_rank, geo.tp_size, p_tp)


def _needed_tail(d_group, p_ids: np.ndarray, p_group, num_tokens: int, hit_blocks: int) -> np.ndarray:
    """Only the prefill blocks that hold missing tokens (a caller that trims the remote list)."""
    if d_group.kind != ATTENTION:
        return p_ids
    first_token = hit_blocks * d_group.tokens_per_block
    return p_ids[first_token // p_group.tokens_per_block:]
