"""The daemon: engines, peers and request state machines on one asyncio loop.

    prefill side (P)                          decode side (D)
    hold(R, lease) -> held                    read(R) -> handshake (once per peer, shared)
      notif from each consumer: count++               -> plan (cached per peer and local rank)
      count == expected -> "sent"                     -> READ per remote rank, notify the rest
      lease passes      -> "expired"                  -> all DONE -> "received"
                                                      -> error / deadline -> "failed" + block ids

Every NIXL call happens on this loop's thread. NIXL cannot cancel a transfer, so a read
past its deadline is reported failed and its handles are *quarantined*: polled until they
end, with the engine memory they touch kept mapped and registered until then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from . import __version__, handshake as hs, protocol as P
from .config import Config
from .descriptors import RequestBlocks, local_descs, region_addresses, remote_descs, request_indices
from .geometry import Geometry, GeometryError, validate
from .memory import Mapping, MappingError, map_cuda, map_cuda_vmm, map_shm
from .metrics import Metrics, serve_http
from .nixl_driver import DONE, NixlDriver, TransferError
from .planner import PlanError, RankPlan, consumers, plan_rank, targets
from .rpc import FrameError, ServerConnection, serve_unix
from .sdnotify import SystemdNotifier

log = logging.getLogger("kvxferd")

NOTIF_PREFIX = b"KVX1"


def encode_notif(engine_id: str, rank: int, request_id: str, expected: int) -> bytes:
    return msgspec.msgpack.encode([NOTIF_PREFIX, engine_id, rank, request_id, expected])


def decode_notif(data: bytes) -> tuple[str, int, str, int] | None:
    try:
        prefix, engine_id, rank, request_id, expected = msgspec.msgpack.decode(data)
        if prefix != NOTIF_PREFIX:
            return None
        return str(engine_id), int(rank), str(request_id), int(expected)
    except (*P.DECODE_ERRORS, ValueError, TypeError):
        return None


class RequestError(Exception):
    """A request the daemon refuses; becomes a protocol Error with this code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class EngineRank:
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    mappings: list[Mapping]
    registrations: list
    region_addr: np.ndarray
    compat_hash: str
    conn: ServerConnection | None
    completions: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    pinned: int = 0  # transfers (in flight or quarantined) that may still touch this memory
    closing: bool = False
    release_after: float = 0.0  # prefill memory: the latest lease a reader may still be using

    @property
    def key(self) -> tuple[str, int]:
        return self.engine_id, self.tp_rank

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mappings)

    def complete(self, c: P.Completion) -> None:
        if not self.closing:
            self.completions.append(c)
            self.wakeup.set()


@dataclass
class PeerLink:
    """Prepared descriptor lists for one local rank reading one peer's rank."""

    local: object
    remote: object


@dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    ready: asyncio.Future
    agent: str = ""
    ranks: dict[int, hs.RankInfo] = field(default_factory=dict)
    since: float = 0.0
    handshake_s: float = 0.0
    plans: dict[tuple[str, int], RankPlan] = field(default_factory=dict)
    links: dict[tuple[str, int, int], PeerLink] = field(default_factory=dict)
    active: int = 0  # transfers using this peer's lists
    broken: bool = False

    @property
    def label(self) -> str:
        return self.engine_id

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Transfer:
    engine: EngineRank
    request_id: str
    remote: str  # the remote engine id: the peer label in metrics and logs
    peer: Peer | None
    local_blocks: list[list[int]]
    started: float
    deadline: float
    received_at: float = 0.0  # perf_counter when the read RPC arrived
    posted_at: float = 0.0  # monotonic time the READs were posted
    handles: list = field(default_factory=list)  # (remote rank, nixl handle)
    nbytes: int = 0
    descriptors: int = 0
    done: bool = False


