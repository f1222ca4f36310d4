"""The daemon's components in one process: real NIXL agents (UCX over loopback), a real ZMQ
side channel, real shared memory; no daemon subprocess. A prefill side (engines, holds, the
handshake server) and a decode side (engines, peers, reads) are wired as the daemon wires them,
and every read is checked byte for byte against what the decode engine would hold had it
computed the prompt itself."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import unittest.mock
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import msgspec
import numpy as np
import pytest
import zmq.asyncio

import kvxferd
from kvxferd import handshake as hs
from kvxferd import protocol as P
from kvxferd.engines import EngineRank, Engines
from kvxferd.holds import Holds
from kvxferd.lab.synthetic import testing
from kvxferd.lanes import Lanes
from kvxferd.liveness import Liveness
from kvxferd.memory import create_shm
from kvxferd.nixl_driver import NixlDriver
from kvxferd.notices import Notices
from kvxferd.peers import Peer, Peers
from kvxferd.plan.geometry import Geometry
from kvxferd.plan.models import PRESETS, build
from kvxferd.protocol import RequestError
from kvxferd.reads import Reads
from kvxferd.recorder import Recorder
from kvxferd.sidelink import Links

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64, layers=2)


@dataclass
class Side:
    """One daemon's components and one engine rank registered with them."""

    name: str
    nixl: NixlDriver
    recorder: Recorder
    engines: Engines
    geometry: Geometry
    views: list[np.ndarray] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)
    rank: EngineRank | None = None

    def register(self, engine_id: str) -> EngineRank:
        fds = []
        for size in self.geometry.buffers:
            fd, mm = create_shm(size)
            fds.append(fd)
            self.keep.append(mm)
            self.views.append(np.frombuffer(mm, dtype=np.uint8))
        msg = P.Register(engine_id, self.geometry.tp_rank, self.geometry.tp_size, self.geometry,
                         [P.MemoryHandle("shm", size) for size in self.geometry.buffers])
        self.rank = self.engines.register(msg, fds)
        return self.rank


def side(name: str) -> Side:
    nixl = NixlDriver(name, progress_thread=False)
    recorder = Recorder()
    return Side(name, nixl, recorder, Engines(nixl, recorder), build(SHAPE, 1, 0))


@dataclass
class World:
    prefill: Side
    decode: Side
    holds: Holds
    peers: Peers
    reads: Reads
    port: int
    nixl_notifications: int = 0  # taken off the prefill's NIXL agent (not the side channel)
    notice_versions: list[int] = field(default_factory=list)  # of the notice requests the prefill got
    serve_requests: int = 0  # requests for the prefill's progress

    def remote(self, request_id: str) -> P.RemoteRef:
        return P.RemoteRef("prefill", "127.0.0.1", self.port, 1, request_id)

    def progress(self) -> None:
        """One turn of both daemons' progress loops."""
        for nixl, on_notification in ((self.prefill.nixl, self.holds.on_notification),
                                      (self.decode.nixl, None)):
            for sender, messages in nixl.notifications().items():
                for m in messages:
                    assert on_notification is not None, "the decode side gets no notifications"
                    on_notification(sender, m)
                    self.nixl_notifications += 1
        self.reads.poll(time.monotonic())

    async def completion(self, er: EngineRank, timeout: float = 10) -> P.Completion:
        deadline = time.monotonic() + timeout
        while not er.completions:
            assert time.monotonic() < deadline, "no completion in time"
            self.progress()
            await asyncio.sleep(0.001)
        return er.completions.popleft()


