"""Decode side: reads from peer daemons, from the request to the completion the engine polls.

    start(R) -> route (cached; else handshake + plan, shared) -> claims granted (the holds' block
             lists; R's remote blocks among them, else "forbidden") -> Transfer.post: a READ per
             remote rank read from, a notification alone to the others -> polled until every
             READ is DONE -> "received";  an error or the deadline -> "failed" + the local block ids

A read large enough is split across posting lanes (lanes.py): its slices are posted from the
lanes' threads, and its consumers are notified once every slice is DONE. Whole READs and slices
are one kind of work here (postings.py): polled, released and timed alike, in one list.

A read is reported `received` only when the prefill daemon vouched that its holds lived through
the READ (leases.py): a claim covering the moment it was seen DONE, or asked for then; a hold
that ended before fails the read `expired`, whatever bytes NIXL brought.

An audited read (integrity.py), once DONE, digests the rows that arrived and asks the prefill
daemon for its digests of the same rows; its consumers are notified, and it is reported
`received`, only when every row matches and no block was reused; otherwise it fails
"integrity" with the local blocks that hold wrong bytes.

A deadline counts the daemon's running time: a pause (the process or its host stopped) moves
each read's deadline on by what the read lived of it (`paused`), up to max_deadline_s after the
read began, and no deadline is judged while a pause is still uncounted (`pausing`). Every wait
of a read (for its handshake, its claims, its audit) follows `_deadline`; a handshake's own
request keeps its timeout. Nothing could progress or be answered meanwhile; failing the reads
on waking would only recompute them.

Every call on the daemon's own agent happens on the loop's thread. NIXL cannot cancel a transfer: a read past its
deadline is reported failed and its handles are quarantined, polled until they end, and the
engine memory they touch stays mapped and registered until then. A transfer uses its engine
rank and its route for as long as it is in flight or quarantined; nothing counts that by hand,
`uses_engine` and `uses_route` ask the two collections that own the transfers.

`allowed_peers` (CIDRs; empty: any) bounds the side-channel addresses a read may name: a read
naming another address fails `handshake` naming it, before anything is dialed. With a list set,
a name that is not an IP literal is refused too: it is not resolved, because what a name
resolves to may change between the check and ZMQ's own resolution at connect.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import ipaddress
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from . import handshake as hs
from . import integrity
from . import protocol as P
from .copier import Copier, Spans, spans
from .deadline import until_deadline
from .engines import EngineRank
from .identity import fingerprinted
from .lanes import Lanes
from .leases import RESTARTED, ClaimKey, Leases, Refusal, claim_keys, ungranted
from .logs import Throttle
from .nixl_driver import NixlDriver, TransferError
from .notices import Notices
from .peers import Link, Peer, Peers, Route
from .plan.descriptors import (
    RequestBlocks,
    local_rows,
    peer_indices,
    remote_rows,
    request_chunks,
    request_reads,
    row_blocks,
)
from .plan.geometry import Geometry, GeometryError
from .plan.planner import PlanError
from .postings import AgentRead, Posting
from .protocol import RequestError
from .quotas import Quota
from .rates import Rates
from .reading import ROWS_ON_LOOP, Builder, Reading, estimate
from .reading import build as build_reading
from .recorder import FailureKind, Recorder

log = logging.getLogger("kvxferd")

ReadKey = tuple[str, int, str]  # (engine id, tp rank, request id)
ATTEMPTS = 2  # a peer restarted behind a cached route: the first post fails, the second handshakes anew
AUDIT_RETRY_S = 0.02  # between audits of a request the prefill does not hold yet
_encode = msgspec.msgpack.Encoder().encode


# A READ this large, posted whole, holds the loop while it copies (CMA copies inside the post).
# So it is posted once the engine has its answer (the engine, a scheduler step, must not wait
# for the copy); its claims are sent before it, so their answers are back when it ends (a claim's
# round trip through two daemons is ~0.5-2 ms, ~10% of a 64 MiB read here); and it is reported
# as soon as the post returns DONE. Smaller reads are posted at once, and their claims leave at
# the end of the loop turn, one request per peer for all of them. Either is posted only once its
# claims are granted (`_admitted`): an announced read's grants are in before it starts.
EARLY_CLAIM_BYTES = 1 << 20
PAUSE_GRACE_S = 0.1  # a deadline is judged again this long after a pause was seen, once it is counted
AUDIT_ASK_MIN_S = 0.05  # an audit is asked again after a stop only with this much of the deadline left


def host_spans(er: EngineRank) -> Spans:
    """The host memory `er` maps now (none once released): where a copy's rows may lie."""
    return spans([(m.address, m.nbytes) for m in er.mappings if m.kind == "DRAM"])


class StaleRoute(Exception):
    """Nothing could be posted on a route: most likely its peer restarted (new agent, same address)."""


