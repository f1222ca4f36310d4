"""Prefill side: held requests, consumer notifications, leases, and handshake answers.

    hold(R, lease) -> held;   notification from each consumer: count += 1
    count == expected -> "sent";   lease passes -> "expired";   engine leaves -> dropped

A consumer may finish before the engine's hold arrives; its notification waits (at most the
longest lease) for the hold it belongs to.

Claims (side-channel leases, a decode daemon's `LeaseRequest`): a daemon that reads or will
read a held request asks to keep it alive `extend_s` longer (up to max_lease_s after the hold
began) and is told for how long it is alive. Until then the hold does not end, not even once
its consumers have all notified, unless that daemon notified it too: a pin. A claim on a
request whose hold ended, or was held again after ending, is answered `ended`; the decode fails
its read `expired` rather than report bytes the engine may have reused (leases.py).

    held --lease or pins pass--> expired          held --consumers all notified, no pin--> sent
    held --consumers all notified, pinned--> consumed --pins pass or their agents notify--> sent

Leases and pins count the daemon's running time: a loop held or a process paused for seconds
could answer no claim meanwhile (`Holds.paused`).

With the integrity audit, a hold digests its blocks' bytes as they are when held
(integrity.py); a consumer's audit compares them again (a changed row: the block was reused)
and digests the rows the consumer read.

Housekeeping costs what expires, not what is held: leases sit in a heap by deadline (a renewal
pushes a new entry, the stale one is skipped when it surfaces), and holds and early
notifications are dicts in arrival order, so the oldest is the first.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import hmac
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field

import numpy as np

from . import handshake as hs
from . import integrity
from . import protocol as P
from .engines import EngineKey, EngineRank, Engines
from .identity import fingerprint_of, fingerprinted
from .logs import Throttle
from .nixl_driver import NixlDriver
from .protocol import RequestError
from .quotas import Quota
from .recorder import HoldOutcome, Recorder

log = logging.getLogger("kvxferd")

HoldKey = tuple[str, int, str]  # (engine id, tp rank, request id)


@dataclass(eq=False)
class Held:
    engine: EngineRank
    request_id: str
    deadline: float  # when it ends: its lease or its last pin, whichever is later (`Holds._settle`)
    since: float
    block_ids: P.Blocks  # as the hold named them (lists, or protocol 8's packed ids)
    count: int = 0  # consumers that notified
    expected: int = 0  # consumers the first notification announced; 0 until then
    digests: asyncio.Future[HeldDigests] | None = None  # the blocks' bytes when held (integrity audit)
    audits: int = 0  # audits of it accepted and not answered yet
    lease_until: float = 0.0  # the engine's lease (monotonic)
    pins: dict[str, float] = field(default_factory=dict)  # claiming agent -> not ended before (monotonic)
    notifiers: set[str] = field(default_factory=set)  # agents whose notifications counted
    read_token: str = ""  # what a reader presents (protocol 11); "": any reader
    _granted: list[bytes] | None = None  # block_ids packed, as a claim's grant lists them (`granted`)

    @property
    def key(self) -> HoldKey:
        return self.engine.engine_id, self.engine.tp_rank, self.request_id

    def admits(self, token: str) -> bool:
        """`token` is this hold's read token (compared in constant time), or the hold has none."""
        return not self.read_token or hmac.compare_digest(token.encode(), self.read_token.encode())

    @property
    def granted(self) -> list[bytes]:
        """Per cache group, the held block ids as little-endian int32: a grant (ClaimAnswer.blocks)."""
        if self._granted is None:
            self._granted = [ids if isinstance(ids, bytes) else P.block_array(ids).astype("<i4").tobytes()
                             for ids in self.block_ids]
        return self._granted

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
    def of(cls, er: EngineRank, block_ids: P.Blocks) -> HeldDigests:
        rows, group, block = integrity.block_rows(er.geometry, er.region_addr, P.block_arrays(block_ids))
        return cls(rows, group, block, integrity.digest_rows(er.mappings, rows))

    def reused(self, er: EngineRank, groups: int) -> list[list[int]]:
        """Per cache group, the blocks with a row whose bytes changed since they were digested."""
        changed = integrity.digest_rows(er.mappings, self.rows) != self.digests
        return [sorted({int(b) for b in self.block[changed & (self.group == g)]}) for g in range(groups)]


