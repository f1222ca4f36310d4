"""Fault injection with real processes and real NIXL. For each fault: the affected requests
end `failed` (with their block ids) or `expired` within the configured deadline, memory whose
transfer outcome is unknown stays mapped, and the daemon serves the next valid request."""

import os
import signal
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvxferd.client import EngineClient, RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import PRESETS, ModelShape, build

replace = msgspec.structs.replace
SHAPE = replace(PRESETS["dense"], num_blocks=256, layers=2)
BIG = replace(PRESETS["dense"], num_blocks=2048, layers=8, block_size=16)
BIG_TOKENS = 16 * 1900  # ~1 GB per prompt over 4 ranks: long enough over TCP to be caught mid-transfer


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def serves_next_request(c: Cluster, seq: int) -> None:
    out = c.transfer(seq, num_tokens=37, hit_tokens=16)
    assert out["status"] == "received" and out["released"] == ["sent"] * c.p_tp, out["reason"]


def read_outcome(c: Cluster, seq: int, num_tokens: int, deadline: float, remote=None, blocks=None):
    """Post a read on every decode rank; return (elapsed, outcomes, local blocks).

    Without `remote`, the prompt is prefilled first; otherwise `blocks` (or 64 made-up
    block ids) stand for the prefill side's blocks.
    """
    if remote is None:
        blocks = c.prefill.prefill(seq, num_tokens, 30.0)
    elif blocks is None:
        blocks = [list(range(64))]
    t0 = time.monotonic()
    local = c.decode.post_read(seq, num_tokens, remote or c.remote(seq), blocks, 0, deadline)
    outcomes = c.decode.wait_read(seq, deadline + 10)
    return time.monotonic() - t0, outcomes, local


def test_prefill_daemon_killed_mid_transfer_then_restarts_on_the_same_port():
    with Cluster(BIG, 2, 4, daemon_args=["--ucx", "UCX_TLS=tcp"]) as c:
        c.transfer(0, 64)  # handshake done, peer cached
        blocks = c.prefill.prefill(1, BIG_TOKENS, 30.0)
        c.decode.post_read(1, BIG_TOKENS, c.remote(1), blocks, 0, 5.0)  # returns once posted
        c.daemons[0].kill()
        c.prefill.proc.kill()
        outcomes = c.decode.wait_read(1, 20)
        assert len(outcomes) == 4  # exactly one completion per decode rank
        for status, block_ids, reason, _ in outcomes:
            assert status in ("failed", "received")
            if status == "failed":
                assert block_ids and reason
        failed = [o for o in outcomes if o[0] == "failed"]
        assert failed, "the transfer finished before the kill; make the prompt larger"
        # the prefill side comes back on the same port: cached metadata is stale and never reused
        d = DaemonProcess(c.work, "prefill-daemon-2", side_channel_port=c.port, extra=["--ucx", "UCX_TLS=tcp"])
        c.daemons.append(d)
        c.prefill = EngineProcess(d.socket, "prefill", BIG, 2)
        c.engines.append(c.prefill)
        serves_next_request(c, 2)
        assert c.status(1).counters.handshakes == 2


def test_prefill_engine_killed_while_holding():
    with Cluster(SHAPE, 2, 4, daemon_args=["--handshake-timeout", "2"]) as c:
        serves_next_request(c, 0)
        blocks = c.prefill.prefill(1, 40, 1.5)
        c.prefill.proc.kill()
        # the daemon keeps the dead engine's memory while a reader could still be using it ...
        st = wait_for(lambda: (st := c.status(0)).engines and all(e.state == "closing" for e in st.engines) and st,
                      10, "both ranks marked closing")  # one rank closing first still lists the other's hold
        assert st.held == []
        # ... and lets it go once the lease has passed
        wait_for(lambda: not c.status(0).engines, 15, "memory released after the lease")
        _elapsed, outcomes, _local = read_outcome(c, 1, 40, 5.0, remote=c.remote(1), blocks=blocks)
        assert [o[0] for o in outcomes] == ["failed"] * 4
        # refused at the grant (the cached route's claim: no hold there any more), or at a fresh handshake
        assert all("no longer holds" in o[2] or "not registered" in o[2] for o in outcomes), outcomes
        c.prefill = EngineProcess(c.daemons[0].socket, "prefill", SHAPE, 2)
        c.engines.append(c.prefill)
        serves_next_request(c, 2)


