"""The standing side-channel link (sidelink.py) against a real ROUTER (handshake.HandshakeServer):
replies matched by seq whatever their order, an older daemon's refusal taken for the oldest
request, silence bounded by the timeout, and links capped."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq.asyncio

from kvxferd import handshake as hs
from kvxferd import sidelink


def lease(seq: int) -> hs.LeaseRequest:
    return hs.LeaseRequest(hs.LEASE_VERSION, seq, "decode-agent", 1.0, [hs.Claimed("p", 0, f"r{seq}")])


@contextlib.asynccontextmanager
async def linked(answer) -> AsyncIterator[sidelink.Link]:
    """A link to a real side-channel server answering with `answer`."""
    ctx = zmq.asyncio.Context()
    server = hs.HandshakeServer(ctx, "127.0.0.1", 0, answer)
    task = asyncio.create_task(server.run())
    links = sidelink.Links(ctx, None)
    try:
        yield links.to("127.0.0.1", server.port)
    finally:
        links.close()
        task.cancel()
        server.close()
        ctx.term()


@contextlib.asynccontextmanager
async def linked_to_router() -> AsyncIterator[tuple[sidelink.Link, zmq.Socket]]:
    """A link to a plain ROUTER that the test drives itself (synchronously, so the loop stands
    still while it does)."""
    ctx = zmq.asyncio.Context()
    sync = zmq.Context()
    router = sync.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    links = sidelink.Links(ctx, None)
    try:
        yield links.to("127.0.0.1", port), router
    finally:
        links.close()
        router.close(0)
        sync.term()
        ctx.term()


def test_replies_are_matched_by_seq_whatever_their_order():
    async def main():
        async def slow_first(req):  # the first request is answered last
            await asyncio.sleep(0.2 if req.seq == 1 else 0.0)
            return hs.LeaseReply(True, seq=req.seq, answers=[hs.ClaimAnswer("held", float(req.seq))])

        async with linked(slow_first) as link:
            replies = await asyncio.gather(*(link.ask(lease(s), 5.0) for s in (1, 2, 3)))
            assert [r.answers[0].granted_s for r in replies] == [1.0, 2.0, 3.0]
            assert not link.waiting

    asyncio.run(main())


def test_an_older_daemons_refusal_answers_the_oldest_request():
    async def main():
        # a daemon before side-channel version 3 cannot decode the request: it refuses, without seq
        async with linked(lambda req: hs.HandshakeReply(False, "malformed side-channel request")) as link:
            reply = await link.ask(lease(7), 5.0)
            assert not reply.ok and "malformed" in reply.reason

    asyncio.run(main())


def test_a_silent_peer_times_out_and_links_are_capped(monkeypatch):
    async def main():
        ctx = zmq.asyncio.Context()
        silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        links = sidelink.Links(ctx, None)
        try:
            with pytest.raises(hs.HandshakeError, match="no lease answer"):
                await links.to("127.0.0.1", port).ask(lease(1), 0.2)
            monkeypatch.setattr(sidelink, "MAX_LINKS", 2)
            links.to("127.0.0.1", 1)
            links.to("127.0.0.1", 2)  # the first link (idle) makes room
            assert len(links) == 2
            waiting = asyncio.ensure_future(links.to("127.0.0.1", port).ask(lease(2), 5.0))
            await asyncio.sleep(0.05)
            other = asyncio.ensure_future(links.to("127.0.0.1", 3).ask(lease(3), 5.0))
            await asyncio.sleep(0.05)
            with pytest.raises(hs.HandshakeError, match="have lease requests waiting"):
                links.to("127.0.0.1", 4)  # both links wait for replies: none is closed under them
            waiting.cancel()
            other.cancel()
        finally:
            links.close()
            silent.close(0)
            ctx.term()

    asyncio.run(main())


def test_a_request_is_on_the_wire_when_ask_returns():
    """`ask` sends before it returns: a caller about to hold the loop (a large READ, copied inside
    its post) has its claim answered meanwhile. The peer here is a plain ROUTER the test drives
    while the loop stands still."""
    async def main():
        async with linked_to_router() as (link, router):
            reply = link.ask(lease(9), 5.0)
            assert router.poll(5000), "the request was not sent when ask returned"  # the loop never ran
            ident, empty, body = router.recv_multipart()
            assert msgspec.msgpack.decode(body, type=hs.LeaseRequest) == lease(9)
            router.send_multipart([ident, empty, hs.encode(hs.LeaseReply(True, seq=9))])
            assert await asyncio.wait_for(reply, 5.0) == hs.LeaseReply(True, seq=9)
            await asyncio.sleep(0)
            assert not link.waiting  # answered: nothing left waiting

    asyncio.run(main())


def test_take_ready_takes_what_waits_and_the_reader_what_comes_after():
    """Replies already in the socket are taken by `take_ready` with the loop standing still, each
    once (the reader task awaits the same socket); a burst of an older daemon's refusals without
    seq answers the oldest unanswered requests, one each; a reply that comes later still reaches
    the reader task; a closed link takes nothing."""
    async def main():
        async with linked_to_router() as (link, router):
            replies = [link.ask(lease(seq), 5.0) for seq in (1, 2, 3, 4)]
            await asyncio.sleep(0)  # the reader task now waits on the socket
            for _ in replies:
                assert router.poll(5000)
                ident, _empty, _body = router.recv_multipart()
            for reply in (hs.LeaseReply(True, seq=2), hs.LeaseReply(False, reason="x"),
                          hs.LeaseReply(False, reason="y")):
                router.send_multipart([ident, b"", hs.encode(reply)])
            for _ in range(500):  # until all three arrived (the loop stands still: nobody else takes them)
                link.take_ready()
                if replies[2].done():
                    break
                time.sleep(0.01)
            assert [r.done() for r in replies] == [True, True, True, False]
            assert (replies[0].result().reason, replies[1].result().seq, replies[2].result().reason) == ("x", 2, "y")
            router.send_multipart([ident, b"", hs.encode(hs.LeaseReply(True, seq=4))])
            assert (await asyncio.wait_for(replies[3], 5.0)).seq == 4
            await asyncio.sleep(0)
            assert not link.waiting and link.malformed == 0
        link.take_ready()  # closed with its Links: nothing to take, nothing raised

    asyncio.run(main())


def test_replies_take_ready_leaves_still_reach_the_reader():
    """`take_ready` takes at most one reply more than it waits for (a flooding peer is left to
    the reader task). A reply queued behind more stale replies than that still reaches its
    request, with no other request sent to wake the socket."""
    async def main():
        async with linked_to_router() as (link, router):
            reply = link.ask(lease(5), 5.0)
            await asyncio.sleep(0)  # the reader task now waits on the socket
            assert router.poll(5000)
            ident, _empty, _body = router.recv_multipart()
            for seq in (101, 102, 103, 5):  # answers to requests long given up, then ours
                router.send_multipart([ident, b"", hs.encode(hs.LeaseReply(True, seq=seq))])
            for _ in range(500):  # they arrive (the loop stands still: nobody takes them)
                if link._now.poll(0):
                    break
                time.sleep(0.01)
            time.sleep(0.3)  # the rest of them too
            link.take_ready()  # takes two of them: one more than the one request waiting
            assert not reply.done()
            assert (await asyncio.wait_for(reply, 2.0)).seq == 5

    asyncio.run(main())


def test_a_reply_that_cannot_be_read_is_logged_and_its_claim_times_out(caplog):
    """A peer answering garbage: each dropped reply is counted, the first logged (then every
    1,000th, so it cannot flood the log), and the request still ends, by its timeout."""
    async def main():
        async with linked_to_router() as (link, router):
            replies = [link.ask(lease(seq), 3.0) for seq in (1, 2)]
            for _ in replies:
                assert router.poll(5000)
                ident, empty, _body = router.recv_multipart()
                router.send_multipart([ident, empty, b"\xc1 not msgpack"])
            for _ in range(1000):  # both dropped before either request times out
                if link.malformed == 2:
                    break
                await asyncio.sleep(0.005)
            assert link.malformed == 2
            for reply in replies:
                with pytest.raises(hs.HandshakeError, match="no lease answer"):
                    await reply

    with caplog.at_level("WARNING", logger="kvxferd"):
        asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if "lease reply from" in r.getMessage()]
    assert len(dropped) == 1 and "dropped (1 so far)" in dropped[0], dropped


def test_a_peer_that_takes_nothing_more_is_refused_at_once():
    """Nothing listens at the address: ZMQ queues requests up to its high-water mark, then
    refuses the send. That refusal is raised by `ask` (before, it was left on an unawaited
    future and the claim waited for its timeout); the requests queued wait for theirs."""
    async def main():
        ctx = zmq.asyncio.Context()
        with socket_nobody_listens() as port:
            links = sidelink.Links(ctx, None)
            link = links.to("127.0.0.1", port)
            link.sock.setsockopt(zmq.SNDHWM, 4)  # new pipes only: the refusal comes within a few sends
            try:
                waiting = []
                with pytest.raises(hs.HandshakeError) as refused:
                    for seq in range(1, sidelink.MAX_WAITING):
                        waiting.append(link.ask(lease(seq), 60.0))
                assert refused.value.reason == "unreachable"
                assert len(waiting) < sidelink.MAX_WAITING - 1
                assert len(link.waiting) == len(waiting)  # the refused one is not left waiting
            finally:
                links.close()
                ctx.term()

    asyncio.run(main())


@contextlib.contextmanager
def socket_nobody_listens():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # reserved, never listened on: connections are refused
    try:
        yield s.getsockname()[1]
    finally:
        s.close()