@dataclass
class Early:
    """Notifications for a request whose hold has not arrived yet, by the read token they carry:
    once it arrives, those with its token count (all of them, for a hold without one)."""

    expected: int
    first: float
    counts: dict[str, int] = field(default_factory=dict)  # read token -> notifications
    senders: dict[str, set[str]] = field(default_factory=dict)  # read token -> agents
    expects: dict[str, int] = field(default_factory=dict)  # read token -> consumers its last one announced

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def taken_by(self, held: Held) -> None:
        """The notifications that count for `held`, counted."""
        tokens = [t for t in self.counts if held.admits(t)] if held.read_token else list(self.counts)
        held.count = sum(self.counts[t] for t in tokens)
        held.expected = max((self.expects[t] for t in tokens), default=0)  # none admitted: not announced
        held.notifiers = set().union(*(self.senders[t] for t in tokens))


MAX_EARLY_TOKENS = 16  # tokens early notifications of one request carry; others are dropped
# (request, token) pairs waiting in all, and agents kept per pair: a peer notifying request ids
# and tokens without end (or from many names of one key) is bounded (65,536 x 4 names of at
# most 1 KiB: some 300 MiB at worst), oldest out; a sender past 4 keeps its pin to its claim's end
MAX_EARLY_SLOTS, MAX_EARLY_SENDERS = 1 << 16, 4


class EarlyBook:
    """Notifications waiting for their holds, in arrival order (the first waited longest)."""

    def __init__(self) -> None:
        self._early: dict[HoldKey, Early] = {}
        self._slots = 0  # (request, token) pairs held, all requests together

    def __len__(self) -> int:
        return len(self._early)

    def add(self, key: HoldKey, n: hs.Notification, sender: str, now: float) -> int:
        """Keep one notification; returns how many were dropped (its own, or the oldest's)."""
        early = self._early.get(key)
        dropped = 0
        if early is None or n.token not in early.counts:  # a new (request, token) pair
            if early is not None and len(early.counts) >= MAX_EARLY_TOKENS:
                return 1
            while self._slots >= MAX_EARLY_SLOTS or (early is None and len(self._early) >= MAX_EARLY):
                oldest = next(iter(self._early))
                dropped += self._drop(oldest)
                early = None if oldest == key else early
            if early is None:
                early = self._early[key] = Early(n.expected, now)
            self._slots += 1
        early.counts[n.token] = early.counts.get(n.token, 0) + 1
        senders = early.senders.setdefault(n.token, set())
        if len(senders) < MAX_EARLY_SENDERS:
            senders.add(sender)
        early.expected = early.expects[n.token] = n.expected
        return dropped

    def take(self, key: HoldKey) -> Early | None:
        early = self._early.pop(key, None)
        if early is not None:
            self._slots -= len(early.counts)
        return early

    def _drop(self, key: HoldKey) -> int:
        early = self.take(key)
        return early.count if early is not None else 0

    def expire(self, before: float) -> int:
        """Drop those that came before `before`; how many notifications they were."""
        dropped = 0
        while self._early:
            key, early = next(iter(self._early.items()))
            if early.first >= before:
                break
            dropped += self._drop(key)
        return dropped


# how a hold ended, the agents that notified it, and its engine's registration (epoch)
Ended = tuple[HoldOutcome, frozenset[str], str]
# Grants one lease reply carries, in bytes (a decode's link takes replies of up to 64 MiB): the
# claims beyond are answered "pending" and asked again.
GRANT_REPLY_BYTES = 32 << 20
MEMORY_LOOK_S = 0.05  # a rank's memory is looked at for holes at most this often (`_check_memory`)
MAX_PINS = 64  # claiming agents pinning one hold; more are told how long it lives, unpinned (granted 0)


RECENTLY_ENDED = 65536  # ended holds remembered, so an audit can tell "not yet" from "no more"
# An audit names the rows one consumer read of a held request: each inside the request's blocks,
# each byte once, so at most the hold's bytes (a held row may split into thousands: a row per head,
# key element and chunk phase where blocks translate inside CPU attention's heads). Rows not in
# whole words are digested one by one: few in honest reads, so they are bounded apart.
MAX_UNALIGNED_AUDIT_ROWS = 1 << 16
# Peers' agents that handshook, per engine, trusted to notify for it: least recently used first
# out (a handshake or an accepted notification uses one), so a live consumer stays.
MAX_NOTIFIERS = 65536
# ... and per daemon key: an agent name is its key's whatever comes before the fingerprint, so one
# key could handshake under names without end and push every other peer's out; its own go first.
MAX_NOTIFIERS_PER_KEY = 256


