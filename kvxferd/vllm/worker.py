"""The connector's worker half: one TP rank's connection to its daemon.

    register_kv_caches -> KV moved into shareable memory (shared_kv), described (layout),
                          registered with the daemon (fds over the Unix socket)
    each step:  orders from the scheduler -> one batch frame (expects, holds, reads, releases)
                doorbell read (only while something is pending; a pipe the daemon writes the
                completions into, doorbell.py) -> a poll only if it asked for one -> finished
                sending / receiving, failed reads' block ids -> vLLM's kv_load_failure_policy
                (a step with no tokens scheduled waits up to `idle_wait_s` on the doorbell:
                vLLM steps an engine without pause while transfers are pending, and a step
                that only reads a pipe would spin its cores)

The daemon can restart under a running engine. A watcher thread notices (the socket reads
EOF) even while the engine is idle: reads in flight end failed (vLLM recomputes or fails
them, by its policy), and once a daemon answers again the watcher registers the same memory
and re-holds what the prefill side still holds. A hold whose lease passes while no daemon is
there is freed by the worker itself. One lock guards the connection and the request tables:
vLLM calls from one thread, so it is contended only while the watcher reconnects.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import msgspec

from .. import protocol as P
from ..client import DaemonError, EngineClient, MemoryHandle, Order
from ..plan.geometry import Geometry
from ..rpc import FrameError
from .handoff import ExpectOrder, HoldOrder, Orders, ReadOrder
from .shared_kv import SharedBuffer

log = logging.getLogger("kvxferd.vllm")

RECONNECT_INTERVAL_S = 1.0
ORPHAN_GRACE_S = 5.0  # past its lease, a connected daemon's "expired" should have come
MAX_STEP_SAMPLES = 4096  # step costs kept between two of vLLM's stats collections
# What a connection that can no longer be trusted raises: the socket failed, or a reply (or the
# doorbell: DoorbellError is a ConnectionError) was not understood, so the stream is lost.
LOST = (OSError, FrameError, msgspec.DecodeError)


@dataclass
class TransferStats:
    """What this worker's transfers did since vLLM last asked (`get_kv_connector_stats`)."""

    read_seconds: list[float] = field(default_factory=list)  # reads received: post to arrival
    read_bytes: list[int] = field(default_factory=list)
    failed_reads: int = 0
    sent: int = 0  # holds whose consumers all read them
    expired: int = 0  # holds whose lease passed first
    # per step that schedules tokens while transfers are pending: what learning about finished
    # transfers cost it (the doorbell read, and a poll when it asked for one)
    step_seconds: list[float] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.read_seconds or self.failed_reads or self.sent or self.expired or self.step_seconds)


