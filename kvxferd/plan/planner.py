"""Transfer planning: local geometry + remote geometries -> which bytes to read from where.

One algorithm for every model kind. For each local segment, intersect this rank's unit
range with the unit ranges of the remote ranks it talks to, pick one source per unit
(the first target rank holding it, which de-duplicates replicas the way vLLM does), and
emit *pieces*: (local offset, remote offset, length) inside a page. Heterogeneous TP,
GQA replication, MLA, Mamba conv/SSM splits and per-group head counts all fall out of it.

Block-size mismatch is the same arithmetic on tokens: a group moves in chunks of
`c = min(local, remote tokens per kernel page)` tokens; the side with larger pages
addresses a chunk by its *phase* (which c-token slice of the page). A piece then
expands into one descriptor per (phase, page) on each side:

    desc_id = base[piece] + phase * pages[piece] + page

The planner is pure: no I/O, no NIXL. `descriptors` turns plans into NIXL arrays and
per-request indices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from .geometry import TOKEN_MAJOR, UNIT_SEALED, CacheGroup, Geometry, Segment


class PlanError(ValueError):
    """A combination that cannot be transferred; the message names the case."""


def check_tp(local_tp: int, remote_tp: int) -> None:
    if local_tp < 1 or remote_tp < 1 or (local_tp % remote_tp and remote_tp % local_tp):
        raise PlanError(f"TP sizes do not divide: decode TP {local_tp}, prefill TP {remote_tp}")


def targets(local_rank: int, local_tp: int, remote_tp: int) -> tuple[int, ...]:
    """Remote ranks that local rank talks to (handshakes with and notifies), in preference order.

    D_TP >= P_TP: the one prefill rank whose slice contains ours. P_TP > D_TP: the
    P_TP/D_TP prefill ranks whose slices make up ours.
    """
    check_tp(local_tp, remote_tp)
    if not 0 <= local_rank < local_tp:
        raise PlanError(f"local rank {local_rank} out of range for TP {local_tp}")
    if local_tp >= remote_tp:
        return (local_rank * remote_tp // local_tp,)
    ratio = remote_tp // local_tp
    return tuple(range(local_rank * ratio, (local_rank + 1) * ratio))


def consumers(local_tp: int, remote_tp: int) -> int:
    """How many decode ranks notify each prefill rank per request."""
    check_tp(local_tp, remote_tp)
    return max(1, local_tp // remote_tp)


@dataclass(frozen=True)
class GroupPairing:
    """Token arithmetic of one cache group between the two sides."""

    name: str
    kind: str
    local_tokens_per_block: int
    remote_tokens_per_block: int
    local_pages_per_block: int
    remote_pages_per_block: int
    local_num_blocks: int
    remote_num_blocks: int
    chunk_tokens: int  # tokens per descriptor (1 for state groups)
    local_phases: int  # chunks per local kernel page
    remote_phases: int


@dataclass(frozen=True)
class Piece:
    """One piece: `length` bytes at `local_offset + phase * local_step` in every page of a local
    view, read from `remote_offset + phase * remote_step` in every page of a remote view.

    It expands into one descriptor per (phase, page) on each side (`descriptors.descriptor_array`).
    """

    group: int
    key: str  # "view.segment[units]"
    local_view: int
    remote_view: int
    local_offset: int
    remote_offset: int
    length: int
    local_step: int  # bytes between phases on the local side
    remote_step: int


@dataclass(frozen=True)
class GroupColumns:
    """The id arithmetic of one group's pieces, shaped (pieces, 1) to broadcast over chunks."""

    local_base: np.ndarray
    local_pages: np.ndarray
    remote_base: np.ndarray
    remote_pages: np.ndarray
    chunk_bytes: int  # bytes one chunk moves: a descriptor per piece, each its piece's length


@dataclass(frozen=True)
class PeerPlan:
    """What local rank reads from one remote rank: pieces as numpy columns, one row per piece."""

    remote_rank: int
    pieces: tuple[Piece, ...]
    group: np.ndarray
    local_region: np.ndarray
    remote_region: np.ndarray
    local_offset: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray
    local_step: np.ndarray
    remote_step: np.ndarray
    local_stride: np.ndarray
    remote_stride: np.ndarray
    local_pages: np.ndarray
    remote_pages: np.ndarray
    local_phases: np.ndarray
    remote_phases: np.ndarray
    local_base: np.ndarray  # first descriptor id of each piece
    remote_base: np.ndarray
    num_local_descs: int
    num_remote_descs: int
    by_group: dict[int, GroupColumns] = field(default_factory=dict)


