"""Races and hostile peers around fail-closed reads and leases: two decode ranks sharing one
claim, a prefill daemon restarted behind a grant, an unpin overtaking a claim, a refusing peer,
unbounded expectations, a vLLM worker freeing what its daemon still vouches for, a lease-request
flood, a refused read's expectation. Each reproduced a wrong `received` or a stall before its fix."""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd import handshake as hs
from kvxferd import leases as leases_mod
from kvxferd import protocol as P
from kvxferd.client import Client, RemoteRef
from kvxferd.holds import Holds
from kvxferd.lab.synthetic import testing
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.synthetic.engine import SyntheticEngine, _compare_blocks, _poison_blocks
from kvxferd.leases import Leases
from kvxferd.plan.models import PRESETS
from kvxferd.recorder import Recorder

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=2)
TOKENS = 40


def read_rank(eng: SyntheticEngine, r: int, seq: int, remote: RemoteRef, blocks, remote_blocks):
    """Rank r alone reads request `seq` into `blocks`; its completion and what differs."""
    s = testing.Sequence(seq, TOKENS, blocks)
    rank = eng.ranks[r]
    for bufs in (rank.view, rank.shadow):
        _poison_blocks(bufs, rank.geometry, blocks)
    rank.client.read(f"d-{seq}", remote, TOKENS, [list(b) for b in blocks], [list(b) for b in remote_blocks], 5.0)
    c = eng._wait(rank, f"d-{seq}", 10)
    testing.expect_after_read(rank.shadow, rank.geometry, s, [0] * len(blocks),
                              eng._chunk_tokens(SHAPE, remote.tp_size), in_place=True)
    return c, _compare_blocks(rank.view, rank.shadow, rank.geometry, blocks)


def test_two_decode_ranks_of_one_daemon_read_one_prefill_rank_past_its_lease(tmp_path):
    """Decode TP 2 on one daemon, prefill TP 1: both ranks read prefill rank 0. The first
    rank's notification must not unpin the hold the second still reads."""
    p = DaemonProcess(tmp_path, "p", -1, ["--claim-s", "1"])
    d = DaemonProcess(tmp_path, "d", -1, ["--claim-s", "1"])
    try:
        pre = SyntheticEngine(p.socket, "prefill", SHAPE, 1)
        dec = SyntheticEngine(d.socket, "decode", SHAPE, 2)
        host, port = pre.side_channel.rsplit(":", 1)
        ref = RemoteRef("prefill", host, int(port), 1, "req-1")
        blocks = pre.prefill(1, TOKENS, 0.5)
        dec.expect(1, ref)
        time.sleep(1.5)  # the lease passed: the claims keep the hold
        local = dec.allocate(TOKENS)
        c0, bad0 = read_rank(dec, 0, 1, ref, local, blocks)
        assert c0.status == "received" and not bad0
        time.sleep(0.3)
        st = Client(p.socket).status()
        if not st.held:  # what the bug did: the hold ended; the engine reuses its blocks
            pre.reuse(blocks, 2)
        c1, bad1 = read_rank(dec, 1, 1, ref, local, blocks)
        assert not (c1.status == "received" and bad1), "another prompt's KV reported received"
        assert c1.status == "received" and not bad1
        assert pre.wait_released(1, 5) == ["sent"]
        pre.close()
        dec.close()
    finally:
        p.stop()
        d.stop()