@dataclass
class Finished:
    """What one step reports to vLLM."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(self, socket_path: str, engine_id: str, rank: int, tp_size: int, read_deadline_s: float,
                 idle_wait_s: float = 0.0) -> None:
        self.socket_path, self.engine_id, self.rank, self.tp_size = socket_path, engine_id, rank, tp_size
        self.read_deadline_s, self.idle_wait_s = read_deadline_s, idle_wait_s
        self.idle_step = False  # this step schedules no tokens: results() may wait for a completion
        self.client: EngineClient | None = None
        self.geometry: Geometry | None = None
        self.buffers: list[SharedBuffer] = []
        self.holds: dict[str, tuple[HoldOrder, float]] = {}  # request -> (order, lease end, monotonic)
        # Holds the connected daemon accepted (request -> when): it ends them (sent / expired), maybe
        # long after their lease while a decode's claims keep them: never freed here while it is
        # connected, nor before its claims could end if the connection drops (`_lost`).
        self.accepted: dict[str, float] = {}
        self.daemon_agent = ""  # the daemon instance connected last (a new agent: it restarted)
        self.max_lease_s = 0.0  # the daemon's: how long claims may keep a hold
        self.poll_again = False  # a poll was refused after the doorbell asked for one
        self.reading: dict[str, ReadOrder] = {}
        self.releasing: set[str] = set()
        self.finished = Finished()
        self.stats = TransferStats()
        self.lock = threading.Lock()
        self.closed = threading.Event()

    # --- connection --------------------------------------------------------------
    def register(self, geometry: Geometry, buffers: list[SharedBuffer], timeout_s: float) -> None:
        """First registration: wait up to `timeout_s` for the daemon, then fail vLLM's start clearly."""
        self.geometry, self.buffers = geometry, buffers
        deadline = time.monotonic() + timeout_s
        while not self._connect():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"kvxferd: no daemon answered at {self.socket_path} within {timeout_s:g} s "
                                   "(start `kvxferd serve --socket ...` beside this engine)")
            time.sleep(0.5)
        threading.Thread(target=self._watch, name="kvxferd-watch", daemon=True).start()

    def _connect(self) -> bool:
        assert self.geometry is not None
        try:
            client = EngineClient(self.socket_path, self.engine_id, self.rank, self.tp_size)
        except LOST as exc:
            log.debug("kvxferd daemon not reachable: %s", exc)
            return False
        try:
            memory = [MemoryHandle(b.kind, b.nbytes, b.device) for b in self.buffers]
            side = client.register(self.geometry, memory=memory, fds=[b.fd for b in self.buffers],
                                   doorbell=True, records=True)
            now = time.monotonic()
            accepted = {}  # the worker's only once every hold is taken (a failure below leaves none)
            for request_id, (order, end) in list(self.holds.items()):
                if client.agent != self.daemon_agent:  # a new daemon: the old one's claims died with it
                    end = now + order.lease_s if end > now + order.lease_s else end
                    self.holds[request_id] = (order, end)
                client.hold(order.request_id, max(0.1, min(end - now, client.max_lease_s or end - now)),
                            order.block_ids, read_token=order.read_token)
                accepted[order.request_id] = time.monotonic()  # answered: the daemon's hold began before
            self.accepted.update(accepted)
            self.daemon_agent, self.max_lease_s = client.agent, client.max_lease_s
        except (*LOST, DaemonError) as exc:
            client.close()
            raise RuntimeError(f"kvxferd: registering engine {self.engine_id} rank {self.rank} failed: {exc}") \
                from exc
        self.client = client
        log.info("kvxferd: engine %s rank %d registered (%d B in %d buffers, side channel %s, %d holds renewed)",
                 self.engine_id, self.rank, sum(b.nbytes for b in self.buffers), len(self.buffers), side,
                 len(self.holds))
        return True

    def _watch(self) -> None:
        """Notice a daemon that went away while the engine is idle; register again when one is back."""
        while not self.closed.wait(RECONNECT_INTERVAL_S):
            with self.lock:
                if self.client is None:
                    try:
                        self._connect()
                    except RuntimeError as exc:
                        log.warning("%s", exc)
                elif _closed_by_peer(self.client.rpc.sock):
                    self._lost(ConnectionError("the daemon closed the connection"))

    def _lost(self, exc: Exception) -> None:
        """The daemon went away: reads in flight are lost, holds wait for the next daemon."""
        if self.client is not None:
            try:  # what the daemon wrote to the doorbell before it went is still true
                self._take(self.client.pushed(force=True)[0])
            except LOST:
                pass  # an unreadable doorbell: what it held is lost with the connection
        log.warning("kvxferd: connection to the daemon lost (%s); %d reads fail, %d holds kept", exc,
                    len(self.reading), len(self.holds))
        if self.client is not None:
            self.client.close()
        self.client = None
        # The daemon, if it lives, may have vouched for these blocks to a decode reading them, up to
        # max_lease_s after it accepted them: kept that long unless it turns out to be a new daemon.
        for request_id, since in self.accepted.items():
            if request_id in self.holds:
                order, end = self.holds[request_id]
                self.holds[request_id] = (order, max(end, since + self.max_lease_s))
        self.accepted.clear()
        for request_id in list(self.reading):
            self._fail(request_id, f"daemon connection lost: {exc}")
        self.releasing.clear()  # the prefill side's lease frees those blocks

    # --- orders --------------------------------------------------------------------
    def start(self, orders: Orders) -> None:
        with self.lock:
            self._start(orders)

    def _start(self, orders: Orders) -> None:
        self.idle_step = orders.idle
        now = time.monotonic()
        for hold in orders.holds:
            self.holds[hold.request_id] = (hold, now + hold.lease_s)
        reads = []
        for read in orders.reads:
            if read.refusal:  # cannot be read as vLLM was promised: fail it here, free the prefill's hold
                self.reading[read.request_id] = read
                self._fail(read.request_id, read.refusal)
                read = msgspec.structs.replace(read, local_blocks=[[] for _ in read.local_blocks], refusal="")
            if read.is_release:
                self.releasing.add(read.request_id)
            else:
                self.reading[read.request_id] = read
            reads.append(read)
        if orders.expects or orders.holds or reads:
            self._send(orders.expects, orders.holds, reads)

    def _send(self, expects: list[ExpectOrder], holds: list[HoldOrder], reads: list[ReadOrder]) -> None:
        """A step's orders in one frame: one round trip per step, however many it holds."""
        if self.client is None:
            for read in reads:
                if read.request_id in self.reading:
                    self._fail(read.request_id, "no kvxferd daemon connected")
                self.releasing.discard(read.request_id)
            return
        r = self.client.requests
        sent: list[tuple[str, Order]] = [
            *((e.request_id, r.expect(e.request_id, e.remote)) for e in expects),
            *((h.request_id, r.hold(h.request_id, h.lease_s, h.block_ids, read_token=h.read_token)) for h in holds),
            *((o.request_id, r.read(o.request_id, o.remote, o.num_tokens, o.local_blocks, o.remote_blocks,
                                    self.read_deadline_s)) for o in reads)]
        for i in range(0, len(sent), P.MAX_BATCH):  # a step with more orders than a frame holds
            self._send_frame(sent[i:i + P.MAX_BATCH])

    def _send_frame(self, sent: list[tuple[str, Order]]) -> None:
        if self.client is None:  # lost with an earlier frame of this step: `_lost` failed its reads
            return
        try:
            outcomes: list[DaemonError | None] = self.client.batch([order for _, order in sent])
        except LOST as exc:
            # the daemon may have taken this frame's holds, and vouched for them, before it went
            # quiet: kept as long as accepted ones (`_lost`)
            answered = time.monotonic()
            self.accepted.update((rid, answered) for rid, order in sent if isinstance(order, P.Hold))
            self._lost(exc)
            return
        except DaemonError as exc:  # the frame itself refused (its size): every order in it
            outcomes = [exc] * len(sent)
        self._settle(sent, outcomes)

    def _settle(self, sent: list[tuple[str, Order]], outcomes: list[DaemonError | None]) -> None:
        answered = time.monotonic()  # the daemon's holds began before: kept from here (`_lost`) outlives them
        for (request_id, order), refused in zip(sent, outcomes):
            if refused is None:
                if isinstance(order, P.Hold):
                    self.accepted[request_id] = answered
                continue
            log.warning("kvxferd refused %s of request %s: %s", type(order).__name__.lower(), request_id, refused)
            if isinstance(order, P.Read):  # a refused hold waits for its lease; an expect changes nothing
                if request_id in self.reading:
                    self._fail(request_id, str(refused))
                self.releasing.discard(request_id)

    # --- completions -----------------------------------------------------------------
    def results(self) -> Finished:
        """Finished transfers since the last step. While something is pending, a step reads the
        doorbell (no round trip) and polls only when the daemon asked it to."""
        with self.lock:
            if self.reading or self.releasing or self.holds:
                waiting = self.idle_step and not (self.finished.sending or self.finished.recving)
                started = time.perf_counter()
                self._collect(self.idle_wait_s if waiting else 0.0)
                if not self.idle_step and len(self.stats.step_seconds) < MAX_STEP_SAMPLES:
                    self.stats.step_seconds.append(time.perf_counter() - started)
            self._expire_orphaned_holds()
            finished, self.finished = self.finished, Finished()
            return finished

    def _collect(self, wait_s: float) -> None:
        """Take the daemon's completions, waiting up to `wait_s` for one: from the doorbell (the
        completions themselves, protocol 7), then one poll only if it asked for one; a daemon
        without doorbells (before protocol 5) is long-polled."""
        if self.client is None:
            return
        try:
            if self.client.doorbell is None:
                self._poll(wait_s)
                return
            pushed, poll = self.client.pushed(0.0 if self.poll_again else wait_s)
            self._take(pushed)
            if poll or self.poll_again:
                self._poll(0.0)
        except LOST as exc:
            self._lost(exc)

    def _poll(self, wait_s: float) -> None:
        assert self.client is not None
        try:
            completions = self.client.poll(wait_s)
        except LOST as exc:
            self._lost(exc)
            return
        except DaemonError as exc:
            log.warning("kvxferd poll refused: %s", exc)
            self.poll_again = True  # the doorbell asked once: it asks again only after a poll
            return
        self.poll_again = False
        self._take(completions)

    def _take(self, completions: list[P.Completion]) -> None:
        for c in completions:
            if c.status in ("sent", "expired"):
                self.accepted.pop(c.request_id, None)
                if self.holds.pop(c.request_id, None) is not None:
                    self.finished.sending.add(c.request_id)
                    self.stats.sent += c.status == "sent"
                    self.stats.expired += c.status == "expired"
                    if c.status == "expired":
                        log.warning("kvxferd: request %s's lease passed before its consumers read it: %s",
                                    c.request_id, c.reason)
            elif c.request_id in self.releasing:
                self.releasing.discard(c.request_id)
                if c.status == "failed":
                    log.warning("kvxferd: release of %s failed (the prefill lease frees it): %s", c.request_id,
                                c.reason)
            elif c.request_id in self.reading:
                if c.status == "received":
                    del self.reading[c.request_id]
                    self.finished.recving.add(c.request_id)
                    self.stats.read_seconds.append(c.seconds)
                    self.stats.read_bytes.append(c.nbytes)
                else:
                    self._fail(c.request_id, c.reason)

    def _fail(self, request_id: str, reason: str) -> None:
        read = self.reading.pop(request_id)
        self.stats.failed_reads += 1
        log.warning("kvxferd: read of request %s failed: %s", request_id, reason)
        self.finished.recving.add(request_id)
        self.finished.failed.add(request_id)
        for ids in read.local_blocks:
            self.finished.load_errors.update(ids)

    def take_stats(self) -> TransferStats:
        with self.lock:
            stats, self.stats = self.stats, TransferStats()
            return stats

    def _expire_orphaned_holds(self) -> None:
        """Holds whose lease passed without the daemon ending them (no daemon connected, or it
        refused the hold): free them here, so no block is held forever."""
        if self.client is not None and self.accepted.keys() >= self.holds.keys():
            return  # every hold is the connected daemon's to end
        now = time.monotonic()
        grace = 0.0 if self.client is None else ORPHAN_GRACE_S
        for request_id, (_, end) in list(self.holds.items()):
            if self.client is not None and request_id in self.accepted:
                continue  # the daemon ends it, at its lease or when the last claim on it passes
            if now >= end + grace:
                del self.holds[request_id]
                self.accepted.pop(request_id, None)
                self.finished.sending.add(request_id)
                self.stats.expired += 1
                log.warning("kvxferd: request %s's lease passed with no word from the daemon; blocks freed",
                            request_id)

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.client is not None:
            try:
                self.client.unregister()
            except (OSError, DaemonError):
                pass
            self.client.close()
            self.client = None
        for b in self.buffers:
            b.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """EOF waiting on a socket the daemon never writes to unasked (called between calls)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
