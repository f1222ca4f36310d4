"""Prefill side: held requests, consumer notifications, leases, and handshake answers.

    hold(R, lease) -> held;   notification from each consumer: count += 1
    count == expected -> "sent";   lease passes -> "expired";   engine leaves -> dropped

A consumer may finish before the engine's hold arrives; its notification waits (at most the
longest lease) for the hold it belongs to.

With the integrity audit, a hold digests its blocks' bytes as they are when held
(integrity.py); a consumer's audit compares them again (a changed row: the block was reused)
and digests the rows the consumer read.

Housekeeping costs what expires, not what is held: leases sit in a heap by deadline (a renewal
pushes a new entry, the stale one is skipped when it surfaces), and holds and early
notifications are dicts in arrival order, so the oldest is the first.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np

from . import handshake as hs
from . import integrity
from . import protocol as P
from .engines import EngineKey, EngineRank, Engines
from .nixl_driver import NixlDriver
from .protocol import RequestError
from .recorder import Recorder

log = logging.getLogger("kvxferd")

HoldKey = tuple[str, int, str]  # (engine id, tp rank, request id)


@dataclass(eq=False)
class Held:
    engine: EngineRank
    request_id: str
    deadline: float
    since: float
    block_ids: list[list[int]]
    count: int = 0  # consumers that notified
    expected: int = 0  # consumers the first notification announced; 0 until then
    digests: HeldDigests | None = None  # the blocks' bytes when held (integrity audit)

    @property
    def key(self) -> HoldKey:
        return self.engine.engine_id, self.engine.tp_rank, self.request_id

    @property
    def consumed(self) -> bool:
        return bool(self.expected) and self.count >= self.expected


@dataclass(frozen=True)
class HeldDigests:
    """Every byte row of a held request's blocks, its cache group and block, and its digest."""

    rows: np.ndarray
    group: np.ndarray
    block: np.ndarray
    digests: np.ndarray

    @classmethod
    def of(cls, er: EngineRank, block_ids: list[list[int]]) -> HeldDigests:
        rows, group, block = integrity.block_rows(er.geometry, er.region_addr, block_ids)
        return cls(rows, group, block, integrity.digest_rows(er.mappings, rows))

    def reused(self, er: EngineRank, groups: int) -> list[list[int]]:
        """Per cache group, the blocks with a row whose bytes changed since they were digested."""
        changed = integrity.digest_rows(er.mappings, self.rows) != self.digests
        return [sorted({int(b) for b in self.block[changed & (self.group == g)]}) for g in range(groups)]


@dataclass
class Early:
    """Notifications for a request whose hold has not arrived yet."""

    count: int
    expected: int
    first: float


RECENTLY_ENDED = 65536  # ended holds remembered, so an audit can tell "not yet" from "no more"
# An audit names the rows one consumer read of a held request: each inside the request's blocks,
# each byte once, so at most the hold's bytes (a held row may split into thousands: a row per head,
# key element and chunk phase where blocks translate inside CPU attention's heads). Rows not in
# whole words are digested one by one: few in honest reads, so they are bounded apart.
MAX_UNALIGNED_AUDIT_ROWS = 1 << 16


def _check_block_ids(er: EngineRank, block_ids: list[list[int]]) -> None:
    """A hold names, per cache group, distinct blocks that the registered geometry has."""
    groups = er.geometry.groups
    if len(block_ids) != len(groups):
        raise RequestError("bad_request", f"block lists for {len(block_ids)} groups; the geometry has {len(groups)}")
    for group, ids in zip(groups, block_ids):
        bad = [b for b in ids if not 0 <= b < group.num_blocks]
        if bad:
            raise RequestError("bad_request", f"group {group.name}: block ids {bad[:8]} out of range "
                                              f"0..{group.num_blocks - 1}")
        if len(set(ids)) != len(ids):
            raise RequestError("bad_request", f"group {group.name}: a block id appears twice in {ids[:16]}")