@contextlib.asynccontextmanager
async def make_world(notices: bool = False, peer: int = hs.SERVE_VERSION) -> AsyncIterator[World]:
    """`notices`: the decode side sends notifications on the side channel (notices.py) to a peer
    that takes them; `peer`: the side-channel version the prefill side answers handshakes as
    (below NOTICE_VERSION: a daemon from before notices; below SERVE_VERSION: before serve
    requests)."""
    ctx = zmq.asyncio.Context()
    p, d = side("p"), side("d")
    p.register("prefill")
    d.register("decode")
    holds = Holds(p.engines, p.nixl, p.recorder, max_lease_s=60)
    no_lanes = Lanes(0, 8 << 20, "d", ("UCX",))  # every read posted whole on the daemon's agent
    peers = Peers(ctx, d.nixl, d.recorder, timeout_s=5, keys=None, lanes=no_lanes)
    links = Links(ctx, None)
    reads = Reads(d.nixl, peers, d.recorder, max_deadline_s=60, lanes=no_lanes,
                  notices=Notices(links, d.recorder, d.nixl.name) if notices else None)
    world = World(p, d, holds, peers, reads, 0)

    def answer(req: hs.SideRequest) -> hs.SideReply | None:  # (no audits or leases here)
        if isinstance(req, hs.ProbeRequest):
            return p.engines.answer_probe(req)
        if isinstance(req, hs.NoticeRequest):
            world.notice_versions.append(req.version)
            holds.take_notices(req)
            return None
        if isinstance(req, hs.ServeRequest):
            world.serve_requests += 1
            return None
        assert isinstance(req, hs.HandshakeRequest)
        reply = holds.answer_handshake(req)
        return msgspec.structs.replace(reply, notices=reply.notices if peer >= hs.NOTICE_VERSION else 0,
                                       serve=reply.serve if peer >= hs.SERVE_VERSION else 0)
    server = hs.HandshakeServer(ctx, "127.0.0.1", 0, answer)
    task = asyncio.create_task(server.run())
    world.port = server.port
    try:
        yield world
    finally:
        task.cancel()
        server.close()
        links.close()
        peers.close()
        for s in (p, d):
            for er in s.engines.all():
                s.engines.release(er)
        ctx.term()


async def wait_until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        await asyncio.sleep(0.01)


def in_world(scenario: Callable[[World], Awaitable[None]]) -> Callable[[], None]:
    """A test: the scenario runs on a fresh world on its own event loop."""
    def test() -> None:
        async def main() -> None:
            async with make_world() as w:
                await scenario(w)
        asyncio.run(main())
    test.__name__ = scenario.__name__
    test.__doc__ = scenario.__doc__
    return test


def prompt(w: World, seq: int, num_tokens: int) -> tuple[testing.Sequence, testing.Sequence]:
    """The prompt computed on the prefill side, and where the decode side wants it."""
    need = testing.blocks_needed(w.prefill.geometry, num_tokens)
    p_seq = testing.Sequence(seq, num_tokens, tuple(tuple(range(n)) for n in need))
    d_seq = testing.Sequence(seq, num_tokens, tuple(tuple(range(40, 40 + n)) for n in need))
    testing.fill_sequence(w.prefill.views, w.prefill.geometry, p_seq)
    return p_seq, d_seq


def read_msg(w: World, request_id: str, p_seq: testing.Sequence, d_seq: testing.Sequence,
             deadline_s: float = 10.0) -> P.Read:
    return P.Read("decode", 0, request_id, w.remote(request_id), p_seq.num_tokens,
                  [list(b) for b in d_seq.blocks], [list(b) for b in p_seq.blocks], deadline_s)


def expected(w: World, d_seq: testing.Sequence) -> list[np.ndarray]:
    chunks = [g.tokens_per_page for g in w.decode.geometry.groups]
    return testing.expect_after_read([v.copy() for v in w.decode.views], w.decode.geometry, d_seq,
                                     [0] * len(d_seq.blocks), chunks)


@in_world
async def test_read_handshakes_once_then_posts_from_the_cached_route(w: World) -> None:
    p_er, d_er = w.prefill.rank, w.decode.rank
    assert p_er is not None and d_er is not None
    for i, num_tokens in enumerate((37, 64)):
        p_seq, d_seq = prompt(w, i, num_tokens)
        want = expected(w, d_seq)
        w.holds.hold(p_er, P.Hold("prefill", 0, f"r{i}", 30.0, [list(b) for b in p_seq.blocks]))
        w.reads.start(d_er, read_msg(w, f"r{i}", p_seq, d_seq), time.perf_counter())
        if i == 1:  # the route is cached: posted inside start(), no task, no await
            assert [r.request for r in w.reads.status(time.monotonic(), 10)] == ["r1"]
            assert w.reads.uses_engine(d_er) == 1
        done = await w.completion(d_er)
        assert (done.status, done.block_ids, done.reason) == ("received", [], "")
        assert testing.check(w.decode.views, want, w.decode.geometry) == []
        sent = await w.completion(p_er)
        assert (sent.request_id, sent.status) == (f"r{i}", "sent")
    assert w.decode.recorder.counters.handshakes == 1
    assert w.decode.recorder.counters.received == 2
    assert w.prefill.recorder.counters.sent == 2
    assert w.reads.uses_engine(d_er) == 0
    (peer,) = w.peers.status(w.reads.uses_peer)
    assert (peer.engine, peer.plans, peer.active, peer.ranks) == ("prefill", 1, 0, [0])