def test_a_grant_of_a_prefill_daemon_since_restarted_vouches_for_nothing(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = DaemonProcess(tmp_path, "p", -1, [], side_channel_port=port)
    d = DaemonProcess(tmp_path, "d", -1, [])
    p2 = None
    try:
        pre = SyntheticEngine(p.socket, "prefill", SHAPE, 1)
        dec = SyntheticEngine(d.socket, "decode", SHAPE, 1)
        ref = lambda seq: RemoteRef("prefill", "127.0.0.1", port, 1, f"req-{seq}")  # noqa: E731
        b0 = pre.prefill(0, TOKENS, 30)
        assert dec.decode(0, TOKENS, ref(0), b0, 0, 5.0, SHAPE)["status"] == "received"
        b1 = pre.prefill(1, TOKENS, 0.5)
        dec.expect(1, ref(1))  # pinned claim_s (20 s) ahead by this daemon instance
        time.sleep(1.0)
        p.kill()
        p2 = DaemonProcess(tmp_path, "p2", -1, [], side_channel_port=port)
        pre2 = SyntheticEngine(p2.socket, "prefill", SHAPE, 1)
        pre2.reuse(b1, 2)
        pre2.ranks[0].client.hold("req-1", 0.1, [list(b) for b in b1])  # re-held, what was left of its lease
        assert pre2.wait_released(1, 5) == ["expired"]
        out = dec.decode(1, TOKENS, ref(1), b1, 0, 5.0, SHAPE)  # VerificationError if received
        assert out["status"] == "failed" and "expired" in out["reason"]
    finally:
        for x in (p, d, p2):
            if x is not None:
                x.stop()


class _FakeRank:
    engine_id, tp_rank, key, epoch, uid = "prefill", 0, ("prefill", 0), "", None
    geometry = SimpleNamespace(groups=[SimpleNamespace(name="attn", num_blocks=64)])
    mappings: tuple[object, ...] = ()  # no memory to look at

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    def complete(self, c: P.Completion) -> None:
        self.done.append((c.request_id, c.status))


def held_and_claimed(lease_s: float, claim_s: float) -> tuple[_FakeRank, Holds, Leases, list]:
    """A prefill's Holds holding r1 under `lease_s`, and a decode's Leases whose claims (of
    `claim_s`) it answers in process; returns (its engine rank, holds, leases, r1's claim keys)."""
    er = _FakeRank()
    holds = Holds(SimpleNamespace(knows=lambda k: True), SimpleNamespace(name="p"), Recorder(), max_lease_s=60)
    holds.hold(er, P.Hold("prefill", 0, "r1", lease_s, [[1, 2]]))

    class Link:
        async def ask(self, req, timeout_s):
            return holds.answer_lease(req)
    leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "decode-agent", claim_s, True, 5.0)
    return er, holds, leases, [("127.0.0.1", 5600, "prefill", 0, "r1", "", "")]


def test_a_claim_released_and_made_again_in_one_turn_stays_pinned():
    async def main() -> None:
        er, holds, leases, k = held_and_claimed(0.2, 20.0)
        leases.acquire(k)
        await asyncio.sleep(0.3)
        leases.release(k)
        leases.acquire(k)
        await asyncio.sleep(0.05)
        holds.expire(time.monotonic())
        assert not (er.done and leases.covers(k, time.monotonic())), "vouched for a hold that expired"
        assert not er.done and leases.covers(k, time.monotonic())  # and it is still pinned, its lease past
    asyncio.run(main())


def test_a_claim_granted_past_two_claims_length_is_still_renewed():
    """The engine's own lease (vLLM's 120 s) is longer than two claims (claim_s 20 s): the first
    answer grants the whole lease. The claim is asked again before that grant passes, so a
    decode still waiting keeps the hold past the lease."""
    async def main() -> None:
        er, holds, leases, k = held_and_claimed(3.0, 1.0)
        leases.acquire(k)  # answered: held for ~3 s, three claims' length
        end = time.monotonic() + 5.0
        while (now := time.monotonic()) < end:  # the two daemons' housekeeping
            leases.renew(now)
            holds.expire(now)
            await asyncio.sleep(0.02)
        assert not er.done, "the hold expired while its claim was needed"
        assert leases.covers(k, time.monotonic())
    asyncio.run(main())


@pytest.mark.parametrize("now, until", [(2664039.274012138, 2664052.6073454716), (1000.0, 1000.0 + 20 * 2 / 3)])
def test_a_long_grants_next_renewal_never_falls_due_at_once(now, until):
    """Where `until - 2/3 claim_s` rounds to `now`, the renewal due then is asked at once, not
    pushed back as due now (the loop that pops due renewals would pop it again, for ever)."""
    def stuck(*_: object) -> None:
        raise TimeoutError("Leases.renew did not return")

    async def main() -> None:
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": None), Recorder(), "me", 20.0, True, 5.0)
        key = ("10.0.0.1", 5600, "prefill", 0, "r1", "", "")
        leases._claims[key] = leases_mod.Claim(holders=1, state="held", until=until)
        leases._renewals.append((now, key))
        previous = signal.signal(signal.SIGALRM, stuck)
        signal.setitimer(signal.ITIMER_REAL, 2.0)
        try:
            leases.renew(now)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert leases._claims[key].asking is not None  # asked now
        leases._claims.clear()  # the queued ask would go to a fake link
        leases._queued.clear()
    asyncio.run(main())