def _check_block_ids(er: EngineRank, block_ids: P.Blocks) -> None:
    """A hold names, per cache group, distinct blocks that the registered geometry has."""
    groups = er.geometry.groups
    if len(block_ids) != len(groups):
        raise RequestError("bad_request", f"block lists for {len(block_ids)} groups; the geometry has {len(groups)}")
    P.check_blocks(block_ids)  # packed lists: whole ids, none negative (without copying them)
    for group, listed in zip(groups, block_ids):
        count = len(listed) // 4 if isinstance(listed, bytes) else len(listed)
        if not count:
            continue
        limit = group.num_blocks  # a property that scans the group's views: once per group
        if count > limit:  # some id repeats: refused before converting or sorting whatever a frame holds
            raise RequestError("bad_request", f"group {group.name}: {count} block ids for {limit} blocks")
        ids = P.block_array(listed)  # never negative (decoding or block_array checked)
        if ids.max() >= limit:
            raise RequestError("bad_request", f"group {group.name}: block ids {ids[ids >= limit][:8].tolist()} out "
                                              f"of range 0..{limit - 1}")
        ordered = np.sort(ids)
        if (ordered[1:] == ordered[:-1]).any():
            raise RequestError("bad_request", f"group {group.name}: a block id appears twice in "
                                              f"{ids[:16].tolist()}")


MAX_PENDING_AUDITS = 64  # audits accepted and not answered; more are asked to retry
MAX_AUDITS_PER_HOLD = 16  # of those, naming one held request (a TP 16 decode's ranks at once)
SLOW_DIGESTS_S = 1.0  # an audit that waited longer than this for its hold's digests is logged,
SLOW_LOG_S = 10.0  # at most this often
MAX_EARLY = 1 << 16  # notifications waiting for their hold; beyond, the oldest are dropped
UNKNOWN_LOG_S = 10.0  # notifications for an engine not registered here are logged at most this often


def _retrieved(fut: asyncio.Future[HeldDigests]) -> None:
    """Mark a failure as seen: `_log_failure` on the digests themselves reports it once."""
    if not fut.cancelled():
        fut.exception()