@dataclass(frozen=True)
class RankPlan:
    """Everything one local rank needs to pull from one remote engine."""

    local_rank: int
    local_tp: int
    remote_tp: int
    targets: tuple[int, ...]
    groups: tuple[GroupPairing, ...]
    peers: dict[int, PeerPlan]  # remote ranks read from

    @property
    def notify_only(self) -> tuple[int, ...]:
        return tuple(t for t in self.targets if t not in self.peers)

    @property
    def consumers_per_remote_rank(self) -> int:
        return consumers(self.local_tp, self.remote_tp)


def plan_rank(local: Geometry, remotes: dict[int, Geometry], merge: bool = True) -> RankPlan:
    """Plan local rank `local.tp_rank` reading from the remote engine whose ranks are `remotes`.

    `remotes` must hold the geometry of every target rank. `merge` joins pieces that are
    contiguous on both sides into one (fewer, larger descriptors).
    """
    if not remotes:
        raise PlanError("no remote geometry given")
    remote_tp = next(iter(remotes.values())).tp_size
    want = targets(local.tp_rank, local.tp_size, remote_tp)
    missing = [t for t in want if t not in remotes]
    if missing:
        raise PlanError(f"no geometry for remote ranks {missing}")
    for rank, geo in remotes.items():
        if geo.tp_size != remote_tp or geo.tp_rank != rank:
            raise PlanError(f"remote rank {rank}: geometry says rank {geo.tp_rank} of TP {geo.tp_size}")
    remote_groups = {g.name: g for g in remotes[want[0]].groups}
    pairings: list[GroupPairing] = []
    pieces_by_rank: dict[int, list[Piece]] = {t: [] for t in want}
    for gi, group in enumerate(local.groups):
        rgroup = remote_groups.get(group.name)
        if rgroup is None or rgroup.kind != group.kind:
            raise PlanError(f"cache group {group.name!r} ({group.kind}) has no counterpart on the remote engine")
        pairing = _pair_group(group, rgroup)
        pairings.append(pairing)
        for rank in want:
            _check_group_match(group, next(g for g in remotes[rank].groups if g.name == group.name), rank)
        _plan_group(gi, group, pairing, {t: remotes[t] for t in want}, want, pieces_by_rank)
    if len(remote_groups) != len(local.groups):
        extra = sorted(set(remote_groups) - {g.name for g in local.groups})
        raise PlanError(f"remote engine has cache groups {extra} that the local engine lacks")
    peers = {}
    for rank, pieces in pieces_by_rank.items():
        if pieces:
            if merge:
                pieces = _merge(pieces)
            peers[rank] = _columns(rank, pieces, local, remotes[rank], pairings)
    return RankPlan(local.tp_rank, local.tp_size, remote_tp, want, tuple(pairings), peers)


