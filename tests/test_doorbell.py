"""The completion doorbell (protocol 5): the daemon writes a byte to a pipe whose read end it gave
the engine when completions wait, so a step where nothing finished costs the engine one
non-blocking read instead of a poll round trip. The write end is the daemon's alone."""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

import pytest

from kvxferd import protocol as P
from kvxferd.client import EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)
NOBODY = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")  # nothing listens: a read there fails at its deadline
DEADLINE_S = 1.0


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
        c.read("r1", NOBODY, 8, [[3, 4]], [[3, 4]], DEADLINE_S)
        assert rung_within(c, 10.0)
        [done] = c.poll(0.0)
        assert (done.request_id, done.status, done.block_ids) == ("r1", "failed", [[3, 4]])
        assert not c.rung()  # one ring per batch of completions, consumed above


def test_rings_again_while_completions_remain_after_a_poll(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True)
        for i in range(3):
            c.read(f"r{i}", NOBODY, 8, [[i]], [[i]], DEADLINE_S)
        seen: list[str] = []
        end = time.monotonic() + 10.0
        while len(seen) < 3 and time.monotonic() < end:
            if c.rung():
                seen += [x.request_id for x in c.poll(0.0, max_items=1)]
            else:
                time.sleep(0.005)
        assert sorted(seen) == ["r0", "r1", "r2"]  # each poll took one; the bell rang for the rest
        assert c.poll(0.0) == []


def test_an_engine_made_doorbell_is_closed_unrung(daemon, shm):
    """A protocol 3-4 client's eventfd would share its open file with the engine, which could
    make the daemon's write block: the daemon takes it, closes it and says it has no doorbell."""
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        bell = os.eventfd(0, os.EFD_NONBLOCK)
        try:
            msg, sent = c.requests.register(geo, shm_fds=[fd], doorbell=bell)
            reply = c.rpc.call(msg, P.Registered, sent)
            assert reply.doorbell is False and c.rpc.reader.fds == deque()
            c.read("r", NOBODY, 8, [[3]], [[3]], DEADLINE_S)
            [done] = c.poll(10.0)
            assert done.status == "failed"
            with pytest.raises(BlockingIOError):
                os.eventfd_read(bell)  # never rung
        finally:
            os.close(bell)


def test_the_engine_cannot_make_the_daemon_s_end_blocking(daemon, shm):
    """The engine holds only the read end: making it blocking leaves the daemon's write end
    non-blocking (a separate open file), as /proc shows, and rings still arrive."""
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True)
        assert c.doorbell is not None
        os.set_blocking(c.doorbell, True)
        inode = os.fstat(c.doorbell).st_ino
        pid = daemon.proc.pid
        def ends() -> list[str]:
            return [n for n in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{n}") == f"pipe:[{inode}]"]

        deadline = time.monotonic() + 10  # the daemon closes the read end it sent right after sending
        while len(ends()) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        [write_end] = ends()  # the write end only
        fdinfo = Path(f"/proc/{pid}/fdinfo/{write_end}").read_text().splitlines()
        flags = int(next(line.split()[1] for line in fdinfo if line.startswith("flags:")), 8)
        assert flags & os.O_NONBLOCK and flags & os.O_ACCMODE == os.O_WRONLY
        os.set_blocking(c.doorbell, False)
        c.read("r", NOBODY, 8, [[3]], [[3]], DEADLINE_S)
        assert rung_within(c, 10.0)


def test_a_protocol_2_client_has_no_doorbell_and_polls_every_time(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.rpc.version = 2  # what the client learns from a daemon that speaks protocol 2
        c.register(geo, shm_fds=[fd], doorbell=True)
        assert c.doorbell is None
        assert c.rung()  # without a doorbell every poll may find something
