"""The daemon: lifecycle, engine connections and the dispatch of their requests.

    engine ─► rpc (Unix socket) ─► Daemon._dispatch ─► engines   registration, lookup, release
                                                     ├► holds     prefill: holds, notifications, leases
                                                     └► reads     decode: reads ─► peers (handshake, routes)
    peer daemon ─► side channel ─► holds.answer_handshake, holds.answer_audit (integrity audit),
                                   engines.answer_probe (is an engine still there, which epoch)
    housekeeping ─► liveness (decode: probe peers, retire the gone) ─► peers
    every component ─► recorder (Prometheus, status counters, recent windows)

Each component owns its state; the daemon hands each only what it needs and owns the tasks
that drive them: the progress loop (NIXL transfers and notifications), housekeeping (leases,
releases) and the systemd watchdog. Lifecycle: `start`, then `stop` in phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import grp
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from . import __version__, integrity
from . import handshake as hs
from . import protocol as P
from .config import Config, authorized_keys_dir, is_loopback, is_wildcard
from .copier import Copier
from .doorbell import ring_supported
from .engines import EngineRank, Engines
from .holds import Holds
from .identity import PeerKeys, load_curve
from .lanes import Lanes
from .leases import Leases
from .liveness import Liveness
from .logs import Throttle
from .metrics import serve_http
from .nixl_driver import NixlDriver
from .notices import Notices
from .ownside import OwnSide
from .pace import SPIN, Pace, Wake
from .peers import Peers, SelfPeer
from .protocol import RequestError
from .rates import Rates
from .reading import Builder
from .reads import Reads
from .recorder import Recorder, RpcOutcome
from .rpc import FrameError, ServerConnection, serve_unix
from .sdnotify import SystemdNotifier
from .serving import Readers
from .sidelink import Links
from .sockdir import unlink_if_bound
from .stall import StallWatch

log = logging.getLogger("kvxferd")
R = TypeVar("R", bound=P.Msg)

LONG_POLL_MAX_S = 60.0
HOUSEKEEPING_S = 0.05
NOTICES_DRAIN_S = 0.05  # at shutdown, for the notices flushed last to leave
HOUSEKEEPING_LOG_S = 10.0  # a housekeeping turn that keeps failing is logged this often


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.recorder = Recorder()
        self.started = time.time()
        self.ready = False
        self._tasks: list[asyncio.Task[None]] = []
        self.loops: tuple[asyncio.Task[None], ...] = ()
        self._http: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self._per_uid: dict[int, int] = {}  # open engine connections by uid (max_connections_per_uid)
        self._socket_gid: int | None = None
        self._wake = Wake()  # a READ was posted or a hold arrived: progress NIXL now
        self.pace = Pace(cfg.spin_s, cfg.idle_poll_s, cfg.idle_max_s, cfg.idle_hot_s)
        self._misattributed_warned = Throttle(60.0)  # by sending key
        self.readers = Readers()  # whether peers reading our memory need our progress (serving.py)
        self.recorder.serving_unasked(lambda: self.readers.unasked(time.monotonic()))
        self.metrics_port = 0

    # --- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        _open_files_to_the_hard_limit()
        for key, value in cfg.ucx.items():
            os.environ[key] = value
        self.keys = None  # our CurveZMQ identity and our peers' (identity.py)
        if cfg.curve_secret_key_file:
            self.keys = PeerKeys(load_curve(cfg.curve_secret_key_file, authorized_keys_dir(cfg),
                                            cfg.curve_server_key_file))
        # with Curve our agent's name ends with our key's fingerprint: peers attribute it to us alone
        self.nixl = NixlDriver(cfg.name, tuple(cfg.backends), progress_thread=cfg.nixl_progress_thread,
                               threads=cfg.nixl_threads, name_suffix=self.keys.fingerprint if self.keys else "")
        self.zmq = zmq.asyncio.Context()
        self.lanes = Lanes(cfg.lanes, cfg.lane_split_bytes, cfg.name, tuple(cfg.backends))
        self.engines = Engines(self.nixl, self.recorder, self.lanes, cfg.max_ranks_per_uid, cfg.max_buffers_per_uid)
        self.digester = integrity.Digester("digest")  # our engines' holds and reads
        self.audit_digester = integrity.Digester("audit")  # peers' audits: apart, so neither starves the other
        self.holds = Holds(self.engines, self.nixl, self.recorder, cfg.max_lease_s, cfg.integrity_audit,
                           self.digester, self.audit_digester, cfg.max_holds_per_engine, cfg.max_holds_per_uid,
                           nixl_notices=self.keys is None or cfg.unattributed_peers, open_holds=cfg.open_holds)
        own = OwnSide(self._is_own_address, self._answer_side_channel)  # same-node reads: answered in-process
        self.builder = Builder()  # routes' and large reads' arrays, off the loop (reading.py)
        self.peers = Peers(self.zmq, self.nixl, self.recorder, cfg.handshake_timeout_s, self.keys, self.lanes,
                           cfg.max_plan_descriptors,
                           SelfPeer(own, self.engines.serving, cfg.host_lane, cfg.same_node_uids == "any"),
                           self.builder)
        self.copier = Copier(cfg.copy_threads)
        self.links = Links(self.zmq, self.keys, own)
        self.leases = Leases(self.links, self.recorder, self.nixl.name, cfg.claim_s, cfg.lease_renewal,
                             cfg.handshake_timeout_s, cfg.confirm_leases, cfg.max_lease_s,
                             max_expects_per_uid=cfg.max_expects_per_uid)
        self.notices = Notices(self.links, self.recorder, self.nixl.name)
        self.reads = Reads(self.nixl, self.peers, self.recorder, cfg.max_deadline_s, self.lanes, self._wake.set,
                           cfg.integrity_audit, cfg.allowed_peers, self.digester,
                           max_per_rank=cfg.max_reads_per_engine, max_per_uid=cfg.max_reads_per_uid,
                           leases=self.leases, pausing=lambda now: self.stall.behind(now, HOUSEKEEPING_S),
                           notices=self.notices, copier=self.copier, builder=self.builder,
                           rates=Rates(self.recorder, cfg.slow_route_gbps))
        self.liveness = Liveness(self.peers, self.recorder, cfg.peer_probe_interval_s, cfg.peer_dead_after_s,
                                 cfg.peer_idle_ttl_s, self.reads.uses_peer)
        self.hs_server = hs.HandshakeServer(self.zmq, cfg.side_channel_host, cfg.side_channel_port,
                                            self._answer_side_channel, self.keys, self._on_misattributed,
                                            cfg.unattributed_peers)
        self.cfg = cfg = msgspec.structs.replace(cfg, side_channel_port=self.hs_server.port)
        group = self._socket_gid = grp.getgrnam(cfg.socket_group).gr_gid if cfg.socket_group else None
        self.unix_sock, accept = await serve_unix(cfg.socket_path, self._on_connect, self._on_frame,
                                                  self._on_close,
                                                  cfg.socket_mode | (0o060 if group is not None else 0),
                                                  cfg.max_frame_bytes, group,
                                                  self.recorder.accept_failed)
        self._accepting = [accept, asyncio.create_task(self.hs_server.run()),
                           asyncio.create_task(self.hs_server.watch_auth(self._on_refused_peer))]
        self.stall = StallWatch(time.monotonic())
        # its own loops: if one ends, `run` stops the daemon (only a defect ends one)
        self._progressing = asyncio.create_task(self._progress())
        self.loops = (self._progressing, asyncio.create_task(self._housekeeping()))
        self._tasks = list(self.loops)
        if cfg.metrics_port >= 0:
            self._http = await serve_http(self.recorder.metrics, cfg.metrics_host, cfg.metrics_port,
                                          lambda: self.ready)
            self.metrics_port = self._http.sockets[0].getsockname()[1]
        _warm_up()
        self.notifier = SystemdNotifier()
        self.ready = True
        self.notifier.ready(f"serving {cfg.socket_path}, side channel {cfg.side_channel}")
        if self.notifier.watchdog_s:
            self._tasks.append(asyncio.create_task(self._watchdog()))
        log.info("kvxferd %s ready: socket %s, side channel %s, agent %s", __version__, cfg.socket_path,
                 cfg.side_channel, self.nixl.name)

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop in phases, each bounded, so the whole fits in systemd's stop timeout (30 s).

        1. stop accepting engines and handshakes;  2. end in-flight reads as `failed`;
        3. wait up to `drain_s` for quarantined READs NIXL still runs and for the engines to
           poll those failures;
        4. release prepared lists, peers' agents and engine memory;  5. close the sockets.
        """
        self.ready = False
        self.notifier.stopping()
        await _cancel(self._accepting)
        self.hs_server.close()
        self.unix_sock.close()
        unlink_if_bound(self.unix_sock, self.cfg.socket_path)  # not a newer daemon's socket at that path
        told = self.reads.fail_all("shutdown", "the daemon is stopping")
        deadline = time.monotonic() + drain_s
        # (the progress loop is what releases quarantined READs: not waited for once it ended)
        while time.monotonic() < deadline and ((self.reads.quarantined and not self._progressing.done()) or any(
                er.completions and not er.closing for er in told)):
            await asyncio.sleep(0.005)  # the progress loop polls NIXL; engines poll their failures
        if self.reads.quarantined:
            log.warning("stopping with %d quarantined reads still running in NIXL", self.reads.quarantined)
        await _cancel(self._tasks)
        self.stall.arm(time.monotonic())  # what follows closes and joins: a hang there is dumped too
        await self.liveness.close()
        if self._http is not None:
            self._http.close()
        try:
            for conn in list(self._connections):
                conn.close()  # unregisters its engine ranks
            self.peers.close()
            if self.notices.close():  # best effort: a notice not sent leaves its hold to its lease
                await asyncio.sleep(NOTICES_DRAIN_S)  # ZMQ's I/O thread sends them; links close with LINGER 0
            self.links.close()
            self.digester.close()  # waits for a digest reading engine memory to end
            self.audit_digester.close()
            for er in self.engines.all():
                self.engines.close(er, "daemon stopping")
                if not self.reads.uses_engine(er):  # memory NIXL may still write stays mapped until exit
                    self.engines.release(er)
        finally:
            # Whatever socket a task still holds open (a handshake, an audit, a probe, a claim under
            # way) is closed here: `term` alone would wait for it, holding the stop until SIGKILL.
            self.zmq.destroy(linger=0)
            self.lanes.close()
            self.copier.close()  # a copy still running writes memory this process keeps mapped
            self.builder.close()  # arrays in the making
            self.stall.disarm()
        log.info("kvxferd stopped")

    async def _watchdog(self) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    async def _progress(self) -> None:
        """Drive NIXL: peers' notifications, our reads' states, quarantined handles.

        With reads in flight the loop follows `Reads.next_poll`; without, `Pace` (peers reading
        our memory need our progress). A posted READ or a new hold wakes it at once. A spinning
        turn offers the core to whatever else is runnable on it (`sched_yield`): under traffic
        the spin never ends, and it took the core the engine and the other daemon needed
        (docs/benchmarks.md, the control path against raw NIXL); on an idle core it returns at once.
        """
        cfg = self.cfg
        failed = Throttle(HOUSEKEEPING_LOG_S)
        while True:
            self._drain_notifications()
            try:
                self.reads.poll(time.monotonic())
            except Exception:  # a defect: logged, and every read still in flight keeps its progress
                if failed.due():
                    log.exception("polling reads failed (logged at most every %g s)", HOUSEKEEPING_LOG_S)
            if self.reads.busy:
                wait = self.reads.next_poll(time.monotonic(), cfg.spin_s, cfg.poll_interval_s)
                if wait <= 0:
                    os.sched_yield()
                    await asyncio.sleep(0)
                    continue
                await self._wake.sleep(wait)  # a lane's slice posted (or a new READ) wakes it sooner
                continue
            now = time.monotonic()
            wait = self.pace.idle_wait(now, self.readers.need_progress(now, bool(self.holds.held)))
            if wait == SPIN:
                os.sched_yield()
                await asyncio.sleep(0)
                continue
            await self._wake.sleep(wait)

    def _drain_notifications(self) -> None:
        try:
            notifs = self.nixl.notifications()
        except Exception as exc:
            log.warning("reading notifications failed: %s", exc)
            return
        now = time.monotonic()
        for sender, messages in notifs.items():  # NIXL keeps an entry, often empty, per known agent
            for m in messages:  # the sender's name, as it declared it
                if self.holds.on_notification(sender, m) and not self.readers.asks(sender):
                    self.readers.notified(sender, now, asks=False)  # it rode a READ
                    self.pace.active(now)

    async def _housekeeping(self) -> None:
        failed = Throttle(HOUSEKEEPING_LOG_S)  # a step's failure, by step
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            for name, step in self._housekeeping_steps(time.monotonic()):
                try:
                    step()
                except Exception:  # one failing step must not end the others: leases, deadlines, pauses
                    if failed.due(name):
                        log.exception("housekeeping step %s failed (logged at most every %g s)", name,
                                      HOUSEKEEPING_LOG_S)

    def _housekeeping_steps(self, now: float) -> list[tuple[str, Callable[[], None]]]:
        """One turn's steps, each run whatever the others do."""
        steps: list[tuple[str, Callable[[], None]]] = []
        gap = self.stall.tick(now, HOUSEKEEPING_S)
        if gap.held:  # before expiring: a claim that could not be answered meanwhile keeps its hold
            steps += [("holds.paused", functools.partial(self.holds.paused, gap.held)),
                      # only the time it did not run: its own work counts against a read
                      ("reads.paused", functools.partial(self.reads.paused, gap.stopped, now)),
                      # moving many holds on is not itself a pause
                      ("stall.restart", lambda: self.stall.restart(time.monotonic()))]
        return [*steps, ("holds.expire", functools.partial(self.holds.expire, now)),
                ("leases.renew", functools.partial(self.leases.renew, now)),
                ("links.close_idle", functools.partial(self.links.close_idle, now)),
                ("liveness.tick", functools.partial(self.liveness.tick, now)),
                ("release_idle", functools.partial(self._release_idle, now))]

    def _release_idle(self, now: float) -> None:
        self.peers.collect(self.reads.uses_route)
        for er in self.engines.idle(lambda e: bool(self.reads.uses_engine(e)), now):
            self.peers.forget_engine(er)  # its prepared lists go before its memory
            self.engines.release(er)

    def _is_own_address(self, host: str, port: int) -> bool:
        """`host:port` names this daemon's side channel: as advertised or bound, or on loopback
        when it listens there (a read naming it is a same-node read, peers.py)."""
        cfg = self.cfg
        if port != cfg.side_channel_port or port == 0:
            return False
        host = host.strip().removeprefix("[").removesuffix("]")
        if host in (cfg.advertise_host, cfg.side_channel_host):
            return True
        return is_loopback(host) and (is_loopback(cfg.side_channel_host) or is_wildcard(cfg.side_channel_host))

    def _answer_side_channel(self, req: hs.SideRequest) -> hs.SideReply | Awaitable[hs.SideReply] | None:
        now = time.monotonic()
        match req:
            case hs.AuditRequest():
                return self.holds.answer_audit(req)
            case hs.ProbeRequest():
                return self.engines.answer_probe(req)
            case hs.LeaseRequest():
                if not self.readers.asks(req.requester) or self.readers.unasked(now):
                    self._progress_now(now)  # a reader that may not ask is about to read our memory
                return self.holds.answer_lease(req)
            case hs.NoticeRequest():
                if self.holds.take_notices(req):
                    asks = req.version == hs.SERVE_VERSION
                    self.readers.notified(req.requester, now, asks)
                    if not asks:
                        self._progress_now(now)
                return None
            case hs.ServeRequest():
                if req.version == hs.SERVE_VERSION:
                    self.recorder.serve_request("received")
                    self.readers.serve(req.serve_s, now)
                    self._progress_now(now)
                return None
            case _:  # a handshake: the first READ on a new endpoint wires it up, which needs our progress
                self._progress_now(now)
                return self.holds.answer_handshake(req)

    def _progress_now(self, now: float) -> None:
        """A peer's READ of our memory may need our NIXL progress from now on (pace.py)."""
        self.pace.active(now)
        self._wake.set()

    def _on_misattributed(self, req: hs.SideRequest, sender: str) -> None:
        self.recorder.misattributed(str(req.__struct_config__.tag))
        if self._misattributed_warned.due(sender):
            log.warning("side channel: refused a %s request from key %s in the name of %s, not its own agent",
                        str(req.__struct_config__.tag), sender, hs.printable(getattr(req, "requester", "")[:80]))

    def _on_refused_peer(self, event: int) -> None:
        self.recorder.peer_refused_at_auth()
        log.warning("side channel: refused a peer at the ZMTP handshake (event %d: no or wrong CurveZMQ key)",
                    event)

    # --- engine connections ---------------------------------------------------
    def _on_connect(self, conn: ServerConnection) -> None:
        self._connections.add(conn)
        _, uid, gid = conn.credentials
        if not self._may_connect(uid, gid):
            self.recorder.connection_refused("uid")
            log.warning("refused engine connection from uid %d gid %d: not in allowed_uids%s", uid, gid,
                        f" nor group {self.cfg.socket_group}" if self.cfg.socket_group else "")
            conn.fail(RequestError("forbidden", f"uid {uid} may not use this daemon"))
            return
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        conn.counted = True
        if self._per_uid[uid] > self.cfg.max_connections_per_uid:
            self.recorder.connection_refused("connections")
            log.warning("refused engine connection from uid %d: it has %d open (max_connections_per_uid %d)",
                        uid, self._per_uid[uid] - 1, self.cfg.max_connections_per_uid)
            conn.fail(RequestError("forbidden", f"uid {uid} has {self._per_uid[uid] - 1} connections open "
                                                f"(max_connections_per_uid {self.cfg.max_connections_per_uid})"))

    def _may_connect(self, uid: int, gid: int) -> bool:
        """allowed_uids (default: ours and root), and the members of socket_group whose primary
        group it is (SO_PEERCRED tells the primary gid only; a supplementary member needs its
        uid listed)."""
        if uid in (set(self.cfg.allowed_uids) or {os.getuid(), 0}):
            return True
        return self._socket_gid is not None and gid == self._socket_gid

    def _on_close(self, conn: ServerConnection) -> None:
        self._connections.discard(conn)
        if conn.counted:
            uid = conn.credentials[1]
            self._per_uid[uid] -= 1
            if not self._per_uid[uid]:
                del self._per_uid[uid]
        for er in self.engines.all():
            if er.conn is conn:
                self._unregister(er, "engine disconnected")

    def _unregister(self, er: EngineRank, why: str) -> None:
        """Stop serving a rank: fail its reads, drop its holds; its memory goes once nothing uses it."""
        if not self.engines.close(er, why):
            return
        self.peers.retire_local(er.engine_id, f"engine {er.engine_id} rank {er.tp_rank} closed here: {why}")
        self.reads.fail_engine(er, why)
        self.leases.forget_engine(er.key)
        # Readers may still be pulling held blocks: keep the memory until their leases end.
        er.release_after = max(er.release_after, self.holds.drop_engine(er.key))
        self._release_idle(time.monotonic())

    def _on_frame(self, conn: ServerConnection, data: bytes | Exception) -> bytes | Awaitable[bytes]:
        """One request -> its encoded reply, or an awaitable of it (a long poll that must wait)."""
        received_at = time.perf_counter()
        method = "frame"
        try:
            if isinstance(data, Exception):
                raise data
            msg = P.request_decoder.decode(data)
            method = type(msg).__name__.lower()
            if isinstance(msg, P.Poll) and msg.wait_s > 0:
                er = self._rank(msg.engine_id, msg.tp_rank, conn, "poll")
                if not er.completions:
                    return self._poll_later(er, msg, received_at)
            reply = self._dispatch(conn, msg, received_at)
            if not isinstance(reply, P.Msg):  # a hold digesting its blocks: answered once they are
                return self._answer_later(reply, method, received_at)
            outcome: RpcOutcome = "ok"
        except P.DECODE_ERRORS as exc:
            reply, outcome = P.Error("bad_request", f"malformed request: {exc}{_offending(data, exc)}"), "error"
        except RequestError as exc:
            reply, outcome = P.Error(exc.code, str(exc)), "error"
        except FrameError as exc:
            reply, outcome = P.Error("bad_request", str(exc)), "error"
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("internal error handling %s", method)
            reply, outcome = P.Error("internal", f"{type(exc).__name__}: {exc}"), "error"
        self.recorder.rpc_answered(method, outcome, time.perf_counter() - received_at)
        return P.encoder.encode(reply)

    async def _answer_later(self, reply: Awaitable[P.Reply], method: str, received_at: float) -> bytes:
        answer = await reply
        self.recorder.rpc_answered(method, "ok", time.perf_counter() - received_at)
        return P.encoder.encode(answer)

    def _dispatch(self, conn: ServerConnection, msg: P.Request, received_at: float) -> P.Reply | Awaitable[P.Reply]:
        match msg:
            case P.Hello(version=version):
                if version not in P.SUPPORTED_VERSIONS:
                    raise RequestError("version", f"protocol version {version} unsupported; "
                                                  f"this daemon speaks {', '.join(map(str, P.SUPPORTED_VERSIONS))}")
                conn.protocol = version
                return P.Welcome(P.PROTOCOL_VERSION, f"kvxferd {__version__}")
            case P.Register(memory=memory, doorbell=eventfd, doorbell_pipe=pipe, doorbell_records=records,
                            doorbell_counter=counter, doorbell_ring=ring):
                # A protocol 3-4 eventfd is taken and closed unrung: its open file is the engine's too,
                # which could make a write to it block (doorbell.py's pipe is the daemon's alone).
                fds = conn.reader.take_fds(sum(1 for m in memory if m.has_fd) + eventfd)
                er = self.engines.register(msg, fds, conn)
                version = conn.protocol or P.PROTOCOL_VERSION
                records = pipe and records and version >= 7  # a reply to an older hello could not say so
                counter = records and counter and version >= 9
                ring = counter and ring and version >= 10 and ring_supported()
                if pipe:
                    try:
                        opened = er.open_doorbell(records, counter, ring)
                    except OSError as exc:  # all or nothing: the engine's retry registers anew
                        self._unregister(er, "its registration failed")
                        raise RequestError("internal", f"the doorbell could not be made: {exc}") from None
                    for fd in opened:
                        conn.send_with_next_reply(fd)
                    counter = er.doorbell is not None and er.doorbell.counter is not None  # a page was made
                    ring = er.doorbell is not None and er.doorbell.ring  # a ring implies its page
                return P.Registered(self.cfg.side_channel, self.nixl.name, pipe, er.token, self.cfg.max_lease_s,
                                    records, counter, ring,
                                    self.keys.public if self.keys else "").for_version(version)
            case P.Attach(engine_id=engine_id, tp_rank=rank, token=token):
                er = self._rank(engine_id, rank, None)
                if not secrets.compare_digest(token.encode(), er.token.encode()):
                    self.recorder.request_forbidden("attach")
                    raise RequestError("forbidden", f"wrong token for engine {engine_id!r} rank {rank}")
                er.attached.add(conn)
                return P.Ok()
            case P.Unregister(engine_id=engine_id, tp_rank=rank):
                self._unregister(self._rank(engine_id, rank, conn, "unregister"), "unregistered")
                return P.Ok()
            case P.Hold(engine_id=engine_id, tp_rank=rank):
                digesting = self._hold(self._rank(engine_id, rank, conn, "hold"), msg)
                return P.Ok() if digesting is None else _when_done(digesting, P.Ok())
            case P.Read(engine_id=engine_id, tp_rank=rank):
                self.reads.start(self._rank(engine_id, rank, conn, "read"), msg, received_at)
                return P.Ok()
            case P.Expect(engine_id=engine_id, tp_rank=rank):
                self._expect(self._rank(engine_id, rank, conn, "expect"), msg)
                return P.Ok()
            case P.Batch(items=items):
                return self._batch(conn, items, received_at)
            case P.Poll(engine_id=engine_id, tp_rank=rank, max_items=max_items):
                return self._rank(engine_id, rank, conn, "poll").take_completions(max_items)
            case P.StatusQuery():
                return P.StatusReply(self.status())

    def _expect(self, er: EngineRank, msg: P.Expect) -> None:
        if self.reads.may_dial(msg.remote.host, msg.remote.port):
            self.leases.expect(er.key, msg.request_id, msg.remote, er.uid)

    def _hold(self, er: EngineRank, msg: P.Hold) -> Awaitable[object] | None:
        digesting = self.holds.hold(er, msg)
        now = time.monotonic()
        if self.readers.unasked(now):  # a reader that never asks for progress may read it at once
            self._progress_now(now)
        return digesting

    def _batch(self, conn: ServerConnection, items: list[P.Hold | P.Read | P.Expect],
               received_at: float) -> P.Results | Awaitable[P.Results]:
        """All or nothing: every item is checked before any is applied; one refused, none applied
        (each refused item says why, the others that they were not applied)."""
        refusals: list[P.Error | None] = []
        new: dict[tuple[str, str, int], int] = {}  # new holds / reads per rank, earlier in this batch
        new_of_uid: dict[tuple[str, int | None], int] = {}  # ... per uid (a batch may name several ranks)
        reading: set[tuple[str, int, str]] = set()  # reads earlier in this batch (a second hold renews)
        holding: dict[tuple[str, int, str], str] = {}  # holds earlier in this batch: their read tokens
        for item in items:
            kind = type(item).__name__.lower()
            try:
                er = self._rank(item.engine_id, item.tp_rank, conn, kind)
                key = (item.engine_id, item.tp_rank, item.request_id)
                if isinstance(item, P.Read):
                    if key in reading:
                        raise RequestError("bad_request", f"request {item.request_id!r} is already being read "
                                                          "(earlier in this batch)")
                    reading.add(key)
                if isinstance(item, P.Hold) and holding.setdefault(key, item.read_token) != item.read_token:
                    raise RequestError("bad_request", f"request {item.request_id!r} is held under another "
                                                      "read_token (earlier in this batch)")
                count, of_uid = (kind, item.engine_id, item.tp_rank), (kind, er.uid)
                if isinstance(item, P.Hold):
                    fresh = self.holds.check(er, item, new.get(count, 0), new_of_uid.get(of_uid, 0))
                elif isinstance(item, P.Expect):
                    fresh = False  # the rank's own: nothing else to check
                else:
                    self.reads.check(er, item, new.get(count, 0), new_of_uid.get(of_uid, 0))
                    fresh = True
                new[count] = new.get(count, 0) + fresh
                new_of_uid[of_uid] = new_of_uid.get(of_uid, 0) + fresh
                refusals.append(None)
            except RequestError as exc:
                refusals.append(P.Error(exc.code, str(exc)))
        refused = [i for i, r in enumerate(refusals) if r is not None]
        if refused:
            for i in refused:  # a refused read is not sent again: what its engine expected keeps nothing alive
                item = items[i]
                rank = self.engines.ranks.get((item.engine_id, item.tp_rank))
                if isinstance(item, P.Read) and rank is not None and rank.may_act(conn):
                    self.reads.refused(rank, item)
            note = P.Error("bad_request", f"{P.NOT_APPLIED}batch item {refused[0]} was refused")
            return P.Results([r or note for r in refusals])
        results: list[P.Ok | P.Error] = []
        waits: list[Awaitable[object]] = []
        for item in items:
            try:
                if isinstance(item, P.Hold):
                    digesting = self._hold(self._rank(item.engine_id, item.tp_rank, conn), item)
                    if digesting is not None:
                        waits.append(digesting)
                elif isinstance(item, P.Expect):
                    self._expect(self._rank(item.engine_id, item.tp_rank, conn), item)
                else:
                    self.reads.start(self._rank(item.engine_id, item.tp_rank, conn), item, received_at)
                results.append(P.Ok())
            except Exception as exc:  # checked above: only a bug gets here; the item says so
                log.error("batch item %s %r failed after its check", type(item).__name__, item.request_id,
                          exc_info=exc)
                results.append(P.Error("internal", f"{type(exc).__name__}: {exc}"))
        reply = P.Results(results)
        return _when_done(asyncio.gather(*waits, return_exceptions=True), reply) if waits else reply

    def _rank(self, engine_id: str, rank: int, conn: ServerConnection | None, method: str = "") -> EngineRank:
        """The serving rank a request names: `unknown_engine` if there is none, `forbidden` (and
        counted) if the connection may not act for it (engines.EngineRank.may_act)."""
        er = self.engines.ranks.get((engine_id, rank))
        if er is None or er.closing:
            raise RequestError("unknown_engine", f"engine {engine_id!r} rank {rank} is not registered")
        if not er.may_act(conn):
            self.recorder.request_forbidden(method)
            raise RequestError("forbidden", f"engine {engine_id!r} rank {rank} was registered by another "
                                            "process; attach with its token to act for it")
        return er

    async def _poll_later(self, er: EngineRank, msg: P.Poll, received_at: float) -> bytes:
        """A long poll: wait up to wait_s (at most a minute) for the first completion."""
        er.wakeup.clear()
        if not er.completions:  # one may have arrived before this task first ran
            try:
                await asyncio.wait_for(er.wakeup.wait(), min(msg.wait_s, LONG_POLL_MAX_S))
            except TimeoutError:
                pass
        self.recorder.rpc_answered("poll", "ok", time.perf_counter() - received_at)
        return P.encoder.encode(er.take_completions(msg.max_items))

    def status(self) -> P.Status:
        now = time.monotonic()
        cfg = self.cfg
        rows = P.STATUS_ROWS
        engines = self.engines.status(self.reads.uses_engine)
        peers = self.peers.status(self.reads.uses_peer, self.reads.rates)
        in_flight, held = self.reads.status(now, rows), self.holds.status(now, rows)
        return P.Status(
            version=__version__, agent=self.nixl.name, uptime_s=time.time() - self.started,
            socket=cfg.socket_path, side_channel=cfg.side_channel,
            side_channel_auth="curve" if self.keys else "none", side_channel_key=self.keys.public if self.keys else "",
            metrics=f"{cfg.metrics_host}:{self.metrics_port}" if self._http is not None else None,
            engines=engines[:rows],
            peers=peers[:rows],
            in_flight=in_flight,
            quarantined=self.reads.quarantined,
            held=held,
            recent=self.recorder.recent(),
            counters=msgspec.structs.replace(self.recorder.counters),
            latency_us=self.recorder.latency(),
            failures=list(self.recorder.failures)[-16:],
            totals=P.Totals(len(engines), len(peers), self.reads.in_flight, self.holds.held,
                            len(self.nixl.remote_agents), self.lanes.remote_agents()),
        )


