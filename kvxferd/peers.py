"""Decode side's view of peer daemons: handshakes, plans, prepared descriptor lists, retirement.

    route(ref, local rank) -> handshake (once per peer, shared by every waiting read)
                           -> plan (per local rank) -> prepared lists (per remote rank) = Route

A plan with more descriptors than PREPARED_DESCRIPTORS_MAX (block-size translation inside
vLLM CPU attention's transposed keys: a descriptor per key element and chunk, ~19M for a 1 GB
cache) is not prepared: its reads post the rows each request needs (as a posting lane does).

A Route is everything a read needs to post: the reads component looks it up in `routes`
(owned here, read there) and posts without a call into this module. A peer is retired when its
READs cannot be posted, or when liveness.py finds it gone (silent, engine gone, restarted, idle):
its routes leave `routes` at once, so the next read handshakes again (never stale metadata); its
lists are released once no read uses them (`collect`).

    handshaking --handshake ok--> ready --retire(reason)--> retired --no read uses it--> released
         `--handshake failed: forgotten (the next read handshakes again)

A handshake's metadata names the remote engine's memory only (nixl_driver.partial_metadata):
two engines behind one peer daemon are two Peers sharing one NIXL agent, and loading the second
one's metadata adds its memory to what the agent could read, NIXL keeping the first's. So an
agent is shared, not owned: it is removed (from the daemon's agent and the lanes') once no other
Peer, live or retired, names it; retiring one engine's Peer leaves the others' reads alone.

A remote engine registered with this daemon itself (two engines of one node, one daemon) is a
local Peer: its handshake is this daemon's own answer, made in-process (no side-channel round
trip, no metadata: NIXL refuses to load its own agent's), and its routes read by a lane of this
daemon (`Lane`). Everything else about it (plan, holds, claims, notices, audit, liveness,
retirement) is a remote peer's. It is retired as soon as its engine's rank closes here.

    Lane   who moves the bytes                                 for
    nixl   a NIXL READ from the peer daemon's agent (UCX)       another daemon
    copy   this daemon's own memcpy between its two mappings   this daemon, host memory (copier.py)
    loop   a NIXL READ naming this daemon's own agent          this daemon, GPU memory (UCX cuda_copy)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
import zmq.asyncio

from . import handshake as hs
from . import protocol as P
from .deadline import until_deadline
from .engines import EngineKey, EngineRank
from .identity import CurveKeys, KeyRefused, PeerKeys, speaks_for
from .lanes import Lanes
from .memory import MemType
from .nixl_driver import NixlDriver, PreparedList, metadata_agent
from .ownside import OwnSide
from .plan.descriptors import local_descs, region_addresses, remote_descs
from .plan.geometry import validate
from .plan.planner import PlanError, RankPlan, plan_rank, targets
from .rates import Rates
from .reading import MIN_ROW_BYTES, Builder, rows_per_block
from .recorder import PeerState, Recorder, RetireReason

log = logging.getLogger("kvxferd")

# (remote engine id, side-channel host, port, the daemon key dialed there: "" without CurveZMQ).
# The key is part of who the peer is: a read naming another key is another peer's, and its
# failed handshake is its own (it cannot fail the reads of a peer that proved its key).
PeerKey = tuple[str, str, int, str]
RouteKey = tuple[PeerKey, EngineKey]
FREE_DESCRIPTORS = 1 << 20  # a route may take this many, whatever its pages (over_budget)
PREPARED_DESCRIPTORS_MAX = 1 << 23  # local + remote, per remote rank: above, reads post explicit rows
Lane = Literal["nixl", "copy", "loop"]


@dataclass(frozen=True)
class SelfPeer:
    """This daemon as the peer of its own engines: its side channel answered in-process
    (ownside.py), its serving ranks of an engine, and the lane for host memory."""

    side: OwnSide
    ranks: Callable[[str], list[EngineRank]]
    host_lane: Lane = "copy"  # host memory's lane ("copy" or "loop"); GPU memory's is "loop"
    any_uid: bool = False  # an engine may read one registered by another uid (same_node_uids = "any")


def over_budget(plan: RankPlan, max_descriptors: int) -> str:
    """Why a plan takes more descriptors than a route may (in Python ints: no wrap), or "".

    The budget is sized from the two geometries: a route of more than FREE_DESCRIPTORS must move
    MIN_ROW_BYTES a row on average (pages of a head of a token of a real model are 128 B and
    more), so what its reads build (reading.py: 56 B a row at most) stays a fraction of what
    they move; max_plan_descriptors bounds every route.
    """
    total = sum(int(pp.num_local_descs) + int(pp.num_remote_descs) for pp in plan.peers.values())
    nbytes = sum(length * (lph * lpg + rph * rpg) for pp in plan.peers.values()  # what both sides' rows cover
                 for length, lph, lpg, rph, rpg in zip(pp.length.tolist(), pp.local_phases.tolist(),
                                                       pp.local_pages.tolist(), pp.remote_phases.tolist(),
                                                       pp.remote_pages.tolist()))
    if total > max_descriptors:
        return (f"{total:,} descriptors (max_plan_descriptors {max_descriptors:,}): the peer's pages are too "
                "small for its cache")
    if total > FREE_DESCRIPTORS and nbytes < total * MIN_ROW_BYTES:
        return (f"{total:,} descriptors of {nbytes // total} B on average: the peer's pages are too small for "
                f"its cache (a route of more than {FREE_DESCRIPTORS:,} descriptors must move {MIN_ROW_BYTES} B a row)")
    return ""


def _prepared_arrays(plan: RankPlan, ranks: Sequence[int], local_addr: np.ndarray, local_device: int,
                     remote_addr: dict[int, np.ndarray], remote_device: dict[int, int],
                     ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per remote rank in `ranks`: the local and remote descriptor arrays its lists are prepared
    from. Pure: runs on the builder's thread."""
    return {rank: (local_descs(plan.peers[rank], local_addr, local_device),
                   remote_descs(plan.peers[rank], remote_addr[rank], remote_device[rank])) for rank in ranks}


