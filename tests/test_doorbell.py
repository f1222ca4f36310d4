"""Protocol 3's doorbell: the daemon rings an engine's eventfd when completions wait, so a step
where nothing finished costs the engine one non-blocking read instead of a poll round trip."""

from __future__ import annotations

import os
import time

import pytest

from kvxferd import protocol as P
from kvxferd.client import DaemonError, EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)
NOBODY = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")  # nothing listens: a read there fails fast


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, "daemon")
    yield d
    d.stop()


@pytest.fixture
def shm():
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    yield geo, fd
    os.close(fd)
    mm.close()


def rung_within(c: EngineClient, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if c.rung():
            return True
        time.sleep(0.005)
    return False


def test_rings_when_a_completion_waits_and_not_before(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True)
        assert c.doorbell is not None
        assert not c.rung()  # nothing queued yet
        c.hold("held", 600.0, [[1]])  # a hold alone completes nothing
        assert not rung_within(c, 0.3)
        c.read("r1", NOBODY, 8, [[3, 4]], [[3, 4]], 5.0)
        assert rung_within(c, 10.0)
        [done] = c.poll(0.0)
        assert (done.request_id, done.status, done.block_ids) == ("r1", "failed", [[3, 4]])
        assert not c.rung()  # one ring per batch of completions, consumed above


def test_rings_again_while_completions_remain_after_a_poll(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True)
        for i in range(3):
            c.read(f"r{i}", NOBODY, 8, [[i]], [[i]], 5.0)
        seen: list[str] = []
        end = time.monotonic() + 10.0
        while len(seen) < 3 and time.monotonic() < end:
            if c.rung():
                seen += [x.request_id for x in c.poll(0.0, max_items=1)]
            else:
                time.sleep(0.005)
        assert sorted(seen) == ["r0", "r1", "r2"]  # each poll took one; the bell rang for the rest
        assert c.poll(0.0) == []


def test_a_fd_that_is_no_eventfd_is_refused_by_name(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        r, w = os.pipe()
        try:
            msg, sent = c.requests.register(geo, shm_fds=[fd], doorbell=r)
            with pytest.raises(DaemonError) as err:
                c.rpc.call(msg, P.Registered, sent)
            assert err.value.code == "bad_request" and "doorbell" in str(err.value) and "eventfd" in str(err.value)
            c.register(geo, shm_fds=[fd])  # nothing was kept: the rank registers cleanly afterwards
        finally:
            os.close(r)
            os.close(w)


def test_a_protocol_2_client_has_no_doorbell_and_polls_every_time(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.rpc.version = 2  # what the client learns from a daemon that speaks protocol 2
        c.register(geo, shm_fds=[fd], doorbell=True)
        assert c.doorbell is None
        assert c.rung()  # without a doorbell every poll may find something
