"""Decode side: telling prefill daemons that reads of their holds are done, on the side channel.

A READ that carries a NIXL notification completes only once the serving daemon's UCX worker
has progressed (the notification is an active message on UCX's TCP lane, and the READ's handle
waits for it; measured: over CMA, with the serving daemon ticking every 50 ms, a 16-block READ
took 47 ms with one and 0.09-0.24 ms without). So READs to a daemon that takes notices
(`HandshakeReply.notices`) carry none; the read's notifications follow once it is done:

    READ posted (no notification) ── DONE, seen by this daemon alone
        └─ tell(host, port, notifications) ─ queued; within BATCH_S one NoticeRequest per peer
           daemon on its link (sidelink.py), not answered ─> the prefill daemon counts them
           (holds.py)

Notices travel behind the lease claims asked before them on the same connection. One that
cannot be sent (the peer's queue full, no route) is counted and logged; the hold it would have
ended lives until its lease (the prefill engine gets its blocks back then, as after a lost NIXL
notification).

To a daemon that serves on request (side-channel version 5, serving.py) notices go as version
5, which tells it that this daemon asks for its progress when a READ needs it: `serve` sends
that request at once, not batched (the READ waits on it), at most every SERVE_S / 2 per peer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import zmq

from . import handshake as hs
from .logs import Throttle
from .recorder import Recorder
from .sidelink import Links

if TYPE_CHECKING:
    from .peers import Peer

log = logging.getLogger("kvxferd")

# Notices wait this long to leave together: the prefill daemon answers its side channel one
# message a loop turn, so a message per read would queue the lease claims behind them (measured
# at 256 reads in flight: the claims' answers, and so the reads' completions, came ~200 ms late).
# A hold ends this much later; its lease is seconds.
BATCH_S = 0.005
WARN_S = 10.0  # notices to a peer that could not be sent are logged at most this often
SERVE_S = 1.0  # a serve request asks for this much of the peer's progress; asked again at half


class Notices:
    """Notifications waiting to leave, by peer daemon side channel."""

    def __init__(self, links: Links, recorder: Recorder, requester: str) -> None:
        self._links, self._recorder, self._requester = links, recorder, requester
        self._queued: dict[tuple[str, int, str, int], list[hs.Notification]] = {}  # by peer daemon and version
        self._flushing = False
        self._closed = False
        self._warned = Throttle(WARN_S)  # notices lost, by peer

    def tell(self, peer: Peer, notifications: list[hs.Notification]) -> None:
        """Send these to `peer`'s daemon within BATCH_S, as a NoticeRequest of the version that
        says whether we ask for its progress (5, to a daemon that serves on request)."""
        if not notifications:
            return
        if self._closed:  # the daemon is stopping: its links are gone
            self._lost(peer.host, peer.port, len(notifications), "the daemon is stopping")
            return
        version = hs.SERVE_VERSION if peer.serves_on_request else hs.NOTICE_VERSION
        self._queued.setdefault((peer.host, peer.port, peer.server, version), []).extend(notifications)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_later(BATCH_S, self._flush)

    def close(self) -> bool:
        """The daemon is stopping: send what waits now, nothing after. True when something was
        sent (the caller gives the links a moment before closing them: they close with LINGER 0)."""
        self._closed = True
        sent = bool(self._queued)
        self._flush()
        return sent

    def _flush(self) -> None:
        self._flushing = False
        queued, self._queued = self._queued, {}
        for (host, port, server, version), notifications in queued.items():
            for i in range(0, len(notifications), hs.MAX_CLAIMS):
                self._send(host, port, server, notifications[i:i + hs.MAX_CLAIMS], version)

    def serve(self, peer: Peer, now: float) -> None:
        """A READ of `peer`'s memory may need its daemon's progress (it is running, not done once
        posted; called on every check of one): ask for SERVE_S of it, if that daemon serves on
        request (one that does not progresses unasked) and was not asked (or tried: a peer whose
        queue is full must not cost every check a failed send) within SERVE_S / 2."""
        if self._closed or not peer.serves_on_request or now - peer.serve_asked < SERVE_S / 2:
            return
        peer.serve_asked = now
        try:
            self._links.to(peer.host, peer.port, peer.server).tell(
                hs.ServeRequest(hs.SERVE_VERSION, self._requester, SERVE_S))
        except (hs.HandshakeError, zmq.ZMQError, OSError) as exc:  # the READ goes on; the peer's pace serves it
            if self._warned.due(("serve", peer.host, peer.port)):
                log.warning("serve request to %s not sent: %s", peer.address, exc)
            return
        self._recorder.serve_request("sent")

    def _send(self, host: str, port: int, server: str, chunk: list[hs.Notification], version: int) -> None:
        try:
            self._links.to(host, port, server).tell(hs.NoticeRequest(version, self._requester, chunk))
        except Exception as exc:  # whatever one peer's address does, the others' notices still go
            if not isinstance(exc, hs.HandshakeError):
                log.error("notices to %s:%d failed unexpectedly", host, port, exc_info=exc)
            self._lost(host, port, len(chunk), str(exc))

    def _lost(self, host: str, port: int, n: int, why: str) -> None:
        self._recorder.notices_lost(n)
        if self._warned.due((host, port)):
            log.warning("%d notifications to %s:%d not sent (their holds end with their leases): %s",
                        n, host, port, why)