def test_a_grant_that_is_no_duration_is_not_decoded():
    """NaN, infinite or negative grants from a peer: the whole reply is dropped (the claim is
    unanswered, its read fails closed), never a NaN at the top of the renewal heap."""
    for bad in (float("nan"), float("inf"), -1.0, 1e300):
        raw = msgspec.msgpack.encode(hs.LeaseReply(True, seq=1, answers=[hs.ClaimAnswer("held", bad)]))
        with pytest.raises(msgspec.ValidationError):
            hs.lease_reply_decoder.decode(raw)


def test_a_refusing_peer_is_asked_again_at_most_every_retry():
    async def main() -> None:
        asked = 0

        class Link:
            async def ask(self, req, timeout_s):
                nonlocal asked
                asked += 1
                return hs.LeaseReply(False, "malformed side-channel request (an older daemon)")
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "me", 20.0, True, 5.0)
        keys = [("10.0.0.1", 5600, "prefill", 0, "req-1", "", "")]
        leases.acquire(keys)
        t = time.monotonic()
        assert await leases.confirm(keys, t, lambda: t + 0.5)
        assert asked <= 40, f"{asked} lease requests in 0.5 s for one read"
    asyncio.run(main())


def test_expectations_hold_a_bounded_number_of_claims_and_one_rank_never_evicts_another():
    """An engine rank that announces 4,096-rank reads without end drops its own oldest, never
    another rank's (which would unpin that rank's prefill holds)."""
    async def main() -> None:
        class Link:
            async def ask(self, req, timeout_s):
                await asyncio.sleep(3600)
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "me", 20.0, True, 5.0)
        victim = P.RemoteRef("p", "10.0.0.1", 5600, 2, "victim")
        leases.expect(("decode-b", 0), "b-1", victim)
        bound = leases_mod.MAX_EXPECT_CLAIMS_PER_RANK
        for i in range(bound // 4096 + 8):
            leases.expect(("decode", 0), f"r{i}", P.RemoteRef("p", "10.0.0.1", 5600, 4096, f"q{i}"))
        assert leases.claims <= bound + 2
        assert leases.take_expect(("decode-b", 0), "b-1") == leases_mod.claim_keys(victim, range(2))
        for t in list(leases._tasks):
            t.cancel()
    asyncio.run(main())


def holding_worker(daemon: DaemonProcess):
    """A vLLM worker registered with `daemon`, holding request r1 (blocks 1, 2) under a 0.3 s lease."""
    from kvxferd.memory import buffer_address, create_shm
    from kvxferd.plan.models import ModelShape, build
    from kvxferd.vllm import worker as worker_mod
    from kvxferd.vllm.handoff import HoldOrder, Orders
    from kvxferd.vllm.shared_kv import SharedBuffer

    shape = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)
    geo = build(shape, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    w = worker_mod.WorkerSide(daemon.socket, "engine-a", 0, 1, read_deadline_s=5.0)
    w.register(geo, [SharedBuffer(fd, geo.buffers[0], buffer_address(mm), "shm", 0, [mm])], timeout_s=10)
    w.start(Orders([HoldOrder("r1", [[1, 2]], 0.3)], []))
    return w


def test_a_connected_worker_frees_no_hold_its_daemon_keeps_for_a_claim(tmp_path, monkeypatch):
    from kvxferd.vllm import worker as worker_mod

    monkeypatch.setattr(worker_mod, "ORPHAN_GRACE_S", 0.3)
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        w = holding_worker(daemon)
        port = int(Client(daemon.socket).status().side_channel.rsplit(":", 1)[1])
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(hs.encode(hs.LeaseRequest(hs.LEASE_VERSION, 1, "decode-agent", 30.0,
                                            [hs.Claimed("engine-a", 0, "r1")])))
        assert sock.poll(5000)
        assert hs.lease_reply_decoder.decode(sock.recv()).answers[0].state == "held"
        sock.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            assert "r1" not in w.results().sending, "freed while its daemon vouches for it"
            time.sleep(0.05)
        assert [h.request for h in Client(daemon.socket).status().held] == ["r1"]
        w.close()
    finally:
        daemon.stop()


def test_a_flood_of_lease_requests_does_not_hold_the_event_loop():
    async def main() -> None:
        import zmq.asyncio
        ctx = zmq.asyncio.Context()
        holds = Holds(SimpleNamespace(knows=lambda k: True), SimpleNamespace(name="p"), Recorder(), max_lease_s=600)
        er = _FakeRank()
        er.geometry = SimpleNamespace(groups=[SimpleNamespace(name="attn", num_blocks=1 << 20)])
        for i in range(4096):
            holds.hold(er, P.Hold("prefill", 0, f"r{i}", 60, [[i]]))
        server = hs.HandshakeServer(ctx, "127.0.0.1", 0, holds.answer_lease)
        srv = asyncio.create_task(server.run())
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.001)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        tick = asyncio.create_task(ticker())

        def flood() -> None:
            c = zmq.Context()
            s = c.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{server.port}")
            req = hs.encode(hs.LeaseRequest(hs.LEASE_VERSION, 1, "evil", 3600,
                                            [hs.Claimed("prefill", 0, f"r{i}") for i in range(4096)]))
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:
                s.send_multipart([b"", req])
                while s.poll(0):
                    s.recv_multipart()
            s.close()
            c.term()
        await asyncio.to_thread(flood)
        await asyncio.sleep(0.2)
        tick.cancel()
        srv.cancel()
        server.close()
        ctx.term()
        assert max(gaps) < 0.5, f"the loop stood still {max(gaps):.1f} s"
    asyncio.run(main())


