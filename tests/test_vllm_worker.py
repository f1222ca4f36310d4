"""The connector's worker half against a real daemon (no vLLM): leases, refusals, a daemon that
dies and comes back while the engine is idle."""

from __future__ import annotations

import select

import msgspec
import pytest
from vllm_world import daemon_status, wait_until

from kvxferd.doorbell import DoorbellError
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import buffer_address, create_shm
from kvxferd.plan.models import ModelShape, build
from kvxferd.protocol import RemoteRef
from kvxferd.rpc import FrameError
from kvxferd.vllm import worker as worker_mod
from kvxferd.vllm.handoff import HoldOrder, Orders, ReadOrder
from kvxferd.vllm.shared_kv import SharedBuffer
from kvxferd.vllm.worker import WorkerSide

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, "daemon")
    yield d
    d.stop()


def make_worker(daemon: DaemonProcess, engine: str = "engine-a") -> WorkerSide:
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    w = WorkerSide(daemon.socket, engine, 0, 1, read_deadline_s=5.0)
    w.register(geo, [SharedBuffer(fd, geo.buffers[0], buffer_address(mm), "shm", 0, [mm])], timeout_s=10)
    return w


def collect(w: WorkerSide, what: str, timeout: float):
    seen = worker_mod.Finished()

    def step():
        done = w.results()
        for name in ("sending", "recving", "failed", "load_errors"):
            getattr(seen, name).update(getattr(done, name))
        return seen if what in seen.sending | seen.recving else None
    return wait_until(f"{what} finished", step, timeout, 0.05)


def test_a_hold_whose_lease_passes_is_freed(daemon):
    w = make_worker(daemon)
    w.start(Orders([HoldOrder("r1", [[1, 2]], 0.3)], []))
    assert [h.request for h in daemon_status(daemon).held] == ["r1"]
    assert "r1" in collect(w, "r1", 5).sending
    w.close()


def test_an_idle_step_waits_for_the_daemon_and_a_busy_step_does_not(daemon):
    """vLLM steps an engine without pause while transfers are pending: a step with no tokens
    scheduled waits for the next completion instead of returning at once (and spinning)."""
    w = make_worker(daemon)
    w.idle_wait_s = 30.0
    w.start(Orders([HoldOrder("r1", [[1, 2]], 0.5)], [], idle=False))
    assert not w.results().sending  # a busy step: one look, the lease has not passed
    w.start(Orders([], [], idle=True))
    assert w.results().sending == {"r1"}  # one idle step: it waited until the lease passed
    w.close()


def spy_calls(w: WorkerSide) -> list[str]:
    """The names of the messages the worker's connection sends (each call goes through)."""
    assert w.client is not None
    sent: list[str] = []
    real = w.client.rpc.call

    def call(msg, *args, **kwargs):
        sent.append(type(msg).__name__)
        return real(msg, *args, **kwargs)
    w.client.rpc.call = call
    return sent


def test_a_step_learns_what_finished_without_a_round_trip(daemon):
    """With transfers pending, a busy step reads the doorbell, and the completion itself comes
    in it (protocol 7): no poll, whether nothing finished or something did (here: the hold's
    lease passes)."""
    w = make_worker(daemon)
    assert w.client is not None and w.client.doorbell is not None
    w.start(Orders([HoldOrder("r1", [[1, 2]], 0.5)], [], idle=False))
    sent = spy_calls(w)
    for _ in range(200):
        assert not w.results().sending
    assert sent == []  # 200 steps, no round trip
    assert "r1" in collect(w, "r1", 5).sending
    assert sent == []  # the expiry came in the doorbell
    steps = w.take_stats().step_seconds  # what vLLM's /metrics shows (vllm:kvxferd_step_seconds)
    assert len(steps) >= 200 and all(s > 0 for s in steps)
    w.start(Orders([], [], idle=True))
    w.results()
    assert w.take_stats().step_seconds == []  # nothing pending, and an idle step waits by design
    w.close()


def test_what_the_doorbell_held_when_the_daemon_went_still_counts(daemon):
    """A hold's expiry sits in the doorbell, unread, when the daemon stops: the worker takes it
    before it drops the connection, so the blocks are freed now instead of kept for the daemon's
    max lease (what a lost connection does to holds the daemon had accepted)."""
    w = make_worker(daemon)
    w.start(Orders([HoldOrder("r1", [[1, 2]], 0.3)], [], idle=False))
    assert w.client is not None and w.client.doorbell is not None
    doorbell = w.client.doorbell
    wait_until("the expiry in the doorbell", lambda: select.select([doorbell], [], [], 0)[0], 10, 0.05)
    daemon.stop()
    wait_until("the worker notices", lambda: w.client is None, 10, 0.05)
    assert w.results().sending == {"r1"} and w.take_stats().expired == 1
    w.close()


@pytest.mark.parametrize("error", [FrameError("frame of 1 TiB announced"), msgspec.DecodeError("not msgpack"),
                                   DoorbellError("record of 1048576 B announced; at most 4092")])
def test_a_reply_not_understood_is_a_lost_connection_not_an_exception_in_vllm_s_step(daemon, error):
    """A reply (or doorbell record) the worker cannot read leaves the stream unusable: its step
    must not raise into vLLM; the read in flight fails visibly and the hold waits for a daemon."""
    w = make_worker(daemon)
    w.start(Orders([HoldOrder("h1", [[1]], 30.0)], [ReadOrder("d1", RemoteRef("nobody", "127.0.0.1", 1, 1, "x"),
                                                              4, [[5]], [[1]])]))
    assert w.client is not None

    def broken(*args, **kwargs):
        raise error
    w.client.pushed = broken
    w.client.poll = broken
    done = w.results()
    assert w.client is None and done.failed == {"d1"} and "h1" in w.holds
    w.close()