def _offending(data: bytes | Exception, exc: Exception) -> str:
    """For a field out of bounds: the value the request gave, so the error names what was wrong."""
    where = str(exc).rpartition("at `$.")[2].rstrip("`")
    if not isinstance(exc, msgspec.ValidationError) or not isinstance(data, bytes) or not where:
        return ""
    try:
        value: Any = msgspec.msgpack.decode(data)
        for part in where.replace("[", ".").replace("]", "").split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
    except Exception:
        return ""
    return f" (got {where} {value!r})"


async def _when_done(work: Awaitable[object], reply: R) -> R:
    """`reply` once `work` ends (a hold's digests: the engine may reuse nothing it held before)."""
    with contextlib.suppress(Exception):  # a failed digest is logged where it ran; the hold stands
        await work
    return reply


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _warm_up() -> None:
    """Plan a tiny transfer once so that the first real request pays no lazy imports."""
    from .plan.descriptors import RequestBlocks, local_descs, region_addresses, request_indices
    from .plan.geometry import ATTENTION, CacheGroup, Geometry, Region, Segment, View, validate
    from .plan.planner import plan_rank

    page = Segment("k", offset=0, total_units=1, unit_start=0, unit_stop=1, tokens=4, token_bytes=4)
    group = CacheGroup("attn", ATTENTION, tokens_per_block=4, pages_per_block=1,
                       views=(View("layer0", region=0, page_stride=16, num_pages=4, segments=(page,)),))
    geo = validate(Geometry("warm-up", "float16", 1, 0, buffers=(64,), regions=(Region(0, 0, 64),), groups=(group,)))
    plan = plan_rank(geo, {0: geo})
    request_indices(plan, RequestBlocks.of(4, [[0]], [[0]]))
    local_descs(plan.peers[0], region_addresses(geo, [0]))


class LoopEnded(RuntimeError):
    """One of the daemon's own loops (progress, housekeeping) ended, which only a defect does."""


async def run(cfg: Config, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` (SIGINT, SIGTERM), or until one of the daemon's loops ends: then stop
    and raise LoopEnded, so that the supervisor starts it again rather than keep a daemon that
    answers and never completes a read (its watchdog pings come from a loop of their own)."""
    daemon = Daemon(cfg)
    await daemon.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    why = ""
    try:
        await asyncio.wait([stopping, *daemon.loops], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        ended = next((t for t in daemon.loops if t.done()), None)  # before `stop` cancels them
        if ended is not None:  # said before stopping, which could raise too
            exc = None if ended.cancelled() else ended.exception()
            why = "cancelled" if ended.cancelled() else repr(exc)
            log.critical("a daemon loop ended (%s); stopping", why, exc_info=exc)
        await daemon.stop()
    if why:
        raise LoopEnded(f"a daemon loop ended ({why}); stopped, to be started again")


def _open_files_to_the_hard_limit() -> None:
    """Engines' memfds and doorbells, peers' sockets: the daemon holds files for all of them. A
    container runtime's soft limit (1024) would refuse them long before the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