def test_a_refused_read_lets_go_of_what_its_engine_expected():
    """A read the daemon refuses (here: over max_reads_per_engine) must not leave the engine's
    expectation pinning the prefill's holds until max_lease_s."""
    async def main() -> None:
        from kvxferd.protocol import RequestError
        from kvxferd.reads import Reads

        class Link:
            async def ask(self, req, timeout_s):
                return hs.LeaseReply(True, seq=req.seq, answers=[hs.ClaimAnswer("held", 20.0) for _ in req.claims])
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "me", 20.0, True, 5.0)
        peers = SimpleNamespace(routes={}, keys=None)
        reads = Reads(SimpleNamespace(), peers, Recorder(), 60, SimpleNamespace(), max_per_rank=0, leases=leases)
        er = SimpleNamespace(engine_id="decode", tp_rank=0, key=("decode", 0), uid=None,
                             geometry=SimpleNamespace(groups=[object()]))
        ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 2, "p-1")
        leases.expect(("decode", 0), "d-1", ref)
        await asyncio.sleep(0.01)
        assert leases.claims == 2
        with pytest.raises(RequestError):
            reads.start(er, P.Read("decode", 0, "d-1", ref, 8, [[1]], [[1]]), 0.0)
        assert leases.claims == 0
    asyncio.run(main())


def test_a_worker_that_loses_a_living_daemon_keeps_what_it_may_have_vouched_for(tmp_path):
    """The connection drops (an RPC timeout) while the daemon lives and has granted claims on a
    hold: the worker keeps the blocks until max_lease_s after the daemon accepted them, not just
    to the hold's own lease (the daemon keeps the memory registered that long, and a decode may
    read it as the request's)."""
    daemon = DaemonProcess(tmp_path, "daemon", extra=["--max-lease-s", "3"])
    try:
        w = holding_worker(daemon)
        assert w.max_lease_s == 3.0
        with w.lock:
            w._lost(ConnectionError("an RPC timed out"))  # what a 30 s timeout on a busy daemon does
        t0 = time.monotonic()
        while "r1" not in w.results().sending:
            assert time.monotonic() - t0 < 10, "never freed"
            time.sleep(0.05)
        assert time.monotonic() - t0 > 2.0, "freed at its own lease, before claims on it could end"
        w.close()
    finally:
        daemon.stop()