class Holds:
    def __init__(self, engines: Engines, nixl: NixlDriver, recorder: Recorder, max_lease_s: float,
                 integrity_audit: bool = False) -> None:
        self._engines = engines
        self._integrity_audit = integrity_audit
        self._nixl = nixl
        self._recorder = recorder
        self._max_lease_s = max_lease_s
        self._held: dict[HoldKey, Held] = {}  # in arrival order: the first is the oldest
        self._leases: list[tuple[float, int, Held]] = []  # heap of (deadline, tie-break, hold)
        self._seq = itertools.count()
        self._early: dict[HoldKey, Early] = {}  # in arrival order
        self._ended: dict[HoldKey, None] = {}  # recently ended holds, oldest first (bounded)

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, er: EngineRank, msg: P.Hold) -> None:
        """Hold a request's blocks for its consumers, or renew the lease of one held already."""
        if msg.lease_s > self._max_lease_s:
            raise RequestError("bad_request", f"lease_s {msg.lease_s} outside (0, {self._max_lease_s}]")
        now = time.monotonic()
        key = (er.engine_id, er.tp_rank, msg.request_id)
        held = self._held.get(key)
        if held is None:
            _check_block_ids(er, msg.block_ids)  # before anything is kept: a refused hold leaves nothing
            digests = None
            if self._integrity_audit if msg.digest is None else msg.digest:
                t0 = time.perf_counter()
                digests = HeldDigests.of(er, msg.block_ids)
                self._recorder.digested("hold", int(digests.rows[:, 1].sum()), time.perf_counter() - t0)
            held = self._held[key] = Held(er, msg.request_id, now + msg.lease_s, now, msg.block_ids, digests=digests)
            early = self._early.pop(key, None)
            if early is not None:
                held.count, held.expected = early.count, early.expected
            self._end_if_consumed(held)
        else:
            held.deadline = now + msg.lease_s
        if self._held.get(key) is held:
            heapq.heappush(self._leases, (held.deadline, next(self._seq), held))
        self._recorder.holds_now(len(self._held))

    def on_notification(self, data: bytes) -> None:
        n = hs.decode_notification(data)
        if n is None:
            self._recorder.notification_received("malformed")
            return
        key = (n.engine_id, n.tp_rank, n.request_id)
        held = self._held.get(key)
        if held is None:
            if not self._engines.knows((n.engine_id, n.tp_rank)):
                self._recorder.notification_received("unknown")
                log.warning("notification for unknown engine %s rank %d request %s dropped",
                            n.engine_id, n.tp_rank, n.request_id)
                return
            early = self._early.setdefault(key, Early(0, n.expected, time.monotonic()))
            early.count, early.expected = early.count + 1, n.expected
            self._recorder.notification_received("early")
            return
        self._recorder.notification_received("consumer")
        held.count += 1
        held.expected = n.expected
        self._end_if_consumed(held)
        self._recorder.holds_now(len(self._held))

    def _forget(self, key: HoldKey) -> None:
        """A hold ended: an audit that names it now is refused, not told to wait for it."""
        del self._held[key]
        self._ended[key] = None
        if len(self._ended) > RECENTLY_ENDED:
            del self._ended[next(iter(self._ended))]

    def _end_if_consumed(self, held: Held) -> None:
        if held.consumed:
            self._forget(held.key)
            self._recorder.hold_ended("sent")
            held.engine.complete(P.Completion(held.request_id, "sent", held.block_ids,
                                              seconds=time.monotonic() - held.since))

    def expire(self, now: float) -> None:
        """End holds whose lease passed; forget early notifications older than any lease."""
        while self._leases and self._leases[0][0] <= now:
            deadline, _, held = heapq.heappop(self._leases)
            if self._held.get(held.key) is not held or held.deadline != deadline:
                continue  # ended already, or renewed (its newer entry is still in the heap)
            self._forget(held.key)
            self._recorder.hold_ended("expired")
            log.warning("hold expired: engine=%s rank=%d request=%s consumers=%d/%d", held.engine.engine_id,
                        held.engine.tp_rank, held.request_id, held.count, held.expected)
            held.engine.complete(P.Completion(
                held.request_id, "expired", held.block_ids,
                reason=f"lease passed with {held.count} of {held.expected or '?'} consumers",
                seconds=now - held.since))
        while self._early:
            key, early = next(iter(self._early.items()))
            if now - early.first <= self._max_lease_s:
                break
            del self._early[key]
            self._recorder.early_notifications_dropped(early.count)
        oldest = next(iter(self._held.values()), None)
        self._recorder.holds_now(len(self._held), now - oldest.since if oldest else 0)
        if len(self._leases) > 2 * len(self._held) + 64:  # renewals left many stale entries
            self._leases = [e for e in self._leases if self._held.get(e[2].key) is e[2] and e[2].deadline == e[0]]
            heapq.heapify(self._leases)

    def drop_engine(self, er: EngineKey) -> float:
        """Forget a leaving engine's holds; returns when the last lease ends (readers may still pull)."""
        until = 0.0
        for held in [h for h in self._held.values() if h.engine.key == er]:
            until = max(until, held.deadline)
            self._forget(held.key)
            self._recorder.hold_ended("dropped")
        self._recorder.holds_now(len(self._held))
        return until

    def answer_handshake(self, req: hs.HandshakeRequest) -> hs.HandshakeReply:
        """A peer daemon asks what memory an engine has: its ranks and this daemon's NIXL agent."""
        if req.version != hs.HANDSHAKE_VERSION:
            self._recorder.handshake_answered("version")
            return hs.HandshakeReply(False, f"handshake version {req.version} unsupported "
                                            f"(this daemon speaks {hs.HANDSHAKE_VERSION})")
        ranks = self._engines.serving(req.engine_id)
        if not ranks:
            self._recorder.handshake_answered("unknown_engine")
            return hs.HandshakeReply(False, f"engine {req.engine_id!r} is not registered with this daemon")
        self._recorder.handshake_answered("ok")
        return hs.HandshakeReply(True, agent=self._nixl.name, metadata=self._nixl.metadata(),
                                 ranks=[e.rank_info() for e in ranks])

    def answer_audit(self, req: hs.AuditRequest) -> hs.AuditReply:
        """A consumer asks for the digests of the rows it read, and whether the blocks changed."""
        if req.version != hs.HANDSHAKE_VERSION:
            return hs.AuditReply(False, f"side-channel version {req.version} unsupported")
        held = self._held.get((req.engine_id, req.tp_rank, req.request_id))
        where = f"request {req.request_id!r} of engine {req.engine_id!r} rank {req.tp_rank}"
        if held is None:
            key = (req.engine_id, req.tp_rank, req.request_id)
            if key not in self._ended and self._engines.knows((req.engine_id, req.tp_rank)):
                # vLLM asks for a hold one engine step after it answered the request: a fast
                # reader can get here first. The blocks are not free yet (vLLM delays that).
                return hs.AuditReply(False, f"{where} is not held yet", retry=True)
            return hs.AuditReply(False, f"{where} is not held (its lease passed, or it was never held): "
                                        "its blocks may have been reused")
        if held.digests is None:
            return hs.AuditReply(False, f"{where} was held without digests (integrity_audit is off on the "
                                        "prefill daemon and the hold did not ask for them)")
        if len(req.rows) % 16:
            return hs.AuditReply(False, f"audit rows are {len(req.rows)} bytes, not whole (address, length) pairs")
        rows = np.frombuffer(req.rows, "<i8").reshape(-1, 2)
        held_bytes = int(held.digests.rows[:, 1].sum())
        unaligned = int(np.count_nonzero((rows[:, 0] % 8 != 0) | (rows[:, 1] % 8 != 0)))
        if unaligned > MAX_UNALIGNED_AUDIT_ROWS:
            return hs.AuditReply(False, f"audit of {unaligned} rows not in whole 8-byte words "
                                        f"(at most {MAX_UNALIGNED_AUDIT_ROWS})")
        outside = integrity.outside_spans(held.digests.rows, rows)
        if outside >= 0:  # a consumer may ask for the bytes of the blocks it read, nothing else
            return hs.AuditReply(False, f"audit row {outside} ({int(rows[outside, 0]):#x}, {int(rows[outside, 1])} B) "
                                        f"lies outside {where}'s blocks")
        asked_bytes = sum(int(n) for n in rows[:, 1].tolist())  # Python ints: no wrap
        if asked_bytes > held_bytes:
            return hs.AuditReply(False, f"audit rows cover more bytes than {where} holds ({held_bytes} B)")
        t0 = time.perf_counter()
        try:
            digests = integrity.digest_rows(held.engine.mappings, rows)
        except integrity.AuditError as exc:
            return hs.AuditReply(False, str(exc))
        reused = held.digests.reused(held.engine, len(held.engine.geometry.groups))
        self._recorder.digested("audit", held_bytes + asked_bytes, time.perf_counter() - t0)  # read + held
        return hs.AuditReply(True, digests=digests.astype("<u8").tobytes(), reused=reused)

    def status(self, now: float, limit: int) -> list[P.HoldStatus]:
        """The `limit` oldest holds."""
        return [P.HoldStatus(h.engine.engine_id, h.engine.tp_rank, h.request_id,
                             f"{h.count}/{h.expected or '?'}", now - h.since, h.deadline - now)
                for h in itertools.islice(self._held.values(), limit)]