@dataclass(eq=False)
class Peer:
    """One remote engine behind one peer daemon, as its handshake described it."""

    engine_id: str
    host: str
    port: int
    ready: asyncio.Future[None]
    server: str = ""  # the daemon key its handshake dialed (Z85; "" without CurveZMQ)
    agent: str = ""
    # The peer daemon's NIXL agent metadata for this engine's memory, from the handshake (one
    # blob per memory type); posting lanes load it on first use.
    metadata: tuple[bytes, ...] = ()
    ranks: dict[int, hs.RankInfo] = field(default_factory=dict)
    since: float = 0.0  # wall time of the handshake
    handshake_s: float = 0.0
    epoch: str = ""  # the engine's registration, from the handshake ("": a daemon before epochs)
    notices: int = 0  # the NoticeRequest version its daemon takes (0: none; notices.py)
    serve: int = 0  # the ServeRequest version its daemon takes (0: none; it progresses unasked)
    serve_asked: float = float("-inf")  # monotonic: we last asked its daemon for progress (notices.py)
    # monotonic: its side channel last answered (handshake, probe), moved on by any time this
    # daemon itself did not run (liveness.py)
    heard: float = 0.0
    used: float = 0.0  # monotonic: a read was last posted to it (reads.Transfer.post), or the handshake
    probed: float = 0.0  # monotonic: the last probe began (liveness.py)
    probing: bool = False
    retired: bool = False
    reason: RetireReason | None = None  # why it was retired
    local: bool = False  # registered with this daemon itself: read by a lane of ours (module's doc)

    @property
    def takes_notices(self) -> bool:
        """Its daemon takes a done read's notifications on the side channel (else they ride READs)."""
        return self.notices == hs.NOTICE_VERSION

    @property
    def serves_on_request(self) -> bool:
        """Its daemon progresses NIXL for our READs only when asked (serving.py), and takes our
        notices as saying so."""
        return self.takes_notices and self.serve == hs.SERVE_VERSION

    @property
    def state(self) -> PeerState:
        return "retired" if self.retired else "ready" if self.ready.done() else "handshaking"

    @property
    def key(self) -> PeerKey:
        return self.engine_id, self.host, self.port, self.server

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tp_size(self) -> int:
        return next(iter(self.ranks.values())).tp_size