def _log_failure(fut: asyncio.Future[HeldDigests]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("digesting held blocks failed", exc_info=fut.exception())


def _audit_rows(er: EngineRank, when_held: HeldDigests, raw_rows: bytes, where: str) -> tuple[hs.AuditReply, int]:
    """The audit's answer and the bytes digested for it (runs on the digest thread). The rows
    come off the wire: each must lie inside the held blocks, none not in whole words beyond a
    bound, and all together no more bytes than the hold has."""
    rows = np.frombuffer(raw_rows, "<i8").reshape(-1, 2)
    held_bytes = int(when_held.rows[:, 1].sum())
    unaligned = int(np.count_nonzero((rows[:, 0] % 8 != 0) | (rows[:, 1] % 8 != 0)))
    if unaligned > MAX_UNALIGNED_AUDIT_ROWS:
        return hs.AuditReply(False, f"audit of {unaligned} rows not in whole 8-byte words "
                                    f"(at most {MAX_UNALIGNED_AUDIT_ROWS})"), 0
    outside = integrity.outside_spans(when_held.rows, rows)
    if outside >= 0:  # a consumer may ask for the bytes of the blocks it read, nothing else
        return hs.AuditReply(False, f"audit row {outside} ({int(rows[outside, 0]):#x}, {int(rows[outside, 1])} B) "
                                    f"lies outside {where}'s blocks"), 0
    asked_bytes = sum(int(n) for n in rows[:, 1].tolist())  # Python ints: no wrap
    if asked_bytes > held_bytes:
        return hs.AuditReply(False, f"audit rows cover more bytes than {where} holds ({held_bytes} B)"), 0
    try:
        digests = integrity.digest_rows(er.mappings, rows)
    except integrity.AuditError as exc:
        return hs.AuditReply(False, str(exc)), 0
    reused = when_held.reused(er, len(er.geometry.groups))
    return hs.AuditReply(True, digests=digests.astype("<u8").tobytes(), reused=reused), held_bytes + asked_bytes


class Holds:
    def __init__(self, engines: Engines, nixl: NixlDriver, recorder: Recorder, max_lease_s: float,
                 integrity_audit: bool = False, digester: integrity.Digester | None = None,
                 audit_digester: integrity.Digester | None = None,
                 max_per_rank: int = 1 << 16, max_per_uid: int = 1 << 18, nixl_notices: bool = True,
                 open_holds: bool = True) -> None:
        self._engines = engines
        self._open_holds = open_holds  # holds without a read_token are kept (any reader naming them may read)
        # NIXL notifications under names without a key's fingerprint count (False: a keyed daemon
        # that attributes every request to its key, where those come on the side channel only)
        self._nixl_notices = nixl_notices
        self._quota = Quota("held requests", max_per_rank, "max_holds_per_engine", max_per_uid, "max_holds_per_uid")
        self._memory_seen: dict[EngineKey, float] = {}  # monotonic: a rank's memory was last found whole
        self._digester = digester or integrity.Digester()  # engines' holds
        self._audit_digester = audit_digester or integrity.Digester("audit")  # peers' audits
        self._audits = 0  # accepted, not answered yet
        self._slow_logged, self._slow_unlogged = -SLOW_LOG_S, 0  # audits slowed by their digests: logging
        self._integrity_audit = integrity_audit
        self._nixl = nixl
        self._recorder = recorder
        self._max_lease_s = max_lease_s
        self._held: dict[HoldKey, Held] = {}  # in arrival order: the first is the oldest
        self._leases: list[tuple[float, int, Held]] = []  # heap of (deadline, tie-break, hold)
        self._seq = itertools.count()
        self._early = EarlyBook()
        self._ended: dict[HoldKey, Ended] = {}  # recently ended holds, oldest first (bounded)
        self._notifiers: OrderedDict[tuple[str, str], None] = OrderedDict()  # (engine id, peer agent)
        self._notifiers_of_key: dict[str, OrderedDict[tuple[str, str], None]] = {}  # fingerprint -> its own
        self._refused_senders: set[str] = set()  # senders of refused notifications already logged
        self._unknown_logged = Throttle(UNKNOWN_LOG_S)  # notifications for an engine not registered here

    @property
    def held(self) -> int:
        return len(self._held)

    def check(self, er: EngineRank, msg: P.Hold, also_new: int = 0, also_new_of_uid: int | None = None) -> bool:
        """What `hold` would refuse (RequestError), without holding; True for a new hold.
        `also_new`: new holds of the same rank applied before this one (a batch's), and
        `also_new_of_uid` of the same uid (default: the rank's)."""
        if msg.lease_s > self._max_lease_s:
            raise RequestError("bad_request", f"lease_s {msg.lease_s} outside (0, {self._max_lease_s}]")
        if not msg.read_token and not self._open_holds:
            raise RequestError("bad_request", f"hold of request {msg.request_id!r} carries no read_token: this "
                                              "daemon keeps no open holds (open_holds = false), which any reader "
                                              "naming the request could read; pass client.new_read_token()")
        if msg.read_token and len(msg.read_token) < P.MIN_READ_TOKEN:
            raise RequestError("bad_request", f"read_token of {len(msg.read_token)} characters; at least "
                                              f"{P.MIN_READ_TOKEN} (128 random bits as hex), or none")
        renewed = self._held.get((er.engine_id, er.tp_rank, msg.request_id))
        if renewed is not None:
            if msg.read_token != renewed.read_token:  # a renewal is the same hold's, never a new capability
                raise RequestError("bad_request", f"request {msg.request_id!r} is held under another read_token")
            return False
        _check_block_ids(er, msg.block_ids)
        self._check_memory(er)
        self._quota.check(er, also_new, also_new_of_uid)
        return True

    def _check_memory(self, er: EngineRank) -> None:
        """A hole punched in the rank's memory since it registered: the daemon would pay for its
        pages (RequestError). Looked at once per MEMORY_LOOK_S per rank: a batch of holds of a
        rank with many buffers costs one look, not one per hold and buffer."""
        now = time.monotonic()
        if now - self._memory_seen.get(er.key, float("-inf")) < MEMORY_LOOK_S:
            return
        for mapping in er.mappings:
            if why := mapping.sparse():
                raise RequestError("bad_request", f"engine {er.engine_id!r} rank {er.tp_rank}'s memory lost pages "
                                                  f"since it registered ({why}): no hold of it is kept")
        if len(self._memory_seen) >= 65536:
            self._memory_seen.clear()
        self._memory_seen[er.key] = now

    def hold(self, er: EngineRank, msg: P.Hold) -> asyncio.Future[HeldDigests] | None:
        """Hold a request's blocks for its consumers, or renew the lease of one held already.
        Returns the new hold's digests while they are computed (the integrity audit), else None."""
        self.check(er, msg)  # before anything is kept: a refused hold leaves nothing
        now = time.monotonic()
        key = (er.engine_id, er.tp_rank, msg.request_id)
        held = self._held.get(key)
        digests = None
        if held is None:
            self._quota.take(er)
            if self._integrity_audit if msg.digest is None else msg.digest:
                digests = asyncio.ensure_future(self._digest_hold(er, msg.block_ids))
                digests.add_done_callback(_log_failure)
            held = self._held[key] = Held(er, msg.request_id, 0.0, now, msg.block_ids, digests=digests,
                                          read_token=msg.read_token)
            early = self._early.take(key)
            if early is not None:
                early.taken_by(held)
        held.lease_until = now + msg.lease_s  # a renewal never ends a hold before a pin it granted
        self._settle(held, now)
        self._recorder.holds_now(len(self._held))
        # The digests are the hold's, for every audit to come: whoever waits on them (the hold's
        # reply, which a closed connection cancels) gets a view it cannot cancel them through.
        if digests is None:
            return None
        view = asyncio.shield(digests)
        view.add_done_callback(_retrieved)  # a view nobody awaited (its connection went) logs nothing
        return view

    def on_notification(self, sender: str, data: bytes) -> bool:
        """A peer's NIXL notification; `sender` is the agent name NIXL reports it under. True when
        that agent may notify for the engine it names."""
        n = hs.decode_notification(data)
        if n is None:
            self._recorder.notification_received("malformed")
            return False
        if fingerprinted(sender) or not self._nixl_notices:
            # NIXL reports the name its sender declares: a name with a key's fingerprint belongs to
            # a daemon that sends its notices on the side channel, where the key is checked
            # (identity.py). One riding a READ under such a name is someone else's, posing; where
            # only attributed requests count, so is one under any name.
            self._recorder.notification_received("unauthorized")
            return False
        return self._notified(sender, n)

    def take_notices(self, req: hs.NoticeRequest) -> bool:
        """A peer daemon's notifications on the side channel, from the agent it names as requester
        (not answered: a version this daemon does not speak is counted malformed). True when one
        of them came from an agent that may notify for the engine it names."""
        if req.version not in (hs.NOTICE_VERSION, hs.SERVE_VERSION):
            for _ in req.notices:
                self._recorder.notification_received("malformed")
            return False
        authorized = False
        for n in req.notices:
            authorized |= self._notified(req.requester, n)
        return authorized

    def _notified(self, sender: str, n: hs.Notification) -> bool:
        """One consumer is done with a hold. Counted only from an agent that handshook for the
        engine it names (anyone who can reach our NIXL agent or side channel can send one, under
        any name); others are dropped and counted `unauthorized` (False)."""
        notifier = (n.engine_id, sender)
        if notifier not in self._notifiers:
            self._recorder.notification_received("unauthorized")
            if len(self._refused_senders) < 1024 and sender not in self._refused_senders:
                self._refused_senders.add(sender)  # logged once per sender: a flood is counted, not logged
                log.warning("notification from agent %r for engine %s rank %d request %s dropped: that agent "
                            "never handshook for the engine", sender[:256], n.engine_id, n.tp_rank, n.request_id)
            return False
        self._notifiers.move_to_end(notifier)
        key = (n.engine_id, n.tp_rank, n.request_id)
        held = self._held.get(key)
        if held is not None and not held.admits(n.token):
            # its sender was never given the hold's token: it cannot end what another reader pins
            self._recorder.notification_received("unauthorized")
            if self._unknown_logged.due():
                log.warning("notification from agent %r for engine %s rank %d request %s dropped: not the "
                            "hold's read token (logged at most every %g s)", sender[:256], n.engine_id,
                            n.tp_rank, n.request_id, UNKNOWN_LOG_S)
            return False
        if held is None:
            if not self._engines.knows((n.engine_id, n.tp_rank)):
                self._recorder.notification_received("unknown")
                if self._unknown_logged.due():  # one notice request names up to 4,096
                    log.warning("notification for unknown engine %s rank %d request %s dropped (logged at "
                                "most every %g s)", n.engine_id, n.tp_rank, n.request_id, UNKNOWN_LOG_S)
                return True
            dropped = self._early.add(key, n, sender, time.monotonic())  # oldest out: it waited longest
            if dropped:
                self._recorder.early_notifications_dropped(dropped)
            self._recorder.notification_received("early")
            return True
        self._recorder.notification_received("consumer")
        held.count += 1
        held.expected = n.expected
        held.notifiers.add(sender)
        # One daemon may run several reads of this hold (decode ranks reading one prefill rank):
        # a notification is one of them, not all. Its pin stays until every consumer is done.
        if held.consumed:
            for agent in held.notifiers:
                held.pins.pop(agent, None)
        self._settle(held, time.monotonic())
        self._recorder.holds_now(len(self._held))
        return True

    def _forget(self, held: Held, outcome: HoldOutcome) -> None:
        """A hold ended: an audit or a claim that names it now is refused, not told to wait for it."""
        key = held.key
        del self._held[key]
        self._quota.give(held.engine)
        self._recorder.hold_ended(outcome)
        before = self._ended.pop(key, None)  # to the end of the line: it ended last
        # held again after it ended without being sent: it stays "ended" (blocks may have been reused)
        self._ended[key] = before if before is not None and before[0] != "sent" else \
            (outcome, frozenset(held.notifiers), held.engine.epoch)
        if len(self._ended) > RECENTLY_ENDED:
            del self._ended[next(iter(self._ended))]

    def _settle(self, held: Held, now: float) -> None:
        """When a hold ends: its lease or its last pin, whichever is later; once consumed, its
        last pin (a claiming daemon may still read), or now when none is left."""
        pinned = max((t for t in held.pins.values() if t > now), default=0.0)
        if held.consumed and not pinned:
            self._end_sent(held, now)
            return
        deadline = pinned if held.consumed else max(held.lease_until, pinned)
        if deadline != held.deadline:
            held.deadline = deadline
            heapq.heappush(self._leases, (deadline, next(self._seq), held))

    def _end_sent(self, held: Held, now: float) -> None:
        self._forget(held, "sent")
        held.engine.complete(P.Completion(held.request_id, "sent", P.block_lists(held.block_ids),
                                          seconds=now - held.since))

    def paused(self, seconds: float) -> None:
        """This daemon did not run for `seconds` (its loop held, the process or its host
        stopped): no claim could be answered meanwhile, so that time does not count against any
        lease or pin. Each moves on by it, at most to max_lease_s after its hold began (how long
        the engine keeps blocks the daemon accepted once it loses the daemon). A hold only ever
        lives longer for it: no grant told to a decode ends sooner."""
        for held in self._held.values():
            cap = held.since + self._max_lease_s
            held.lease_until = _moved(held.lease_until, seconds, cap)
            held.pins = {agent: _moved(t, seconds, cap) for agent, t in held.pins.items()}
            held.deadline = _moved(held.deadline, seconds, cap)  # the later of the two, moved alike
        self._leases = [(held.deadline, next(self._seq), held) for held in self._held.values()]
        heapq.heapify(self._leases)
        if self._held:
            log.warning("daemon paused %.1f s: %d holds' leases and pins moved on by that", seconds, len(self._held))

    def expire(self, now: float) -> None:
        """End holds whose lease passed; forget early notifications older than any lease."""
        while self._leases and self._leases[0][0] <= now:
            deadline, _, held = heapq.heappop(self._leases)
            if self._held.get(held.key) is not held or held.deadline != deadline:
                continue  # ended already, or renewed (its newer entry is still in the heap)
            if held.consumed:  # its consumers are done; the pins that kept it passed
                self._end_sent(held, now)
                continue
            self._forget(held, "expired")
            log.warning("hold expired: engine=%s rank=%d request=%s consumers=%d/%d", held.engine.engine_id,
                        held.engine.tp_rank, held.request_id, held.count, held.expected)
            held.engine.complete(P.Completion(
                held.request_id, "expired", P.block_lists(held.block_ids),
                reason=f"lease passed with {held.count} of {held.expected or '?'} consumers",
                seconds=now - held.since))
        expired = self._early.expire(now - self._max_lease_s)
        if expired:
            self._recorder.early_notifications_dropped(expired)
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
            self._forget(held, "dropped")
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
        metadata = self._nixl.partial_metadata([(m.address, m.nbytes, m.kind, m.device)
                                                for e in ranks for m in e.mappings])
        if req.requester:  # its notifications for this engine count from now on
            self._trust_notifier((req.engine_id, req.requester))
        self._recorder.handshake_answered("ok")
        return hs.HandshakeReply(True, agent=self._nixl.name, metadata=metadata[0],
                                 ranks=[e.rank_info() for e in ranks], more_metadata=metadata[1:],
                                 epoch=ranks[0].epoch, notices=hs.NOTICE_VERSION, serve=hs.SERVE_VERSION)

    def _trust_notifier(self, notifier: tuple[str, str]) -> None:
        """`notifier` (engine id, agent) handshook: its notifications count, least recently used out."""
        self._notifiers[notifier] = None
        self._notifiers.move_to_end(notifier)
        key = fingerprint_of(notifier[1])
        if key:
            own = self._notifiers_of_key.setdefault(key, OrderedDict())
            own[notifier] = None
            own.move_to_end(notifier)
            if len(own) > MAX_NOTIFIERS_PER_KEY:
                self._forget_notifier(next(iter(own)))
        if len(self._notifiers) > MAX_NOTIFIERS:
            self._forget_notifier(next(iter(self._notifiers)))

    def _forget_notifier(self, notifier: tuple[str, str]) -> None:
        self._notifiers.pop(notifier, None)
        key = fingerprint_of(notifier[1])
        own = self._notifiers_of_key.get(key) if key else None
        if own is not None:
            own.pop(notifier, None)
            if not own:
                del self._notifiers_of_key[key]

    def answer_lease(self, req: hs.LeaseRequest) -> hs.LeaseReply:
        """A decode daemon's claims on holds it reads or will read (see the module's doc). A
        requester before read tokens (version 3) is told `ended` where a newer one is `denied`."""
        if req.version not in (hs.LEASE_VERSION, hs.GRANT_VERSION):
            return hs.LeaseReply(False, f"lease version {req.version} unsupported (this daemon speaks "
                                        f"{hs.LEASE_VERSION} and {hs.GRANT_VERSION})", seq=req.seq)
        now = time.monotonic()
        grants = req.version >= hs.GRANT_VERSION
        budget = [GRANT_REPLY_BYTES]
        answers = [self._claim(c, req.requester, req.extend_s, req.release, now, grants, budget) for c in req.claims]
        self._recorder.claims_answered(len(answers))
        return hs.LeaseReply(True, seq=req.seq, answers=answers, agent=self._nixl.name)

    def _claim(self, c: hs.Claimed, requester: str, extend_s: float, release: bool, now: float,
               grants: bool, budget: list[int]) -> hs.ClaimAnswer:
        key = (c.engine_id, c.tp_rank, c.request_id)
        held = self._held.get(key)
        if held is not None and not held.admits(c.token):  # neither pinned nor unpinned, nothing granted
            return hs.ClaimAnswer("denied" if grants else "ended")
        ended = self._ended.get(key)
        if ended is not None:  # also when held again since: its blocks may have been reused meanwhile
            outcome, notifiers, epoch = ended
            if outcome == "sent" and requester in notifiers:
                return hs.ClaimAnswer("consumed", epoch=epoch)
            return hs.ClaimAnswer("ended")
        if held is None:
            return hs.ClaimAnswer("pending" if self._engines.knows((c.engine_id, c.tp_rank)) else "ended")
        if release:  # the claimer is done with it (its read failed, or it went): the lease decides again
            if held.pins.pop(requester, None) is not None:
                self._settle(held, now)
            return hs.ClaimAnswer("held" if self._held.get(key) is held else "consumed", epoch=held.engine.epoch)
        blocks = held.granted if grants and c.grant else []
        if blocks:
            size = sum(map(len, blocks))
            if size > budget[0]:  # this reply is full: asked again, the claimer takes it as not held yet
                return hs.ClaimAnswer("pending")
            budget[0] -= size
        if requester not in held.pins and len(held.pins) >= MAX_PINS:
            # not pinned: another consumer's notification may end it
            return hs.ClaimAnswer("held", 0.0, held.engine.epoch, blocks)
        # demand keeps it alive, up to a bound; never less than it lives already
        until = max(min(now + extend_s, held.since + self._max_lease_s), held.deadline, held.pins.get(requester, 0.0))
        held.pins[requester] = until
        self._settle(held, now)
        return hs.ClaimAnswer("held", max(until - now, 0.0), held.engine.epoch, blocks)

    async def _digest_hold(self, er: EngineRank, block_ids: P.Blocks) -> HeldDigests:
        """The held blocks' digests, computed on the digest thread (the hold is answered at once)."""
        digests, seconds = await self._digester.run(er, functools.partial(HeldDigests.of, er, block_ids))
        self._recorder.digested("hold", int(digests.rows[:, 1].sum()), seconds)
        return digests

    def answer_audit(self, req: hs.AuditRequest) -> hs.AuditReply | Awaitable[hs.AuditReply]:
        """A consumer asks for the digests of the rows it read, and whether the blocks changed.
        Refusals are answered at once; the digesting happens on the digest thread."""
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
        if not held.admits(req.token):
            return hs.AuditReply(False, f"{where} is held under another read token: an audit reads the hold's "
                                        "bytes, and only its readers may")
        if held.digests is None:
            return hs.AuditReply(False, f"{where} was held without digests (integrity_audit is off on the "
                                        "prefill daemon and the hold did not ask for them)")
        if len(req.rows) % 16:
            return hs.AuditReply(False, f"audit rows are {len(req.rows)} bytes, not whole (address, length) pairs")
        if not req.rows:
            return hs.AuditReply(False, "an audit must name the rows it read")
        if self._audits >= MAX_PENDING_AUDITS or held.audits >= MAX_AUDITS_PER_HOLD:
            return hs.AuditReply(False, f"{self._audits} audits pending ({held.audits} of {where})", retry=True)
        self._audits += 1
        held.audits += 1
        return self._audit(held, req.rows, where)

    async def _audit(self, held: Held, raw_rows: bytes, where: str) -> hs.AuditReply:
        assert held.digests is not None
        asked = time.monotonic()
        try:
            try:
                when_held = await asyncio.shield(held.digests)  # an audit cancelled leaves them to the rest
                waited = time.monotonic() - asked
                if waited > SLOW_DIGESTS_S:  # the digest thread is behind: the audit's reader waits too
                    self._slow_audit(where, waited)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not held.digests.cancelled() or (task is not None and task.cancelling()):
                    raise  # this audit is cancelled (the side channel closes): nobody waits for it
                return hs.AuditReply(False, f"{where}'s blocks were never digested (cancelled)")
            (reply, nbytes), seconds = await self._audit_digester.run(
                held.engine, functools.partial(_audit_rows, held.engine, when_held, raw_rows, where))
        except Exception as exc:
            return hs.AuditReply(False, f"digesting {where}'s blocks failed: {exc}")
        finally:
            self._audits -= 1
            held.audits -= 1
        if nbytes:
            self._recorder.digested("audit", nbytes, seconds)
        return reply

    def _slow_audit(self, where: str, waited: float) -> None:
        """Logged at most every SLOW_LOG_S, with how many were not (a backlog must not add a line per audit)."""
        now = time.monotonic()
        if now - self._slow_logged < SLOW_LOG_S:
            self._slow_unlogged += 1
            return
        log.warning("audit of %s waited %.1f s for the hold's digests (%d digest jobs pending; %d more slow "
                    "audits since the last such line)", where, waited, self._digester.pending, self._slow_unlogged)
        self._slow_logged, self._slow_unlogged = now, 0

    def status(self, now: float, limit: int) -> list[P.HoldStatus]:
        """The `limit` oldest holds."""
        return [P.HoldStatus(h.engine.engine_id, h.engine.tp_rank, h.request_id,
                             f"{h.count}/{h.expected or '?'}", now - h.since, h.deadline - now)
                for h in itertools.islice(self._held.values(), limit)]


def _moved(t: float, seconds: float, cap: float) -> float:
    """`t` later by `seconds`, not past `cap` (nor earlier than it was)."""
    return min(t + seconds, max(t, cap))