def test_a_hold_whose_answer_never_came_is_kept_as_one_the_daemon_took(tmp_path):
    """The step's frame reached the daemon, which took the hold (and may have granted claims on
    it), but its answer never came (an RPC timeout): the worker keeps those blocks as long as
    the holds the daemon answered, not just to the hold's own 0.3 s lease."""
    from kvxferd.vllm.handoff import HoldOrder, Orders

    daemon = DaemonProcess(tmp_path, "daemon", extra=["--max-lease-s", "3"])
    try:
        w = holding_worker(daemon)
        client = w.client
        real_batch = client.batch

        def unanswered(orders):
            real_batch(orders)  # the daemon has them
            raise TimeoutError("no reply within the RPC timeout")
        client.batch = unanswered
        w.start(Orders([HoldOrder("r2", [[3]], 0.3)], []))
        assert w.client is None  # lost
        t0 = time.monotonic()
        while "r2" not in w.results().sending:
            assert time.monotonic() - t0 < 10, "never freed"
            time.sleep(0.05)
        assert time.monotonic() - t0 > 2.0, "freed at its own lease, before claims on it could end"
        w.close()
    finally:
        daemon.stop()


def test_a_hold_that_never_comes_is_asked_about_less_and_less():
    """An expectation naming a request the prefill never holds (any client can name one): its
    claim is asked again from 50 ms on, backing off to every 2 s, not 20 times a second."""
    async def main() -> None:
        asked: list[float] = []

        class Link:
            async def ask(self, req, timeout_s):
                asked.append(time.monotonic())
                return hs.LeaseReply(True, seq=req.seq, answers=[hs.ClaimAnswer("pending") for _ in req.claims])
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "me", 20.0, True, 5.0)
        leases.expect(("decode", 0), "d-1", RemoteRef("prefill", "10.0.0.1", 5600, 1, "never-held"))
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            leases.renew(time.monotonic())
            await asyncio.sleep(0.01)
        gaps = [b - a for a, b in itertools.pairwise(asked)]
        assert 5 <= len(asked) <= 9, asked  # 0, .05, .15, .35, .75, 1.55, 3.15 s (+ the ticks)
        planned = [min(0.05 * 2 ** i, 2.0) for i in range(len(gaps))]  # a busy machine asks later, never sooner
        assert all(g >= p - 0.005 for g, p in zip(gaps, planned)) and gaps[-1] >= 1.0, gaps
    asyncio.run(main())


GRANT_OF_1 = [np.array([1], dtype="<i4").tobytes()]  # a hold of block 1 (one cache group)


def _stand_in_reads(monkeypatch, link, nbytes: int, posted: list, completions: list):
    """Reads whose route is cached, whose READ posts report DONE at once, and whose claims go
    to `link`; `posted` gets the number of claim requests out at each post."""
    from kvxferd import reads as reads_mod

    class Done:  # a READ NIXL reports DONE
        def ended(self) -> bool:
            return True

        def release(self) -> None:
            pass

        def release_if_ended(self) -> bool:
            return True

        def cancel(self) -> bool:
            return False

        def timing(self) -> None:
            return None

        def ended_at(self) -> float:
            return 0.0

    def reads_on(self, route):
        self.route, self.read_ranks = route, [0]
        ids = np.arange(4, dtype=np.int32)
        return reads_mod.Reading({0: (ids, ids)}, {0: nbytes})

    def post(self, reading, nixl, lanes, on_sliced, notices, copier):
        posted.append(len(link.out))
        self.postings.append(Done())  # the copy ran inside this call
        return 1

    monkeypatch.setattr(reads_mod.Transfer, "reads_on", reads_on)
    monkeypatch.setattr(reads_mod.Transfer, "post", post)
    leases = Leases(SimpleNamespace(to=lambda h, p, k="": link, get=lambda h, p, k="": link), Recorder(), "me", 20.0,
                    True, 5.0)
    attn = SimpleNamespace(groups=[SimpleNamespace(name="attn")])  # one cache group, on both sides
    er = SimpleNamespace(engine_id="decode", tp_rank=0, key=("decode", 0), uid=None, closing=False, geometry=attn,
                         complete=completions.append)
    ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 1, "p-1")
    route = SimpleNamespace(remote_tp=1, agent="", peer=SimpleNamespace(epoch="", local=False, used=0.0, since=0.0,
                                                                      ranks={0: SimpleNamespace(geometry=attn)}),
                            plan=SimpleNamespace(targets=(0,)), rank=er, sources=(), lane="nixl",
                            rows_per_block=(0.0,))

    async def cached(ref, er, deadline):
        return route
    peers = SimpleNamespace(routes={((ref.engine_id, ref.host, ref.port, ""), ("decode", 0)): route}, route=cached,
                            retire=lambda *a: None, keys=None)
    reads = reads_mod.Reads(SimpleNamespace(), peers, Recorder(), 60, SimpleNamespace(slices=lambda n: 0),
                            leases=leases, on_posted=lambda: None)
    return reads, er, ref, leases


