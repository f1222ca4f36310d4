"""Prefill side of the daemon: held requests, consumer notifications, leases, and the
handshake server that tells decode daemons what memory an engine has.

    hold(R, lease) -> held;  notification from each consumer: count++
    count == expected -> "sent";  lease passes -> "expired"
"""

from __future__ import annotations

import logging
import time

from . import handshake as hs
from . import protocol as P
from .state import Held, RequestError, decode_notif

log = logging.getLogger("kvxferd")


class PrefillSide:
    """Mixed into Daemon; uses its engines, holds, early_notifs, metrics, counters, cfg, nixl."""

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