@dataclass(frozen=True)
class Link:
    """Prepared descriptor lists for one local rank reading one remote rank (None: too many to
    prepare, reads post explicit rows), and where the remote rank's regions are (posting lanes
    compute a slice's rows from them)."""

    local: PreparedList | None
    remote: PreparedList | None
    remote_region_addr: np.ndarray
    remote_mem: MemType
    remote_device: int
    source: EngineRank | None = None  # copy lane: the remote rank, an engine rank of this daemon


@dataclass(eq=False)
class Route:
    """A local rank's way to a peer: the plan and, per remote rank read from, its prepared lists.

    Plain fields only: posting a read on a route runs no code of this module.
    """

    peer: Peer
    agent: str  # the peer daemon's NIXL agent
    rank: EngineRank  # the local rank it reads for (not its key: a rank registered again is another)
    plan: RankPlan
    remote_tp: int
    expected: int  # consumers of each remote rank's blocks: what the notification announces
    links: dict[int, Link]
    lane: Lane = "nixl"
    # a local peer's ranks read (this daemon maps their memory: it stays while a read uses it)
    sources: tuple[EngineRank, ...] = ()
    rows_per_block: tuple[float, ...] = ()  # per cache group (reading.py: when a read is built off the loop)

    @property
    def engine(self) -> EngineKey:
        return self.rank.key