class _GrantingLink:
    """A prefill daemon's side of the claims: answered when `answer` is called, granting `blocks`."""

    def __init__(self, blocks=GRANT_OF_1) -> None:
        self.out: list[tuple[hs.LeaseRequest, asyncio.Future]] = []
        self.blocks = blocks

    def ask(self, req, timeout_s):
        self.out.append((req, asyncio.get_running_loop().create_future()))
        return self.out[-1][1]

    def answer(self) -> None:
        for req, fut in self.out:
            if not fut.done():
                fut.set_result(hs.LeaseReply(True, seq=req.seq, answers=[
                    hs.ClaimAnswer("held", 20.0, "", self.blocks if c.grant else []) for c in req.claims]))

    def take_ready(self) -> None:
        self.answer()


@pytest.mark.parametrize("nbytes", [2 << 20, 4096])
def test_a_read_not_announced_is_posted_once_its_claim_grants_its_blocks(monkeypatch, nbytes):
    """A READ touches only blocks its hold grants: a read the engine did not announce is
    posted after its claim was answered with the hold's blocks (one request asks for them),
    never inside `start`; then it is received."""
    async def main() -> None:
        link, posted, completions = _GrantingLink(), [], []
        reads, er, ref, _ = _stand_in_reads(monkeypatch, link, nbytes, posted, completions)
        reads.start(er, P.Read("decode", 0, "d-1", ref, 8, [[1]], [[1]]), 0.0)
        await asyncio.sleep(0)
        assert posted == [] and len(link.out) == 1 and link.out[0][0].claims[0].grant
        link.answer()
        for _ in range(10):
            await asyncio.sleep(0)
        reads.poll(time.monotonic())  # the progress loop's look at what is posted
        assert posted == [1] and [c.status for c in completions] == ["received"]
    asyncio.run(main())


def test_a_read_of_blocks_its_hold_does_not_grant_is_never_posted(monkeypatch):
    async def main() -> None:
        link, posted, completions = _GrantingLink([np.array([7], dtype="<i4").tobytes()]), [], []
        reads, er, ref, _ = _stand_in_reads(monkeypatch, link, 4096, posted, completions)
        reads.start(er, P.Read("decode", 0, "d-1", ref, 8, [[1]], [[1]]), 0.0)
        await asyncio.sleep(0)
        link.answer()
        for _ in range(10):
            await asyncio.sleep(0)
        assert posted == []
        assert [(c.status, c.block_ids) for c in completions] == [("failed", [[1]])]
        assert "does not grant blocks [[1]]" in completions[0].reason
    asyncio.run(main())


def test_an_announced_large_read_done_when_its_post_returns_is_reported_at_once(monkeypatch):
    """An announced read's grant is in before it starts. Over CMA a large READ's copy runs
    inside its post: the read is reported `received` as the post returns, in the same loop turn,
    because the grant's answer vouches for its end."""
    async def main() -> None:
        from kvxferd import reads as reads_mod

        link, posted, completions = _GrantingLink(), [], []
        reads, er, ref, leases = _stand_in_reads(monkeypatch, link, reads_mod.EARLY_CLAIM_BYTES, posted, completions)
        leases.expect(("decode", 0), "d-1", ref)
        await asyncio.sleep(0)
        link.answer()
        await asyncio.sleep(0)
        reads.start(er, P.Read("decode", 0, "d-1", ref, 8, [[1]], [[1]]), 0.0)
        assert not completions and not posted  # posted after the engine's answer
        await asyncio.sleep(0)  # the post: copy, READ seen DONE
        assert posted == [1] and [c.status for c in completions] == ["received"]
    asyncio.run(main())