def test_decode_engine_killed_mid_read():
    with Cluster(BIG, 2, 4, daemon_args=["--ucx", "UCX_TLS=tcp"]) as c:
        serves_next_request(c, 0)
        blocks = c.prefill.prefill(1, BIG_TOKENS, 5.0)
        c.decode.post_read(1, BIG_TOKENS, c.remote(1), blocks, 0, 30.0)
        c.decode.proc.kill()
        st = wait_for(lambda: (lambda s: s if not s.engines and not s.in_flight else None)(c.status(1)),
                      30, "decode memory released after its transfers ended")
        assert st.quarantined == 0
        assert st.counters.failed + st.counters.received >= 4 + 4
        # the prefill side is told: every rank's hold ends once (sent if the reads completed, else expired)
        assert sorted(c.prefill.wait_released(1, 15)) in (["sent", "sent"], ["expired", "expired"],
                                                                   ["expired", "sent"])
        c.prefill.free(blocks)
        c.decode = EngineProcess(c.daemons[1].socket, "decode", BIG, 4)
        c.engines.append(c.decode)
        serves_next_request(c, 2)


def test_peer_unreachable():
    with Cluster(SHAPE, 2, 4, daemon_args=["--handshake-timeout", "1"]) as c:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        elapsed, outcomes, local = read_outcome(c, 1, 40, 10.0,
                                                remote=RemoteRef("prefill", "127.0.0.1", dead_port, 2, "r"))
        assert elapsed < 1 + 3
        assert [o[0] for o in outcomes] == ["failed"] * 4
        assert all(o[1] == local and "handshake" in o[2] for o in outcomes)
        assert c.status(1).counters.handshake_failures == 1  # one handshake shared by the 4 ranks
        serves_next_request(c, 2)