class Peers:
    def __init__(self, ctx: zmq.asyncio.Context, nixl: NixlDriver, recorder: Recorder, timeout_s: float,
                 keys: PeerKeys | None, lanes: Lanes, max_plan_descriptors: int = 1 << 27,
                 self_peer: SelfPeer | None = None, builder: Builder | None = None) -> None:
        self._ctx = ctx
        self._self = self_peer
        self._max_plan_descriptors = max_plan_descriptors
        self._nixl = nixl
        self._lanes = lanes
        self._recorder = recorder
        self._timeout_s = timeout_s
        self.keys = keys  # read by reads.py's fast path (key_of, inline)
        self._peers: dict[PeerKey, Peer] = {}
        self.routes: dict[RouteKey, Route] = {}  # ready routes of live peers (the reads' fast path)
        self._retired: dict[Route, Peer] = {}  # routes of retired peers, until no read uses them
        self._retired_peers: list[Peer] = []
        self._handshakes: set[asyncio.Task[None]] = set()  # in flight; cancelled at shutdown
        self._building: dict[tuple[Peer, EngineRank], asyncio.Task[Route]] = {}  # routes being planned
        self.builder = builder or Builder()  # a route's descriptor arrays, off the loop (reading.py)

    async def route(self, ref: P.RemoteRef, er: EngineRank, deadline: Callable[[], float]) -> Route:
        """The route from `er` to the remote engine `ref` names: handshake and plan when new.
        `deadline()`: the read's deadline now (a pause of this daemon moves it on)."""
        key = self.key_of(ref)
        route = self.routes.get((key, er.key))
        if route is not None and route.remote_tp == ref.tp_size and route.rank is er:
            return route
        peer = await self._peer(ref, key, deadline)
        if er.closing:  # unregistered while the handshake ran: no route for memory about to go
            raise PlanError(f"engine {er.engine_id} rank {er.tp_rank} unregistered during the handshake")
        if peer.retired:  # while this read waited (its engine closed here, or it went silent)
            raise PlanError(f"remote engine {ref.engine_id} at {peer.address} went away ({peer.reason}) "
                            "as its handshake ended")
        if peer.tp_size != ref.tp_size:
            raise PlanError(f"remote engine {ref.engine_id} runs TP {peer.tp_size}, the request says {ref.tp_size}")
        route = self.routes.get((peer.key, er.key))
        if route is not None and route.rank is not er:  # its rank's predecessor's: kept for its reads
            self._retired[self.routes.pop((peer.key, er.key))] = route.peer
            route = None
        if route is None:
            building = self._building.get((peer, er))
            if building is None:  # one build for every read waiting on this route
                building = self._building[(peer, er)] = asyncio.get_running_loop().create_task(self._built(peer, er))
                building.add_done_callback(functools.partial(self._build_ended, peer, er))
            route = await until_deadline(asyncio.shield(building), deadline)
        return route

    async def _built(self, peer: Peer, er: EngineRank) -> Route:
        route = await self._build(peer, er)
        if peer.retired or er.closing:  # while its arrays were built: its lists are not kept
            self._release(route.links.values())
            raise PlanError(f"engine {er.engine_id} rank {er.tp_rank} or remote engine {peer.engine_id} went away "
                            "while the route was planned")
        self.routes[(peer.key, er.key)] = route
        return route

    def _build_ended(self, peer: Peer, er: EngineRank, task: asyncio.Task[Route]) -> None:
        del self._building[(peer, er)]
        if not task.cancelled():
            task.exception()  # retrieved: each waiter got it (or gave up waiting)

    async def audit(self, ref: P.RemoteRef, req: hs.AuditRequest, timeout_s: float) -> hs.AuditReply:
        """Ask the peer's side channel for the digests of rows a read took from it."""
        if self._self is not None and self.is_self(ref.host, ref.port):
            return await self._self.side.ask(req, hs.AuditReply)
        return await hs.audit(self._ctx, ref.host, ref.port, req, timeout_s, self._dialing(self.key_of(ref)[3]))

    async def probe(self, peer: Peer, timeout_s: float) -> hs.ProbeReply:
        """Ask the peer's side channel whether its engine is still registered, and as which epoch."""
        if self._self is not None and peer.local:
            return await self._self.side.ask(hs.ProbeRequest(hs.HANDSHAKE_VERSION, peer.engine_id), hs.ProbeReply)
        return await hs.probe(self._ctx, peer.host, peer.port, peer.engine_id, min(timeout_s, self._timeout_s),
                              self._dialing(peer.server))

    def is_self(self, host: str, port: int) -> bool:
        """`host:port` is this daemon's own side channel (as it advertises it, or on loopback)."""
        return self._self is not None and self._self.side.is_address(host, port)

    def revoked(self) -> list[Peer]:
        """Ready peers whose daemon key left the authorized keys (liveness.py retires them)."""
        if self.keys is None:
            return []
        allowed = self.keys.authorized.keys()
        return [p for p in self.ready() if not p.local and not p.retired and p.server.encode() not in allowed]

    def ready(self) -> list[Peer]:
        """Live peers whose handshake is done (what liveness.py watches)."""
        return [p for p in self._peers.values() if p.ready.done()]

    def key_of(self, ref: P.RemoteRef) -> PeerKey:
        """The peer a read names: its engine, address and the daemon key it names (none: the key
        that address proved, else the default). Not checked here: a new peer's handshake checks
        that the key is authorized (`_peer`)."""
        if self.keys is None:
            return ref.engine_id, ref.host, ref.port, ""
        return ref.engine_id, ref.host, ref.port, ref.daemon_key or self.keys.at(ref.host, ref.port)

    def _dialing(self, server: str) -> CurveKeys | None:
        return self.keys.curve.dialing(server.encode()) if self.keys is not None else None

    async def _peer(self, ref: P.RemoteRef, key: PeerKey, deadline: Callable[[], float]) -> Peer:
        """The peer's handshake, done once and shared by every read waiting on it."""
        peer = self._peers.get(key)
        if peer is None:
            if self.keys is not None and not self.is_self(ref.host, ref.port):
                try:  # the key named, proved there before, or the default: authorized now
                    self.keys.authorize(key[3])
                except KeyRefused as exc:
                    raise hs.HandshakeError("refused", f"{ref.host}:{ref.port}: {exc}") from None
            peer = self._peers[key] = Peer(ref.engine_id, ref.host, ref.port,
                                           asyncio.get_running_loop().create_future(), key[3])
            task = asyncio.get_running_loop().create_task(self._handshake(peer))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)
            self._changed()
        # shielded: one read giving up leaves the handshake to the others; raises its error
        await until_deadline(asyncio.shield(peer.ready), deadline)
        return peer

    async def _handshake(self, peer: Peer) -> None:
        t0 = time.perf_counter()
        try:
            local = self._self is not None and self.is_self(peer.host, peer.port)
            if local and self._self is not None:
                reply = await self._self.side.ask(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, peer.engine_id,
                                                                      self._nixl.name), hs.HandshakeReply)
                if not reply.ok:
                    raise hs.HandshakeError("refused", f"this daemon ({peer.address}): {reply.reason}")
            else:
                reply = await hs.request(self._ctx, peer.host, peer.port, peer.engine_id, self._timeout_s,
                                         self._nixl.name, self._dialing(peer.server))
            if not local and reply.agent == self._nixl.name:
                # Our agent's name is no secret (every request of ours carries it): a peer that
                # answers with it is this daemon under an address it does not know as its own, or
                # one posing as it to have our own engines' memory copied for it
                raise hs.HandshakeError("invalid", f"{peer.address} answered with this daemon's own NIXL agent: "
                                                   "if it is this daemon, set advertise_host to that address")
            # A peer's geometry is checked, and its compatibility hash recomputed from it: the
            # hash the peer sent is not evidence of anything.
            ranks = {r.tp_rank: msgspec.structs.replace(r, compat_hash=hs.compat_hash(validate(r.geometry)))
                     for r in reply.ranks}
            if local:  # no metadata to load: NIXL reads our own registrations
                peer.agent, peer.local = self._nixl.name, True
            else:
                metadata = reply.all_metadata
                if not metadata:
                    raise hs.HandshakeError("malformed", f"{peer.address} sent no NIXL metadata")
                if self.keys is not None and not speaks_for(reply.agent, peer.server):
                    raise hs.HandshakeError("invalid", f"{peer.address} answered under key {peer.server} with agent "
                                                       f"{hs.printable(reply.agent[:80])}, another key's")
                named = {metadata_agent(blob) for blob in metadata}
                if named != {reply.agent}:  # checked before NIXL merges it into an agent already known
                    raise hs.HandshakeError("invalid", f"{peer.address}'s metadata names agents "
                                                       f"{sorted(hs.printable(n[:80]) for n in named)[:4]}, "
                                                       f"not the agent it answered as")
                for blob in metadata:  # for an agent loaded already (another engine there), NIXL adds
                    peer.agent = self._nixl.add_peer(blob)
                peer.metadata = metadata  # posting lanes load it on first use
            if self.keys is not None and not local:
                self.keys.proved(peer.host, peer.port, peer.server)  # links dial it, reads naming no key too
            peer.ranks, peer.since, peer.handshake_s = ranks, time.time(), time.perf_counter() - t0
            peer.epoch, peer.heard, peer.notices, peer.serve = reply.epoch, time.monotonic(), reply.notices, reply.serve
            peer.used = peer.probed = peer.heard
            self._recorder.handshake_ran(peer.engine_id, peer.handshake_s)
            peer.ready.set_result(None)
            self._retire_older(peer)
            self._changed()
        except Exception as exc:
            err = exc if isinstance(exc, hs.HandshakeError) else hs.HandshakeError("invalid", str(exc))
            self._recorder.handshake_ran(peer.engine_id, time.perf_counter() - t0, err.reason)
            log.warning("handshake failed: peer=%s address=%s reason=%s: %s", peer.engine_id, peer.address,
                        err.reason, err)
            if self._peers.get(peer.key) is peer:
                del self._peers[peer.key]
            self._drop_agent(peer)
            peer.ready.set_exception(err)
            peer.ready.exception()  # mark retrieved: waiters each get it through their shield
            self._changed()

    def _retire_older(self, peer: Peer) -> None:
        """A handshake met the engine under a new epoch: a Peer of its old registration (reached by
        another address, same agent) is stale."""
        if not peer.epoch:
            return
        for other in self.ready():
            if (other is not peer and other.engine_id == peer.engine_id and other.agent == peer.agent
                    and other.epoch and other.epoch != peer.epoch):
                self.retire(other, f"a handshake met epoch {peer.epoch}, not {other.epoch}", "restarted")

    async def _build(self, peer: Peer, er: EngineRank) -> Route:
        """Plan `er` reading `peer` and prepare the descriptor lists of every remote rank it reads."""
        wanted = targets(er.tp_rank, er.tp_size, peer.tp_size)
        missing = [r for r in wanted if r not in peer.ranks]
        if missing:
            raise PlanError(f"remote engine {peer.engine_id} has no registered ranks {missing}")
        for r in wanted:
            if peer.ranks[r].compat_hash != er.compat_hash:
                raise PlanError(hs.explain_mismatch(er.geometry, peer.ranks[r].geometry))
            if why := hs.weights_mismatch(er.geometry, peer.ranks[r].geometry):
                raise PlanError(why)
        if peer.local:
            return await self._build_local(peer, er, wanted)
        return await self._build_nixl(peer, er, wanted)

    async def _build_nixl(self, peer: Peer, er: EngineRank, wanted: Sequence[int]) -> Route:
        """Plan `er` reading `peer` through NIXL; prepare the lists of every remote rank it reads
        (their arrays built off the loop: up to PREPARED_DESCRIPTORS_MAX rows take ~0.5 s)."""
        t0 = time.perf_counter()
        plan = self._plan(peer, er, wanted)
        log.info("planned engine %s rank %d <- %s ranks %s in %.1f ms", er.engine_id, er.tp_rank,
                 peer.engine_id, list(plan.peers), (time.perf_counter() - t0) * 1e3)
        remote_addr = {rank: region_addresses(peer.ranks[rank].geometry, peer.ranks[rank].buffer_addrs)
                       for rank in plan.peers}
        prepared = [rank for rank, pp in plan.peers.items()
                    if pp.num_local_descs + pp.num_remote_descs <= PREPARED_DESCRIPTORS_MAX]
        arrays = await self.builder.run(_prepared_arrays, plan, prepared, er.region_addr, er.device, remote_addr,
                                        {rank: peer.ranks[rank].device for rank in prepared})
        if peer.retired or er.closing:  # nothing prepared yet: nothing to release
            raise PlanError(f"engine {er.engine_id} rank {er.tp_rank} or remote engine {peer.engine_id} went away "
                            "while the route was planned")
        links: dict[int, Link] = {}
        try:
            for rank, pp in plan.peers.items():
                info = peer.ranks[rank]
                t0 = time.perf_counter()
                if rank not in arrays:
                    links[rank] = Link(None, None, remote_addr[rank], info.mem_type, info.device)
                    log.info("engine %s rank %d <- %s rank %d: %d local / %d remote descriptors, too many to "
                             "prepare; reads post the rows they need", er.engine_id, er.tp_rank, peer.engine_id,
                             rank, pp.num_local_descs, pp.num_remote_descs)
                    continue
                local_array, remote_array = arrays[rank]
                local = self._nixl.prep_local(local_array, er.mem_type)
                try:
                    remote = self._nixl.prep_remote(peer.agent, remote_array, info.mem_type)
                except Exception:
                    self._nixl.release_dlist(local)
                    raise
                links[rank] = Link(local, remote, remote_addr[rank], info.mem_type, info.device)
                log.info("prepared %d local / %d remote descriptors for engine %s rank %d <- %s rank %d in %.1f ms",
                         pp.num_local_descs, pp.num_remote_descs, er.engine_id, er.tp_rank, peer.engine_id, rank,
                         (time.perf_counter() - t0) * 1e3)
        except Exception:
            self._release(links.values())
            raise
        return Route(peer, peer.agent, er, plan, peer.tp_size, plan.consumers_per_remote_rank, links,
                     rows_per_block=rows_per_block(plan))

    def _plan(self, peer: Peer, er: EngineRank, wanted: Sequence[int]) -> RankPlan:
        plan = plan_rank(er.geometry, {r: peer.ranks[r].geometry for r in wanted})  # counts, no arrays yet
        if why := over_budget(plan, self._max_plan_descriptors):  # tiny pages over a huge cache: not built
            raise PlanError(f"reading {peer.engine_id} for engine {er.engine_id} rank {er.tp_rank}: {why}")
        return plan

    async def _build_local(self, peer: Peer, er: EngineRank, wanted: Sequence[int]) -> Route:
        """`er` reading another engine of this daemon: host memory by our copy (no lists to
        prepare), GPU memory by a READ on our own agent (its lists prepared as for a peer)."""
        assert self._self is not None
        sources = {s.tp_rank: s for s in self._self.ranks(peer.engine_id) if s.epoch == peer.epoch}
        if missing := [r for r in wanted if r not in sources]:
            raise PlanError(f"engine {peer.engine_id} ranks {missing} are no longer registered with this daemon")
        reader = er.uid
        others = {u for r in wanted if (u := sources[r].uid) is not None and u != reader}
        if not self._self.any_uid and reader is not None and others:
            # the daemon maps both: nothing but this rule keeps one user's engine from copying
            # another's KV (across daemons, the side channel's keys decide)
            raise PlanError(f"engine {peer.engine_id} is registered by another user (uid {min(others)}) than engine "
                            f"{er.engine_id} (uid {er.uid}): reads between users of one daemon are refused "
                            "(same_node_uids = \"any\" allows them)")
        host = all(m.kind == "DRAM" for e in (er, *(sources[r] for r in wanted)) for m in e.mappings)
        if not host or self._self.host_lane == "loop":  # NIXL's own loopback: it reads what it registered
            return dataclasses.replace(await self._build_nixl(peer, er, wanted), lane="loop",
                                       sources=tuple(sources[r] for r in wanted))
        plan = self._plan(peer, er, wanted)
        links = {rank: Link(None, None, region_addresses(peer.ranks[rank].geometry, peer.ranks[rank].buffer_addrs),
                            "DRAM", 0, sources[rank])
                 for rank in plan.peers}
        log.info("engine %s rank %d <- %s ranks %s on this daemon: copied by it", er.engine_id, er.tp_rank,
                 peer.engine_id, list(plan.peers))
        return Route(peer, peer.agent, er, plan, peer.tp_size, plan.consumers_per_remote_rank, links, "copy",
                     tuple(sources[r] for r in wanted), rows_per_block(plan))

    def retire_local(self, engine_id: str, why: str) -> None:
        """A rank of `engine_id` closed here: the local Peers of that engine go at once, so the
        next read handshakes again (and is refused while the engine is gone)."""
        for peer in [p for p in self._peers.values() if p.local and p.engine_id == engine_id]:
            self.retire(peer, why, "engine_gone")

    # --- retirement and release -----------------------------------------------
    def retire(self, peer: Peer, why: str, reason: RetireReason = "posting_failed") -> None:
        """Forget a peer: the next read handshakes again. Its lists wait for `collect`."""
        if peer.retired:
            return
        peer.retired, peer.reason = True, reason
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        for key in [k for k, r in self.routes.items() if r.peer is peer]:
            self._retired[self.routes.pop(key)] = peer
        self._retired_peers.append(peer)
        self._recorder.peer_retired(reason)
        self._changed()
        log.warning("peer %s at %s retired (%s): %s", peer.engine_id, peer.address, reason, why)

    def collect(self, in_use: Callable[[Route], bool]) -> None:
        """Release the lists of retired routes no read uses; drop the agents of peers fully released."""
        for route in [r for r in self._retired if not in_use(r)]:
            del self._retired[route]
            self._release(route.links.values())
        released = [p for p in self._retired_peers if p not in self._retired.values()]
        for peer in released:
            self._retired_peers.remove(peer)
            self._drop_agent(peer)
        if released:
            self._changed()

    def forget_engine(self, er: EngineRank) -> None:
        """A local rank is being released: drop its routes (no read uses them any more), not
        those of a rank registered since under the same key."""
        for key in [k for k, r in self.routes.items() if r.rank is er]:
            self._release(self.routes.pop(key).links.values())
        for route in [r for r in self._retired if r.rank is er]:
            del self._retired[route]
            self._release(route.links.values())

    def close(self) -> None:
        """Shutdown: cancel the handshakes under way (nothing waits for them now; the daemon's
        context closes their sockets), release every list and remove every agent."""
        for task in [*self._handshakes, *self._building.values()]:
            task.cancel()
        for route in [*self.routes.values(), *self._retired]:
            self._release(route.links.values())
        agents = {p.agent for p in [*self._peers.values(), *self._retired_peers] if p.agent}
        for agent in agents - {self._nixl.name}:
            self._remove_agent(agent)
        self.routes.clear()
        self._retired.clear()
        self._peers.clear()
        self._retired_peers.clear()
        self._changed()

    def _release(self, links: Iterable[Link]) -> None:
        for link in list(links):
            for handle in (link.local, link.remote):
                if handle is not None:
                    self._nixl.release_dlist(handle)

    # --- shared agents ----------------------------------------------------------
    def _drop_agent(self, peer: Peer) -> None:
        """`peer` (out of both collections) is done with its agent: removed unless another Peer of
        the same daemon, live or retired, still names it (never our own agent: a local Peer's)."""
        agent, peer.agent = peer.agent, ""
        others = [*self._peers.values(), *self._retired_peers]
        if agent and agent != self._nixl.name and not any(p.agent == agent for p in others):
            self._remove_agent(agent)

    def _remove_agent(self, agent: str) -> None:
        try:
            self._nixl.remove_peer(agent)
        except Exception as exc:
            log.warning("removing agent %s: %s", agent, exc)
        self._lanes.remove_peer(agent)

    # --- what is there ----------------------------------------------------------
    def _changed(self) -> None:
        live = list(self._peers.values())
        handshaking = sum(1 for p in live if not p.ready.done())
        self._recorder.peers_now(handshaking, len(live) - handshaking, len(self._retired_peers),
                                 len(self._nixl.remote_agents))

    def status(self, active: Callable[[Peer], int], rates: Rates | None = None) -> list[P.PeerStatus]:
        """Live peers (handshaking, ready), then retired ones whose lists reads still use."""
        wall, now = time.time(), time.monotonic()
        out = []
        for p in [*self._peers.values(), *self._retired_peers]:
            rate = rates.of(p) if rates is not None else None
            out.append(P.PeerStatus(
                p.engine_id, p.address, p.agent, wall - p.since if p.since else None,
                p.handshake_s, sum(1 for r in self.routes.values() if r.peer is p), sorted(p.ranks),
                active(p), p.state, p.reason or "", p.epoch, now - p.heard if p.heard else None,
                now - p.used if p.used else None,
                sorted({r.lane for r in [*self.routes.values(), *self._retired] if r.peer is p}),
                read_gbps=rate.bytes_per_s / 1e9 if rate is not None else None,
                slow=rate is not None and rate.slow))
        return out