def test_a_peer_address_zmq_refuses_does_not_hold_up_other_peers_claims():
    """An engine may name any address; one ZMQ cannot dial (it raises while the turn's claims
    go out) fails its own claims only: the other peers' claims of that turn are asked and
    answered."""
    async def main() -> None:
        class Link:
            def ask(self, req, timeout_s):
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(hs.LeaseReply(True, seq=req.seq, answers=[hs.ClaimAnswer("held", 20.0)
                                                                         for _ in req.claims]))
                return fut

        def to(host, port, server=""):
            if host == "a b":
                raise zmq.ZMQError(zmq.EINVAL)
            return Link()
        leases = Leases(SimpleNamespace(to=to), Recorder(), "me", 20.0, True, 5.0)
        bad, good = [("a b", 5600, "prefill", 0, "r1", "", "")], [("10.0.0.1", 5600, "prefill", 0, "r2", "", "")]
        leases.acquire(bad)
        leases.acquire(good)
        leases.flush()
        await asyncio.sleep(0.01)
        t = time.monotonic()
        assert leases.covers(good, t)
        assert not leases.covers(bad, t)
        for task in list(leases._tasks):
            task.cancel()
    asyncio.run(main())


def test_a_claim_made_again_after_a_failed_read_lets_its_pin_go_at_its_end():
    """Two decode ranks read one prefill rank: one fails before the other claims (separate claim
    lifetimes), the other reads and notifies. The hold waits for two consumers and gets one: our
    pin must go, or the hold outlives its lease by a whole claim for a consumer that never comes."""
    async def main() -> None:
        er, holds, leases, k = held_and_claimed(0.2, 20.0)
        leases.acquire(k)
        await asyncio.sleep(0.05)  # granted: pinned 20 s
        leases.release(k, unread=True)  # the first read failed
        await asyncio.sleep(0.05)
        leases.acquire(k)  # the second read's claim
        await asyncio.sleep(0.05)
        leases.notified(k, [0])
        leases.release(k)  # it was received and notified
        await asyncio.sleep(0.3)
        holds.expire(time.monotonic())
        assert er.done == [("r1", "expired")], "the pin outlived both reads"
    asyncio.run(main())


def test_expectations_past_a_uid_s_quota_push_out_that_uid_s_own_oldest_across_its_ranks():
    """A uid announcing reads from many engine ranks (each under its own rank quota) drops its
    own oldest past max_expects_per_uid, never another uid's, whose claims stay acquired."""
    async def main() -> None:
        class Link:
            async def ask(self, req, timeout_s):
                await asyncio.sleep(3600)
        leases = Leases(SimpleNamespace(to=lambda h, p, k="": Link()), Recorder(), "me", 20.0, True, 5.0,
                        max_expects_per_uid=3)
        def ref(i):
            return P.RemoteRef("p", "10.0.0.1", 5600, 1, f"q{i}")
        leases.expect(("victim", 0), "v-1", ref(99), uid=2000)
        for i in range(6):  # six ranks of uid 1000, one expectation each
            leases.expect((f"e{i}", 0), f"r{i}", ref(i), uid=1000)
        assert leases.take_expect(("victim", 0), "v-1") == leases_mod.claim_keys(ref(99), range(1))
        kept = [i for i in range(6) if leases.take_expect((f"e{i}", 0), f"r{i}")]
        assert kept == [3, 4, 5]  # the uid's three newest
        for t in list(leases._tasks):
            t.cancel()
    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 2), st.integers(1, 3)), max_size=80))