@dataclass(eq=False, slots=True)
class Transfer:
    """One read request: what it asked for, what it posted, and how it ended."""

    engine: EngineRank
    msg: P.Read
    blocks: RequestBlocks  # msg's block lists as arrays
    received_at: float  # perf_counter when the engine's request arrived
    started: float  # monotonic
    deadline: float
    route: Route | None = None
    postings: list[Posting] = field(default_factory=list)  # its READs in flight (postings.py)
    split: int = 0  # slices per remote rank when split across lanes (0: posted whole)
    # notifications its READs do not carry, sent once it is DONE (notices.py; split or audited reads)
    notify_after: list[hs.Notification] = field(default_factory=list)
    posted_at: float = 0.0  # monotonic
    nbytes: int = 0
    descriptors: int = 0
    done: bool = False
    received: bool = False
    audit: bool = False  # check the bytes against the prefill's digests before `received`
    read_ranks: list[int] = field(default_factory=list)  # prefill ranks READ from
    read_claims: list[ClaimKey] = field(default_factory=list)  # their holds: what must vouch for the bytes
    claims: list[ClaimKey] = field(default_factory=list)  # on the prefill holds it reads (leases.py)
    reading: Reading | None = None  # what it reads on `route` (`reads_on`)
    done_at: float = 0.0  # monotonic: when every READ was seen DONE
    told: P.Completion | None = None  # `received`, handed to the engine ahead of the bookkeeping (`_tell`)
    told_at: float = 0.0  # perf_counter: when
    paused: float = 0.0  # seconds its deadline moved on for pauses of this daemon (`Reads.paused`)

    @property
    def key(self) -> ReadKey:
        return self.engine.engine_id, self.engine.tp_rank, self.msg.request_id

    @property
    def peer_label(self) -> str:
        return self.msg.remote.engine_id

    @property
    def lane(self) -> str:
        """Who moves its bytes (peers.Lane); "none" before it has a route."""
        return self.route.lane if self.route is not None else "none"

    @property
    def running(self) -> bool:
        """Something NIXL moves for this read may still be running."""
        return bool(self.postings)

    @property
    def unseen(self) -> bool:
        """Posted and not yet seen DONE (nor ended): what the progress loop checks. A read seen
        DONE may keep a posting whose handle NIXL would not release; it is not checked again."""
        return bool(self.postings) and not (self.done or self.done_at)

    def reads_on(self, route: Route, built: Reading | None = None) -> Reading:
        """What this request reads on `route`, per remote rank (its `read_ranks`): `built` off
        the loop for a large read (`heavy`), else computed here."""
        if self.route is route and self.reading is not None:
            return self.reading
        self.route = route
        if built is None:
            built = Reading({}, {})
            for rank, lids, rids, nbytes in request_reads(route.plan, self.blocks):
                built.indices[rank] = lids, rids
                built.nbytes[rank] = nbytes
        self.reading = built
        self.read_ranks = list(built.indices)
        return built

    def heavy(self, route: Route) -> bool:
        """Too many rows to build on the loop (reading.py), and not built yet for `route`."""
        return (self.route is not route or self.reading is None) and \
            estimate(route.rows_per_block, self.blocks) > ROWS_ON_LOOP

    def post(self, reading: Reading, nixl: NixlDriver, lanes: Lanes, on_sliced: Callable[[], None],
             notices: Notices | None, copier: Copier) -> int:
        """Post a READ per remote rank read (split across lanes when large, `on_sliced` running
        on the loop as each slice's post returns), notify the rest; returns notifications.

        With `notices` and a peer daemon that takes them, no READ carries a notification (see
        notices.py): they are all sent once the read is DONE. Raises StaleRoute when NIXL refused
        the first READ (nothing posted), TransferError when it refused a later one (some READs are
        running).
        """
        route = self.route
        assert route is not None
        plan = route.plan
        reads, nbytes = reading.indices, reading.nbytes
        split = self.split = lanes.slices(reading.total) if route.lane == "nixl" else 0
        self.posted_at = time.monotonic()  # before the first slice: a lane may end it at once
        ref = self.msg.remote
        expected = route.expected
        on_side_channel = self.side_channel(notices) is not None
        try:
            for rank, (lids, rids) in reads.items():
                link = route.links[rank]
                notif = hs.Notification(ref.engine_id, rank, ref.request_id, expected, ref.read_token)
                if route.lane == "copy":  # this daemon maps both: its own copy (copier.py)
                    source = link.source
                    if source is None or source.closing:
                        raise TransferError(f"engine {ref.engine_id} rank {rank} closed on this daemon")
                    rows_l, rows_r = self._rows(reading, rank, link)
                    self.postings.append(copier.post(rows_l, host_spans(self.engine), rows_r, host_spans(source),
                                                     on_sliced))
                    self.notify_after.append(notif)
                elif split:
                    rows_l, rows_r = self._rows(reading, rank, link)
                    er = self.engine
                    for lane, local, remote in zip(lanes.lanes, np.array_split(rows_l, split),
                                                   np.array_split(rows_r, split)):  # slice i on lane i
                        self.postings.append(lane.post(local, er.mem_type, remote, link.remote_mem, route.agent,
                                                       route.peer.metadata, on_sliced))
                    self.notify_after.append(notif)
                elif link.local is None or link.remote is None:  # too many descriptors to prepare
                    rows_l, rows_r = self._rows(reading, rank, link)
                    self.postings.append(AgentRead(nixl, nixl.read_rows(rows_l, self.engine.mem_type, rows_r,
                                                                        link.remote_mem, route.agent)))
                    self.notify_after.append(notif)
                elif self.audit or on_side_channel:  # consumers are told once the bytes are here (and checked)
                    self.postings.append(AgentRead(nixl, nixl.read(link.local, lids, link.remote, rids, b"")))
                    self.notify_after.append(notif)
                else:
                    self.postings.append(AgentRead(nixl, nixl.read(link.local, lids, link.remote, rids,
                                                                   _encode(notif))))
                self.nbytes += nbytes[rank]
                self.descriptors += len(lids)
            unread = [hs.Notification(ref.engine_id, rank, ref.request_id, expected, ref.read_token)
                      for rank in plan.targets if rank not in reads]
            if unread:  # consumers of ranks nothing is read from are done now
                # Nothing read at all (a full prefix hit): sent to the peer's NIXL agent, whose
                # refusal says that daemon instance is gone (StaleRoute: a fresh handshake, as a
                # READ's refusal would). A notice goes to whichever daemon has the address now.
                # A daemon with a key notifies on the side channel only: NIXL's sender names are
                # what the sender declares, so a keyed name's are not counted (identity.py).
                self._notify(unread, nixl, notices if reads or fingerprinted(nixl.name) else None)
                if not reads and notices is not None and not route.peer.local:
                    # the peer's next READ on this endpoint waits for the NIXL notification's
                    # progress there (measured: 31-47 ms at its idle pace): ask for it now
                    notices.serve(route.peer, time.monotonic())
        except TransferError as exc:
            if not self.running:
                raise StaleRoute(str(exc)) from exc
            raise
        route.peer.used = time.monotonic()  # liveness.py's idle clock
        return len(plan.targets)

    def _rows(self, reading: Reading, rank: int, link: Link) -> tuple[np.ndarray, np.ndarray]:
        """The explicit rows of `rank`'s READs: built ahead off the loop for a large read."""
        if rank in reading.rows:
            return reading.rows[rank]
        route = self.route
        assert route is not None
        pp, er, (lids, rids) = route.plan.peers[rank], self.engine, reading.indices[rank]
        return (local_rows(pp, lids, er.region_addr, er.device),
                remote_rows(pp, rids, link.remote_region_addr, link.remote_device))

    def poll(self) -> bool:
        """True once every READ is DONE; TransferError when NIXL reports one failed."""
        return all(p.ended() for p in self.postings)

    def release_ended(self) -> None:
        """Release the READs that ended (done or failed); keep the ones still running."""
        self.postings = [p for p in self.postings if not p.release_if_ended()]

    def settle(self) -> None:
        """A read that ends: drop the slices still queued on a lane (never posted: it must not
        write into blocks its engine has back) and release the READs that ended. What NIXL
        still runs stays (quarantined)."""
        self.postings = [p for p in self.postings if not p.cancel() and not p.release_if_ended()]

    def release_all(self) -> None:
        """Release every READ: all DONE, as `poll` just saw (no second state query). One whose
        handle NIXL keeps stays, as if running (`_end` quarantines it until it is released)."""
        self.postings = [p for p in self.postings if not p.release()]

    def notify_consumers(self, nixl: NixlDriver, notices: Notices | None) -> None:
        """The read is DONE: the notifications its READs did not carry leave now."""
        notifications, self.notify_after = self.notify_after, []
        try:
            self._notify(notifications, nixl, notices)
        except TransferError as exc:  # the bytes are here; the prefill side's lease frees its blocks
            assert self.route is not None
            log.warning("read %s arrived, but notifying %s failed: %s", self.msg.request_id,
                        self.route.peer.engine_id, exc)

    def side_channel(self, notices: Notices | None) -> Notices | None:
        """Where this read's notifications go instead of riding its READs: `notices` when its
        peer daemon takes them, else None (none here, or a peer from before notices)."""
        assert self.route is not None
        return notices if notices is not None and self.route.peer.takes_notices else None

    def _notify(self, notifications: list[hs.Notification], nixl: NixlDriver, notices: Notices | None) -> None:
        """On the side channel where the peer daemon takes notices, else as NIXL notifications
        (TransferError when NIXL refuses one)."""
        route = self.route
        assert route is not None
        side = self.side_channel(notices)
        if side is not None:
            side.tell(route.peer, notifications)
            return
        for notif in notifications:
            nixl.notify(route.agent, _encode(notif))

    def transfer_seconds(self, recorder: Recorder) -> float:
        """How long the read took to move, not when the loop noticed (0: not known). NIXL's own
        time for its slowest READ, recorded per READ; a split read's from its post to the end
        of its last slice (a lane posts its slices one after another)."""
        slowest = 0.0
        for p in self.postings:
            timing = p.timing()
            if timing:
                recorder.nixl_timed(*timing)
                slowest = max(slowest, timing[0] + timing[1])
        if not slowest and self.postings:
            ends = [p.ended_at() for p in self.postings]
            if all(ends):
                slowest = max(ends) - self.posted_at
        return slowest

    @property
    def wakes_loop(self) -> bool:
        """Every READ's end wakes the loop by itself: no spinning for this one."""
        return all(p.wakes_loop for p in self.postings)