def _pair_group(local: CacheGroup, remote: CacheGroup) -> GroupPairing:
    lt, rt = local.tokens_per_page, remote.tokens_per_page
    if max(lt, rt) % min(lt, rt):
        raise PlanError(f"group {local.name}: tokens per page differ and do not divide "
                        f"(local {lt}, remote {rt})")
    chunk = min(lt, rt)
    return GroupPairing(local.name, local.kind, local.tokens_per_block, remote.tokens_per_block,
                        local.pages_per_block, remote.pages_per_block, local.num_blocks, remote.num_blocks,
                        chunk, lt // chunk, rt // chunk)


def _segment_index(group: CacheGroup) -> dict[str, tuple[int, Segment]]:
    return {f"{v.name}.{s.name}": (vi, s) for vi, v in enumerate(group.views) for s in v.segments}


def _check_group_match(local: CacheGroup, remote: CacheGroup, rank: int) -> None:
    lkeys, rkeys = _segment_index(local), _segment_index(remote)
    if lkeys.keys() != rkeys.keys():
        diff = sorted(lkeys.keys() ^ rkeys.keys())
        raise PlanError(f"group {local.name}: segments differ from remote rank {rank}: {diff[:6]}")
    for key, (_, seg) in lkeys.items():
        rseg = rkeys[key][1]
        if (seg.total_units, seg.token_bytes) != (rseg.total_units, rseg.token_bytes):
            raise PlanError(f"segment {key}: local {seg.total_units} units of {seg.token_bytes} B/token, "
                            f"remote rank {rank} {rseg.total_units} units of {rseg.token_bytes} B/token")


def _plan_group(gi: int, group: CacheGroup, pairing: GroupPairing, remotes: dict[int, Geometry],
                want: tuple[int, ...], out: dict[int, list[Piece]]) -> None:
    remote_index = {rank: _segment_index(next(g for g in geo.groups if g.name == group.name))
                    for rank, geo in remotes.items()}
    c = pairing.chunk_tokens
    for vi, view in enumerate(group.views):
        for seg in view.segments:
            key = f"{view.name}.{seg.name}"
            for rank, start, stop in _sources(seg, key, want, remote_index):
                rvi, rseg = remote_index[rank][key]
                out[rank].extend(_pieces(gi, key, vi, rvi, seg, rseg, start, stop, c))


def _sources(seg: Segment, key: str, want: tuple[int, ...],
             remote_index: dict[int, dict[str, tuple[int, Segment]]]) -> list[tuple[int, int, int]]:
    """Runs (remote rank, unit start, unit stop) covering the local units, one source per unit."""
    runs: list[tuple[int, int, int]] = []
    for unit in range(seg.unit_start, seg.unit_stop):
        src = next((r for r in want if remote_index[r][key][1].unit_start <= unit < remote_index[r][key][1].unit_stop),
                   None)
        if src is None:
            raise PlanError(f"segment {key}: no remote rank among {list(want)} holds unit {unit}")
        if runs and runs[-1][0] == src and runs[-1][2] == unit:
            runs[-1] = (src, runs[-1][1], unit + 1)
        else:
            runs.append((src, unit, unit + 1))
    return runs


def _pieces(gi: int, key: str, lvi: int, rvi: int, seg: Segment, rseg: Segment,
            start: int, stop: int, chunk: int) -> list[Piece]:
    """The pieces that read units [start, stop) of segment `key` from one remote rank into this one.

    Offsets are bytes from the start of a page; tb = token_bytes, c = `chunk`, unit_bytes = tokens * tb:

        local_at  = seg.offset  + (start - seg.unit_start)  * seg.unit_stride
        remote_at = rseg.offset + (start - rseg.unit_start) * rseg.unit_stride

    Both sides c tokens per page: one piece, local_at <- remote_at, (stop - start) * unit_bytes long
    (a piece per unit where units are not back to back). Otherwise one piece per unit u = start + i
    and lane l: local_at + i * seg.unit_stride + l * seg.lane_bytes <- remote_at + i *
    rseg.unit_stride + l * rseg.lane_bytes, c * tb long, step c * tb (phase p of a page starts
    p * c * tb further on).
    Token-major (same units on both sides): one piece seg.offset <- rseg.offset covering c tokens of
    all units, c * (stop - start) * tb long, step the same. Unit-sealed: whole units only.

    Local units [2, 4) with 16 tokens per page, remote units [0, 4) with 32 (c = 16; ph p: tokens
    [16p, 16p + 16) of a remote unit). Two pieces, [2] and [3], each 16 * tb long:

      remote | unit 0            | unit 1            | unit 2            | unit 3            |
                                                     | ph 0    | ph 1    | ph 0    | ph 1    |
             ^rseg.offset                            ^remote_at          ^remote_at + rseg.unit_bytes
      local  | unit 2  | unit 3  |      (one phase: 16 tokens per unit)
             ^local_at ^local_at + seg.unit_bytes
    """
    tb = seg.token_bytes
    if TOKEN_MAJOR in (seg.layout, rseg.layout):
        same = (seg.unit_start, seg.unit_stop) == (rseg.unit_start, rseg.unit_stop) == (start, stop)
        if not same or seg.layout != rseg.layout:
            raise PlanError(f"segment {key}: token-major (NHD) layout needs the same heads on both sides "
                            f"and the same layout; local units [{seg.unit_start}, {seg.unit_stop}) "
                            f"{seg.layout}, remote [{rseg.unit_start}, {rseg.unit_stop}) {rseg.layout}. "
                            "NHD with heterogeneous TP is unsupported: heads interleave per token")
        row = (stop - start) * tb
        return [Piece(gi, f"{key}[{start}:{stop}]", lvi, rvi, seg.offset, rseg.offset,
                      chunk * row, chunk * row, chunk * row)]
    if UNIT_SEALED in (seg.layout, rseg.layout):
        if seg.layout != rseg.layout:
            raise PlanError(f"segment {key}: local layout {seg.layout}, remote {rseg.layout}; a sealed unit "
                            "(tokens not addressable inside a head) pairs only with the same layout")
        if not seg.tokens == rseg.tokens == chunk:
            raise PlanError(f"segment {key}: block-size mismatch (local {seg.tokens}, remote {rseg.tokens} tokens "
                            "per page) needs token-addressable pages, but this layout seals each head's tokens "
                            "(vLLM's CPU backend stores a head's K transposed next to its V); run both engines "
                            "with the same block size")
    if seg.lanes != rseg.lanes:
        raise PlanError(f"segment {key}: {seg.lanes} lanes per unit locally, {rseg.lanes} on the remote side")
    local_at = seg.offset + (start - seg.unit_start) * seg.unit_stride
    remote_at = rseg.offset + (start - rseg.unit_start) * rseg.unit_stride
    units = range(stop - start)
    if seg.tokens == rseg.tokens == chunk:  # whole units: one piece for the run where they are back to back
        if seg.unit_stride == seg.unit_bytes and rseg.unit_stride == rseg.unit_bytes:
            length = (stop - start) * seg.unit_bytes
            return [Piece(gi, f"{key}[{start}:{stop}]", lvi, rvi, local_at, remote_at, length, length, length)]
        n = seg.unit_bytes
        return [Piece(gi, f"{key}[{start + i}]", lvi, rvi, local_at + i * seg.unit_stride,
                      remote_at + i * rseg.unit_stride, n, n, n) for i in units]
    return [Piece(gi, f"{key}[{start + i}]" + (f".{lane}" if seg.lanes > 1 else ""), lvi, rvi,
                  local_at + i * seg.unit_stride + lane * seg.lane_bytes,
                  remote_at + i * rseg.unit_stride + lane * rseg.lane_bytes, chunk * tb, chunk * tb, chunk * tb)
            for i in units for lane in range(seg.lanes)]


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbours contiguous on both sides (K|V of a blocks-first page, conv x|B|C|ssm, the
    interleaved K and V segments of CPU attention's heads): in page order, then joined."""
    pieces = sorted(pieces, key=lambda p: (p.group, p.local_view, p.remote_view, p.local_offset))
    out = [pieces[0]]
    for p in pieces[1:]:
        q = out[-1]
        if ((p.group, p.local_view, p.remote_view) == (q.group, q.local_view, q.remote_view)
                and q.length == q.local_step == q.remote_step and p.length == p.local_step == p.remote_step
                and q.local_offset + q.length == p.local_offset and q.remote_offset + q.length == p.remote_offset):
            length = q.length + p.length
            out[-1] = Piece(q.group, f"{q.key}+{p.key}", q.local_view, q.remote_view,
                            q.local_offset, q.remote_offset, length, length, length)
        else:
            out.append(p)
    return out


def _columns(rank: int, pieces: list[Piece], local: Geometry, remote: Geometry,
             pairings: list[GroupPairing]) -> PeerPlan:
    def col(values: Iterable[int]) -> np.ndarray:
        return np.fromiter(values, dtype=np.int64, count=len(pieces))

    lviews = [local.groups[p.group].views[p.local_view] for p in pieces]
    rgroups = {g.name: g for g in remote.groups}
    rviews = [rgroups[local.groups[p.group].name].views[p.remote_view] for p in pieces]
    lphases = col(pairings[p.group].local_phases for p in pieces)
    rphases = col(pairings[p.group].remote_phases for p in pieces)
    lpages = col(v.num_pages for v in lviews)
    rpages = col(v.num_pages for v in rviews)
    lsize, rsize = lphases * lpages, rphases * rpages
    groups = col(p.group for p in pieces)
    lbase = np.concatenate(([0], np.cumsum(lsize)[:-1]))
    rbase = np.concatenate(([0], np.cumsum(rsize)[:-1]))
    by_group = {}
    for g in np.unique(groups).tolist():
        t = np.flatnonzero(groups == g)
        lb, lp, rb, rp = (np.ascontiguousarray(a[t, None], dtype=np.int32) for a in (lbase, lpages, rbase, rpages))
        by_group[g] = GroupColumns(lb, lp, rb, rp, chunk_bytes=sum(pieces[i].length for i in t.tolist()))
    if max(lsize.sum(), rsize.sum()) >= 2**31:
        raise PlanError(f"remote rank {rank}: {max(lsize.sum(), rsize.sum())} descriptors exceed NIXL's int32 ids")
    return PeerPlan(
        remote_rank=rank, pieces=tuple(pieces), group=groups,
        local_region=col(v.region for v in lviews), remote_region=col(v.region for v in rviews),
        local_offset=col(p.local_offset for p in pieces), remote_offset=col(p.remote_offset for p in pieces),
        length=col(p.length for p in pieces),
        local_step=col(p.local_step for p in pieces), remote_step=col(p.remote_step for p in pieces),
        local_stride=col(v.page_stride for v in lviews), remote_stride=col(v.page_stride for v in rviews),
        local_pages=lpages, remote_pages=rpages, local_phases=lphases, remote_phases=rphases,
        local_base=lbase, remote_base=rbase,
        num_local_descs=int(lsize.sum()), num_remote_descs=int(rsize.sum()), by_group=by_group,
    )
