"""What happened in the daemon, recorded once: Prometheus, the status counters, recent windows.

Components call one intent-named method per event ("a read finished", "a hold ended", "a
handshake ran"); each method feeds every view of that event, so the views cannot disagree.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Literal, get_args

import numpy as np
from prometheus_client import Counter, Histogram

from . import protocol as P
from .logs import Throttle
from .metrics import Metrics

log = logging.getLogger("kvxferd")

RECENT_S = 10  # the status reply's throughput window
PEER_LABELS = 64  # distinct `peer` label values in Prometheus; later peers count as "other"

# expired: the prefill's hold could not be vouched for through the READ (leases.py)
# forbidden: its blocks are not all granted by the hold it names, or its read token is not the hold's
FailureKind = Literal["handshake", "plan", "transfer", "deadline", "engine_gone", "shutdown", "integrity",
                      "expired", "internal", "forbidden"]
DigestWhere = Literal["hold", "audit", "read"]  # prefill at hold, prefill answering, decode checking
HoldOutcome = Literal["sent", "expired", "dropped"]
# unauthorized: from a NIXL agent that never handshook for the engine it names (dropped)
NotificationKind = Literal["consumer", "early", "unknown", "malformed", "unauthorized"]
ProbeOutcome = Literal["alive", "epoch_unknown", "engine_gone", "restarted", "no_answer"]
PeerState = Literal["handshaking", "ready", "retired"]
RetireReason = Literal["posting_failed", "silent", "engine_gone", "restarted", "idle", "revoked"]
PEER_STATES: tuple[PeerState, ...] = get_args(PeerState)
RETIRE_REASONS: tuple[RetireReason, ...] = get_args(RetireReason)
RpcOutcome = Literal["ok", "error"]


class _ReadSeries:
    """One peer label's per-read series on one lane, looked up once (a `labels()` call costs
    ~2 us, and a read touches four of them)."""

    __slots__ = ("received", "received_bytes", "received_seconds")

    def __init__(self, m: Metrics, peer: str, lane: str) -> None:
        self.received = m.transfers.labels(peer, lane, "received")
        self.received_seconds = m.transfer_seconds.labels(peer, lane, "received")
        self.received_bytes = m.transfer_bytes.labels(peer, lane)


class Recorder:
    def __init__(self) -> None:
        self.metrics = Metrics()
        self.counters = P.Counters()
        self.failures: deque[P.FailureRecord] = deque(maxlen=64)
        self._reads: deque[tuple[float, int]] = deque(maxlen=4096)  # (finish time, bytes) of recent reads
        self._rpc_to_post: deque[float] = deque(maxlen=8192)  # seconds
        self._rpc_to_completion: deque[float] = deque(maxlen=8192)
        self._nixl_post: deque[float] = deque(maxlen=8192)
        self._peer_labels: set[str] = set()
        self._read_series: dict[tuple[str, str], _ReadSeries] = {}  # by peer label and lane
        self._descriptors: dict[str, Histogram] = {}  # by peer label: at most PEER_LABELS + 1
        # by (method, outcome): method names are the protocol's, a bounded set
        self._rpc_series: dict[tuple[str, RpcOutcome], tuple[Counter, Histogram]] = {}
        self._accept_failed = Throttle(1.0)
        for state in PEER_STATES:  # every series from the start: dashboards and alerts see zeros
            self.metrics.peers.labels(state).set(0)
        for reason in RETIRE_REASONS:
            self.metrics.peers_retired.labels(reason)
        for outcome in get_args(ProbeOutcome):
            self.metrics.peer_probes.labels(outcome)

    def _peer(self, peer: str) -> str:
        """The peer's label: its engine id for the first PEER_LABELS peers, then "other", so the
        number of series stays bounded however many peers a daemon meets."""
        if peer in self._peer_labels:
            return peer
        if len(self._peer_labels) < PEER_LABELS:
            self._peer_labels.add(peer)
            return peer
        return "other"

    def _reads_of(self, peer: str, lane: str) -> _ReadSeries:
        label = self._peer(peer)
        series = self._read_series.get((label, lane))
        if series is None:
            series = self._read_series[label, lane] = _ReadSeries(self.metrics, label, lane)
        return series

    # --- engine connections ---------------------------------------------------
    def rpc_answered(self, method: str, outcome: RpcOutcome, seconds: float) -> None:
        series = self._rpc_series.get((method, outcome))
        if series is None:
            series = self._rpc_series[method, outcome] = (self.metrics.rpc.labels(method, outcome),
                                                          self.metrics.rpc_seconds.labels(method))
        series[0].inc()
        series[1].observe(seconds)

    def request_forbidden(self, method: str) -> None:
        self.counters.forbidden += 1
        self.metrics.forbidden.labels(method).inc()

    def connection_refused(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    def accept_failed(self, exc: OSError) -> None:
        """The engine socket could not accept (out of fds or memory): counted, logged at most
        once a second (a flood fails thousands of times)."""
        name = errno.errorcode.get(exc.errno or 0, "other")
        self.metrics.accept_errors.labels(name).inc()
        if self._accept_failed.due():
            log.warning("engine socket: accept failed (%s); retrying with backoff", exc)

    def engines_changed(self, ranks: int, engines: int, registered_bytes: int) -> None:
        self.metrics.ranks.set(ranks)
        self.metrics.engines.set(engines)
        self.metrics.registered_bytes.set(registered_bytes)

    # --- reads ----------------------------------------------------------------
    def reads_now(self, in_flight: int, quarantined: int) -> None:
        self.metrics.inflight.set(in_flight)
        self.metrics.quarantined.set(quarantined)

    def read_quarantined(self) -> None:
        self.counters.quarantined += 1
        self.metrics.quarantines.inc()

    def read_posted(self, peer: str, descriptors: int, notifications: int, since_rpc_s: float,
                    slices: int = 0) -> None:
        """`slices`: how many lanes the read was split across (0: posted whole)."""
        if slices:
            self.counters.split_reads += 1
            self.metrics.split_reads.inc()
            self.metrics.read_slices.inc(slices)
        label = self._peer(peer)
        histogram = self._descriptors.get(label)
        if histogram is None:
            histogram = self._descriptors[label] = self.metrics.descriptors.labels(label)
        histogram.observe(descriptors)
        self.metrics.notifs_sent.inc(notifications)
        self.metrics.read_post.observe(since_rpc_s)
        self._rpc_to_post.append(since_rpc_s)

    def read_expected(self) -> None:
        self.metrics.reads_expected.inc()

    def claims_asked(self, n: int, answered: bool) -> None:
        self.metrics.lease_claims.labels("asked", "answered" if answered else "unanswered").inc(n)

    def claims_now(self, n: int) -> None:
        self.metrics.claims_open.set(n)

    def claims_answered(self, n: int) -> None:
        self.metrics.lease_claims.labels("answered", "ok").inc(n)

    def nixl_timed(self, post_s: float, transfer_s: float) -> None:
        self.metrics.nixl_post.observe(post_s)
        self._nixl_post.append(post_s)
        self.metrics.nixl_xfer.observe(transfer_s)

    def read_received(self, peer: str, lane: str, nbytes: int, seconds: float, since_rpc_s: float) -> None:
        self.counters.received += 1
        series = self._reads_of(peer, lane)
        series.received.inc()
        series.received_seconds.observe(seconds)
        series.received_bytes.inc(nbytes)
        self._rpc_to_completion.append(since_rpc_s)
        self._reads.append((time.time(), nbytes))

    def peer_rate(self, peer: str, memory: str, bytes_per_s: float) -> None:
        self.metrics.peer_rate.labels(self._peer(peer), memory).set(bytes_per_s)

    def read_failed(self, peer: str, lane: str, kind: FailureKind, seconds: float, failure: P.FailureRecord) -> None:
        self.counters.failed += 1
        self.metrics.transfers.labels(self._peer(peer), lane, "failed").inc()
        self.metrics.transfer_seconds.labels(self._peer(peer), lane, "failed").observe(seconds)
        self.metrics.transfer_failures.labels(self._peer(peer), kind).inc()
        self.failures.append(failure)
        log.warning("transfer failed: engine=%s rank=%d request=%s peer=%s reason=%s", failure.engine,
                    failure.rank, failure.request, peer, failure.reason,
                    extra={"fields": {f: getattr(failure, f) for f in failure.__struct_fields__}})

    def digested(self, where: DigestWhere, nbytes: int, seconds: float) -> None:
        self.metrics.digested_bytes.labels(where).inc(nbytes)
        self.metrics.digest_seconds.labels(where).observe(seconds)

    def audit_ended(self, corrupt_blocks: int, unanswered: bool = False) -> None:
        """A read was checked against the prefill's digests (`corrupt_blocks` local blocks
        failed), or could not be (`unanswered`: not held any more, no digests, no answer)."""
        self.metrics.audits.labels("unanswered" if unanswered else "corrupt" if corrupt_blocks else "ok").inc()
        if corrupt_blocks:
            self.counters.integrity_failures += 1
            self.metrics.corrupt_blocks.inc(corrupt_blocks)

    # --- holds and notifications ----------------------------------------------
    def holds_now(self, held: int, oldest_age_s: float | None = None) -> None:
        self.metrics.held.set(held)
        if oldest_age_s is not None:
            self.metrics.held_oldest.set(oldest_age_s)

    def hold_ended(self, outcome: HoldOutcome) -> None:
        if outcome == "sent":
            self.counters.sent += 1
        elif outcome == "expired":
            self.counters.expired += 1
        self.metrics.holds_finished.labels(outcome).inc()

    def notices_lost(self, n: int) -> None:
        self.metrics.notifs_lost.inc(n)

    def serve_request(self, way: Literal["sent", "received"]) -> None:
        self.metrics.serve_requests.labels(way).inc()

    def serving_unasked(self, unasked: Callable[[], bool]) -> None:
        """Where `kvxferd_serving_unasked` is read from, on each scrape."""
        self.metrics.serving_unasked.set_function(lambda: float(unasked()))

    def notification_received(self, kind: NotificationKind) -> None:
        if kind in ("unknown", "malformed"):
            self.counters.unknown_notifs += 1
        elif kind == "unauthorized":
            self.counters.unauthorized_notifs += 1
        self.metrics.notifs_received.labels(kind).inc()

    def early_notifications_dropped(self, count: int) -> None:
        """Consumers that finished for a hold that never came, forgotten after the longest lease."""
        self.counters.unknown_notifs += count

    # --- peers ----------------------------------------------------------------
    def handshake_ran(self, peer: str, seconds: float, failure: str = "") -> None:
        if failure:
            self.counters.handshake_failures += 1
            self.metrics.handshakes.labels(self._peer(peer), "failed").inc()
            self.metrics.handshake_failures.labels(failure).inc()
        else:
            self.counters.handshakes += 1
            self.metrics.handshakes.labels(self._peer(peer), "ok").inc()
            self.metrics.handshake_seconds.observe(seconds)

    def peers_now(self, handshaking: int, ready: int, retired: int, remote_agents: int) -> None:
        for state, count in zip(PEER_STATES, (handshaking, ready, retired)):
            self.metrics.peers.labels(state).set(count)
        self.metrics.remote_agents.set(remote_agents)

    def peer_retired(self, reason: RetireReason) -> None:
        self.counters.peers_retired += 1
        self.metrics.peers_retired.labels(reason).inc()

    def peer_probed(self, outcome: ProbeOutcome) -> None:
        self.metrics.peer_probes.labels(outcome).inc()

    def handshake_answered(self, outcome: str) -> None:
        self.metrics.handshakes_served.labels(outcome).inc()

    def peer_refused_at_auth(self) -> None:
        self.counters.unauthenticated_peers += 1
        self.metrics.handshakes_served.labels("unauthenticated").inc()

    def misattributed(self, kind: str) -> None:
        """A side-channel request of `kind` named a requester its CurveZMQ key is not (identity.py)."""
        self.counters.misattributed += 1
        self.metrics.handshakes_served.labels("misattributed").inc()

    # --- status ---------------------------------------------------------------
    def recent(self) -> P.Recent:
        since = time.time() - RECENT_S
        nbytes = [b for ts, b in self._reads if ts >= since]
        return P.Recent(RECENT_S, len(nbytes), sum(nbytes), sum(nbytes) / RECENT_S)

    def latency(self) -> P.Latency:
        return P.Latency(_percentiles(self._rpc_to_post), _percentiles(self._rpc_to_completion),
                         _percentiles(self._nixl_post))


def _percentiles(samples: deque[float]) -> P.Percentiles:
    if not samples:
        return P.Percentiles(0)
    us = np.fromiter(samples, dtype=np.float64) * 1e6
    return P.Percentiles(len(us), float(np.percentile(us, 50)), float(np.percentile(us, 99)))