@pytest.mark.parametrize("peer", [hs.SERVE_VERSION, hs.NOTICE_VERSION, 0])
def test_a_reads_notification_goes_on_the_side_channel_to_a_peer_that_takes_notices(peer: int) -> None:
    """To a peer daemon that takes notices, the READ carries no NIXL notification (with one, it
    completes only once that daemon progresses: notices.py) and the consumer's notice follows
    on the side channel, as version 5 to a daemon that serves on request; to a daemon from before
    notices, the READ carries it. Either way the bytes arrive and the hold ends `sent`. Over CMA
    a READ on an endpoint wired up already is done once posted: it asks nothing of the peer."""
    async def main() -> None:
        async with make_world(notices=True, peer=peer) as w:
            p_er, d_er = w.prefill.rank, w.decode.rank
            assert p_er is not None and d_er is not None
            for seq, rid in ((1, "n1"), (4, "n2")):
                asked = w.serve_requests  # the first READ's wire-up may ask
                await asyncio.sleep(0.6)  # past SERVE_S / 2: a request would not be held back
                p_seq, d_seq = prompt(w, seq, 40)
                want = expected(w, d_seq)
                w.holds.hold(p_er, P.Hold("prefill", 0, rid, 30.0, [list(b) for b in p_seq.blocks]))
                w.reads.start(d_er, read_msg(w, rid, p_seq, d_seq), time.perf_counter())
                done = await w.completion(d_er)
                assert (done.status, done.reason) == ("received", "")
                assert testing.check(w.decode.views, want, w.decode.geometry) == []
                sent = await w.completion(p_er)
                assert (sent.request_id, sent.status) == (rid, "sent")
            assert w.nixl_notifications == (0 if peer >= hs.NOTICE_VERSION else 2)
            assert w.notice_versions == ([peer, peer] if peer >= hs.NOTICE_VERSION else [])
            assert w.prefill.recorder.metrics.notifs_received.labels("consumer")._value.get() == 2
            assert w.serve_requests == asked, "the second READ, over a wired-up endpoint, asked"
    asyncio.run(main())


