"""Decode side: claims on the prefill holds this daemon reads or will read.

A prefill engine frees a held request's blocks once its lease passes, and may fill them with
another prompt's KV at once. A READ that runs after that delivers the other prompt's bytes, and
NIXL reports it done all the same. So a read is reported `received` only if the prefill daemon
vouched that the hold lived from before the READ's post to after its end:

    read about to post / engine expects R -> claim each prefill rank's hold (one LeaseRequest
                                      per peer daemon per loop turn, sidelink.py; a READ of
                                      1 MiB or more sends its claims before its post)
        answer "held", granted g, asked at s (our clock): the hold lives until >= s + g
        answer "consumed": our own notification, sent after our READ ended, ended it
    READ seen DONE at t:   a claim covers t -> "received" at once (no round trip)
                           else ask again:  held / consumed -> "received"
                                            ended, or pending until the deadline -> "failed expired"
    while anything holds a claim (renewal on): asked again when a third of its grant is left
                                               (of a grant past 2 x claim_s: when 2/3 claim_s is left);
                                               while the hold is not there yet, from 50 ms on, backing off

Why this is enough: the prefill daemon answers "held" only for a hold that never ended (one held
again after ending is "ended"), and does not end a hold it answered before the time it granted,
not even once its consumers all notified (a pin, cleared by our own notification). "held"
asked at s > t, or granted past t, means the blocks were the request's through t; "consumed"
with our notification means through our READ's end. Both clocks only measure durations (a
grant is seconds from its answer): they need not agree, only run at about the same rate.

A decode engine that goes away stops renewing: its claims lapse with their grant, and the
prefill's own lease decides.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zmq

from . import handshake as hs
from . import protocol as P
from .logs import Throttle
from .recorder import Recorder
from .sidelink import Links

log = logging.getLogger("kvxferd")

# (peer host, side-channel port, engine id, prefill rank, request id, read token): readers that
# present different tokens for one request make different claims, each granted (or denied) alone
# (prefill daemon host, port, engine, prefill rank, request id, read token, the daemon key its
# reads name: claims go to the daemon that holds it, "" the key that address proved or the default)
ClaimKey = tuple[str, int, str, int, str, str, str]
Address = tuple[str, int, str]  # host, port, daemon key: one link (sidelink.py)
ExpectKey = tuple[str, int, str]  # (local engine id, tp rank, local request id)
RETRY_S = 0.02  # between claims of a hold not held yet, or after a claim got no answer
# An expectation's claim on a hold not held yet is asked again after PENDING_RETRY_S, doubling to
# PENDING_RETRY_MAX_S (a request id the prefill never holds costs a claim every 2 s, not 20 a
# second); one that got no answer (refused, timed out) after 1 s, doubling to 10 s.
PENDING_RETRY_S, PENDING_RETRY_MAX_S = 0.05, 2.0
UNANSWERED_RETRY_S, UNANSWERED_RETRY_MAX_S = 1.0, 10.0
MAX_UNREAD = 4096  # claims remembered as let go after a failed read (`Leases.acquire`)
SKEW = 1e-3  # a grant is trusted to (1 - SKEW) of its length, less SKEW seconds: clock rates and rounding
RESTARTED = "prefill engine restarted under the same id"  # starts confirm's answer when that is why
WARN_S = 10.0
# Requests engines said they will read, and the claims those make (one per prefill rank: up to
# 4,096 each). Each engine rank has its own quota, and each uid (max_expects_per_uid, and 65,536
# claims), beyond which its own oldest are dropped; the daemon's bound (16 users at theirs) refuses
# a new expectation (its read still claims).
MAX_EXPECTS_PER_RANK, MAX_EXPECT_CLAIMS_PER_RANK = 4096, 1 << 16
MAX_EXPECT_CLAIMS_PER_UID = 1 << 16  # an announcement of a TP-4096 prefill is 4,096 claims
MAX_EXPECTS, MAX_EXPECT_CLAIMS = 1 << 16, 1 << 20


class _Owned:
    """One owner's (a rank's, a uid's) expectations in arrival order, and their claims counted."""

    __slots__ = ("claims", "keys")

    def __init__(self) -> None:
        self.keys: dict[ExpectKey, None] = {}
        self.claims = 0

    def full(self, most: int, most_claims: int, more: int) -> bool:
        return bool(self.keys) and (len(self.keys) >= most or self.claims + more > most_claims)

    def took(self, key: ExpectKey, claims: int) -> _Owned:
        self.keys[key] = None
        self.claims += claims
        return self

    def gave(self, key: ExpectKey, claims: int) -> bool:
        """`key` let go; whether any is left."""
        del self.keys[key]
        self.claims -= claims
        return bool(self.keys)


