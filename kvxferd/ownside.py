"""This daemon's own side channel, for reads between two engines registered with it.

A same-node read (peers.py, a local Peer) asks what any read asks of the prefill's daemon (its
handshake, lease claims, notices, audits, probes), but that daemon is this one: each request is
answered in-process by the function that answers the side channel (`Daemon._answer_side_channel`),
with no socket, no CurveZMQ key of its own to authorize, and no advertised address that must
reach back (one behind NAT may not).

    is_address(host, port)  the address a read names is this daemon's own
    answer(request)         its reply (an audit's may be awaitable); None for a notice
    SelfLink                a `sidelink.Link` of this daemon to itself: claims and notices in
                            order, each answered on the next loop turn (or at `take_ready`)
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from . import handshake as hs

log = logging.getLogger("kvxferd")

Answer = Callable[[hs.SideRequest], hs.SideReply | Awaitable[hs.SideReply] | None]
R = TypeVar("R", hs.HandshakeReply, hs.AuditReply, hs.ProbeReply)


@dataclass(frozen=True)
class OwnSide:
    is_address: Callable[[str, int], bool]
    answer: Answer

    async def ask(self, req: hs.SideRequest, kind: type[R]) -> R:
        """A request that is answered (handshake, audit, probe), answered here; HandshakeError
        when the answer is not of `kind`."""
        answer = self.answer(req)
        reply = answer if answer is None or isinstance(answer, hs.SideReply) else await answer
        if not isinstance(reply, kind):
            raise hs.HandshakeError("malformed", f"this daemon answered a {req.__struct_config__.tag} request "
                                                 f"with {type(reply).__name__}")
        return reply


class SelfLink:
    """A link to this daemon's own side channel (see the module): what leases and notices use of
    `sidelink.Link` (ask, tell, take_ready)."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self._queue: deque[tuple[hs.SideRequest, asyncio.Future[hs.LeaseReply] | None]] = deque()
        self._closed = False

    def ask(self, req: hs.LeaseRequest, timeout_s: float) -> asyncio.Future[hs.LeaseReply]:
        fut: asyncio.Future[hs.LeaseReply] = asyncio.get_running_loop().create_future()
        self._put(req, fut)
        return fut

    def tell(self, req: hs.NoticeRequest | hs.ServeRequest) -> None:
        self._put(req, None)

    def _put(self, req: hs.SideRequest, fut: asyncio.Future[hs.LeaseReply] | None) -> None:
        """Answered after the caller's turn, as a reply off a socket would be: the caller's state
        is settled before the answer changes the holds it reads."""
        if self._closed:  # the daemon stops: nothing is answered by its holds any more
            raise hs.HandshakeError("unreachable", "this daemon is stopping")
        if not self._queue:
            asyncio.get_running_loop().call_soon(self.take_ready)
        self._queue.append((req, fut))

    def take_ready(self) -> None:
        """Answer every request waiting, in order."""
        try:
            while self._queue:
                self._take(*self._queue.popleft())
        finally:  # whatever escaped one answer, the requests after it are still answered
            if self._queue:
                asyncio.get_running_loop().call_soon(self.take_ready)

    def _take(self, req: hs.SideRequest, fut: asyncio.Future[hs.LeaseReply] | None) -> None:
        try:
            reply = self._answer(req)
        except Exception as exc:  # as the side channel's server does: one request's defect is its own
            log.exception("answering this daemon's own %s request failed", req.__struct_config__.tag)
            reply = hs.LeaseReply(False, f"internal error: {type(exc).__name__}: {exc}")
        if fut is None or fut.done():
            return
        if isinstance(reply, hs.LeaseReply):
            fut.set_result(reply)
        else:
            fut.set_exception(hs.HandshakeError("invalid", f"this daemon answered a lease request with {reply!r}"))
            fut.exception()

    def close(self) -> None:
        self._closed = True
        queued, self._queue = self._queue, deque()
        for _, fut in queued:
            if fut is not None and not fut.done():
                fut.set_exception(hs.HandshakeError("unreachable", "this daemon is stopping"))
                fut.exception()