@pytest.mark.parametrize("peer", [hs.SERVE_VERSION, hs.NOTICE_VERSION])
def test_a_read_running_once_posted_asks_a_peer_that_serves_on_request_for_its_progress(peer: int, monkeypatch) -> None:
    """Over UCX's TCP transport a READ runs after its post and needs the serving daemon's
    progress: the decode side asks for it (at most every SERVE_S / 2, however often it checks)
    of a daemon that serves on request, and of no other (such a daemon progresses unasked)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each NIXL agent's UCX context as it starts

    async def main() -> None:
        async with make_world(notices=True, peer=peer) as w:
            p_er, d_er = w.prefill.rank, w.decode.rank
            assert p_er is not None and d_er is not None
            p_seq, d_seq = prompt(w, 3, 40)
            want = expected(w, d_seq)
            w.holds.hold(p_er, P.Hold("prefill", 0, "t1", 30.0, [list(b) for b in p_seq.blocks]))
            w.reads.start(d_er, read_msg(w, "t1", p_seq, d_seq), time.perf_counter())
            done = await w.completion(d_er)
            assert (done.status, done.reason) == ("received", "")
            assert testing.check(w.decode.views, want, w.decode.geometry) == []
            await w.completion(p_er)  # the notice came: whatever was sent before it is in
            sent = w.decode.recorder.metrics.serve_requests.labels("sent")._value.get()
            if peer == hs.SERVE_VERSION:  # once, or again SERVE_S / 2 later on a slow host
                assert sent >= 1 and w.serve_requests == sent, (sent, w.serve_requests)
            else:
                assert sent == w.serve_requests == 0
    asyncio.run(main())


@in_world
async def test_a_notice_is_never_answered_not_even_a_malformed_one(w: World) -> None:
    """On a standing link a reply without seq answers the oldest lease claim waiting: a notice
    or serve request that cannot be read (or of a version this daemon does not speak) gets no
    reply at all, and the next request on the link gets its own answer. Its notices are counted."""
    ctx = zmq.asyncio.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{w.port}")
    try:
        forged = hs.Notification("prefill", 0, "x", 1)
        for body in (msgspec.msgpack.encode({"kind": "notice", "version": 4, "requester": "d", "notices": [1, 2]}),
                     msgspec.msgpack.encode({"kind": "notice", "version": 4, "surprise": True}),
                     hs.encode(hs.NoticeRequest(99, "d", [forged, forged])),
                     hs.encode(hs.NoticeRequest(hs.NOTICE_VERSION, "never-handshook", [forged])),
                     msgspec.msgpack.encode({"kind": "serve", "version": 5, "requester": "d", "serve_s": 1e300}),
                     hs.encode(hs.ServeRequest(99, "d", 1.0))):
            await dealer.send_multipart([b"", body])
        await dealer.send_multipart([b"", hs.encode(hs.ProbeRequest(hs.HANDSHAKE_VERSION, "prefill"))])
        assert await dealer.poll(5000)
        empty, reply = await dealer.recv_multipart()
        assert empty == b"" and msgspec.msgpack.decode(reply, type=hs.ProbeReply).ok  # the probe's own answer
        assert not await dealer.poll(200), "a notice was answered"
    finally:
        dealer.close(0)
    received = w.prefill.recorder.metrics.notifs_received
    assert received.labels("malformed")._value.get() == 2  # version 99's two notices
    assert received.labels("unauthorized")._value.get() == 1


@pytest.mark.parametrize("peer", [hs.SERVE_VERSION, hs.NOTICE_VERSION])
def test_a_full_prefix_hit_notifies_through_nixl(peer: int) -> None:
    """Nothing is read: the notification goes to the peer's NIXL agent either way, whose refusal
    would say the daemon instance is gone (a notice goes to whichever daemon has the address).
    The next READ on that endpoint waits for the notification's progress at the peer: a daemon
    that serves on request is asked for it."""
    async def main() -> None:
        async with make_world(notices=True, peer=peer) as w:
            p_er, d_er = w.prefill.rank, w.decode.rank
            assert p_er is not None and d_er is not None
            p_seq, d_seq = prompt(w, 2, 32)
            w.holds.hold(p_er, P.Hold("prefill", 0, "hit", 30.0, [list(b) for b in p_seq.blocks]))
            msg = msgspec.structs.replace(read_msg(w, "hit", p_seq, d_seq), num_tokens=0,
                                          local_blocks=[[] for _ in d_seq.blocks],
                                          remote_blocks=[[] for _ in p_seq.blocks])
            w.reads.start(d_er, msg, time.perf_counter())
            done = await w.completion(d_er)
            assert done.status == "received", done
            sent = await w.completion(p_er)
            assert (sent.request_id, sent.status) == ("hit", "sent")
            assert w.nixl_notifications == 1
            if peer == hs.SERVE_VERSION:  # the serve request, sent with the notification
                await wait_until(lambda: w.serve_requests >= 1, "a serve request")
            else:
                await asyncio.sleep(0.2)  # time for one that should not come
                assert w.serve_requests == 0
    asyncio.run(main())


@in_world
async def test_unknown_remote_engine_fails_with_the_local_block_ids(w: World) -> None:
    d_er = w.decode.rank
    assert d_er is not None
    p_seq, d_seq = prompt(w, 5, 20)
    msg = msgspec.structs.replace(read_msg(w, "x", p_seq, d_seq),
                                  remote=P.RemoteRef("nobody", "127.0.0.1", w.port, 1, "x"))
    w.reads.start(d_er, msg, time.perf_counter())
    done = await w.completion(d_er)
    assert done.status == "failed" and done.block_ids == msg.local_blocks
    assert done.reason.startswith("handshake:") and "not registered" in done.reason
    failure = w.decode.recorder.failures[-1]
    assert (failure.request, failure.peer) == ("x", "nobody") and failure.reason == done.reason
    assert w.decode.recorder.counters.handshake_failures == 1


@in_world
async def test_engine_leaving_fails_its_reads_and_is_released_once_unused(w: World) -> None:
    d_er = w.decode.rank
    assert d_er is not None
    p_seq, d_seq = prompt(w, 6, 48)
    w.reads.start(d_er, read_msg(w, "gone", p_seq, d_seq), time.perf_counter())
    assert w.decode.engines.close(d_er, "unregistered")
    w.reads.fail_engine(d_er, "unregistered")
    assert not d_er.completions, "a closing rank takes no completions"
    await asyncio.sleep(0.05)  # the handshake task ends; it finds the read done
    for _ in range(1000):
        w.progress()
        if not w.reads.uses_engine(d_er):
            break
        await asyncio.sleep(0.002)
    assert w.decode.engines.idle(lambda e: bool(w.reads.uses_engine(e)), time.monotonic()) == [d_er]
    w.peers.forget_engine(d_er.key)
    w.decode.engines.release(d_er)
    assert w.decode.engines.all() == [] and d_er.mappings == [] and not w.decode.engines.ranks
    assert w.decode.recorder.counters.failed == 1


@in_world
async def test_notifications_before_the_hold_are_kept_for_it(w: World) -> None:
    p_er = w.prefill.rank
    assert p_er is not None
    assert w.holds.answer_handshake(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", "consumer")).ok
    note = msgspec.msgpack.encode(hs.Notification("prefill", 0, "early", 2))
    w.holds.on_notification("consumer", note)
    w.holds.on_notification("consumer", b"\x93not a notification")
    w.holds.on_notification("consumer", msgspec.msgpack.encode(hs.Notification("stranger", 0, "r", 1)))
    w.holds.on_notification("never-handshook", note)  # dropped: counts for no consumer
    w.holds.hold(p_er, P.Hold("prefill", 0, "early", 30.0, [[1, 2]]))
    assert not p_er.completions, "one of two consumers so far"
    w.holds.on_notification("consumer", note)
    sent = p_er.completions.popleft()
    assert (sent.request_id, sent.status, sent.block_ids) == ("early", "sent", [[1, 2]])
    assert w.prefill.recorder.counters.unknown_notifs == 1  # the malformed one
    assert w.prefill.recorder.counters.unauthorized_notifs == 2  # the stranger engine's, the unknown agent's


@in_world
async def test_lease_ends_as_expired_and_renewal_extends_it(w: World) -> None:
    p_er = w.prefill.rank
    assert p_er is not None
    w.holds.hold(p_er, P.Hold("prefill", 0, "a", 0.05, [[3]]))
    w.holds.hold(p_er, P.Hold("prefill", 0, "b", 0.05, [[4]]))
    w.holds.hold(p_er, P.Hold("prefill", 0, "b", 30.0, [[4]]))  # renewed
    w.holds.expire(time.monotonic() + 1.0)
    (expired,) = p_er.completions
    assert (expired.request_id, expired.status, expired.block_ids) == ("a", "expired", [[3]])
    assert "0 of ? consumers" in expired.reason
    assert [h.request for h in w.holds.status(time.monotonic(), 10)] == ["b"]
    w.holds.expire(time.monotonic() + 31.0)  # the renewed lease passes in its turn, once
    w.holds.expire(time.monotonic() + 62.0)
    assert [(c.request_id, c.status) for c in p_er.completions] == [("a", "expired"), ("b", "expired")]
    assert w.holds.held == 0
    with pytest.raises(RequestError, match="lease_s 120"):
        w.holds.hold(p_er, P.Hold("prefill", 0, "c", 120.0))


@in_world
async def test_time_the_daemon_did_not_run_does_not_count_against_a_hold(w: World) -> None:
    """The daemon's loop held, or it or its host stopped: nobody could renew a claim meanwhile.
    Leases and pins move on by that time, never past max_lease_s (60 s here) after the hold."""
    p_er = w.prefill.rank
    assert p_er is not None
    t0 = time.monotonic()
    w.holds.hold(p_er, P.Hold("prefill", 0, "a", 1.0, [[3]]))
    w.holds.hold(p_er, P.Hold("prefill", 0, "b", 1.0, [[4]]))
    claim = hs.LeaseRequest(hs.LEASE_VERSION, 1, "decode-agent", 4.0, [hs.Claimed("prefill", 0, "b")])
    assert w.holds.answer_lease(claim).answers[0].state == "held"  # pinned for 4 s
    w.holds.paused(5.0)
    w.holds.expire(t0 + 5.9)  # under 1 s of running time: neither the 1 s lease nor the 4 s pin passed
    assert not p_er.completions and w.holds.held == 2
    w.holds.expire(t0 + 7.5)  # a's lease passed; b's pin did not
    assert [(c.request_id, c.status) for c in p_er.completions] == [("a", "expired")]
    w.holds.paused(100.0)  # b lives on to 60 s after it was held, not past
    w.holds.expire(t0 + 59.9)
    assert w.holds.held == 1
    w.holds.expire(t0 + 61.5)
    assert [(c.request_id, c.status) for c in p_er.completions] == [("a", "expired"), ("b", "expired")]


@in_world
async def test_handshake_answer_describes_the_serving_ranks(w: World) -> None:
    reply = w.holds.answer_handshake(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill"))
    assert reply.ok and reply.agent == w.prefill.nixl.name and [r.tp_rank for r in reply.ranks] == [0]
    assert reply.ranks[0].geometry == w.prefill.geometry
    assert not w.holds.answer_handshake(hs.HandshakeRequest(hs.HANDSHAKE_VERSION + 1, "prefill")).ok
    assert "not registered" in w.holds.answer_handshake(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "x")).reason


@in_world
async def test_a_read_on_a_cached_route_reaches_the_read_post_through_seven_files(w: World) -> None:
    """After the dispatch (rpc.py -> daemon.py), a read runs code of reads.py, its block lists'
    arrays (protocol.py), its rank's and uid's quota (quotas.py), what it reads (reading.py: its
    size, to build it on the loop or not; the descriptor ids, plan/descriptors.py) and the lanes'
    size check (lanes.py) before NixlDriver.read posts it: nine files in all."""
    d_er = w.decode.rank
    assert d_er is not None
    p_seq, d_seq = prompt(w, 7, 40)
    w.reads.start(d_er, read_msg(w, "warm", p_seq, d_seq), time.perf_counter())  # handshake, route
    assert (await w.completion(d_er)).status == "received"
    package = str(Path(kvxferd.__file__).parent)
    touched: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and "nixl_driver.py" not in touched:
            touched.append(str(Path(code.co_filename).relative_to(package)))

    sys.setprofile(profile)
    try:
        w.reads.start(d_er, read_msg(w, "cached", p_seq, d_seq), time.perf_counter())
    finally:
        sys.setprofile(None)
    assert "nixl_driver.py" in touched, touched
    assert set(touched) == {"reads.py", "protocol.py", "quotas.py", "reading.py", "plan/descriptors.py", "lanes.py",
                            "nixl_driver.py"}, touched
    assert (await w.completion(d_er)).status == "received"


@in_world
async def test_status_lists_the_oldest_holds_and_counts_all(w: World) -> None:
    p_er = w.prefill.rank
    assert p_er is not None
    for i in range(250):
        w.holds.hold(p_er, P.Hold("prefill", 0, f"h{i}", 30.0, [[i % 8]]))
    oldest = w.holds.status(time.monotonic(), P.STATUS_ROWS)
    assert [h.request for h in oldest] == [f"h{i}" for i in range(P.STATUS_ROWS)]
    assert w.holds.held == 250


# --- peer lifecycle (peers.py, liveness.py) ----------------------------------------------


def second_engine(w: World, engine_id: str) -> Side:
    """Another engine on the prefill side's daemon: the same NIXL agent, memory of its own."""
    other = Side(w.prefill.name, w.prefill.nixl, w.prefill.recorder, w.prefill.engines, w.prefill.geometry)
    other.register(engine_id)
    return other