class Expectations:
    """What engines said they will read (`Leases.expect`), in arrival order, by engine rank and
    by uid: one rank's or one user's announcements never push out another's."""

    def __init__(self, max_per_uid: int = 1 << 14) -> None:
        self._all: dict[ExpectKey, tuple[list[ClaimKey], float, int | None]] = {}  # in arrival order
        self._by_rank: dict[tuple[str, int], _Owned] = {}
        self._by_uid: dict[int, _Owned] = {}
        self._max_per_uid = max_per_uid
        self._claims = 0

    def __contains__(self, key: ExpectKey) -> bool:
        return key in self._all

    def add(self, key: ExpectKey, keys: list[ClaimKey], now: float,
            uid: int | None = None) -> tuple[bool, list[list[ClaimKey]]]:
        """Keep `key` (False when the daemon's bound leaves no room: nothing kept), and the claims
        of the rank's or uid's own expectations it pushed out to make room (to release either way)."""
        rank, more = key[:2], len(keys)
        mine = self._by_rank.get(rank, _Owned())
        users = self._by_uid.get(uid, _Owned()) if uid is not None else _Owned()
        dropped = []
        while users.full(self._max_per_uid, MAX_EXPECT_CLAIMS_PER_UID, more):  # the user's own, across its ranks
            dropped.append(self.pop(next(iter(users.keys))) or [])
        # the rank's own quota, and the daemon's bound when many ranks reach it: room from its own oldest
        while mine.full(MAX_EXPECTS_PER_RANK, MAX_EXPECT_CLAIMS_PER_RANK, more) or (
                mine.keys and (len(self._all) >= MAX_EXPECTS or self._claims + more > MAX_EXPECT_CLAIMS)):
            dropped.append(self.pop(next(iter(mine.keys))) or [])
        if len(self._all) >= MAX_EXPECTS or self._claims + more > MAX_EXPECT_CLAIMS:
            return False, dropped
        self._all[key] = (keys, now, uid)
        self._by_rank[rank] = mine.took(key, more)
        if uid is not None:
            self._by_uid[uid] = users.took(key, more)
        self._claims += more
        return True, dropped

    def pop(self, key: ExpectKey) -> list[ClaimKey] | None:
        entry = self._all.pop(key, None)
        if entry is None:
            return None
        keys, _, uid = entry
        if not self._by_rank[key[:2]].gave(key, len(keys)):
            del self._by_rank[key[:2]]
        if uid is not None and not self._by_uid[uid].gave(key, len(keys)):
            del self._by_uid[uid]
        self._claims -= len(keys)
        return keys

    def of_rank(self, rank: tuple[str, int]) -> list[ExpectKey]:
        owned = self._by_rank.get(rank)
        return list(owned.keys) if owned is not None else []

    def older_than(self, since: float) -> Iterator[ExpectKey]:
        """The expectations made before `since`, oldest first (stop iterating to stop looking)."""
        for key, (_, at, _) in self._all.items():
            if at > since:
                return
            yield key


@dataclass(frozen=True)
class Refusal:
    """Why a read may not be posted: its failure kind and reason."""

    kind: Literal["forbidden", "expired", "deadline", "stale"]
    reason: str


