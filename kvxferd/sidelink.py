"""One standing side-channel connection per peer daemon, for requests made often (lease claims,
notices).

A handshake or an audit opens a REQ socket for its one question; claims go out many times a
second, so each peer daemon's address gets one DEALER socket that stays, with requests told
apart by `seq`:

    Link.ask(LeaseRequest(seq=7)) -> [b"", request] ---> ROUTER (handshake.HandshakeServer)
                   future[7] <------ [b"", reply(seq=7)]

The ROUTER sees a REQ socket's envelope and answers as it does any request. A daemon that does
not know lease requests answers with a refusal that carries no seq: it answers in order, so
that refusal belongs to the oldest request still waiting.

Replies come off the wire: one that matches no waiting request is dropped, one that cannot
be read too, with a log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import cast

import zmq
import zmq.asyncio

from . import handshake as hs
from .identity import CurveKeys, KeyRefused, PeerKeys
from .ownside import OwnSide, SelfLink

log = logging.getLogger("kvxferd")

# A lease reply of CLAIMS_PER_REQUEST answers that each grant a hold's block lists (a 15,000-block
# hold of three groups: 180 KiB) stays well under this.
MAX_REPLY = 64 << 20
MAX_WAITING = 4096  # requests waiting for their reply on one link; more are refused at once
IDLE_CLOSE_S = 120.0  # a link unused this long is closed (reopened on the next request)
MAX_LINKS = 1024  # peer daemons linked at once: beyond, the least recently used idle link closes


class Link:
    """A DEALER socket to one peer daemon's side channel and the requests waiting on it."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, curve: CurveKeys | None) -> None:
        self.address = f"{host}:{port}"
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
        if curve is not None:
            self.sock.curve_secretkey = curve.secret
            self.sock.curve_publickey = curve.public
            self.sock.curve_serverkey = curve.server_public
        try:
            self.sock.connect(f"tcp://{host}:{port}")
        except zmq.ZMQError:  # an address ZMQ cannot parse (engines name it): the socket must not leak
            self.sock.close(0)
            raise
        self.waiting: OrderedDict[int, asyncio.Future[hs.LeaseReply]] = OrderedDict()  # by seq, oldest first
        self.used = time.monotonic()
        self.malformed = 0  # replies dropped because they could not be read
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)  # the same socket, read without the loop
        self.reader = asyncio.get_running_loop().create_task(self._read())

    def ask(self, req: hs.LeaseRequest, timeout_s: float) -> asyncio.Future[hs.LeaseReply]:
        """Send `req` now, before returning (a caller about to hold the loop has it on the wire
        meanwhile); the future gives the peer's reply. HandshakeError: raised at once when the
        request cannot go out, set on the future when no reply comes within `timeout_s`."""
        self.used = time.monotonic()
        if len(self.waiting) >= MAX_WAITING:
            raise hs.HandshakeError("timeout", f"{MAX_WAITING} requests to {self.address} wait for replies")
        # A NOBLOCK send on an asyncio socket is tried at once; its failure (the peer's queue is
        # full) is set on the returned future, not raised.
        sent = cast("asyncio.Future[object]", self.sock.send_multipart([b"", hs.encode(req)], flags=zmq.NOBLOCK))
        failed = sent.exception() if sent.done() else None
        if failed is not None:
            raise hs.HandshakeError("unreachable", f"side channel to {self.address}: {failed}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[hs.LeaseReply] = loop.create_future()
        self.waiting[req.seq] = fut
        timer = loop.call_later(timeout_s, self._unanswered, req.seq, timeout_s)

        def ended(_: object) -> None:  # answered, timed out, or given up by its asker
            timer.cancel()
            self.waiting.pop(req.seq, None)
        fut.add_done_callback(ended)
        return fut

    def tell(self, req: hs.NoticeRequest | hs.ServeRequest) -> None:
        """Send `req`, which is not answered, now; HandshakeError when it cannot go out (the
        peer's queue is full, or the link closed). After the requests asked before it, in order.
        On the asyncio socket, as `ask`: a send on the raw one may take the socket's wake-up for
        a reply already in, and the reader task would not see it."""
        self.used = time.monotonic()
        if self.sock.closed:
            raise hs.HandshakeError("unreachable", f"link to {self.address} closed")
        sent = cast("asyncio.Future[object]", self.sock.send_multipart([b"", hs.encode(req)], flags=zmq.NOBLOCK))
        failed = sent.exception() if sent.done() else None
        if failed is not None:
            raise hs.HandshakeError("unreachable", f"side channel to {self.address}: {failed}")

    def _unanswered(self, seq: int, timeout_s: float) -> None:
        # A reply already in the socket is taken first: waking from a pause, this timer can run
        # before the reader task (one still in transit is not: the claim is asked again).
        try:
            self.take_ready()
        except Exception as exc:  # whatever happens, the request below still ends
            log.warning("taking lease replies from %s failed: %s", self.address, exc)
        fut = self.waiting.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_exception(hs.HandshakeError("timeout",
                                                f"no lease answer from {self.address} within {timeout_s:g} s"))
            fut.exception()  # retrieved: the asker may have gone

    async def _read(self) -> None:
        while True:
            try:
                parts = await self.sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._take(parts)
            try:  # after the reply is taken (its asker wakes a turn sooner): a ready reply is
                await asyncio.sleep(0)  # received without yielding, and a flood must not hold the loop
            except asyncio.CancelledError:
                return

    def take_ready(self) -> None:
        """Take the replies already in the socket now, without waiting for the loop to see it
        readable (`Leases.take_answers`). The reader task takes whatever comes after: each
        message is received once, by one or the other. At most one more than the requests still
        unanswered: a peer that floods replies is left to the reader task, which yields between
        them."""
        if self.sock.closed:
            return
        for _ in range(sum(not f.done() for f in self.waiting.values()) + 1):
            try:
                parts = self._now.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing there (EAGAIN), or closed
                return
            self._take(parts)
        # Stopped with messages perhaps left: our reads consumed the socket's wake-up, and ZMQ
        # sends none for a queue never read empty. Asking the asyncio socket for its events
        # schedules its reader when input waits (pyzmq), so the reader task takes the rest.
        self.sock.get(zmq.EVENTS)

    def _take(self, parts: list[bytes]) -> None:
        """A reply off the wire to the request waiting for it; what is not one is dropped."""
        if len(parts) != 2 or parts[0] != b"":
            self._malformed("not a reply envelope")
            return
        try:
            reply = hs.lease_reply_decoder.decode(parts[1])
        except hs.DECODE_ERRORS as exc:
            self._malformed(str(exc)[:200])
            return
        # an older daemon's refusal answers the oldest request not answered yet (answered ones
        # leave `waiting` only when their callbacks run: take_ready may take several at once)
        seq = reply.seq if reply.seq else next((s for s, f in self.waiting.items() if not f.done()), None)
        fut = self.waiting.get(seq) if seq is not None else None
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _malformed(self, why: str) -> None:
        """Logged the first time and every 1,000th: a peer that sends only garbage must not
        flood the log. Its requests' claims time out ("no lease answer") and fail closed."""
        self.malformed += 1
        if self.malformed == 1 or self.malformed % 1000 == 0:
            log.warning("lease reply from %s dropped (%d so far): %s", self.address, self.malformed, why)

    def close(self) -> None:
        self.reader.cancel()
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(hs.HandshakeError("unreachable", f"link to {self.address} closed"))
                fut.exception()  # retrieved: the asker may have gone
        self.sock.close(0)


class Links:
    """The standing links, by peer daemon address; this daemon's own address, `own`, is answered
    in-process (ownside.py)."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: PeerKeys | None, own: OwnSide | None = None) -> None:
        self._ctx, self._keys, self._own = ctx, keys, own
        self._links: dict[tuple[str, int, str], Link] = {}  # by address and the daemon key dialed there
        self._self_link: SelfLink | None = None

    def to(self, host: str, port: int, server: str = "") -> Link | SelfLink:
        """The link to a peer daemon, dialing `server` (its public key; "": the key that address
        proved, else the default). HandshakeError when that key is not authorized (any more), or
        when MAX_LINKS links all have requests waiting (engines name the addresses their reads go
        to: they may name many)."""
        if self._own is not None and self._own.is_address(host, port):
            if self._self_link is None:
                self._self_link = SelfLink(self._own.answer)
            return self._self_link
        curve = None
        if self._keys is not None:
            server = server or self._keys.at(host, port)
            curve = self._keys.curve.dialing(server.encode())
        link = self._links.pop((host, port, server), None)
        if link is None:
            if self._keys is not None:
                try:
                    self._keys.authorize(server)
                except KeyRefused as exc:
                    raise hs.HandshakeError("refused", f"{host}:{port}: {exc}") from None
            idle = None
            if len(self._links) >= MAX_LINKS:
                idle = next((k for k, old in self._links.items() if not old.waiting), None)
                if idle is None:
                    raise hs.HandshakeError("unreachable", f"{MAX_LINKS} peer daemons have lease requests waiting")
            link = Link(self._ctx, host, port, curve)  # first: an address that fails evicts nothing
            if idle is not None:
                self._links.pop(idle).close()
        self._links[(host, port, server)] = link  # to the end: the most recently used
        return link

    def get(self, host: str, port: int, server: str = "") -> Link | SelfLink | None:
        """The link to a peer daemon if one is open (none is opened)."""
        if self._self_link is not None and self._own is not None and self._own.is_address(host, port):
            return self._self_link
        if self._keys is not None:
            server = server or self._keys.at(host, port)
        return self._links.get((host, port, server))

    def close_idle(self, now: float) -> None:
        for key in [k for k, link in self._links.items() if not link.waiting and now - link.used > IDLE_CLOSE_S]:
            self._links.pop(key).close()

    def __iter__(self) -> Iterable[Link]:
        return iter(list(self._links.values()))

    def __len__(self) -> int:
        return len(self._links)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        if self._self_link is not None:
            self._self_link.close()