@dataclass
class Held:
    engine: EngineRank
    request_id: str
    deadline: float
    since: float
    block_ids: list[list[int]]
    count: int = 0
    expected: int = 0


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.engines: dict[tuple[str, int], EngineRank] = {}
        self.peers: dict[tuple[str, str, int], Peer] = {}
        self.retired_peers: list[Peer] = []
        self.transfers: dict[tuple[str, int, str], Transfer] = {}
        self.quarantine: list[Transfer] = []
        self.holds: dict[tuple[str, int, str], Held] = {}
        self.early_notifs: dict[tuple[str, int, str], tuple[int, int, float]] = {}
        self.failures: deque = deque(maxlen=64)
        self.rates: deque = deque(maxlen=4096)  # (finish time, bytes) of recent reads
        self.lat_post: deque = deque(maxlen=8192)  # read RPC received -> READs posted, seconds
        self.lat_complete: deque = deque(maxlen=8192)  # read RPC received -> completion queued
        self._rpc_started = 0.0
        self.counters = {"received": 0, "failed": 0, "sent": 0, "expired": 0, "unknown_notifs": 0,
                         "handshakes": 0, "handshake_failures": 0, "unauthenticated_peers": 0}
        self.started = time.time()
        self.ready = False
        self._wake = asyncio.Event()
        self._rate = 2e9  # bytes/s of recent large reads: when to expect a read to end
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        for key, value in self.cfg.ucx.items():
            os.environ[key] = value
        self.nixl = NixlDriver(self.cfg.name, tuple(self.cfg.backends),
                               progress_thread=self.cfg.nixl_progress_thread)
        self.zmq = zmq.asyncio.Context()
        self.curve = None
        if self.cfg.curve_secret_key_file:
            self.curve = hs.load_curve(self.cfg.curve_secret_key_file,
                                       self.cfg.curve_authorized_keys_dir or
                                       os.path.dirname(self.cfg.curve_secret_key_file),
                                       self.cfg.curve_server_key_file)
        self.hs_server = hs.HandshakeServer(self.zmq, self.cfg.side_channel_host, self.cfg.side_channel_port,
                                            self._answer_handshake, self.curve)
        self.cfg = msgspec.structs.replace(self.cfg, side_channel_port=self.hs_server.port)
        group = None
        if self.cfg.socket_group:
            import grp
            group = grp.getgrnam(self.cfg.socket_group).gr_gid
        self.unix_sock, accept = await serve_unix(self.cfg.socket_path, self._on_connect, self._on_frame,
                                                  self._on_close, self.cfg.socket_mode, self.cfg.max_frame_bytes,
                                                  group)
        self._tasks += [accept, asyncio.create_task(self.hs_server.run()), asyncio.create_task(self._poll_loop()),
                        asyncio.create_task(self.hs_server.watch_auth(self._on_refused_peer)),
                        asyncio.create_task(self._housekeeping())]
        self.http = None
        if self.cfg.metrics_port >= 0:
            self.http = await serve_http(self.metrics, self.cfg.metrics_host, self.cfg.metrics_port,
                                         lambda: self.ready)
            self.metrics_port = self.http.sockets[0].getsockname()[1]
        _warm_up()
        self.notifier = SystemdNotifier()
        self.ready = True
        self.notifier.ready(f"serving {self.cfg.socket_path}, side channel {self.cfg.side_channel}")
        if self.notifier.watchdog_s:
            self._tasks.append(asyncio.create_task(self._watchdog()))
        log.info("kvxferd %s ready: socket %s, side channel %s, agent %s", __version__, self.cfg.socket_path,
                 self.cfg.side_channel, self.nixl.name)

    async def stop(self) -> None:
        self.ready = False
        self.notifier.stopping()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http:
            self.http.close()
        self.unix_sock.close()
        try:
            os.unlink(self.cfg.socket_path)
        except OSError:
            pass
        self.hs_server.close()
        self.zmq.term()

    async def _watchdog(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    # --- engine connections ---------------------------------------------------
    def _allowed(self, conn: ServerConnection) -> bool:
        uid = conn.credentials[1]
        allowed = set(self.cfg.allowed_uids) or {os.getuid(), 0}
        return uid in allowed

    def _on_connect(self, conn: ServerConnection) -> None:
        if not self._allowed(conn):
            self.metrics.rejected.labels("uid").inc()
            log.warning("refused engine connection from uid %d (pid %d): not in allowed_uids",
                        conn.credentials[1], conn.credentials[0])
            conn.fail(RequestError("forbidden", f"uid {conn.credentials[1]} may not use this daemon"))

    def _on_close(self, conn: ServerConnection) -> None:
        for key in conn.owned:
            er = self.engines.get(key)
            if er is not None and er.conn is conn:
                self._unregister(er, "engine disconnected")

    def _on_frame(self, conn: ServerConnection, data: bytes | Exception):
        """One request -> its encoded reply, or a coroutine producing it (waiting polls)."""
        t0 = self._rpc_started = time.perf_counter()
        method = "unknown"
        try:
            if isinstance(data, Exception):
                method = "frame"
                raise data
            msg = P.request_decoder.decode(data)
            method = type(msg).__name__.lower()
            if isinstance(msg, P.Poll) and msg.wait_s > 0:
                er = self._engine(msg.engine_id, msg.tp_rank)
                if not er.completions:
                    return self._poll_later(er, msg, t0)
            reply, outcome = self._handle(conn, msg), "ok"
        except P.DECODE_ERRORS as exc:
            reply, outcome = P.Error("bad_request", f"malformed request: {exc}"), "error"
        except RequestError as exc:
            reply, outcome = P.Error(exc.code, str(exc)), "error"
        except FrameError as exc:
            reply, outcome = P.Error("bad_request", str(exc)), "error"
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("internal error handling %s", method)
            reply, outcome = P.Error("internal", f"{type(exc).__name__}: {exc}"), "error"
        self.metrics.rpc.labels(method, outcome).inc()
        self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)
        return P.encoder.encode(reply)

    async def _poll_later(self, er: EngineRank, msg: P.Poll, t0: float) -> bytes:
        """A long poll: wait up to wait_s (at most 60 s) for the first completion."""
        er.wakeup.clear()
        try:
            await asyncio.wait_for(er.wakeup.wait(), min(msg.wait_s, 60.0))
        except asyncio.TimeoutError:
            pass
        self.metrics.rpc.labels("poll", "ok").inc()
        self.metrics.rpc_seconds.labels("poll").observe(time.perf_counter() - t0)
        return P.encoder.encode(self._take_completions(er, msg.max_items))

    def _handle(self, conn: ServerConnection, msg: P.Msg) -> P.Msg:
        if isinstance(msg, P.Hello):
            if msg.version != P.PROTOCOL_VERSION:
                raise RequestError("version", f"protocol version {msg.version} unsupported; "
                                              f"this daemon speaks {P.PROTOCOL_VERSION}")
            return P.Welcome(P.PROTOCOL_VERSION, f"kvxferd {__version__}")
        if isinstance(msg, P.Register):
            return self._register(conn, msg)
        if isinstance(msg, P.Unregister):
            self._unregister(self._engine(msg.engine_id, msg.tp_rank), "unregistered")
            conn.owned.discard((msg.engine_id, msg.tp_rank))
            return P.Ok()
        if isinstance(msg, P.Hold):
            return self._hold(msg)
        if isinstance(msg, P.Read):
            return self._read(msg)
        if isinstance(msg, P.Poll):
            return self._take_completions(self._engine(msg.engine_id, msg.tp_rank), msg.max_items)
        if isinstance(msg, P.StatusQuery):
            return P.StatusReply(self.status())
        raise RequestError("bad_request", f"unexpected message {type(msg).__name__}")

    def _engine(self, engine_id: str, rank: int) -> EngineRank:
        er = self.engines.get((engine_id, rank))
        if er is None or er.closing:
            raise RequestError("unknown_engine", f"engine {engine_id!r} rank {rank} is not registered")
        return er

    # --- registration ---------------------------------------------------------
    def _check_registration(self, msg: P.Register) -> Geometry:
        if (msg.engine_id, msg.tp_rank) in self.engines:
            raise RequestError("bad_request", f"engine {msg.engine_id!r} rank {msg.tp_rank} already registered")
        try:
            geo = validate(msg.geometry)
        except GeometryError as exc:
            raise RequestError("bad_request", f"invalid geometry: {exc}") from None
        if (geo.tp_rank, geo.tp_size) != (msg.tp_rank, msg.tp_size):
            raise RequestError("bad_request", f"geometry is for rank {geo.tp_rank}/{geo.tp_size}, "
                                              f"registration for {msg.tp_rank}/{msg.tp_size}")
        if len(msg.memory) != len(geo.buffers):
            raise RequestError("bad_request", f"{len(msg.memory)} memory handles for {len(geo.buffers)} buffers")
        for i, (m, size) in enumerate(zip(msg.memory, geo.buffers)):
            if m.nbytes < size:
                raise RequestError("bad_request", f"buffer {i}: handle of {m.nbytes} B, geometry needs {size} B")
        return geo

    def _register(self, conn: ServerConnection, msg: P.Register) -> P.Msg:
        fds = deque(conn.reader.take_fds(sum(1 for m in msg.memory if m.has_fd)))
        mappings: list[Mapping] = []
        try:
            geo = self._check_registration(msg)
            for m in msg.memory:  # each mapper owns (and closes) the fd it is given
                if m.kind == "shm":
                    mappings.append(map_shm(fds.popleft(), m.nbytes))
                elif m.kind == "cuda_vmm":
                    mappings.append(map_cuda_vmm(fds.popleft(), m.nbytes, m.device))
                else:
                    mappings.append(map_cuda(m.cuda_handle, m.nbytes))
        except MappingError as exc:
            for mp in mappings:
                mp.close()
            raise RequestError("bad_request", str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
        regs = []
        try:
            for mp in mappings:
                regs.append(self.nixl.register(mp.address, mp.nbytes, mp.kind, mp.device))
        except Exception as exc:
            for reg in regs:
                self.nixl.deregister(reg)
            for mp in mappings:
                mp.close()
            raise RequestError("unsupported", f"NIXL cannot register this engine's {mappings[0].kind} memory "
                                              f"({msg.memory[0].kind}): {exc}") from None
        er = EngineRank(msg.engine_id, msg.tp_rank, msg.tp_size, geo, mappings, regs,
                        region_addresses(geo, [mp.address for mp in mappings]), hs.compat_hash(geo), conn)
        self.engines[er.key] = er
        conn.owned.add(er.key)
        self._update_engine_gauges()
        log.info("registered engine %s rank %d/%d: %s, %d B", er.engine_id, er.tp_rank, er.tp_size,
                 geo.model, er.nbytes)
        return P.Registered(self.cfg.side_channel, self.nixl.name)

    def _unregister(self, er: EngineRank, why: str) -> None:
        """Stop serving an engine rank; its memory is released once nothing can touch it."""
        if er.closing:
            return
        er.closing = True
        for t in list(self.transfers.values()):
            if t.engine is er:
                self._fail(t, "engine_gone", f"{why} during the transfer")
        for key, h in list(self.holds.items()):
            if h.engine is er:
                # Readers may still be pulling these blocks: keep the memory until the lease ends.
                er.release_after = max(er.release_after, h.deadline)
                del self.holds[key]
                self.metrics.holds_finished.labels("dropped").inc()
        log.info("engine %s rank %d: %s; memory released when idle", er.engine_id, er.tp_rank, why)
        self._release_if_idle(er)

    def _release_if_idle(self, er: EngineRank) -> None:
        if not er.closing or er.pinned or time.monotonic() < er.release_after:
            return
        if self.engines.get(er.key) is er:
            del self.engines[er.key]
        for link_owner in list(self.peers.values()) + self.retired_peers:
            for k in [k for k in link_owner.links if k[:2] == er.key]:
                link = link_owner.links.pop(k)
                self.nixl.release_dlist(link.local)
                self.nixl.release_dlist(link.remote)
            link_owner.plans.pop(er.key, None)
        for reg in er.registrations:
            self.nixl.deregister(reg)
        for mp in er.mappings:
            mp.close()
        er.registrations, er.mappings = [], []
        self._update_engine_gauges()

    def _update_engine_gauges(self) -> None:
        live = [e for e in self.engines.values() if not e.closing]
        self.metrics.ranks.set(len(live))
        self.metrics.engines.set(len({e.engine_id for e in live}))
        self.metrics.registered_bytes.set(sum(e.nbytes for e in self.engines.values()))

    # --- prefill side: holds and notifications ---------------------------------
    def _hold(self, msg: P.Hold) -> P.Msg:
        er = self._engine(msg.engine_id, msg.tp_rank)
        if not 0 < msg.lease_s <= self.cfg.max_lease_s:
            raise RequestError("bad_request", f"lease_s {msg.lease_s} outside (0, {self.cfg.max_lease_s}]")
        key = (msg.engine_id, msg.tp_rank, msg.request_id)
        now = time.monotonic()
        held = self.holds.get(key)
        if held is None:
            held = self.holds[key] = Held(er, msg.request_id, now + msg.lease_s, now, msg.block_ids)
            early = self.early_notifs.pop(key, None)
            if early:
                held.count, held.expected = early[0], early[1]
        else:
            held.deadline = now + msg.lease_s  # renewal
        self._check_hold(key, held)
        self.metrics.held.set(len(self.holds))
        return P.Ok()

    def _check_hold(self, key, held: Held) -> None:
        if held.expected and held.count >= held.expected:
            del self.holds[key]
            self.counters["sent"] += 1
            self.metrics.holds_finished.labels("sent").inc()
            held.engine.complete(P.Completion(held.request_id, "sent", held.block_ids,
                                              seconds=time.monotonic() - held.since))

    def _on_notification(self, data: bytes) -> None:
        parsed = decode_notif(data)
        if parsed is None:
            self.counters["unknown_notifs"] += 1
            self.metrics.notifs_received.labels("malformed").inc()
            return
        engine_id, rank, request_id, expected = parsed
        key = (engine_id, rank, request_id)
        held = self.holds.get(key)
        if held is None:
            if (engine_id, rank) not in self.engines:
                self.counters["unknown_notifs"] += 1
                self.metrics.notifs_received.labels("unknown").inc()
                log.warning("notification for unknown engine %s rank %d request %s dropped",
                            engine_id, rank, request_id)
                return
            # The consumer may finish before the engine's hold arrives: keep the count for a lease.
            count, _, first = self.early_notifs.get(key, (0, expected, time.monotonic()))
            self.early_notifs[key] = (count + 1, expected, first)
            self.metrics.notifs_received.labels("early").inc()
            return
        self.metrics.notifs_received.labels("consumer").inc()
        held.count += 1
        held.expected = expected
        self._check_hold(key, held)
        self.metrics.held.set(len(self.holds))

    def _expire(self, now: float) -> None:
        for key, held in list(self.holds.items()):
            if now >= held.deadline:
                del self.holds[key]
                self.counters["expired"] += 1
                self.metrics.holds_finished.labels("expired").inc()
                log.warning("hold expired: engine=%s rank=%d request=%s consumers=%d/%d",
                            held.engine.engine_id, held.engine.tp_rank, held.request_id, held.count,
                            held.expected)
                held.engine.complete(P.Completion(held.request_id, "expired", held.block_ids,
                                                  reason=f"lease passed with {held.count} of "
                                                         f"{held.expected or '?'} consumers",
                                                  seconds=now - held.since))
        for key, (count, expected, first) in list(self.early_notifs.items()):
            if now - first > self.cfg.max_lease_s:
                del self.early_notifs[key]
                self.counters["unknown_notifs"] += count
        self.metrics.held.set(len(self.holds))
        self.metrics.held_oldest.set(max((now - h.since for h in self.holds.values()), default=0))

    # --- handshake server -----------------------------------------------------
    def _on_refused_peer(self, event: int) -> None:
        self.counters["unauthenticated_peers"] += 1
        self.metrics.handshakes_served.labels("unauthenticated").inc()
        log.warning("side channel: refused a peer at the ZMTP handshake (event %d: no or wrong CurveZMQ key)",
                    event)

    def _answer_handshake(self, req: hs.HandshakeRequest) -> hs.HandshakeReply:
        if req.version != hs.HANDSHAKE_VERSION:
            self.metrics.handshakes_served.labels("version").inc()
            return hs.HandshakeReply(False, f"handshake version {req.version} unsupported "
                                            f"(this daemon speaks {hs.HANDSHAKE_VERSION})")
        ranks = [e for e in self.engines.values() if e.engine_id == req.engine_id and not e.closing]
        if not ranks:
            self.metrics.handshakes_served.labels("unknown_engine").inc()
            return hs.HandshakeReply(False, f"engine {req.engine_id!r} is not registered with this daemon")
        infos = [hs.RankInfo(e.tp_rank, e.tp_size, e.compat_hash, e.geometry, [m.address for m in e.mappings],
                             e.mappings[0].kind, e.mappings[0].device) for e in sorted(ranks, key=lambda e: e.tp_rank)]
        self.metrics.handshakes_served.labels("ok").inc()
        return hs.HandshakeReply(True, agent=self.nixl.name, metadata=self.nixl.metadata(), ranks=infos)

    # --- decode side: reads ---------------------------------------------------
    def _read(self, msg: P.Read) -> P.Msg:
        er = self._engine(msg.engine_id, msg.tp_rank)
        key = (msg.engine_id, msg.tp_rank, msg.request_id)
        if key in self.transfers:
            raise RequestError("bad_request", f"request {msg.request_id!r} is already being read")
        if not 0 < msg.deadline_s <= self.cfg.max_deadline_s:
            raise RequestError("bad_request", f"deadline_s {msg.deadline_s} outside (0, {self.cfg.max_deadline_s}]")
        if len(msg.local_blocks) != len(er.geometry.groups) or len(msg.remote_blocks) != len(er.geometry.groups):
            raise RequestError("bad_request", f"block lists for {len(msg.local_blocks)}/{len(msg.remote_blocks)} "
                                              f"groups; the geometry has {len(er.geometry.groups)}")
        now = time.monotonic()
        t = Transfer(er, msg.request_id, msg.remote.engine_id, None, msg.local_blocks, now, now + msg.deadline_s,
                     received_at=self._rpc_started)
        self.transfers[key] = t
        er.pinned += 1
        self.metrics.inflight.set(len(self.transfers))
        peer = self.peers.get((msg.remote.engine_id, msg.remote.host, msg.remote.port))
        if peer is not None and peer.ready.done() and not peer.ready.exception() and not peer.broken \
                and next(iter(peer.ranks.values())).tp_size == msg.remote.tp_size:
            try:  # the common case: a known peer, post right here without a task or an await
                if self._post_or_retire(t, peer, msg):
                    return P.Ok()
            except (PlanError, GeometryError) as exc:
                self._fail(t, "plan", str(exc))
                return P.Ok()
        asyncio.get_running_loop().create_task(self._start_read(t, msg))
        return P.Ok()

    async def _start_read(self, t: Transfer, msg: P.Read) -> None:
        try:
            if not self._post_or_retire(t, await self._peer(msg.remote, t.deadline), msg):
                self._post(t, await self._peer(msg.remote, t.deadline), msg)
        except hs.HandshakeError as exc:
            self._fail(t, "handshake", str(exc))
        except (PlanError, GeometryError) as exc:
            self._fail(t, "plan", str(exc))
        except TransferError as exc:
            if t.peer is not None:
                self._retire_peer(t.peer, str(exc))
            self._fail(t, "engine_gone" if t.engine.closing else "transfer", str(exc))
        except asyncio.TimeoutError:
            self._fail(t, "deadline", "deadline passed while waiting for the handshake")
        except Exception as exc:
            log.exception("read %s failed unexpectedly", t.request_id)
            self._fail(t, "internal", f"{type(exc).__name__}: {exc}")

    def _post_or_retire(self, t: Transfer, peer: Peer, msg: P.Read) -> bool:
        """Post `t` on `peer`. False: nothing could be posted, most likely because the peer
        restarted behind cached metadata; the peer is retired and the caller retries once on
        a fresh handshake (a new agent, never the stale one)."""
        try:
            self._post(t, peer, msg)
            return True
        except TransferError as exc:
            if t.handles or t.done:
                self._retire_peer(peer, str(exc))
                self._fail(t, "transfer", str(exc))
                return True
            self._retire_peer(peer, f"posting failed: {exc}")
            peer.active -= 1
            t.peer = None
            self._cleanup_retired()
            return False

    async def _peer(self, ref: P.RemoteRef, deadline: float) -> Peer:
        """The peer's handshake, done once and shared by every request waiting on it."""
        key = (ref.engine_id, ref.host, ref.port)
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(ref.engine_id, ref.host, ref.port,
                                          asyncio.get_running_loop().create_future())
            asyncio.get_running_loop().create_task(self._handshake(peer, ref))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        await asyncio.wait_for(asyncio.shield(peer.ready), remaining)
        if peer.ranks and next(iter(peer.ranks.values())).tp_size != ref.tp_size:
            raise PlanError(f"remote engine {ref.engine_id} runs TP {next(iter(peer.ranks.values())).tp_size}, "
                            f"the request says {ref.tp_size}")
        return peer

    async def _handshake(self, peer: Peer, ref: P.RemoteRef) -> None:
        t0 = time.perf_counter()
        try:
            reply = await hs.request(self.zmq, ref.host, ref.port, ref.engine_id, self.cfg.handshake_timeout_s,
                                     self.nixl.name, self.curve)
            ranks = {r.tp_rank: r for r in reply.ranks}
            for r in ranks.values():
                validate(r.geometry)
            peer.agent = self.nixl.add_peer(reply.metadata)
            peer.ranks, peer.since, peer.handshake_s = ranks, time.time(), time.perf_counter() - t0
            self.counters["handshakes"] += 1
            self.metrics.handshakes.labels(peer.label, "ok").inc()
            self.metrics.handshake_seconds.observe(time.perf_counter() - t0)
            self.metrics.peers.set(len(self.peers))
            peer.ready.set_result(None)
        except Exception as exc:
            err = exc if isinstance(exc, hs.HandshakeError) else hs.HandshakeError("invalid", str(exc))
            self.counters["handshake_failures"] += 1
            self.metrics.handshakes.labels(peer.label, "failed").inc()
            self.metrics.handshake_failures.labels(err.reason).inc()
            log.warning("handshake failed: peer=%s address=%s reason=%s: %s", peer.label, peer.address,
                        err.reason, err)
            if self.peers.get((peer.engine_id, peer.host, peer.port)) is peer:
                del self.peers[(peer.engine_id, peer.host, peer.port)]
            peer.ready.set_exception(err)
            peer.ready.exception()  # mark retrieved: waiters each get it via shield

    def _plan(self, peer: Peer, er: EngineRank) -> RankPlan:
        plan = peer.plans.get(er.key)
        if plan is None:
            wanted = targets(er.tp_rank, er.tp_size, next(iter(peer.ranks.values())).tp_size)
            missing = [r for r in wanted if r not in peer.ranks]
            if missing:
                raise PlanError(f"remote engine {peer.engine_id} has no registered ranks {missing}")
            for r in wanted:
                if peer.ranks[r].compat_hash != er.compat_hash:
                    raise PlanError(hs.explain_mismatch(er.geometry, peer.ranks[r].geometry))
            t0 = time.perf_counter()
            plan = plan_rank(er.geometry, {r: peer.ranks[r].geometry for r in wanted})
            peer.plans[er.key] = plan
            log.info("planned engine %s rank %d <- %s ranks %s in %.1f ms", er.engine_id, er.tp_rank,
                     peer.engine_id, list(plan.peers), (time.perf_counter() - t0) * 1e3)
        return plan

    def _link(self, peer: Peer, er: EngineRank, plan: RankPlan, rank: int) -> PeerLink:
        key = (*er.key, rank)
        link = peer.links.get(key)
        if link is None:
            info, pp = peer.ranks[rank], plan.peers[rank]
            raddr = region_addresses(info.geometry, info.buffer_addrs)
            kind, dev = er.mappings[0].kind, er.mappings[0].device
            t0 = time.perf_counter()
            link = PeerLink(self.nixl.prep_local(local_descs(pp, er.region_addr, dev), kind),
                            self.nixl.prep_remote(peer.agent, remote_descs(pp, raddr, info.device), info.mem_type))
            peer.links[key] = link
            log.info("prepared %d local / %d remote descriptors for engine %s rank %d <- %s rank %d in %.1f ms",
                     pp.num_local_descs, pp.num_remote_descs, er.engine_id, er.tp_rank, peer.engine_id, rank,
                     (time.perf_counter() - t0) * 1e3)
        return link

    def _post(self, t: Transfer, peer: Peer, msg: P.Read) -> None:
        if t.done:
            return
        er = t.engine
        if er.closing:  # unregistered while the handshake ran: nothing to post, the peer is fine
            self._fail(t, "engine_gone", "engine unregistered before the read was posted")
            return
        t.peer = peer
        peer.active += 1
        plan = self._plan(peer, er)
        req = RequestBlocks.of(msg.num_tokens, msg.local_blocks, msg.remote_blocks)
        reads = request_indices(plan, req)
        expected = consumers(er.tp_size, plan.remote_tp)
        for rank, (lids, rids) in reads.items():
            link = self._link(peer, er, plan, rank)
            notif = encode_notif(peer.engine_id, rank, msg.remote.request_id, expected)
            t.handles.append((rank, self.nixl.read(link.local, lids, link.remote, rids, notif)))
            pp = plan.peers[rank]
            t.nbytes += int(_bytes_of(pp, plan, lids))
            t.descriptors += len(lids)
        for rank in plan.targets:
            if rank not in reads:
                self.nixl.notify(peer.agent, encode_notif(peer.engine_id, rank, msg.remote.request_id, expected))
            self.metrics.notifs_sent.inc()
        self.metrics.descriptors.labels(peer.label).observe(t.descriptors)
        posted = time.perf_counter() - t.received_at
        self.lat_post.append(posted)
        self.metrics.read_post.observe(posted)
        if not t.handles:
            self._finish(t, "received")
        else:
            t.posted_at = time.monotonic()
            self._wake.set()

    def _fail(self, t: Transfer, kind: str, reason: str) -> None:
        if not t.done:
            self.metrics.transfer_failures.labels(t.remote, kind).inc()
        self._finish(t, "failed", f"{kind}: {reason}")

    def _finish(self, t: Transfer, status: str, reason: str = "") -> None:
        """End a read for the engine. Handles still running go to quarantine."""
        if t.done:
            return
        t.done = True
        er, now = t.engine, time.monotonic()
        self.transfers.pop((er.engine_id, er.tp_rank, t.request_id), None)
        self.metrics.inflight.set(len(self.transfers))
        peer_label = t.remote
        seconds = now - t.started
        self.counters[status] += 1
        self.metrics.transfers.labels(peer_label, status).inc()
        self.metrics.transfer_seconds.labels(peer_label, status).observe(seconds)
        blocks = t.local_blocks if status == "failed" else []
        if status == "received":
            self.lat_complete.append(time.perf_counter() - t.received_at)
            self.metrics.transfer_bytes.labels(peer_label).inc(t.nbytes)
            self.rates.append((time.time(), t.nbytes))
        else:
            self._log_failure(t, reason)
        er.complete(P.Completion(t.request_id, status, blocks, reason, t.nbytes if status == "received" else 0,
                                 seconds))
        if t.handles:
            self.quarantine.append(t)
            self.metrics.quarantined.set(len(self.quarantine))
        else:
            self._unpin(t)

    def _unpin(self, t: Transfer) -> None:
        t.engine.pinned -= 1
        if t.peer is not None:
            t.peer.active -= 1
            self._cleanup_retired()
        self._release_if_idle(t.engine)

    def _log_failure(self, t: Transfer, reason: str) -> None:
        peer = t.remote
        entry = {"time": time.time(), "engine": t.engine.engine_id, "rank": t.engine.tp_rank,
                 "request": t.request_id, "peer": peer, "reason": reason}
        self.failures.append(entry)
        log.warning("transfer failed: engine=%s rank=%d request=%s peer=%s reason=%s", entry["engine"],
                    entry["rank"], entry["request"], peer, reason, extra={"fields": entry})

    def _retire_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: the next request handshakes again (a new agent name, never stale metadata)."""
        if peer.broken:
            return
        peer.broken = True
        key = (peer.engine_id, peer.host, peer.port)
        if self.peers.get(key) is peer:
            del self.peers[key]
        self.retired_peers.append(peer)
        self.metrics.peers.set(len(self.peers))
        log.warning("peer %s at %s retired: %s", peer.label, peer.address, why)
        self._cleanup_retired()

    def _cleanup_retired(self) -> None:
        for peer in [p for p in self.retired_peers if p.active <= 0]:
            self.retired_peers.remove(peer)
            for link in peer.links.values():
                self.nixl.release_dlist(link.local)
                self.nixl.release_dlist(link.remote)
            peer.links.clear()
            if peer.agent:
                try:
                    self.nixl.remove_peer(peer.agent)
                except Exception as exc:
                    log.warning("removing agent %s: %s", peer.agent, exc)

    # --- polling --------------------------------------------------------------
    async def _poll_loop(self) -> None:
        """Transfer states, notifications, quarantine: all on this loop.

        A read is expected to end `nbytes / observed throughput` after it was posted. The loop
        spins (yielding to other tasks each turn) within `spin_s` of a read's posting or of its
        expected end, and otherwise sleeps until the next such window: small reads are seen
        within microseconds, large ones within a spin of their end, and no core burns while
        bytes are moving. Reads past their window are polled every `poll_interval_s`; an idle
        loop wakes every `idle_poll_s` to progress NIXL (peers' reads and notifications need it).
        """
        while True:
            self._drain_notifications()
            now = time.monotonic()
            for t in list(self.transfers.values()):
                if t.handles and not t.done:
                    self._check_transfer(t, now)
            for t in list(self.quarantine):
                self._check_quarantined(t)
            if self.transfers or self.quarantine:
                await asyncio.sleep(self._next_poll(time.monotonic()))
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.cfg.idle_poll_s)
                except asyncio.TimeoutError:
                    pass

    def _next_poll(self, now: float) -> float:
        """Seconds to sleep before the next poll: 0 inside a spin window."""
        spin, wait = self.cfg.spin_s, self.cfg.poll_interval_s
        for t in self.transfers.values():
            if not t.handles or t.done:
                continue
            for edge in (t.posted_at, t.posted_at + t.nbytes / self._rate):
                if edge - spin <= now <= edge + spin:
                    return 0.0
                if edge - spin > now:
                    wait = min(wait, edge - spin - now) if wait else edge - spin - now
        return wait

    def _drain_notifications(self) -> None:
        try:
            notifs = self.nixl.notifications()
        except Exception as exc:
            log.warning("reading notifications failed: %s", exc)
            return
        for messages in notifs.values():
            for m in messages:
                self._on_notification(m)

    def _check_transfer(self, t: Transfer, now: float) -> None:
        try:
            states = [self.nixl.state(h) for _, h in t.handles]
        except TransferError as exc:
            self._release_terminal(t)
            self._retire_peer(t.peer, str(exc))
            self._fail(t, "transfer", str(exc))
            return
        if all(s == DONE for s in states):
            xfer = 0.0
            for _, h in t.handles:
                tele = self.nixl.telemetry_of(h)
                if tele:
                    self.metrics.nixl_post.observe(tele[0])
                    self.metrics.nixl_xfer.observe(tele[1])
                    xfer = max(xfer, tele[0] + tele[1])
            if t.nbytes >= 1 << 20 and xfer > 0:
                # NIXL's own timing, not when we noticed: a late poll must not slow the estimate
                self._rate = 0.7 * self._rate + 0.3 * (t.nbytes / xfer)
            self._release_terminal(t)
            self._finish(t, "received")
        elif now >= t.deadline:
            self._fail(t, "deadline", f"{t.deadline - t.started:.3g} s passed; memory quarantined")

    def _release_terminal(self, t: Transfer) -> None:
        """Release handles NIXL reports finished (done or failed); keep the ones still running."""
        keep = []
        for rank, h in t.handles:
            try:
                state = self.nixl.state(h)
            except TransferError:
                state = "ERR"
            if state == DONE or state == "ERR":
                self.nixl.release(h)
            else:
                keep.append((rank, h))
        t.handles = keep

    def _check_quarantined(self, t: Transfer) -> None:
        self._release_terminal(t)
        if not t.handles:
            self.quarantine.remove(t)
            self.metrics.quarantined.set(len(self.quarantine))
            self._unpin(t)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            self._expire(now)
            for er in [e for e in self.engines.values() if e.closing]:
                self._release_if_idle(er)

    # --- completions and status -----------------------------------------------
    def _take_completions(self, er: EngineRank, max_items: int) -> P.Completions:
        items = []
        while er.completions and len(items) < max(1, max_items):
            items.append(er.completions.popleft())
        return P.Completions(items)

    def status(self) -> dict:
        now, wall = time.monotonic(), time.time()
        recent = [(ts, b) for ts, b in self.rates if wall - ts <= 10]
        return {
            "version": __version__, "agent": self.nixl.name, "uptime_s": wall - self.started,
            "socket": self.cfg.socket_path, "side_channel": self.cfg.side_channel,
            "side_channel_auth": "curve" if self.curve else "none",
            "metrics": f"{self.cfg.metrics_host}:{self.metrics_port}" if self.http else None,
            "engines": [{"engine": e.engine_id, "rank": e.tp_rank, "tp_size": e.tp_size, "model": e.geometry.model,
                         "bytes": e.nbytes, "memory": e.mappings[0].kind if e.mappings else "-",
                         "state": "closing" if e.closing else "serving", "pinned": e.pinned,
                         "pending_completions": len(e.completions)} for e in self.engines.values()],
            "peers": [{"engine": p.engine_id, "address": p.address, "agent": p.agent,
                       "handshake_age_s": wall - p.since if p.since else None, "handshake_s": p.handshake_s,
                       "plans": len(p.plans),
                       "ranks": sorted(p.ranks), "active": p.active} for p in self.peers.values()],
            "in_flight": [{"engine": t.engine.engine_id, "rank": t.engine.tp_rank, "request": t.request_id,
                           "peer": t.remote, "age_s": now - t.started}
                          for t in self.transfers.values()],
            "quarantined": len(self.quarantine),
            "held": [{"engine": h.engine.engine_id, "rank": h.engine.tp_rank, "request": h.request_id,
                      "consumers": f"{h.count}/{h.expected or '?'}", "age_s": now - h.since,
                      "expires_in_s": h.deadline - now} for h in self.holds.values()],
            "recent": {"window_s": 10, "reads": len(recent), "bytes": sum(b for _, b in recent),
                       "bytes_per_s": sum(b for _, b in recent) / 10},
            "counters": dict(self.counters),
            "latency_us": {"rpc_to_post": _percentiles(self.lat_post),
                           "rpc_to_completion": _percentiles(self.lat_complete)},
            "failures": list(self.failures)[-16:],
        }


def _warm_up() -> None:
    """Plan a tiny transfer once so that the first real request pays no lazy imports."""
    from .models import ModelShape, build

    geo = build(ModelShape(layers=1, kv_heads=2, head_dim=8, block_size=4, num_blocks=4), 1, 0)
    plan = plan_rank(geo, {0: geo})
    request_indices(plan, RequestBlocks.of(4, [[0]], [[0]]))
    local_descs(plan.peers[0], region_addresses(geo, [0]))


def _percentiles(samples) -> dict:
    if not samples:
        return {"n": 0}
    a = np.fromiter(samples, dtype=np.float64) * 1e6
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def _bytes_of(pp, plan: RankPlan, lids: np.ndarray) -> int:
    """Bytes a set of local descriptor ids covers (lengths are per template)."""
    template = np.searchsorted(pp.local_base, lids, side="right") - 1
    return int(pp.length[template].sum())


async def run(cfg: Config, stop: asyncio.Event | None = None) -> None:
    daemon = Daemon(cfg)
    await daemon.start()
    stop = stop or asyncio.Event()
    import signal
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await daemon.stop()