@dataclass(eq=False)
class Claim:
    holders: int = 0  # reads and expectations that need the hold
    state: hs.ClaimState | None = None  # the last answer's; None: not answered yet
    until: float = 0.0  # monotonic: the hold lives at least until then
    held_since: float = 0.0  # monotonic: asked at this time, the answer was "held"
    epoch: str = ""  # the holding engine's registration, as the last answer said
    asking: asyncio.Future[None] | None = None  # a request naming it is out; done when answered
    notified: bool = False  # a read of ours notified the hold: that cleared our pin there
    unread: bool = False  # a read of ours that needed it failed (it never notified)
    agent: str = ""  # the prefill daemon (NIXL agent) that answered last; "" if it did not say
    unanswered: bool = False  # the last request naming it got no answer (refused, timed out)
    retry_s: float = 0.0  # when not held (pending, unanswered): the wait before it is asked again
    # per cache group, the block ids the hold grants (sorted), from the first answer that listed
    # them: a READ of this hold touches no other block (docs/security.md)
    granted: list[np.ndarray] | None = None
    no_grants: bool = False  # its daemon answered "held" to a request for the grant with no blocks (before grants)
    answered_at: float = 0.0  # wall time the last answer was applied (is it newer than a route's handshake?)
    notified_at: float = 0.0  # monotonic: a read of ours notified the hold (the pin may be gone since)

    def covers(self, t: float, epoch: str) -> bool:
        """Vouched for through `t`, by the registration `epoch` the read was planned against."""
        if epoch and self.epoch and epoch != self.epoch:
            return False
        if self.state == "consumed":  # our notification ended it: it vouches for what ran before that
            return not self.notified_at or t <= self.notified_at
        return self.state == "held" and (self.until > t or self.held_since > t)


def claim_keys(ref: P.RemoteRef, ranks: Iterable[int]) -> list[ClaimKey]:
    return [(ref.host, ref.port, ref.engine_id, rank, ref.request_id, ref.read_token, ref.daemon_key) for rank in ranks]


def unpack_grant(blocks: list[bytes]) -> list[np.ndarray] | None:
    """A claim answer's block lists as sorted arrays; None when they are not whole int32 ids."""
    if any(len(b) % 4 for b in blocks):
        return None
    return [np.sort(np.frombuffer(b, dtype="<i4")) for b in blocks]


def ungranted(granted: list[np.ndarray], remote: Sequence[np.ndarray]) -> list[list[int]]:
    """Per cache group, the block ids a read names that its grant does not (the first 8 each)."""
    if len(granted) != len(remote):
        return [ids[:8].tolist() for ids in remote]
    return [ids[~np.isin(ids, g)][:8].tolist() for g, ids in zip(granted, remote)]