def start_read(w: World, src: Side, request_id: str, seq: int, num_tokens: int,
               host: str = "127.0.0.1") -> list[np.ndarray]:
    """Prefill a prompt on `src`'s engine, hold it, start the decode's read; what the decode must hold."""
    p_er, d_er = src.rank, w.decode.rank
    assert p_er is not None and d_er is not None
    need = testing.blocks_needed(src.geometry, num_tokens)
    p_seq = testing.Sequence(seq, num_tokens, tuple(tuple(range(n)) for n in need))
    d_seq = testing.Sequence(seq, num_tokens, tuple(tuple(range(40, 40 + n)) for n in need))
    testing.fill_sequence(src.views, src.geometry, p_seq)
    want = expected(w, d_seq)
    w.holds.hold(p_er, P.Hold(p_er.engine_id, 0, request_id, 30.0, [list(b) for b in p_seq.blocks]))
    msg = msgspec.structs.replace(read_msg(w, request_id, p_seq, d_seq),
                                  remote=P.RemoteRef(p_er.engine_id, host, w.port, 1, request_id))
    w.reads.start(d_er, msg, time.perf_counter())
    return want


async def read_ok(w: World, src: Side, request_id: str, seq: int, num_tokens: int, host: str = "127.0.0.1") -> None:
    """A read from `src`'s engine ends `received`, every byte as the prefill wrote it."""
    want = start_read(w, src, request_id, seq, num_tokens, host)
    assert w.decode.rank is not None
    done = await w.completion(w.decode.rank)
    assert (done.request_id, done.status) == (request_id, "received"), done
    assert testing.check(w.decode.views, want, w.decode.geometry) == []


