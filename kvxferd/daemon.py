"""The daemon: engine connections, registration, completions and status on one asyncio loop.

The request state machines live in `prefill_side` (holds, notifications, leases, handshake
answers) and `decode_side` (reads, polling, quarantine); `state` holds the records they share.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from . import __version__
from . import handshake as hs
from . import protocol as P
from .config import Config
from .decode_side import DecodeSide
from .memory import Mapping, MappingError, map_cuda, map_cuda_vmm, map_shm
from .metrics import Metrics, serve_http
from .nixl_driver import NixlDriver
from .plan.descriptors import RequestBlocks, local_descs, region_addresses, request_indices
from .plan.geometry import Geometry, GeometryError, validate
from .plan.planner import plan_rank
from .prefill_side import PrefillSide
from .rpc import FrameError, ServerConnection, serve_unix
from .sdnotify import SystemdNotifier
from .state import EngineRank, Held, Peer, RequestError, Transfer, decode_notif, encode_notif

log = logging.getLogger("kvxferd")

__all__ = ["Daemon", "decode_notif", "encode_notif", "run"]

class Daemon(PrefillSide, DecodeSide):
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
        if not er.completions:  # one may have arrived before this task first ran
            try:
                await asyncio.wait_for(er.wakeup.wait(), min(msg.wait_s, 60.0))
            except TimeoutError:
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
        for peer in list(self.peers.values()) + self.retired_peers:
            self._release_links(peer, keep=lambda key: key[:2] != er.key)
            peer.plans.pop(er.key, None)
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
    from .plan.models import ModelShape, build

    geo = build(ModelShape(layers=1, kv_heads=2, head_dim=8, block_size=4, num_blocks=4), 1, 0)
    plan = plan_rank(geo, {0: geo})
    request_indices(plan, RequestBlocks.of(4, [[0]], [[0]]))
    local_descs(plan.peers[0], region_addresses(geo, [0]))


def _percentiles(samples) -> dict:
    if not samples:
        return {"n": 0}
    a = np.fromiter(samples, dtype=np.float64) * 1e6
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


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