@pytest.fixture
def silent_peer():
    """A ZMQ ROUTER that takes handshake requests and never answers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, RemoteRef("prefill", "127.0.0.1", port, 2, "r")
    sock.close(0)
    ctx.term()


def test_handshake_answer_never_comes(silent_peer):
    sock, ref = silent_peer
    with Cluster(SHAPE, 2, 4, daemon_args=["--handshake-timeout", "1"]) as c:
        elapsed, outcomes, _ = read_outcome(c, 1, 40, 10.0, remote=ref)
        assert sock.poll(0), "the silent peer did receive the handshake request"
        assert 1 <= elapsed < 4
        assert all(o[0] == "failed" and "no handshake answer" in o[2] for o in outcomes)
        serves_next_request(c, 2)


def test_read_deadline_shorter_than_the_handshake(silent_peer):
    with Cluster(SHAPE, 2, 4, daemon_args=["--handshake-timeout", "5"]) as c:
        elapsed, outcomes, _ = read_outcome(c, 1, 40, 0.5, remote=silent_peer[1])
        assert elapsed < 2.5
        assert all(o[0] == "failed" and "deadline" in o[2] for o in outcomes)


def test_lost_notification_lease_expiry_frees_the_blocks():
    with Cluster(SHAPE, 2, 4) as c:
        blocks = c.prefill.prefill(1, 40, 1.0)
        wrong = RemoteRef("prefill", c.host, c.port, 2, "req-does-not-exist")  # notifications go nowhere
        _, outcomes, _ = read_outcome(c, 1, 40, 1.0, remote=wrong, blocks=blocks)
        # nothing held under that name vouches for the bytes: failed, not received
        assert all(o[0] == "failed" and "expired" in o[2] and "never held" in o[2] for o in outcomes), outcomes
        assert c.prefill.wait_released(1, 10) == ["expired", "expired"]
        c.prefill.free(blocks)
        st = c.status(0)
        assert st.held == [] and st.counters.expired == 2
        serves_next_request(c, 2)


def test_compatibility_hash_mismatch_names_the_difference():
    other = replace(SHAPE, head_dim=64)
    with Cluster(SHAPE, 2, 4, p_shape=other) as c:
        blocks = c.prefill.prefill(1, 40, 2.0)
        _, outcomes, local = read_outcome(c, 1, 40, 5.0, remote=c.remote(1), blocks=blocks)
        assert all(o[0] == "failed" and o[1] == local for o in outcomes)
        assert "compatibility hash mismatch" in outcomes[0][2] and "head_dim=128" in outcomes[0][2] \
            and "head_dim=64" in outcomes[0][2]
        assert c.prefill.wait_released(1, 10) == ["expired", "expired"]
        c.prefill.free(blocks)


def test_deadline_passes_mid_transfer_memory_quarantined():
    with Cluster(BIG, 2, 4, daemon_args=["--ucx", "UCX_TLS=tcp"]) as c:
        serves_next_request(c, 0)
        blocks = c.prefill.prefill(1, BIG_TOKENS, 30.0)
        _, outcomes, local = read_outcome(c, 1, BIG_TOKENS, 0.002, remote=c.remote(1), blocks=blocks)
        assert all(o[0] == "failed" and "deadline" in o[2] and o[1] == local for o in outcomes), outcomes
        st = c.status(1)  # NIXL cannot cancel: the reads ran on, each keeping its rank's memory pinned
        posted = sum("memory quarantined" in o[2] for o in outcomes)  # (one failing before its post is not)
        assert posted and st.counters.quarantined == posted, st
        assert sum(e.pinned for e in st.engines) == st.quarantined, st  # (the fastest may have ended already)
        wait_for(lambda: c.status(1).quarantined == 0, 60, "quarantined transfers to finish")
        assert all(e.pinned == 0 for e in c.status(1).engines)
        c.prefill.wait_released(1, 30)
        c.prefill.free(blocks)
        serves_next_request(c, 2)


def test_sigterm_under_load_fails_reads_and_exits_within_the_stop_timeout():
    with Cluster(BIG, 2, 4, daemon_args=["--ucx", "UCX_TLS=tcp"]) as c:
        serves_next_request(c, 0)
        blocks = c.prefill.prefill(1, BIG_TOKENS, 30.0)
        local = c.decode.post_read(1, BIG_TOKENS, c.remote(1), blocks, 0, 30.0)  # returns once posted
        daemon = c.daemons[1]
        daemon.proc.send_signal(signal.SIGTERM)
        outcomes = c.decode.wait_read(1, 30)
        # Each rank's read ends exactly once: finished before the stop (all its bytes), or failed by
        # the stop with its block ids. Ranks post one after another, so early ones may finish first.
        received = [o for o in outcomes if o[0] == "received"]
        stopped = [o for o in outcomes if o[0] == "failed" and o[2].startswith("shutdown:") and o[1] == local]
        assert len(received) + len(stopped) == len(outcomes) and stopped, outcomes
        assert len({o[3] for o in received}) <= 1 and all(o[3] > 0 for o in received), outcomes
        assert daemon.proc.wait(30) == 0  # within systemd's TimeoutStopSec
        log = Path(daemon.log.name).read_text()
        assert "kvxferd stopped" in log and "Traceback" not in log
        c.prefill.wait_released(1, 30)  # quarantined READs that ended still notified: sent or expired
        c.prefill.free(blocks)


def test_sigterm_with_a_handshake_under_way_exits_at_once(tmp_path):
    """A handshake to a peer that never answers holds a side-channel socket open: the stop
    closes it rather than waiting on it (it waited for the SIGKILL that followed SIGTERM)."""
    # the handshake must still be waiting when the stop comes, however slow this machine is
    daemon = DaemonProcess(tmp_path, "daemon", extra=["--handshake-timeout", "120"])
    geo = build(msgspec.structs.replace(PRESETS["dense"], num_blocks=16, layers=1), 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "engine", 0, 1) as engine:
            engine.register(geo, shm_fds=[fd])
            # TEST-NET: nothing answers there, the handshake waits
            engine.read("r", RemoteRef("silent", "192.0.2.1", 5600, 1, "r"), 16, [[1]], [[1]], 120.0)
            assert engine.status().in_flight  # under way: the handshake is out
            daemon.proc.send_signal(signal.SIGTERM)
            [done] = engine.poll(5.0)  # the stop fails the read, then waits for the engine to learn it
            assert done.status == "failed" and done.reason.startswith("shutdown"), done
            assert daemon.proc.wait(9) == 0  # by itself, well before the harness's SIGKILL at 10 s
        log = Path(daemon.log.name).read_text()
        assert "kvxferd stopped" in log and "Traceback" not in log
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


@pytest.fixture
def lying_proxy():
    """A side channel in front of a real prefill daemon that rewrites each rank's compatibility
    hash in the handshake reply to `want[0]` (the decode's): a peer whose hash is a lie."""
    from kvxferd import handshake as hs

    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    target: list[tuple[str, int]] = []
    want: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not front.poll(50):
                continue
            ident, empty, body = front.recv_multipart()
            back = ctx.socket(zmq.REQ)
            back.connect(f"tcp://{target[0][0]}:{target[0][1]}")
            back.send(body)
            reply = hs._reply_decoder.decode(back.recv())
            back.close(0)
            lie = replace(reply, ranks=[replace(r, compat_hash=want[0]) for r in reply.ranks])
            front.send_multipart([ident, empty, hs._encoder.encode(lie)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port, target, want
    stop.set()
    thread.join(5)
    front.close(0)
    ctx.term()


def test_a_peer_that_lies_about_its_compatibility_hash_is_caught(lying_proxy):
    """The hash a peer sends proves nothing: the decode recomputes it from the geometry the peer
    sent, so a prefill of another head size claiming the decode's hash is refused by name."""
    from kvxferd import handshake as hs
    from kvxferd.plan.geometry import validate
    from kvxferd.plan.models import build

    port, target, want = lying_proxy
    other = replace(SHAPE, head_dim=64)
    with Cluster(SHAPE, 2, 4, p_shape=other) as c:
        target.append((c.host, c.port))
        want.append(hs.compat_hash(validate(build(SHAPE, 4, 0))))
        blocks = c.prefill.prefill(1, 40, 2.0)
        lying = RemoteRef("prefill", "127.0.0.1", port, 2, "req-1")
        _, outcomes, local = read_outcome(c, 1, 40, 5.0, remote=lying, blocks=blocks)
        assert all(o[0] == "failed" and o[1] == local for o in outcomes), outcomes
        assert "compatibility hash mismatch" in outcomes[0][2] and "head_dim=64" in outcomes[0][2]
        c.prefill.free(blocks)


def test_a_plan_over_the_descriptor_budget_is_refused_at_handshake(monkeypatch):
    """A peer whose pages are tiny for its cache would make the decode build descriptor arrays
    without bound; above max_plan_descriptors the route is refused, naming the setting."""
    monkeypatch.setenv("KVXFERD_MAX_PLAN_DESCRIPTORS", "64")
    with Cluster(SHAPE, 2, 4) as c:
        blocks = c.prefill.prefill(1, 40, 2.0)
        _, outcomes, local = read_outcome(c, 1, 40, 5.0, remote=c.remote(1), blocks=blocks)
        assert all(o[0] == "failed" and o[1] == local for o in outcomes), outcomes
        assert all("max_plan_descriptors 64" in o[2] for o in outcomes), outcomes
        c.prefill.free(blocks)


# One-token pages of 64 B (one head of 16 fp32) over 140,000 blocks: 1.1 M descriptors a side.
TINY_PAGES = ModelShape(layers=2, kv_heads=1, head_dim=16, dtype="fp32", block_size=1, num_blocks=140_000)


def test_a_peer_of_pages_too_small_for_its_cache_is_refused_at_handshake():
    """The descriptor budget is sized from the geometries: a route of more than FREE_DESCRIPTORS
    whose rows move less than MIN_ROW_BYTES on average is refused before any array is built,
    whatever max_plan_descriptors allows."""
    from kvxferd.peers import FREE_DESCRIPTORS
    from kvxferd.plan.planner import plan_rank
    from kvxferd.reading import MIN_ROW_BYTES

    plan = plan_rank(build(TINY_PAGES, 1, 0), {0: build(TINY_PAGES, 1, 0)})
    pp = plan.peers[0]  # the case it is: many rows, each shorter than a row must be
    assert pp.num_local_descs + pp.num_remote_descs > FREE_DESCRIPTORS and int(pp.length.max()) < MIN_ROW_BYTES
    with Cluster(TINY_PAGES, 1, 1) as c:
        blocks = c.prefill.prefill(1, 40, 2.0, read_token=c.read_token(1))
        _, outcomes, local = read_outcome(c, 1, 40, 5.0, remote=c.remote(1), blocks=blocks)
        assert [o[:2] for o in outcomes] == [("failed", local)], outcomes
        assert "descriptors of 64 B on average" in outcomes[0][2], outcomes
        c.prefill.free(blocks)


# A prefill of one-token blocks read into 16-token ones: a row per token, head, layer and K/V
WIDE_ROWS = ModelShape(layers=4, kv_heads=8, head_dim=64, block_size=16, num_blocks=128)
WIDE_ROWS_PREFILL = replace(WIDE_ROWS, block_size=1, num_blocks=16 * 128)


def test_a_read_of_many_rows_is_built_off_the_loop_and_arrives_exact():
    """A read whose arrays are too large to build on the daemon's loop (ROWS_ON_LOOP) is built on
    its builder thread; its bytes arrive as a small read's do."""
    from kvxferd.plan.descriptors import RequestBlocks
    from kvxferd.plan.planner import plan_rank
    from kvxferd.reading import ROWS_ON_LOOP, estimate, rows_per_block

    tokens = 100 * WIDE_ROWS.block_size
    plan = plan_rank(build(WIDE_ROWS, 1, 0), {0: build(WIDE_ROWS_PREFILL, 1, 0)})
    assert estimate(rows_per_block(plan), RequestBlocks.of(tokens, [range(100)], [range(tokens)])) > ROWS_ON_LOOP
    with Cluster(WIDE_ROWS, 1, 1, p_shape=WIDE_ROWS_PREFILL) as c:
        assert c.transfer(1, tokens)["status"] == "received"  # every byte verified by the decode engine
        assert c.transfer(2, 40)["status"] == "received"  # small ones go on as before