def restart(side: Side) -> EngineRank:
    """The side's engine leaves and registers again under its id, with new memory."""
    assert side.rank is not None
    side.engines.close(side.rank, "restarting")
    side.engines.release(side.rank)
    side.views.clear()
    return side.register(side.rank.engine_id)


def peer_of(w: World, engine_id: str) -> Peer:
    (peer,) = [p for p in w.peers.ready() if p.engine_id == engine_id]
    return peer


@in_world
async def test_a_shared_agent_outlives_one_engine_s_peer(w: World) -> None:
    """Two engines behind one prefill daemon are two Peers on one NIXL agent: retiring one (its
    lists collected) while a read of the other is in flight leaves that read and the agent alone;
    the agent goes with the last Peer that used it."""
    b = second_engine(w, "prefill-b")
    await read_ok(w, w.prefill, "a0", 0, 37)
    await read_ok(w, b, "b0", 1, 37)
    agent = w.prefill.nixl.name
    assert w.decode.nixl.remote_agents == {agent}
    peer_a, peer_b = peer_of(w, "prefill"), peer_of(w, "prefill-b")
    assert peer_a.agent == peer_b.agent == agent
    want = start_read(w, b, "b1", 2, 64)  # posted on B's cached route before A goes
    w.peers.retire(peer_a, "its engine left", "engine_gone")
    w.peers.collect(w.reads.uses_route)
    assert w.decode.nixl.remote_agents == {agent}, "A's retirement removed the agent B reads through"
    assert w.decode.rank is not None
    done = await w.completion(w.decode.rank)
    assert (done.request_id, done.status) == ("b1", "received"), done
    assert testing.check(w.decode.views, want, w.decode.geometry) == []
    await read_ok(w, b, "b2", 3, 50)
    counters = w.decode.recorder.counters
    assert (counters.handshakes, counters.peers_retired, counters.failed) == (2, 1, 0)
    assert peer_of(w, "prefill-b") is peer_b and not peer_b.retired
    assert [(p.engine, p.state) for p in w.peers.status(w.reads.uses_peer)] == [("prefill-b", "ready")]
    w.peers.retire(peer_b, "its engine left", "engine_gone")
    w.peers.collect(w.reads.uses_route)
    assert w.decode.nixl.remote_agents == set() and w.peers.status(w.reads.uses_peer) == []