def test_expectations_keep_every_quota_and_never_drop_another_uid_s(ops):
    """Any sequence of adds (rank, uid, claims) and pops: each uid's count within its quota, the
    claims counted exactly, and an add drops only expectations of its own rank or uid."""
    exp = leases_mod.Expectations(max_per_uid=3)
    alive: dict[tuple[str, int, str], tuple[int, int]] = {}  # key -> (uid, claims)
    for n, (add, rank, uid, claims) in enumerate(ops):
        if add or not alive:
            key = (f"e{rank}", 0, f"r{n}")
            keys = [("h", 1, "p", i, key[2], "", "") for i in range(claims)]
            kept, dropped = exp.add(key, keys, float(n), uid)
            gone = [k for k in alive if k not in exp]
            assert len(gone) == len(dropped)
            assert all(k[0] == key[0] or alive[k][0] == uid for k in gone)  # its own rank's or uid's
            for k in gone:
                del alive[k]
            if kept:
                alive[key] = (uid, claims)
        else:
            key = next(iter(alive))
            assert len(exp.pop(key) or []) == alive.pop(key)[1]
        for u in range(3):
            assert sum(1 for v in alive.values() if v[0] == u) <= 3
        assert exp._claims == sum(c for _, c in alive.values())


def test_a_uid_s_announced_claims_are_bounded_so_that_others_are_still_kept():
    """One announcement of a TP-4096 prefill is 4,096 claims: a uid announcing them from many
    ranks (each under its rank's quotas) filled the daemon's bound of claims, after which no
    other user's announcement was kept. A uid's claims are bounded too: its own oldest make room."""
    exp = leases_mod.Expectations()
    wide = leases_mod.MAX_EXPECT_CLAIMS_PER_UID // 4096
    for rank in range(64):  # 64 ranks x 1 announcement each, 4,096 claims apiece
        keys = [("h", 1, "p", i, f"q{rank}", "", "") for i in range(4096)]
        kept, _ = exp.add((f"e{rank}", 0, f"r{rank}"), keys, float(rank), uid=1000)
        assert kept
    assert exp._claims == wide * 4096  # the uid's newest only
    assert [k for k in (("e63", 0, "r63"), ("e0", 0, "r0")) if k in exp] == [("e63", 0, "r63")]
    kept, dropped = exp.add(("other", 0, "x"), [("h", 1, "p", 0, "x", "", "")], 99.0, uid=2000)
    assert kept and dropped == []


def test_early_notifications_are_bounded_in_all_oldest_out():
    """Notifications of request ids not held yet, under tokens of any value: 65,536 ids x 16
    tokens took 0.5 GiB of the prefill daemon. The pairs waiting are bounded in all (the oldest
    dropped, counted) and so are the agents kept per pair."""
    from kvxferd.holds import MAX_EARLY_SENDERS, MAX_EARLY_SLOTS, MAX_EARLY_TOKENS, EarlyBook

    book, dropped = EarlyBook(), 0
    for i in range(MAX_EARLY_SLOTS // 8):
        for t in range(MAX_EARLY_TOKENS + 4):  # 4 tokens past a request's bound: dropped at once
            dropped += book.add(("p", 0, f"r{i}"), hs.Notification("p", 0, f"r{i}", 1, f"{t:032x}"), "a", float(i))
    assert book._slots <= MAX_EARLY_SLOTS and len(book) <= MAX_EARLY_SLOTS // MAX_EARLY_TOKENS
    assert dropped >= (MAX_EARLY_SLOTS // 8) * 4
    first_kept = next(iter(book._early))
    assert first_kept[2] != "r0"  # the oldest went first
    for s in range(MAX_EARLY_SENDERS * 2):
        book.add(first_kept, hs.Notification("p", 0, first_kept[2], 1, f"{0:032x}"), f"agent-{s}", 0.0)
    assert len(book.take(first_kept).senders[f"{0:032x}"]) == MAX_EARLY_SENDERS
    assert book.expire(float("inf")) > 0 and len(book) == 0 and book._slots == 0


def test_one_key_handshaking_under_many_names_pushes_out_only_its_own():
    from kvxferd.holds import MAX_NOTIFIERS_PER_KEY
    from kvxferd.identity import fingerprint

    holds = Holds(SimpleNamespace(), SimpleNamespace(), Recorder(), 60.0)
    honest = f"kvxferd-1-00-{fingerprint('b' * 40)}"
    holds._trust_notifier(("prefill", honest))
    for i in range(MAX_NOTIFIERS_PER_KEY * 3):
        holds._trust_notifier(("prefill", f"name{i}-{fingerprint('a' * 40)}"))
    assert ("prefill", honest) in holds._notifiers
    assert len(holds._notifiers) == MAX_NOTIFIERS_PER_KEY + 1