class Leases:
    def __init__(self, links: Links, recorder: Recorder, requester: str, extend_s: float, renew: bool,
                 timeout_s: float, confirm: bool = True, max_expect_s: float = 600.0,
                 max_expects_per_uid: int = 1 << 14) -> None:
        self._links = links
        self._recorder = recorder
        self._requester = requester  # our NIXL agent: the name our notifications arrive under
        self._extend_s = extend_s if renew else 0.0
        self._renew = renew
        self._confirm = confirm
        self._timeout_s = timeout_s
        self._max_expect_s = max_expect_s
        self._claims: dict[ClaimKey, Claim] = {}
        self._unread: dict[ClaimKey, bool] = {}  # claims let go after a failed read, most recent last
        self._queued: dict[Address, set[ClaimKey]] = {}  # by peer daemon, sent at the turn's end
        self._unclaim: dict[Address, set[ClaimKey]] = {}  # released unread: unpinned at the turn's end
        self._flushing = False
        self._tasks: set[asyncio.Task[None]] = set()  # unpins under way
        self._unapplied: dict[asyncio.Future[hs.LeaseReply], _Asked] = {}  # claim requests out, by reply
        self._seq = itertools.count(1)
        self._expects = Expectations(max_expects_per_uid)
        self._renewals: list[tuple[float, ClaimKey]] = []  # heap: when a claim should be asked again
        self._warned = Throttle(WARN_S)  # a refusal, by peer

    @property
    def claims(self) -> int:
        return len(self._claims)

    # --- who needs which hold -------------------------------------------------
    def acquire(self, keys: list[ClaimKey]) -> None:
        """Claim these holds (asked now, unless an answer already covers a while ahead). Claimed
        whether or not reads are confirmed: a READ is posted only for blocks a claim was granted."""
        now = time.monotonic()
        for key in keys:
            c = self._claims.get(key)
            if c is None:
                c = self._claims[key] = Claim()
                # A read of ours that needed this hold failed moments ago (its claim ended with
                # it): this claim's pin is let go at its end too, notified or not, or it would
                # keep the hold past its lease for a consumer that never comes.
                c.unread = self._unread.pop(key, False)
            c.holders += 1
            unclaim = self._unclaim.get((key[0], key[1], key[6]))
            if unclaim is not None:  # released and claimed again this turn: its unpin must not follow the claim
                unclaim.discard(key)
            if c.asking is None and not (c.state == "held" and c.until - now > self._extend_s / 3):
                self._queue(key, c)
        self._recorder.claims_now(len(self._claims))

    def release(self, keys: list[ClaimKey], unread: bool = False) -> None:
        """Done with these holds (`unread`: a read of them failed). A hold that not every read of
        ours notified is unpinned at its prefill daemon (a read failed, the engine went, an
        expectation lapsed): its own lease decides again. So is one whose claim is still out
        (the unpin follows it on the same connection)."""
        for key in keys:
            c = self._claims.get(key)
            if c is not None:
                c.holders -= 1
                c.unread = c.unread or unread
                if c.holders <= 0:
                    del self._claims[key]
                    if c.unread:
                        self._unread[key] = True
                        if len(self._unread) > MAX_UNREAD:
                            del self._unread[next(iter(self._unread))]
                    if (c.state == "held" or c.asking is not None) and (c.unread or not c.notified):
                        self._unclaim.setdefault((key[0], key[1], key[6]), set()).add(key)
                        self._schedule_flush()
        self._recorder.claims_now(len(self._claims))

    def notified(self, keys: list[ClaimKey], ranks: Iterable[int]) -> None:
        """A read notified these prefill ranks' holds (its notification clears our pin there)."""
        wanted = set(ranks)
        for key in keys:
            c = self._claims.get(key)
            if c is not None and key[3] in wanted:
                # Our notification may end the hold (its last consumer): what we were granted
                # before it holds no further READ; a new one needs a fresh "held" (`grants`).
                c.notified, c.notified_at = True, time.monotonic()
                c.until = min(c.until, c.notified_at)

    def expect(self, er: tuple[str, int], request_id: str, ref: P.RemoteRef, uid: int | None = None) -> None:
        """An engine rank (of `uid`) will read `ref` for its request: keep the prefill's holds (all
        its ranks) alive until the read ends, the request is released, or max_lease_s passes."""
        if not self._renew:
            return
        key = (er[0], er[1], request_id)
        if key in self._expects:
            return
        keys = claim_keys(ref, range(ref.tp_size))
        kept, dropped = self._expects.add(key, keys, time.monotonic(), uid)
        for keys_dropped in dropped:  # what made room is let go, kept or not
            self.release(keys_dropped)
        if not kept:
            if self._warned.due("expects"):
                log.warning("expectations at the daemon's bound (%d, or %d claims): engine %s rank %d's not kept "
                            "(its read still claims; logged at most every %g s)", MAX_EXPECTS, MAX_EXPECT_CLAIMS,
                            er[0], er[1], WARN_S)
            return
        self.acquire(keys)
        self._recorder.read_expected()

    def take_expect(self, er: tuple[str, int], request_id: str) -> list[ClaimKey]:
        """The claims an engine's expectation made, now the read's (released when it ends)."""
        return self._expects.pop((er[0], er[1], request_id)) or []

    def forget_engine(self, er: tuple[str, int]) -> None:
        for key in self._expects.of_rank(er):
            self.release(self._expects.pop(key) or [])

    # --- what may a read touch -----------------------------------------------
    def grants(self, keys: list[ClaimKey], agent: str = "",
               planned_at: float = 0.0) -> list[list[np.ndarray]] | Refusal | None:
        """The block lists granted to each claim, by the daemon `agent` the READs go to (its
        route handshaken at wall time `planned_at`), and alive now; a Refusal: why the read may
        not be posted (denied, ended, a daemon that grants nothing; "stale": the claims were
        answered by a newer daemon behind the route's address); None: some are not answered, or
        no longer known alive (asked again: `granted` waits)."""
        out = []
        now = time.monotonic()
        for key in keys:
            c = self._claims.get(key)
            if c is None:
                return Refusal("expired", "the claim was dropped")
            if not _same(c, agent):
                if planned_at and c.answered_at > planned_at:  # a newer daemon answered: the route is stale
                    return Refusal("stale", f"{key[2]}'s daemon was replaced since the route was planned")
                c.granted, c.state, c.epoch = None, None, ""  # an older one's answers: asked anew
                if c.asking is None:
                    self._queue(key, c)
                return None
            if c.state == "denied":
                return Refusal("forbidden", f"prefill rank {key[3]} of {key[2]} refused request {key[4]!r}: the read "
                                            "token is not the one its hold was given")
            if c.state == "ended":
                return Refusal("expired", f"prefill rank {key[3]} of {key[2]} no longer holds request {key[4]!r}")
            if c.state == "consumed":
                return Refusal("expired", f"prefill rank {key[3]} of {key[2]} no longer holds request {key[4]!r}")
            if c.granted is not None and c.state == "held":
                if c.until <= now:  # its grant passed (or our notification may have ended it): ask again
                    if c.asking is None:
                        self._queue(key, c)
                    return None
                out.append(c.granted)
            elif c.granted is not None:  # pending or unanswered again since: not known alive
                return None
            elif c.state == "consumed":
                return Refusal("expired", f"prefill rank {key[3]} of {key[2]} no longer holds request {key[4]!r}")
            elif c.state == "held" and c.no_grants:  # a daemon from before grants: it lists nothing
                return Refusal("forbidden", f"prefill rank {key[3]} of {key[2]}: its daemon grants no blocks (a "
                                            "kvxferd from before read tokens); upgrade it")
            else:  # not answered yet, or "held" to a renewal that did not ask for the grant: ask for it
                if c.state == "held" and c.asking is None:
                    self._queue(key, c)
                return None
        return out

    def restarted(self, keys: list[ClaimKey], epoch: str, agent: str = "") -> bool:
        """A grant of the daemon `agent` came from another registration of the engine than
        `epoch` (a route planned against the old one would read memory the engine no longer has)."""
        return bool(epoch) and any((c := self._claims.get(k)) is not None and _same(c, agent)
                                   and c.epoch not in ("", epoch) for k in keys)

    def _ungranted(self, keys: list[ClaimKey]) -> Refusal:
        """Why a read's deadline passed before its grants came: nothing was read."""
        for key in keys:
            c = self._claims.get(key)
            if c is not None and c.granted is None and c.state == "pending":
                return Refusal("expired", f"prefill rank {key[3]} of {key[2]} never held request {key[4]!r} before "
                                          "the read's deadline: nothing was read")
        return Refusal("deadline", "passed before the prefill daemon granted the read's blocks (unreachable, or not "
                                   "answering): nothing was posted yet")

    async def granted(self, keys: list[ClaimKey], deadline: Callable[[], float], agent: str = "",
                      planned_at: float = 0.0) -> list[list[np.ndarray]] | Refusal:
        """`grants` once every claim is answered (asked again while its hold is pending)."""
        while True:
            answer = self.grants(keys, agent, planned_at)
            if answer is not None:
                return answer
            now, until = time.monotonic(), deadline()
            if now >= until:
                return self._ungranted(keys)
            waits = []
            for key in keys:
                claim = self._claims[key]
                if claim.granted is None or claim.state != "held" or claim.until <= now:
                    if claim.asking is None:
                        self._queue(key, claim)
                    assert claim.asking is not None
                    waits.append(claim.asking)
            await asyncio.wait(waits, timeout=until - now)
            if any((c := self._claims.get(k)) is not None and (c.state == "pending" or c.unanswered) for k in keys):
                await asyncio.sleep(min(RETRY_S, max(deadline() - time.monotonic(), 0)))

    # --- is a read's hold vouched for -----------------------------------------
    def covers(self, keys: list[ClaimKey], t: float, agent: str = "", epoch: str = "") -> bool:
        """Every hold is known to have lived through `t` (no round trip needed), as the daemon
        `agent` the READs went to said (a grant of a daemon since restarted vouches for nothing), of
        the engine registration `epoch` the read was planned against ("": not known)."""
        if not self._confirm:
            return True
        claims = self._claims
        return all((c := claims.get(k)) is not None and _same(c, agent) and c.covers(t, epoch) for k in keys)

    async def confirm(self, keys: list[ClaimKey], t: float, deadline: Callable[[], float], agent: str = "",
                      epoch: str = "") -> str:
        """"" once every hold is vouched for through `t`; else why not (the read fails `expired`).
        `deadline()`: the read's deadline now (a pause of this daemon moves it on)."""
        why = "no answer"
        while True:
            now, until = time.monotonic(), deadline()
            waits: list[asyncio.Future[None]] = []
            for key in keys:
                c = self._claims.get(key)
                if c is None:  # released meanwhile (the engine went): nothing vouches any more
                    return "the claim was dropped"
                if epoch and c.epoch and c.epoch != epoch and _same(c, agent):
                    return (f"{RESTARTED}: {key[2]} is registration {c.epoch} now, the read was planned "
                            f"against {epoch} (the bytes read are the old registration's memory)")
                if _same(c, agent) and c.covers(t, epoch):
                    continue
                if c.state == "denied":
                    return f"prefill rank {key[3]} of {key[2]} refused request {key[4]!r}: not its hold's read token"
                if c.state == "ended" and _same(c, agent):
                    return (f"prefill rank {key[3]} of {key[2]} no longer holds request {key[4]!r} "
                            "(its lease passed, or it was released): its blocks may hold another prompt's KV")
                if c.state == "pending":
                    why = f"prefill rank {key[3]} of {key[2]} never held request {key[4]!r}"
                if c.asking is None:
                    self._queue(key, c)
                assert c.asking is not None
                waits.append(c.asking)
            if not waits:
                return ""
            if now >= until:
                return f"{why} before the read's deadline"
            await asyncio.wait(waits, timeout=until - now)
            if any((c := self._claims.get(k)) is not None and (c.state == "pending" or c.unanswered) for k in keys):
                # not held yet, or no answer (a refusal comes at once): not again before RETRY_S
                await asyncio.sleep(min(RETRY_S, max(deadline() - time.monotonic(), 0)))

    # --- asking ---------------------------------------------------------------
    def _queue(self, key: ClaimKey, c: Claim) -> None:
        c.asking = asyncio.get_running_loop().create_future()
        self._queued.setdefault((key[0], key[1], key[6]), set()).add(key)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def flush(self) -> None:
        """Send what is queued now, not at the turn's end: the caller is about to hold the loop
        (a large READ, copied inside its post), and the answers come back meanwhile."""
        if self._queued or self._unclaim:
            self._flush()

    def _flush(self) -> None:
        """One request per peer daemon for everything queued this loop turn (the requests leave
        before this returns)."""
        self._flushing = False
        queued, self._queued = self._queued, {}
        unclaim, self._unclaim = self._unclaim, {}
        for (host, port, server), keys in queued.items():
            for chunk in _chunks(keys):
                self._ask(host, port, server, chunk)
        for (host, port, server), keys in unclaim.items():
            for chunk in _chunks(keys):
                task = asyncio.get_running_loop().create_task(self._unpin(host, port, server, chunk))
                self._tasks.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._tasks.discard)

    def take_answers(self, keys: list[ClaimKey]) -> None:
        """Apply now the answers to these claims that are already in our sockets, instead of a
        few loop turns from now: for a caller that just held the loop through a large READ's copy
        (its claims were answered meanwhile) and can then report the read at once. Claims no
        longer asking (an announced read's, answered before it) leave nothing to take."""
        if not any((c := self._claims.get(k)) is not None and c.asking is not None for k in keys):
            return
        for host, port, server in {(k[0], k[1], k[6]) for k in keys}:
            link = self._links.get(host, port, server)
            if link is not None:
                link.take_ready()
        for reply in [r for r in self._unapplied if r.done()]:
            self._on_reply(reply)

    def _request(self, keys: list[ClaimKey], extend_s: float, release: bool = False) -> hs.LeaseRequest:
        claims = self._claims
        return hs.LeaseRequest(hs.GRANT_VERSION, next(self._seq), self._requester, extend_s,
                               [hs.Claimed(k[2], k[3], k[4], k[5], not release and (
                                   (c := claims.get(k)) is None or c.granted is None)) for k in keys], release)

    def _send(self, host: str, port: int, server: str, req: hs.LeaseRequest) -> asyncio.Future[hs.LeaseReply]:
        """`req` on the wire now; the awaitable gives the reply, or raises HandshakeError when the
        request could not go out or got no answer."""
        try:
            return asyncio.ensure_future(self._links.to(host, port, server).ask(req, self._timeout_s))
        except Exception as exc:  # whatever one peer's address does, the other peers' requests still go
            if not isinstance(exc, hs.HandshakeError | zmq.ZMQError | OSError):
                log.error("lease request to %s:%d failed unexpectedly", host, port, exc_info=exc)
            failed: asyncio.Future[hs.LeaseReply] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc if isinstance(exc, hs.HandshakeError) else
                                 hs.HandshakeError("unreachable", f"side channel to {host}:{port}: {exc}"))
            failed.exception()  # retrieved: awaited by a task that shutdown may cancel first
            return failed

    def _unpin(self, host: str, port: int, server: str, keys: list[ClaimKey]) -> Coroutine[Any, Any, None]:
        return self._unpinned(host, port, keys, self._send(host, port, server, self._request(keys, 0.0, release=True)))

    async def _unpinned(self, host: str, port: int, keys: list[ClaimKey], reply: asyncio.Future[hs.LeaseReply]) -> None:
        try:
            await reply
        except hs.HandshakeError as exc:  # our pins there lapse with their grant
            log.info("unpinning %d holds at %s:%d: %s", len(keys), host, port, exc)

    def _ask(self, host: str, port: int, server: str, keys: list[ClaimKey]) -> None:
        """Claim these holds of one peer daemon: the request is on the wire when this returns;
        its answer is applied when it comes (or by `take_answers`, whichever is first)."""
        sent = time.monotonic()  # before the request leaves: a "held" answer vouches from here on
        asked = [self._claims.get(k) for k in keys]  # an answer is for these, not for claims made since
        grant = [c is None or c.granted is None for c in asked]  # as `_request` asks
        reply = self._send(host, port, server, self._request(keys, self._extend_s))
        self._unapplied[reply] = _Asked(host, port, keys, asked, sent, grant)
        reply.add_done_callback(self._on_reply)

    def _on_reply(self, reply: asyncio.Future[hs.LeaseReply]) -> None:
        """A claim request's reply (or its failure), applied once."""
        a = self._unapplied.pop(reply, None)
        if a is None:  # applied already (take_answers)
            return
        if reply.cancelled():  # as if unanswered: its claims are asked again, not left asking for ever
            self._apply(a, "", [])
            return
        answers: list[hs.ClaimAnswer] = []
        agent = ""
        host, port, keys = a.host, a.port, a.keys
        exc = reply.exception()
        if exc is None:
            r = reply.result()
            agent = r.agent
            if not r.ok:
                self._warn(host, port, f"peer %s:%d refused lease claims: {r.reason[:200].replace('%', '%%')}")
            elif len(r.answers) != len(keys):
                self._warn(host, port, f"peer %s:%d answered {len(r.answers)} of {len(keys)} claims")
            else:
                answers = r.answers
        elif isinstance(exc, hs.HandshakeError):
            self._warn(host, port, f"lease claims to %s:%d: {str(exc).replace('%', '%%')}")
        else:
            log.error("lease claims to %s:%d failed unexpectedly", host, port, exc_info=exc)
        self._apply(a, agent, answers)

    def _apply(self, a: _Asked, agent: str, answers: list[hs.ClaimAnswer]) -> None:
        """What one request's answers (none: not answered) say of each claim it named."""
        keys, asked, sent = a.keys, a.asked, a.sent
        self._recorder.claims_asked(len(keys), bool(answers))
        for i, key in enumerate(keys):
            c = self._claims.get(key)
            if c is None or c is not asked[i]:
                continue
            fut, c.asking = c.asking, None
            c.unanswered = not answers
            if answers:
                ans = answers[i]
                c.state, c.agent, c.epoch = ans.state, agent, ans.epoch or c.epoch
                c.answered_at = time.time()
                if ans.blocks and c.granted is None and ans.state == "held":
                    c.granted = unpack_grant(ans.blocks) or []  # malformed: grants no group, refuses all
                c.no_grants = ans.state == "held" and a.grant[i] and not ans.blocks
                if ans.state == "held":
                    c.held_since = sent
                    c.until = sent + ans.granted_s * (1 - SKEW) - SKEW
                    c.retry_s = 0.0
                    if self._renew and ans.granted_s > 0:  # asked again when a third of the grant is left
                        heapq.heappush(self._renewals, (sent + ans.granted_s * 2 / 3, key))
                elif ans.state == "pending" and self._renew:
                    # The decode may know of the request before the prefill engine's hold reaches
                    # its daemon: asked again until it is held, so the pin starts with the lease.
                    self._retry(key, c, sent, PENDING_RETRY_S, PENDING_RETRY_MAX_S)
            elif self._renew:
                self._retry(key, c, sent, UNANSWERED_RETRY_S, UNANSWERED_RETRY_MAX_S)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _retry(self, key: ClaimKey, c: Claim, sent: float, first_s: float, max_s: float) -> None:
        c.retry_s = min(max(c.retry_s * 2, first_s), max_s)
        heapq.heappush(self._renewals, (sent + c.retry_s, key))

    def _warn(self, host: str, port: int, msg: str) -> None:
        """A refusal, logged at most every WARN_S per peer (a read asks again every RETRY_S)."""
        if self._warned.due((host, port)):
            log.warning(msg, host, port)

    def renew(self, now: float) -> None:
        """Ask again for claims whose grant is two-thirds gone and that someone still needs."""
        while self._renewals and self._renewals[0][0] <= now:
            _, key = heapq.heappop(self._renewals)
            c = self._claims.get(key)
            if c is None or c.asking is not None:
                continue
            due = c.until - self._extend_s * 2 / 3
            if c.state == "held" and due > now:  # (strictly later: this loop must not pop it again)
                # granted past two claims' length (the engine's own lease is longer): asked again
                # when two-thirds of a claim's length is left of it, not never
                heapq.heappush(self._renewals, (due, key))
            elif c.state == "held" or c.state == "pending" or c.unanswered:
                self._queue(key, c)
        if len(self._renewals) > 2 * len(self._claims) + 64:  # released claims left stale entries
            self._renewals = [e for e in self._renewals if e[1] in self._claims]
            heapq.heapify(self._renewals)
        # an engine that never reads what it expected: bounded
        for expect in list(self._expects.older_than(now - self._max_expect_s)):
            self.release(self._expects.pop(expect) or [])


@dataclass(frozen=True)
class _Asked:
    """A claim request out: to whom, for which claims (as they were when asked), and when."""

    host: str
    port: int
    keys: list[ClaimKey]
    asked: list[Claim | None]
    sent: float  # monotonic, before it left
    grant: list[bool]  # per claim: the request asked for the hold's block lists


CLAIMS_PER_REQUEST = 256  # their answers may carry grants: a reply stays far under sidelink.MAX_REPLY


def _chunks(keys: set[ClaimKey]) -> Iterator[list[ClaimKey]]:
    ordered = list(keys)
    for i in range(0, len(ordered), CLAIMS_PER_REQUEST):
        yield ordered[i:i + CLAIMS_PER_REQUEST]


def _same(c: Claim, agent: str) -> bool:
    """The claim was answered by the daemon `agent` ("" on either side: not known, taken as the same)."""
    return not agent or not c.agent or c.agent == agent