async def probed(w: World, liveness: Liveness, peer: Peer) -> None:
    """One probe of `peer`, answered (the prefill side's server runs on this loop)."""
    peer.probed = 0.0
    liveness.tick(time.monotonic())
    assert peer.probing
    for _ in range(500):
        await asyncio.sleep(0.002)
        if not peer.probing:
            return
    raise AssertionError("no probe answer")


@in_world
async def test_probes_tell_a_restarted_or_departed_engine_and_keep_a_live_one(w: World) -> None:
    p_er = w.prefill.rank
    assert p_er is not None
    await read_ok(w, w.prefill, "r0", 0, 37)
    peer = peer_of(w, "prefill")
    assert peer.epoch == p_er.epoch and peer.epoch
    liveness = Liveness(w.peers, w.decode.recorder, 10.0, 30.0, 0.0, w.reads.uses_peer)
    heard = peer.heard
    await probed(w, liveness, peer)
    assert not peer.retired and peer.heard > heard
    # The engine registers again under its id: another epoch, other memory.
    assert restart(w.prefill).epoch != peer.epoch
    await probed(w, liveness, peer)
    assert (peer.retired, peer.reason) == (True, "restarted")
    await read_ok(w, w.prefill, "r1", 1, 37)  # handshakes anew, reads the new memory
    assert w.decode.recorder.counters.handshakes == 2
    # ... and leaves: the next probe finds it gone.
    peer = peer_of(w, "prefill")
    assert w.prefill.rank is not None
    w.prefill.engines.close(w.prefill.rank, "unregistered")
    await probed(w, liveness, peer)
    assert (peer.retired, peer.reason) == (True, "engine_gone")
    body = w.decode.recorder.metrics.render().decode()
    assert 'kvxferd_peers_retired_total{reason="restarted"} 1.0' in body
    assert 'kvxferd_peers_retired_total{reason="engine_gone"} 1.0' in body
    assert 'kvxferd_peer_probes_total{outcome="alive"} 1.0' in body
    await liveness.close()


@in_world
async def test_a_handshake_meeting_a_new_epoch_retires_the_old_registration_s_peer(w: World) -> None:
    """The same engine reached by another address: its handshake shows the engine registered
    again, so the Peer of the old registration (same agent, other epoch) is retired."""
    p_er = w.prefill.rank
    assert p_er is not None
    await read_ok(w, w.prefill, "r0", 0, 37, host="127.0.0.1")
    old = peer_of(w, "prefill")
    restart(w.prefill)
    await read_ok(w, w.prefill, "r1", 1, 37, host="localhost")
    assert (old.retired, old.reason) == (True, "restarted")
    assert [p.address for p in w.peers.ready()] == [f"localhost:{w.port}"]