def test_a_steps_orders_go_in_one_frame(daemon):
    w = make_worker(daemon, "decode")
    sent = spy_calls(w)
    remote = RemoteRef("nobody", "127.0.0.1", 1, 1, "p-req")
    w.start(Orders([HoldOrder("h1", [[1]], 30.0), HoldOrder("h2", [[2]], 30.0)],
                   [ReadOrder("d1", remote, 4, [[5]], [[1]]), ReadOrder("d2", remote, 4, [[6]], [[2]])]))
    assert sent == ["Batch"]
    assert sorted(h.request for h in daemon_status(daemon).held) == ["h1", "h2"]
    assert set(w.reading) == {"d1", "d2"}
    w.close()


def test_a_step_with_more_orders_than_a_frame_holds_sends_several(daemon, monkeypatch):
    from kvxferd import protocol

    w = make_worker(daemon)
    sent = spy_calls(w)
    monkeypatch.setattr(protocol, "MAX_BATCH", 2)
    w.start(Orders([HoldOrder(f"h{i}", [[i]], 30.0) for i in range(5)], []))
    assert sent == ["Batch"] * 3
    assert sorted(h.request for h in daemon_status(daemon).held) == [f"h{i}" for i in range(5)]
    assert set(w.accepted) == {f"h{i}" for i in range(5)}
    w.close()


def test_a_reconnect_refused_halfway_counts_no_hold_as_the_daemons(daemon):
    """A reconnect re-holds what the worker holds; when the daemon refuses one of them, none
    counts as the daemon's to end (the worker frees them when their lease passes: one counted
    wrongly once kept another hold's blocks for ever)."""
    import time

    w = make_worker(daemon)
    with w.lock:  # the watcher thread reconnects under it
        w._lost(ConnectionError("test: the daemon went away"))
        now = time.monotonic()
        w.holds = {"r1": (HoldOrder("r1", [[1]], 30.0), now + 30), "r2": (HoldOrder("r2", [[99]], 30.0), now + 30)}
        with pytest.raises(RuntimeError, match="registering"):
            w._connect()  # r1 taken, r2 (block 99 of 16) refused
        assert w.client is None and not w.accepted
    w.close()


def test_a_refused_hold_is_freed_by_the_worker_after_its_lease(daemon, monkeypatch):
    monkeypatch.setattr(worker_mod, "ORPHAN_GRACE_S", 0.2)
    w = make_worker(daemon)
    w.start(Orders([HoldOrder("r1", [[1]], 10_000.0)], []))  # over the daemon's max lease: refused
    assert not daemon_status(daemon).held
    w.holds["r1"] = (w.holds["r1"][0], 0.0)  # its lease has passed
    assert "r1" in collect(w, "r1", 5).sending
    w.close()


def test_a_failed_read_reports_its_blocks(daemon):
    w = make_worker(daemon, "decode")
    remote = RemoteRef("nobody", "127.0.0.1", 1, 1, "p-req")  # no daemon there: handshake fails
    w.start(Orders([], [ReadOrder("d-req", remote, 8, [[5, 6]], [[1, 2]])]))
    seen = collect(w, "d-req", 15)
    assert seen.failed == {"d-req"} and seen.load_errors == {5, 6}
    w.close()


def test_daemon_restart_while_idle_reregisters_and_reholds(tmp_path):
    d = DaemonProcess(tmp_path, "daemon", side_channel_port=0)
    w = make_worker(d)
    w.start(Orders([HoldOrder("r1", [[1]], 60.0)], [ReadOrder("d-req", RemoteRef("x", "127.0.0.1", 1, 1, "p"), 8,
                                                              [[3]], [[4]])]))
    d.kill()
    seen = collect(w, "d-req", 10)  # noticed by the watcher, with no call from the engine
    assert seen.failed == {"d-req"} and seen.load_errors == {3}
    d2 = DaemonProcess(tmp_path, "daemon", socket=d.socket)
    try:
        status = wait_until("registered again", lambda: daemon_status(d2).engines and daemon_status(d2), 10)
        assert [h.request for h in status.held] == ["r1"]
        assert status.engines[0].engine == "engine-a"
    finally:
        w.close()
        d2.stop()



def test_a_refused_read_fails_its_blocks_and_still_releases_the_prefill(daemon):
    """The scheduler could not make the read whole (here: the prefill's list is too short for the
    tokens): the worker fails it with the blocks vLLM was promised and still sends the prefill a
    release, which reaches the daemon (and fails there: no prefill answers at that address)."""
    from kvxferd.vllm import handoff

    w = make_worker(daemon)
    try:
        remote = handoff.parse_remote({"remote_engine_id": "p", "remote_request_id": "req-p",
                                       "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1,
                                       "remote_block_ids": [[4, 5]], "remote_num_tokens": 14,
                                       "remote_block_sizes": [4]}, 1)
        order = handoff.read_order("req-d", remote, [handoff.GroupInfo("attention", 4)], [[9, 8, 7, 6]], 14, 4)
        assert "2 blocks" in order.refusal
        w.start(Orders([], [order]))
        done = w.results()
        assert done.recving == {"req-d"} and done.failed == {"req-d"} and done.load_errors == {8, 7, 6}
        wait_until("the release reached the daemon",
                   lambda: any(f.request == "req-d" for f in daemon_status(daemon).failures), 20)
    finally:
        w.close()