class _AuditRefused(Exception):
    """The prefill daemon could not vouch for the bytes (not held, no digests, bad rows)."""


def by_local_group(granted: list[np.ndarray], remote: Geometry, local: Geometry) -> list[np.ndarray]:
    """A grant (per cache group, in the prefill's group order) in the reader's group order: the
    planner pairs groups by name, so must the check (a reader listing its groups in another
    order would otherwise name one group's granted ids for another's blocks). A group the
    prefill does not have is granted nothing."""
    where = {g.name: i for i, g in enumerate(remote.groups)}
    nothing = np.empty(0, dtype=np.int64)
    return [granted[i] if (i := where.get(g.name, len(granted))) < len(granted) else nothing for g in local.groups]


def _outside(host: str, allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    """Why `host` is outside the allowed networks; "" when one holds it."""
    listed = ", ".join(map(str, allowed))
    try:
        addr = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        return (f"{host!r} is not an IP address, and names are not resolved while allowed_peers is set "
                f"({listed})")
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in net for net in allowed):
        return ""
    return f"address {addr} is outside allowed_peers ({listed})"


class Reads:
    def __init__(self, nixl: NixlDriver, peers: Peers, recorder: Recorder, max_deadline_s: float,
                 lanes: Lanes, on_posted: Callable[[], None] = lambda: None, integrity_audit: bool = False,
                 allowed_peers: Sequence[str] = (), digester: integrity.Digester | None = None,
                 max_per_rank: int = 4096, max_per_uid: int = 1 << 15, leases: Leases | None = None,
                 pausing: Callable[[float], bool] = lambda now: False, notices: Notices | None = None,
                 copier: Copier | None = None, builder: Builder | None = None, rates: Rates | None = None) -> None:
        self.rates = rates or Rates(recorder, 0.0)  # each peer's read rate (rates.py)
        self._copier = copier or Copier(1)  # same-node reads of host memory (copier.py)
        self._builder = builder or Builder()  # large reads' arrays, off the loop (reading.py)
        self._leases = leases
        self._notices = notices  # None: notifications ride on the READs, as to a daemon before notices
        self._pausing = pausing  # the loop is waking from a pause not counted yet (see the module's doc)
        self._digester = digester or integrity.Digester()
        # reads in flight or quarantined (NIXL still writes their memory), by engine rank and uid
        self._quota = Quota("reads in flight", max_per_rank, "max_reads_per_engine", max_per_uid, "max_reads_per_uid")
        self._nixl = nixl
        self._allowed = [ipaddress.ip_network(cidr) for cidr in allowed_peers]  # empty: any address
        self._refusals: dict[str, str] = {}  # side-channel host -> why it may not be dialed ("": it may)
        self._integrity_audit = integrity_audit
        self._lanes = lanes
        self._peers = peers
        self._routes = peers.routes  # read only: the fast path's lookup
        self._keys = peers.keys  # the daemon keys peers proved: part of a route's key
        self._recorder = recorder
        self._max_deadline_s = max_deadline_s
        self._in_flight: dict[ReadKey, Transfer] = {}
        self._quarantine: list[Transfer] = []
        self._on_posted = on_posted  # wakes the progress loop from its idle wait
        self._rate = 2e9  # bytes/s of recent large reads: when to expect a read to end
        self._tasks: set[asyncio.Task[None]] = set()  # handshakes, confirmations, audits under way
        self._defects = Throttle(10.0)  # what is logged every poll while it lasts

    # --- start ----------------------------------------------------------------
    def check(self, er: EngineRank, msg: P.Read, also_new: int = 0, also_new_of_uid: int | None = None) -> None:
        """What `start` would refuse (RequestError), without starting. `also_new`: reads of the
        same rank started before this one (a batch's), `also_new_of_uid` of the same uid."""
        if (er.engine_id, er.tp_rank, msg.request_id) in self._in_flight:
            raise RequestError("bad_request", f"request {msg.request_id!r} is already being read")
        if msg.deadline_s > self._max_deadline_s:
            raise RequestError("bad_request", f"deadline_s {msg.deadline_s} outside (0, {self._max_deadline_s}]")
        groups = len(er.geometry.groups)
        if len(msg.local_blocks) != groups or len(msg.remote_blocks) != groups:
            raise RequestError("bad_request", f"block lists for {len(msg.local_blocks)}/{len(msg.remote_blocks)} "
                                              f"groups; the geometry has {groups}")
        P.check_blocks(msg.local_blocks)
        P.check_blocks(msg.remote_blocks)
        for g, ids in enumerate(msg.remote_blocks):  # a block read twice has no meaning, only a cost
            ordered = np.sort(P.block_array(ids))
            if (ordered[1:] == ordered[:-1]).any():
                raise RequestError("bad_request", f"remote block ids of group {g} name block "
                                                  f"{int(ordered[1:][ordered[1:] == ordered[:-1]][0])} twice")
        self._quota.check(er, also_new, also_new_of_uid)

    def start(self, er: EngineRank, msg: P.Read, received_at: float) -> None:
        """Accept a read; it ends as a completion. Posts at once when the route is known."""
        try:
            self.check(er, msg)
            blocks = RequestBlocks(msg.num_tokens, P.block_arrays(msg.local_blocks), P.block_arrays(msg.remote_blocks))
        except RequestError:
            self.refused(er, msg)
            raise
        now = time.monotonic()
        t = Transfer(er, msg, blocks, received_at, now, now + msg.deadline_s,
                     audit=self._integrity_audit if msg.audit is None else msg.audit)
        self._in_flight[t.key] = t
        key = er.engine_id, er.tp_rank  # no property: this is the hot path
        if self._leases is not None:
            t.claims = self._leases.take_expect(key, msg.request_id)  # the engine announced it
        self._quota.take(er)
        ref = msg.remote
        keys = self._keys  # Peers.key_of, inline: the hot path
        server = "" if keys is None else ref.daemon_key or keys.at(ref.host, ref.port)
        route = self._routes.get(((ref.engine_id, ref.host, ref.port, server), (er.engine_id, er.tp_rank)))
        attempts = ATTEMPTS
        if route is not None and route.remote_tp == ref.tp_size and route.rank is er:
            try:  # the common case: post right here, without a task or an await
                if t.heavy(route) or self._large(t.reads_on(route)):  # built off the loop, or copied after the answer
                    self._spawn(t, self._start_slow(t, ATTEMPTS))  # after the engine's answer (EARLY_CLAIM_BYTES)
                else:
                    self._post(t, route)
                attempts = 0
            except StaleRoute as exc:
                self._peers.retire(route.peer, f"posting failed: {exc}")
                attempts = ATTEMPTS - 1
            except Exception as exc:
                self._fail_on(t, exc)
                attempts = 0
        if attempts:
            refused = self._refused(ref.host, ref.port)  # a cached route's address passed already
            if refused:
                self._fail(t, "handshake", refused)
            else:
                self._spawn(t, self._start_slow(t, attempts))
        self._recorder.reads_now(len(self._in_flight), len(self._quarantine))

    def _spawn(self, t: Transfer, work: Coroutine[None, None, None]) -> None:
        """`t`'s next step as a task, kept until it ends (the loop keeps only weak references)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._spawned_ended, t))

    def _spawned_ended(self, t: Transfer, task: asyncio.Task[None]) -> None:
        """What a read's task raised ends the read (a defect: as `internal`), not silently the task."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and isinstance(exc, Exception):
            self._fail_on(t, exc)

    def may_dial(self, host: str, port: int) -> bool:
        """allowed_peers lets `host` be dialed: by a read, or by the claims an engine's
        expectation makes (an expectation naming another address claims nothing; its read fails)."""
        return not self._refused(host, port)

    def _refused(self, host: str, port: int) -> str:
        """Why allowed_peers forbids dialing `host`; "" when it may be dialed (or no list is set,
        or it is this daemon's own address: nothing is dialed)."""
        if not self._allowed or self._peers.is_self(host, port):
            return ""
        why = self._refusals.get(host)
        if why is None:
            why = _outside(host, self._allowed)
            if len(self._refusals) < 4096:  # an engine naming endless addresses costs a parse each
                self._refusals[host] = why
        return why and f"peer {host}:{port} refused, not dialed: {why}"

    async def _start_slow(self, t: Transfer, attempts: int) -> None:
        """Handshake and plan first (shared with every read waiting on the same peer), then post."""
        try:
            for _ in range(attempts):
                route = await self._peers.route(t.msg.remote, t.engine, functools.partial(self._deadline, t))
                if t.heavy(route):
                    built = await self._builder.run(build_reading, route, t.blocks, self._lanes.slices)
                    if t.done:
                        return
                    t.reads_on(route, built)
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
        reading = t.reads_on(route)
        early = self._large(reading)
        if t.read_ranks and self._leases is not None:  # claimed before the READs: see EARLY_CLAIM_BYTES
            t.read_claims = claim_keys(t.msg.remote, t.read_ranks)
            self._leases.acquire(t.read_claims)
            t.claims += t.read_claims
            grants = self._leases.grants(t.read_claims, route.agent, route.peer.since)
            if grants is None:  # not granted yet (a read the engine did not announce): posted once it is
                self._leases.flush()
                self._spawn(t, self._post_when_granted(t, route))
                return
            self._check_route(t, route, grants)
            if not self._admitted(t, route, grants):
                return
            if early:
                self._leases.flush()
        self._post_granted(t, route, reading, early)

    def _check_route(self, t: Transfer, route: Route, grants: list[list[np.ndarray]] | Refusal) -> None:
        """StaleRoute (nothing read, its claims let go) when the grants show the route names
        memory that is gone: a newer daemon, or a newer registration of the engine, answered."""
        assert self._leases is not None
        if isinstance(grants, Refusal) and grants.kind == "stale":
            self._unclaim_reads(t)
            raise StaleRoute(grants.reason)
        if not isinstance(grants, Refusal) and self._leases.restarted(t.read_claims, route.peer.epoch, route.agent):
            self._unclaim_reads(t)
            raise StaleRoute("the prefill engine registered again since the route was planned")

    def _unclaim_reads(self, t: Transfer) -> None:
        """Nothing was read on this route: the retry claims anew on its own."""
        if self._leases is not None and t.read_claims:
            self._leases.release(t.read_claims)
            del t.claims[len(t.claims) - len(t.read_claims):]  # appended last, after the expectation's
            t.read_claims = []

    def _admitted(self, t: Transfer, route: Route, grants: list[list[np.ndarray]] | Refusal) -> bool:
        """A READ touches only blocks the hold grants (docs/security.md): else the read fails
        before a byte moves, naming the blocks it may not read."""
        if isinstance(grants, Refusal):
            self._fail(t, "transfer" if grants.kind == "stale" else grants.kind, grants.reason)
            return False
        for rank, granted in zip(t.read_ranks, grants):
            outside = ungranted(by_local_group(granted, route.peer.ranks[rank].geometry, t.engine.geometry),
                                t.blocks.remote)
            if any(outside):
                ref = t.msg.remote
                self._fail(t, "forbidden", f"prefill rank {rank} of {ref.engine_id} does not grant blocks {outside} "
                                           f"(per cache group, first 8) to request {ref.request_id!r}")
                return False
        return True

    async def _post_when_granted(self, t: Transfer, route: Route) -> None:
        assert self._leases is not None
        grants = await self._leases.granted(t.read_claims, functools.partial(self._deadline, t), route.agent,
                                            route.peer.since)
        if t.done:
            return
        try:
            self._check_route(t, route, grants)
            if not self._admitted(t, route, grants):
                return
            reading = t.reads_on(route)
            self._post_granted(t, route, reading, self._large(reading))
        except StaleRoute as exc:  # as on the fast path: a fresh handshake, once
            self._peers.retire(route.peer, f"posting failed: {exc}")
            t.route = None
            await self._start_slow(t, ATTEMPTS - 1)

    def _post_granted(self, t: Transfer, route: Route, reading: Reading, early: bool) -> None:
        try:
            notifications = t.post(reading, self._nixl, self._lanes, self._on_posted, self._notices, self._copier)
        except StaleRoute:  # nothing was read: the retry claims anew on its own route
            self._unclaim_reads(t)
            raise
        since_rpc, slices = time.perf_counter() - t.received_at, len(t.postings) if t.split else 0
        if not t.running:
            self._finish(t)
        elif early:  # the loop was held through the copy if it ran inside the post (CMA): see it ended now
            self._settle_at_once(t)
        elif not t.split and t.side_channel(self._notices) is not None:
            # No READ carries a notification, so none waits for the peer's progress: over CMA the
            # copy ran inside the post and the READs are DONE already. Checked once the engine's
            # answer has left (its replies go out as this loop callback ends).
            asyncio.get_running_loop().call_soon(self._check_posted, t)
        # after a settled read's completion: metrics need not delay the engine
        self._recorder.read_posted(t.peer_label, t.descriptors, notifications, since_rpc, slices)
        if t.running:
            self._on_posted()

    def _check_posted(self, t: Transfer) -> None:
        if t.unseen:  # not seen DONE yet by the progress loop
            self._guarded_check(t, time.monotonic())

    def _large(self, reading: Reading) -> bool:
        """Posted whole and large: see EARLY_CLAIM_BYTES."""
        return reading.total >= EARLY_CLAIM_BYTES and not self._lanes.slices(reading.total)

    def _settle_at_once(self, t: Transfer) -> None:
        """A large READ just posted: if it is DONE already, report it now rather than after the
        loop turns that would take the claims' answers off the socket, find the READ done and
        deliver it (~1 ms after a 64 MiB copy held the loop, measured: docs/benchmarks.md)."""
        if self._leases is not None:
            self._leases.take_answers(t.read_claims)
        self._check(t, time.monotonic())

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
            log.error("read %s: unexpected error", t.msg.request_id, exc_info=exc)
            self._fail(t, "internal", f"{type(exc).__name__}: {exc}")

    # --- end ------------------------------------------------------------------
    def _tell(self, t: Transfer) -> None:
        """The engine hears its read arrived, before `_finish`'s bookkeeping (notifications, metrics,
        releases: ~0.3 ms after a large copy has flushed the caches) that changes nothing it hears.
        Only for a read whose bytes are here and vouched for."""
        if t.told is None and not t.done:
            told = P.Completion(t.msg.request_id, "received", [], "", t.nbytes, time.monotonic() - t.started)
            told_at = time.perf_counter()
            t.engine.complete(told)
            t.told, t.told_at = told, told_at  # only once it was handed over

    def _finish(self, t: Transfer) -> None:
        """The read arrived: every byte is in the engine's blocks."""
        if t.done:
            return
        self._tell(t)
        assert t.told is not None
        t.done = t.received = True
        self._recorder.read_received(t.peer_label, t.lane, t.nbytes, t.told.seconds, t.told_at - t.received_at)
        self._end(t)

    def _fail(self, t: Transfer, kind: FailureKind, reason: str, block_ids: list[list[int]] | None = None) -> None:
        """The read failed: the engine learns which of its blocks hold no valid data (all of the
        request's, unless an audit named the corrupt ones). Out of flight even where a defect
        raises on the way (logged): a read left half ended would hold its rank's slot, its
        claims and its engine's memory for good, and its request id could not be read again."""
        try:
            self._failed(t, kind, reason, block_ids)
        except Exception:
            log.exception("read %s: ending it raised", t.msg.request_id)
        if self._in_flight.get(t.key) is t:  # a defect left it half ended (here or before)
            t.done = True
            try:
                self._end(t)
            except Exception:
                log.exception("read %s: ending it raised again", t.msg.request_id)

    def _failed(self, t: Transfer, kind: FailureKind, reason: str, block_ids: list[list[int]] | None) -> None:
        if t.done:
            return
        if t.told is not None:  # it heard `received`: its bytes are here and vouched for; its consumers hear too
            self._notify_and_finish(t)
            return
        t.done = True
        seconds = time.monotonic() - t.started
        why = f"{kind}: {reason}"
        t.engine.complete(P.Completion(t.msg.request_id, "failed", P.block_lists(t.msg.local_blocks)
                                       if block_ids is None else block_ids, why, 0, seconds))
        self._recorder.read_failed(t.peer_label, t.lane, kind, seconds, P.FailureRecord(
            time.time(), t.engine.engine_id, t.engine.tp_rank, t.msg.request_id, t.peer_label, why))
        self._end(t)

    def _end(self, t: Transfer) -> None:
        """Out of flight; READs NIXL still runs keep the transfer (and its memory) in quarantine."""
        self._in_flight.pop(t.key, None)
        try:
            if self._leases is not None and t.claims:
                self._leases.release(t.claims, unread=not t.received)
                t.claims = []
        finally:  # whatever releasing its claims did, its READs are settled and the read counted
            t.settle()
            if t.running:
                self._quarantine.append(t)
                self._recorder.read_quarantined()
            else:
                self._gone(t)
            self._recorder.reads_now(len(self._in_flight), len(self._quarantine))

    def _gone(self, t: Transfer) -> None:
        """Neither in flight nor quarantined: it no longer counts against its rank."""
        self._quota.give(t.engine)

    def fail_engine(self, er: EngineRank, why: str) -> None:
        for t in [t for t in self._in_flight.values() if t.engine is er]:
            self._fail(t, "engine_gone", f"{why} during the transfer")

    def fail_all(self, kind: FailureKind, why: str) -> set[EngineRank]:
        """Fail every read in flight; returns the engine ranks that were told."""
        told = {t.engine for t in self._in_flight.values()}
        for t in list(self._in_flight.values()):
            self._fail(t, kind, why)
        return told

    @staticmethod
    def _vouching(t: Transfer) -> tuple[list[ClaimKey], str, str]:
        """The holds a read's bytes came from (not every rank an expectation claimed), the
        prefill daemon instance its READs went to, and the engine registration (epoch) its
        route was planned against ("": not known)."""
        if t.route is None:
            return t.read_claims, "", ""
        return t.read_claims, t.route.agent, t.route.peer.epoch

    def _vouched(self, t: Transfer) -> bool:
        """The prefill's holds are known to have lived until every READ was DONE (no round trip)."""
        if self._leases is None:
            return True
        keys, agent, epoch = self._vouching(t)
        return self._leases.covers(keys, t.done_at, agent, epoch)

    def _deliver(self, t: Transfer, vouched: bool) -> None:
        """Every READ is DONE: `received` once the prefill's holds are vouched for through then
        (`vouched`: known to be now, `_vouched`)."""
        if vouched:
            self._notify_and_finish(t)
        else:
            self._spawn(t, self._deliver_confirmed(t))

    def _notify_and_finish(self, t: Transfer) -> None:
        t.notify_consumers(self._nixl, self._notices)
        if self._leases is not None and t.claims and t.route is not None:
            self._leases.notified(t.claims, t.route.plan.targets)
        self._finish(t)

    async def _deliver_confirmed(self, t: Transfer) -> None:
        assert self._leases is not None
        try:
            keys, agent, epoch = self._vouching(t)
            why = await self._leases.confirm(keys, t.done_at, functools.partial(self._deadline, t), agent, epoch)
        except Exception as exc:
            self._fail_on(t, exc)
            return
        if t.done:  # failed meanwhile (engine gone, shutdown)
            return
        if why:
            if why.startswith(RESTARTED) and t.route is not None:  # its route is the old registration's
                self._peers.retire(t.route.peer, why, "restarted")
            self._fail(t, "expired", why)
            return
        self._notify_and_finish(t)


    # --- audit ----------------------------------------------------------------
    async def _audit(self, t: Transfer) -> None:
        """Compare what arrived with the prefill's digests, row by row; then finish or fail."""
        began = time.monotonic()
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
        except TimeoutError:
            self._recorder.audit_ended(0, unanswered=True)
            # where the read's time went: before the audit (handshake, READ) or in it
            self._fail(t, "deadline", f"the integrity audit did not end before the read's deadline (it began "
                                      f"{began - t.started:.1f} s into the read, {max(t.deadline - began, 0):.1f} s "
                                      f"before it; {self._digester.pending} digest jobs pending now)")
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
        self._deliver(t, self._vouched(t))

    async def _corrupt_blocks(self, t: Transfer) -> tuple[list[list[int]], int]:
        """Per cache group, the local blocks with a row that differs; and how many rows differ."""
        assert t.route is not None
        er, ref, plan = t.engine, t.msg.remote, t.route.plan
        chunks = request_chunks(plan, t.blocks)
        corrupt: list[set[int]] = [set() for _ in er.geometry.groups]
        wrong_rows = 0
        for rank, pp in plan.peers.items():
            lids, rids = peer_indices(pp, chunks)  # what `post` read from this rank
            if not len(lids):
                continue
            remote = remote_rows(pp, rids, t.route.links[rank].remote_region_addr)[:, :2].astype("<i8")
            request = hs.AuditRequest(hs.HANDSHAKE_VERSION, ref.engine_id, rank, ref.request_id, remote.tobytes(),
                                      ref.read_token)
            asked = asyncio.ensure_future(self._audit_answer(t, ref, request))
            try:
                await asyncio.sleep(0)  # the request leaves; the prefill digests while we do
                local = local_rows(pp, lids, er.region_addr)
                ours, seconds = await until_deadline(  # the digest thread may be busy: the deadline holds
                    self._digester.run(er, functools.partial(integrity.digest_rows, er.mappings, local)),
                    functools.partial(self._deadline, t))
            except BaseException:
                asked.cancel()  # abandoned (our digest timed out, or we are cancelled): its socket closes
                raise
            self._recorder.digested("read", int(local[:, 1].sum()), seconds)
            reply = await asked
            while reply.retry and not t.done and time.monotonic() + AUDIT_RETRY_S < self._deadline(t):
                await asyncio.sleep(AUDIT_RETRY_S)  # the read overtook the prefill's hold
                reply = await self._audit_answer(t, ref, request)
            if not reply.ok:
                raise _AuditRefused(f"prefill rank {rank} refused the audit: {hs.printable(reply.reason)}")
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

    async def _audit_answer(self, t: Transfer, ref: P.RemoteRef, request: hs.AuditRequest) -> hs.AuditReply:
        """The prefill's answer to an audit, asked again only when none came in time because
        this daemon stopped meanwhile (its timer ran out in the stop, the read's deadline moved
        on): a prefill that is just slow is not sent the same digest work twice."""
        while True:
            paused = t.paused
            try:
                return await self._peers.audit(ref, request, max(self._deadline(t) - time.monotonic(), 0.001))
            except hs.HandshakeError as exc:
                now = time.monotonic()
                stopped = t.paused > paused or self._pausing(now)
                if exc.reason != "timeout" or not stopped or self._deadline(t, now) - now < AUDIT_ASK_MIN_S:
                    raise

    # --- polling --------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Check posted reads and quarantined handles once."""
        for t in [t for t in self._in_flight.values() if t.unseen]:
            self._guarded_check(t, now)
        for t in list(self._quarantine):
            try:
                t.release_ended()
                if not t.running:
                    self._quarantine.remove(t)
                    self._gone(t)
                    self._recorder.reads_now(len(self._in_flight), len(self._quarantine))
            except Exception:  # a defect, logged: the reads after it still leave quarantine
                if self._defects.due("quarantine"):
                    log.exception("read %s: releasing it from quarantine raised (logged at most every %g s)",
                                  t.msg.request_id, self._defects.every_s)

    def _guarded_check(self, t: Transfer, now: float) -> None:
        """`_check`, an exception no path expects (a defect) ending this read as the read path's
        exceptions do (`_fail_on`: `internal`), not the progress loop that checks every other read."""
        try:
            self._check(t, now)
        except Exception as exc:
            self._fail_on(t, exc)

    def _check(self, t: Transfer, now: float) -> None:
        try:
            done = t.poll()
        except TransferError as exc:
            t.release_ended()
            if t.route is not None:
                self._peers.retire(t.route.peer, str(exc))
            self._fail(t, "transfer", str(exc))
            return
        if not done and t.route is not None and self._notices is not None and not t.route.peer.local:
            # Running once posted (not CMA's copy inside the post): it may need the peer's
            # progress (UCX over TCP, a new endpoint's wire-up), which that daemon gives when asked
            self._notices.serve(t.route.peer, now)
        if done:
            t.done_at = now
            vouched = not t.audit and self._vouched(t)
            if vouched:
                self._tell(t)
            took = t.transfer_seconds(self._recorder)
            if t.nbytes >= 1 << 20 and took > 0:
                # NIXL's own timing, not when we noticed: a late poll must not slow the estimate
                self._rate = 0.7 * self._rate + 0.3 * (t.nbytes / took)
                if t.route is not None:
                    peer = t.route.peer
                    self.rates.observe(peer, t.peer_label, peer.address, t.engine.mem_type, t.nbytes, took)
            t.release_all()
            if t.audit:
                self._spawn(t, self._audit(t))
            else:
                self._deliver(t, vouched)
        elif now >= self._deadline(t, now):
            t.settle()  # before the reason says whether anything is left running
            self._fail(t, "deadline", f"{t.msg.deadline_s:.3g} s passed" +
                       (f" (and {t.paused:.3g} s this daemon did not run); " if t.paused else "; ") +
                       ("memory quarantined" if t.running else "nothing was posted yet"))

    def _deadline(self, t: Transfer, now: float | None = None) -> float:
        """`t`'s deadline, judged now: not before a pause the loop is waking from is counted
        (nor past max_deadline_s after the read began)."""
        now = time.monotonic() if now is None else now
        if not self._pausing(now):
            return t.deadline
        return max(t.deadline, min(now + PAUSE_GRACE_S, t.started + self._max_deadline_s))

    def paused(self, seconds: float, now: float) -> None:
        """This daemon did not run for `seconds`, up to `now`: that time does not count against
        a read's deadline (of a read begun since, only what it lived of it), which moves on by
        it, up to max_deadline_s after the read began."""
        moved = 0
        for t in self._in_flight.values():
            cap = t.started + self._max_deadline_s
            if not t.done and t.deadline < cap:
                by = min(seconds, now - t.started, cap - t.deadline)
                if by > 0:
                    t.deadline += by
                    t.paused += by
                    moved += 1
        if moved:
            log.warning("daemon paused %.1f s: %d reads' deadlines moved on by up to that", seconds, moved)

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
            if not t.postings or t.wakes_loop:
                continue  # nothing posted yet, or lanes that wake the loop as their slices return
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
        """Reads writing `er`'s memory, or reading it by a lane of this daemon (a local route)."""
        return sum(1 for t in self._transfers() if t.engine is er or (t.route is not None and er in t.route.sources))

    def uses_route(self, route: Route) -> bool:
        return any(t.route is route for t in self._transfers())

    def uses_peer(self, peer: Peer) -> int:
        return sum(1 for t in self._transfers() if t.route is not None and t.route.peer is peer)

    def refused(self, er: EngineRank, msg: P.Read) -> None:
        """A read was refused: what its engine expected of it keeps no hold alive (unless the
        refusal was of a duplicate: the read in flight keeps its claims)."""
        if self._leases is not None and (er.engine_id, er.tp_rank, msg.request_id) not in self._in_flight:
            self._leases.release(self._leases.take_expect((er.engine_id, er.tp_rank), msg.request_id))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def status(self, now: float, limit: int) -> list[P.ReadStatus]:
        """The `limit` oldest reads in flight."""
        return [P.ReadStatus(t.engine.engine_id, t.engine.tp_rank, t.msg.request_id, t.peer_label, now - t.started)
                for t in heapq.nsmallest(limit, self._in_flight.values(), key=lambda t: t.started)]