@in_world
async def test_a_daemon_before_probes_is_alive_with_its_epoch_unknown(w: World) -> None:
    """A daemon from before probes answers one as a malformed request (its side channel decodes
    handshakes and audits only): that answer proves it alive; and its handshake replies, which
    carry no epoch, still decode."""
    await read_ok(w, w.prefill, "r0", 0, 37)
    peer = peer_of(w, "prefill")
    old_kinds = msgspec.msgpack.Decoder(hs.HandshakeRequest | hs.AuditRequest)
    with unittest.mock.patch.object(hs, "_req_decoder", old_kinds):
        reply = await w.peers.probe(peer, 5.0)
        assert (reply.ok, reply.gone, reply.epoch) == (False, False, "")
        assert reply.reason.startswith("malformed side-channel request")
        liveness = Liveness(w.peers, w.decode.recorder, 10.0, 30.0, 0.0, w.reads.uses_peer)
        peer.heard -= 25.0  # 5 s left before it would count as silent
        heard = peer.heard
        await probed(w, liveness, peer)
    assert not peer.retired and peer.heard > heard + 20
    assert 'kvxferd_peer_probes_total{outcome="epoch_unknown"} 1.0' in w.decode.recorder.metrics.render().decode()
    old_reply = msgspec.msgpack.encode({"ok": True, "agent": "a", "metadata": b"m"})
    assert hs._reply_decoder.decode(old_reply).epoch == ""
    await liveness.close()


@in_world
async def test_silent_and_idle_peers_are_retired_and_busy_ones_kept(w: World) -> None:
    await read_ok(w, w.prefill, "r0", 0, 37)
    peer = peer_of(w, "prefill")
    liveness = Liveness(w.peers, w.decode.recorder, 10.0, 30.0, 60.0, w.reads.uses_peer)
    now = time.monotonic()
    liveness.tick(now + 20.0)  # within both deadlines: a probe is due, nothing else
    assert not peer.retired and peer.probing
    await liveness.close()  # (cancelled before it ran: the probe's own cleanup never came)
    peer.probing = False
    start_read(w, w.prefill, "r1", 1, 37)  # in flight: the peer is in use, however idle its clock
    peer.used = now - 120.0
    peer.probed = peer.heard = now
    liveness.tick(now)
    assert not peer.retired
    assert w.decode.rank is not None
    assert (await w.completion(w.decode.rank)).status == "received"
    liveness.tick(now)
    assert (peer.retired, peer.reason) == (True, "idle")
    await read_ok(w, w.prefill, "r2", 2, 37)
    peer = peer_of(w, "prefill")
    peer.probed = peer.heard
    for t in range(62):  # 30.5 s of the daemon running (ticks 0.5 s apart) without an answer
        liveness.tick(peer.heard + 0.5 * t)
    assert (peer.retired, peer.reason) == (True, "silent")
    assert w.decode.recorder.counters.peers_retired == 2
    await liveness.close()


@in_world
async def test_a_daemon_resumed_after_a_pause_probes_its_peers_before_calling_them_silent(w: World) -> None:
    """A daemon stopped for longer than peer_dead_after_s (SIGSTOP, a frozen container) last
    heard its peers long ago, but asked them nothing meanwhile: it probes them first, and one
    that stays unanswered is silent once the daemon has run peer_dead_after_s."""
    await read_ok(w, w.prefill, "r0", 0, 37)
    peer = peer_of(w, "prefill")
    cpu = [0.0]  # the loop thread's CPU time: nothing runs while the daemon is stopped
    liveness = Liveness(w.peers, w.decode.recorder, 10.0, 30.0, 0.0, w.reads.uses_peer, lambda: cpu[0])
    heard = peer.heard
    liveness.tick(heard + 5.0)
    assert not peer.retired and not peer.probing
    liveness.tick(heard + 155.0)  # the next tick, as the daemon's clock reads when it runs again
    assert not peer.retired and peer.probing  # silent 5 s of its running time, and asked now
    assert heard + 150.0 <= peer.heard <= heard + 155.0
    for t in range(1, 60):  # had it stayed unanswered: silent once the daemon ran 30 s more
        liveness.tick(heard + 155.0 + 0.5 * t)
    assert (peer.retired, peer.reason) == (True, "silent")
    await liveness.close()


@in_world
async def test_a_loop_held_up_by_its_own_work_still_finds_a_silent_peer(w: World) -> None:
    """Ticks 1.5 s apart because the loop itself was busy (a CMA copy inside a READ's post burns
    its CPU): that is no pause, and a peer that never answers is silent after peer_dead_after_s."""
    await read_ok(w, w.prefill, "r0", 0, 37)
    peer = peer_of(w, "prefill")
    cpu = [0.0]
    liveness = Liveness(w.peers, w.decode.recorder, 10.0, 30.0, 0.0, w.reads.uses_peer, lambda: cpu[0])
    heard = peer.heard
    for t in range(1, 22):
        cpu[0] += 1.45  # busy for nearly all of each gap
        liveness.tick(heard + 1.5 * t)
    assert (peer.retired, peer.reason) == (True, "silent")
    await liveness.close()
