"""Decode side: reads from peer daemons, from the request to the completion the engine polls.

    start(R) -> route (cached; else handshake + plan, shared) -> Transfer.post: a READ per remote
             rank read from, a notification alone to the others -> polled until every READ is
             DONE -> "received";  an error or the deadline -> "failed" + the local block ids

A read large enough is split across posting lanes (lanes.py): its slices are posted from the
lanes' threads, and its consumers are notified once every slice is DONE.

An audited read (integrity.py), once DONE, digests the rows that arrived and asks the prefill
daemon for its digests of the same rows; its consumers are notified, and it is reported
`received`, only when every row matches and no block was reused; otherwise it fails
"integrity" with the local blocks that hold wrong bytes.

Every call on the daemon's own agent happens on the loop's thread. NIXL cannot cancel a transfer: a read past its
deadline is reported failed and its handles are quarantined, polled until they end, and the
engine memory they touch stays mapped and registered until then. A transfer uses its engine
rank and its route for as long as it is in flight or quarantined; nothing counts that by hand,
`uses_engine` and `uses_route` ask the two collections that own the transfers.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from . import handshake as hs
from . import integrity
from . import protocol as P
from .engines import EngineRank
from .lanes import Lanes, SliceRead
from .nixl_driver import DONE, NixlDriver, TransferError, XferHandle
from .peers import Link, Peer, Peers, Route
from .plan.descriptors import (
    RequestBlocks,
    local_rows,
    peer_indices,
    remote_rows,
    request_chunks,
    request_indices,
    row_blocks,
)
from .plan.geometry import GeometryError
from .plan.planner import PeerPlan, PlanError
from .protocol import RequestError
from .recorder import FailureKind, Recorder

log = logging.getLogger("kvxferd")

ReadKey = tuple[str, int, str]  # (engine id, tp rank, request id)
ATTEMPTS = 2  # a peer restarted behind a cached route: the first post fails, the second handshakes anew
AUDIT_RETRY_S = 0.02  # between audits of a request the prefill does not hold yet
_encode = msgspec.msgpack.Encoder().encode


class StaleRoute(Exception):
    """Nothing could be posted on a route: most likely its peer restarted (new agent, same address)."""


@dataclass(eq=False)
class Transfer:
    """One read request: what it asked for, what it posted, and how it ended."""

    engine: EngineRank
    msg: P.Read
    received_at: float  # perf_counter when the engine's request arrived
    started: float  # monotonic
    deadline: float
    route: Route | None = None
    handles: list[XferHandle] = field(default_factory=list)
    slices: list[SliceRead] = field(default_factory=list)  # a split read's slices, on lanes
    notify_after: list[bytes] = field(default_factory=list)  # a split read's notifications, sent once DONE
    posted_at: float = 0.0  # monotonic
    nbytes: int = 0
    descriptors: int = 0
    done: bool = False
    audit: bool = False  # check the bytes against the prefill's digests before `received`

    @property
    def key(self) -> ReadKey:
        return self.engine.engine_id, self.engine.tp_rank, self.msg.request_id

    @property
    def peer_label(self) -> str:
        return self.msg.remote.engine_id

    @property
    def running(self) -> bool:
        """Something NIXL moves for this read may still be running."""
        return bool(self.handles or self.slices)

    def post(self, route: Route, nixl: NixlDriver, lanes: Lanes, on_sliced: Callable[[], None]) -> int:
        """Post a READ per remote rank this request reads (split across lanes when large,
        `on_sliced` running on the loop as each slice's post returns), notify the rest; returns
        notifications.

        Raises StaleRoute when NIXL refused the first READ (nothing posted), TransferError when
        it refused a later one (some READs are running).
        """
        self.route = route
        plan = route.plan
        reads = request_indices(plan, RequestBlocks.of(self.msg.num_tokens, self.msg.local_blocks,
                                                       self.msg.remote_blocks))
        nbytes = {rank: _bytes_read(plan.peers[rank], lids) for rank, (lids, _) in reads.items()}
        split = lanes.slices(sum(nbytes.values()))
        ref = self.msg.remote
        expected = route.expected
        try:
            for rank, (lids, rids) in reads.items():
                link = route.links[rank]
                notif = _encode(hs.Notification(ref.engine_id, rank, ref.request_id, expected))
                if split:
                    self._post_slices(plan.peers[rank], link, lids, rids, route.agent, route.peer.metadata, lanes,
                                      split, on_sliced)
                    self.notify_after.append(notif)
                elif link.local is None or link.remote is None:  # too many descriptors to prepare
                    pp, er = plan.peers[rank], self.engine
                    self.handles.append(nixl.read_rows(local_rows(pp, lids, er.region_addr, er.device), er.mem_type,
                                                       remote_rows(pp, rids, link.remote_region_addr,
                                                                   link.remote_device), link.remote_mem, route.agent))
                    self.notify_after.append(notif)
                elif self.audit:  # consumers are told once the bytes are checked
                    self.handles.append(nixl.read(link.local, lids, link.remote, rids, b""))
                    self.notify_after.append(notif)
                else:
                    self.handles.append(nixl.read(link.local, lids, link.remote, rids, notif))
                self.nbytes += nbytes[rank]
                self.descriptors += len(lids)
            for rank in plan.targets:
                if rank not in reads:
                    nixl.notify(route.agent, _encode(hs.Notification(ref.engine_id, rank, ref.request_id,
                                                                          expected)))
        except TransferError as exc:
            if not self.running:
                raise StaleRoute(str(exc)) from exc
            raise
        self.posted_at = time.monotonic()
        return len(plan.targets)

    def _post_slices(self, pp: PeerPlan, link: Link, lids: np.ndarray, rids: np.ndarray, agent: str,
                     metadata: bytes, lanes: Lanes, k: int, on_sliced: Callable[[], None]) -> None:
        """One remote rank's descriptor pairs in `k` contiguous slices, slice i on lane i."""
        er = self.engine
        for lane, local, remote in zip(lanes.lanes, np.array_split(lids, k), np.array_split(rids, k)):
            rows_l = local_rows(pp, local, er.region_addr, er.device)
            rows_r = remote_rows(pp, remote, link.remote_region_addr, link.remote_device)
            self.slices.append(SliceRead(lane, lane.post(rows_l, er.mem_type, rows_r, link.remote_mem, agent,
                                                         metadata, on_sliced)))

    def poll(self, nixl: NixlDriver) -> bool:
        """True once every READ is DONE; TransferError when NIXL reports one failed."""
        return all(nixl.state(h) == DONE for h in self.handles) and all(s.ended() for s in self.slices)

    def release_ended(self, nixl: NixlDriver) -> None:
        """Release the handles NIXL reports ended (done or failed); keep the ones still running."""
        running = []
        for h in self.handles:
            try:
                ended = nixl.state(h) == DONE
            except TransferError:
                ended = True
            if ended:
                nixl.release(h)
            else:
                running.append(h)
        self.handles = running
        self.slices = [s for s in self.slices if not s.release()]

    def release_all(self, nixl: NixlDriver) -> None:
        """Release every handle: all DONE, as `poll` just saw (no second state query)."""
        for h in self.handles:
            nixl.release(h)
        self.handles = []
        for s in self.slices:
            s.release()
        self.slices = []

    def notify_consumers(self, nixl: NixlDriver) -> None:
        """A split read is DONE: tell its consumers, as a whole READ's own notification would."""
        assert self.route is not None
        for notif in self.notify_after:
            try:
                nixl.notify(self.route.agent, notif)
            except TransferError as exc:  # the bytes are here; the prefill side's lease frees its blocks
                log.warning("read %s arrived, but notifying %s failed: %s", self.msg.request_id,
                            self.route.peer.engine_id, exc)
        self.notify_after = []

    def transfer_seconds(self, nixl: NixlDriver, recorder: Recorder) -> float:
        """NIXL's own time for the slowest READ (0 without telemetry), recorded per handle."""
        slowest = 0.0
        for h in self.handles:
            tele = nixl.telemetry_of(h)
            if tele:
                recorder.nixl_timed(*tele)
                slowest = max(slowest, tele[0] + tele[1])
        return slowest


class _AuditRefused(Exception):
    """The prefill daemon could not vouch for the bytes (not held, no digests, bad rows)."""


def _bytes_read(pp: PeerPlan, lids: np.ndarray) -> int:
    """Bytes a set of local descriptor ids covers (each descriptor has its piece's length)."""
    piece = np.searchsorted(pp.local_base, lids, side="right") - 1
    return int(pp.length[piece].sum())


class Reads:
    def __init__(self, nixl: NixlDriver, peers: Peers, recorder: Recorder, max_deadline_s: float,
                 lanes: Lanes, on_posted: Callable[[], None] = lambda: None, integrity_audit: bool = False) -> None:
        self._nixl = nixl
        self._integrity_audit = integrity_audit
        self._lanes = lanes
        self._peers = peers
        self._routes = peers.routes  # read only: the fast path's lookup
        self._recorder = recorder
        self._max_deadline_s = max_deadline_s
        self._in_flight: dict[ReadKey, Transfer] = {}
        self._quarantine: list[Transfer] = []
        self._on_posted = on_posted  # wakes the progress loop from its idle wait
        self._rate = 2e9  # bytes/s of recent large reads: when to expect a read to end

    # --- start ----------------------------------------------------------------
    def start(self, er: EngineRank, msg: P.Read, received_at: float) -> None:
        """Accept a read; it ends as a completion. Posts at once when the route is known."""
        if (er.engine_id, er.tp_rank, msg.request_id) in self._in_flight:
            raise RequestError("bad_request", f"request {msg.request_id!r} is already being read")
        if msg.deadline_s > self._max_deadline_s:
            raise RequestError("bad_request", f"deadline_s {msg.deadline_s} outside (0, {self._max_deadline_s}]")
        groups = len(er.geometry.groups)
        if len(msg.local_blocks) != groups or len(msg.remote_blocks) != groups:
            raise RequestError("bad_request", f"block lists for {len(msg.local_blocks)}/{len(msg.remote_blocks)} "
                                              f"groups; the geometry has {groups}")
        now = time.monotonic()
        t = Transfer(er, msg, received_at, now, now + msg.deadline_s,
                     audit=self._integrity_audit if msg.audit is None else msg.audit)
        self._in_flight[t.key] = t
        ref = msg.remote
        route = self._routes.get(((ref.engine_id, ref.host, ref.port), (er.engine_id, er.tp_rank)))
        attempts = ATTEMPTS
        if route is not None and route.remote_tp == ref.tp_size:
            try:  # the common case: post right here, without a task or an await
                self._post(t, route)
                attempts = 0
            except StaleRoute as exc:
                self._peers.retire(route.peer, f"posting failed: {exc}")
                attempts = ATTEMPTS - 1
            except Exception as exc:
                self._fail_on(t, exc)
                attempts = 0
        if attempts:
            asyncio.get_running_loop().create_task(self._start_slow(t, attempts))
        self._recorder.reads_now(len(self._in_flight), len(self._quarantine))

    async def _start_slow(self, t: Transfer, attempts: int) -> None:
        """Handshake and plan first (shared with every read waiting on the same peer), then post."""
        try:
            for _ in range(attempts):
                route = await self._peers.route(t.msg.remote, t.engine, t.deadline)
                try:
                    self._post(t, route)
                    return
                except StaleRoute as exc:
                    self._peers.retire(route.peer, f"posting failed: {exc}")
                    t.route = None
            self._fail(t, "transfer", "no READ could be posted on a fresh handshake either")
        except Exception as exc:
            self._fail_on(t, exc)

    def _post(self, t: Transfer, route: Route) -> None:
        if t.done:
            return
        if t.engine.closing:  # unregistered while the handshake ran: nothing to post, the peer is fine
            self._fail(t, "engine_gone", "engine unregistered before the read was posted")
            return
        notifications = t.post(route, self._nixl, self._lanes, self._on_posted)
        self._recorder.read_posted(t.peer_label, t.descriptors, notifications, time.perf_counter() - t.received_at,
                                   len(t.slices))
        if t.running:
            self._on_posted()
        else:
            self._finish(t)

    def _fail_on(self, t: Transfer, exc: Exception) -> None:
        """The failure kind an exception on the read path stands for."""
        if isinstance(exc, hs.HandshakeError):
            self._fail(t, "handshake", str(exc))
        elif isinstance(exc, PlanError | GeometryError):
            self._fail(t, "plan", str(exc))
        elif isinstance(exc, TransferError):
            if t.route is not None:
                self._peers.retire(t.route.peer, str(exc))
            self._fail(t, "engine_gone" if t.engine.closing else "transfer", str(exc))
        elif isinstance(exc, asyncio.TimeoutError):
            self._fail(t, "deadline", "deadline passed while waiting for the handshake")
        else:
            log.error("read %s failed unexpectedly", t.msg.request_id, exc_info=exc)
            self._fail(t, "internal", f"{type(exc).__name__}: {exc}")

    # --- end ------------------------------------------------------------------
    def _finish(self, t: Transfer) -> None:
        """The read arrived: every byte is in the engine's blocks."""
        if t.done:
            return
        t.done = True
        seconds = time.monotonic() - t.started
        self._recorder.read_received(t.peer_label, t.nbytes, seconds, time.perf_counter() - t.received_at)
        t.engine.complete(P.Completion(t.msg.request_id, "received", [], "", t.nbytes, seconds))
        self._end(t)

    def _fail(self, t: Transfer, kind: FailureKind, reason: str, block_ids: list[list[int]] | None = None) -> None:
        """The read failed: the engine learns which of its blocks hold no valid data (all of the
        request's, unless an audit named the corrupt ones)."""
        if t.done:
            return
        t.done = True
        seconds = time.monotonic() - t.started
        why = f"{kind}: {reason}"
        self._recorder.read_failed(t.peer_label, kind, seconds, P.FailureRecord(
            time.time(), t.engine.engine_id, t.engine.tp_rank, t.msg.request_id, t.peer_label, why))
        t.engine.complete(P.Completion(t.msg.request_id, "failed", t.msg.local_blocks if block_ids is None
                                       else block_ids, why, 0, seconds))
        self._end(t)

    def _end(self, t: Transfer) -> None:
        """Out of flight; READs NIXL still runs keep the transfer (and its memory) in quarantine."""
        self._in_flight.pop(t.key, None)
        if t.running:
            self._quarantine.append(t)
            self._recorder.read_quarantined()
        self._recorder.reads_now(len(self._in_flight), len(self._quarantine))

    def fail_engine(self, er: EngineRank, why: str) -> None:
        for t in [t for t in self._in_flight.values() if t.engine is er]:
            self._fail(t, "engine_gone", f"{why} during the transfer")

    def fail_all(self, kind: FailureKind, why: str) -> set[EngineRank]:
        """Fail every read in flight; returns the engine ranks that were told."""
        told = {t.engine for t in self._in_flight.values()}
        for t in list(self._in_flight.values()):
            self._fail(t, kind, why)
        return told

    # --- audit ----------------------------------------------------------------
    async def _audit(self, t: Transfer) -> None:
        """Compare what arrived with the prefill's digests, row by row; then finish or fail."""
        try:
            corrupt, rows = await self._corrupt_blocks(t)
        except hs.HandshakeError as exc:
            self._recorder.audit_ended(0, unanswered=True)
            self._fail(t, "integrity", f"no audit answer: {exc}")
            return
        except _AuditRefused as exc:
            self._recorder.audit_ended(0, unanswered=True)
            self._fail(t, "integrity", str(exc))
            return
        except Exception as exc:
            self._fail_on(t, exc)
            return
        if t.done:  # failed meanwhile (engine gone, shutdown)
            return
        self._recorder.audit_ended(sum(len(b) for b in corrupt))
        if rows:
            self._fail(t, "integrity", f"{rows} rows differ from the prefill's digests, in local blocks "
                                       f"{corrupt}", corrupt)
            return
        t.notify_consumers(self._nixl)
        self._finish(t)

    async def _corrupt_blocks(self, t: Transfer) -> tuple[list[list[int]], int]:
        """Per cache group, the local blocks with a row that differs; and how many rows differ."""
        assert t.route is not None
        er, ref, plan = t.engine, t.msg.remote, t.route.plan
        chunks = request_chunks(plan, RequestBlocks.of(t.msg.num_tokens, t.msg.local_blocks, t.msg.remote_blocks))
        corrupt: list[set[int]] = [set() for _ in er.geometry.groups]
        wrong_rows = 0
        for rank, pp in plan.peers.items():
            lids, rids = peer_indices(pp, chunks)  # what `post` read from this rank
            if not len(lids):
                continue
            remote = remote_rows(pp, rids, t.route.links[rank].remote_region_addr)[:, :2].astype("<i8")
            request = hs.AuditRequest(hs.HANDSHAKE_VERSION, ref.engine_id, rank, ref.request_id, remote.tobytes())
            asked = asyncio.ensure_future(self._peers.audit(ref, request, max(t.deadline - time.monotonic(), 0.001)))
            await asyncio.sleep(0)  # the request leaves; the prefill digests while we do
            t0 = time.perf_counter()
            local = local_rows(pp, lids, er.region_addr)
            ours = integrity.digest_rows(er.mappings, local)
            self._recorder.digested("read", int(local[:, 1].sum()), time.perf_counter() - t0)
            reply = await asked
            while reply.retry and not t.done and time.monotonic() + AUDIT_RETRY_S < t.deadline:
                await asyncio.sleep(AUDIT_RETRY_S)  # the read overtook the prefill's hold
                reply = await self._peers.audit(ref, request, max(t.deadline - time.monotonic(), 0.001))
            if not reply.ok:
                raise _AuditRefused(f"prefill rank {rank} refused the audit: {reply.reason}")
            theirs = np.frombuffer(reply.digests, "<u8")
            if len(theirs) != len(ours):
                raise _AuditRefused(f"prefill rank {rank} sent {len(theirs)} digests for {len(ours)} rows")
            group, local_block, remote_block = row_blocks(plan, pp, chunks)
            wrong = ours != theirs
            for g, reused in enumerate(reply.reused):
                if reused:
                    wrong |= (group == g) & np.isin(remote_block, reused)
            wrong_rows += int(wrong.sum())
            for g, block in zip(group[wrong].tolist(), local_block[wrong].tolist()):
                corrupt[g].add(block)
        return [sorted(c) for c in corrupt], wrong_rows

    # --- polling --------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Check posted reads and quarantined handles once."""
        for t in [t for t in self._in_flight.values() if t.running]:
            self._check(t, now)
        for t in list(self._quarantine):
            t.release_ended(self._nixl)
            if not t.running:
                self._quarantine.remove(t)
                self._recorder.reads_now(len(self._in_flight), len(self._quarantine))

    def _check(self, t: Transfer, now: float) -> None:
        try:
            done = t.poll(self._nixl)
        except TransferError as exc:
            t.release_ended(self._nixl)
            if t.route is not None:
                self._peers.retire(t.route.peer, str(exc))
            self._fail(t, "transfer", str(exc))
            return
        if done:
            took = t.transfer_seconds(self._nixl, self._recorder)
            if t.nbytes >= 1 << 20 and took > 0:
                # NIXL's own timing, not when we noticed: a late poll must not slow the estimate
                self._rate = 0.7 * self._rate + 0.3 * (t.nbytes / took)
            t.release_all(self._nixl)
            if t.audit:
                asyncio.get_running_loop().create_task(self._audit(t))
                return
            t.notify_consumers(self._nixl)
            self._finish(t)
        elif now >= t.deadline:
            self._fail(t, "deadline", f"{t.deadline - t.started:.3g} s passed; memory quarantined")

    @property
    def busy(self) -> bool:
        return bool(self._in_flight or self._quarantine)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def next_poll(self, now: float, spin_s: float, interval_s: float) -> float:
        """Seconds to sleep before the next poll: 0 inside a spin window.

        A read is expected to end `nbytes / observed throughput` after it was posted. The loop
        spins within `spin_s` of a read's posting or of its expected end, and otherwise sleeps
        until the next such window (at most `interval_s`): small reads are seen within
        microseconds, large ones within a spin of their end, and no core burns while bytes move.
        """
        wait = interval_s
        for t in self._in_flight.values():
            if not t.handles:
                continue  # nothing posted here; a split read's lanes wake the loop as slices are posted
            for edge in (t.posted_at, t.posted_at + t.nbytes / self._rate):
                if edge - spin_s <= now <= edge + spin_s:
                    return 0.0
                if edge - spin_s > now:
                    wait = min(wait, edge - spin_s - now) if wait else edge - spin_s - now
        return wait

    # --- who uses what --------------------------------------------------------
    def _transfers(self) -> list[Transfer]:
        return [*self._in_flight.values(), *self._quarantine]

    def uses_engine(self, er: EngineRank) -> int:
        return sum(1 for t in self._transfers() if t.engine is er)

    def uses_route(self, route: Route) -> bool:
        return any(t.route is route for t in self._transfers())

    def uses_peer(self, peer: Peer) -> int:
        return sum(1 for t in self._transfers() if t.route is not None and t.route.peer is peer)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def status(self, now: float, limit: int) -> list[P.ReadStatus]:
        """The `limit` oldest reads in flight."""
        return [P.ReadStatus(t.engine.engine_id, t.engine.tp_rank, t.msg.request_id, t.peer_label, now - t.started)
                for t in heapq.nsmallest(limit, self._in_flight.values(), key=lambda t: t.started)]
