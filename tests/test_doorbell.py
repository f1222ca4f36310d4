"""The completion doorbell: a pipe whose read end the daemon gave the engine. Protocol 7 writes the
completions themselves into it (records), protocol 5-6 a byte when completions wait for a poll
(ring), so a step costs the engine one non-blocking read instead of a poll round trip. The
write end is the daemon's alone."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import time
from collections import deque
from pathlib import Path

import msgspec
import pytest
from fake_daemon import register_with

from kvxferd import protocol as P
from kvxferd.client import EngineClient
from kvxferd.doorbell import (
    F_SEAL_FUTURE_WRITE,
    POLL_MARKER,
    Doorbell,
    DoorbellError,
    PipeReader,
    Records,
    queued_bytes,
)
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


def pushed_within(c: EngineClient, seconds: float, want: int = 1) -> tuple[list[P.Completion], bool]:
    """What the doorbell brought within `seconds`: until `want` completions or a poll request."""
    got: list[P.Completion] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        items, poll = c.pushed(0.05)
        got += items
        if poll or len(got) >= want:
            return got, poll
    return got, False


def test_a_completion_comes_in_the_doorbell_and_no_poll_is_needed(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True, records=True)
        assert c.doorbell is not None
        assert c.pushed() == ([], False)  # nothing queued yet
        c.hold("held", 600.0, [[1]])  # a hold alone completes nothing
        assert pushed_within(c, 0.3) == ([], False)
        c.read("r1", NOBODY, 8, [[3, 4]], [[3, 4]], DEADLINE_S)
        [done], poll = pushed_within(c, 10.0)
        assert (done.request_id, done.status, done.block_ids, poll) == ("r1", "failed", [[3, 4]], False)
        assert "connection" in done.reason or "deadline" in done.reason
        assert c.poll(0.0) == []  # delivered once, in the pipe only


def test_ring_mode_rings_when_a_completion_waits_and_not_before(daemon, shm):
    """A protocol 5-6 engine (records=False): a byte, then a poll takes the completion."""
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True, records=False)
        assert c.pushed() == ([], False)
        c.read("r1", NOBODY, 8, [[3, 4]], [[3, 4]], DEADLINE_S)
        assert pushed_within(c, 10.0) == ([], True)
        [done] = c.poll(0.0)
        assert (done.request_id, done.status, done.block_ids) == ("r1", "failed", [[3, 4]])
        assert c.pushed() == ([], False)  # one ring per batch of completions, consumed above


def test_ring_mode_rings_again_while_completions_remain_after_a_poll(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True, records=False)
        for i in range(3):
            c.read(f"r{i}", NOBODY, 8, [[i]], [[i]], DEADLINE_S)
        seen: list[str] = []
        end = time.monotonic() + 10.0
        while len(seen) < 3 and time.monotonic() < end:
            if c.pushed(0.05)[1]:
                seen += [x.request_id for x in c.poll(0.0, max_items=1)]
        assert sorted(seen) == ["r0", "r1", "r2"]  # each poll took one; the bell rang for the rest
        assert c.poll(0.0) == []


BIG_SHAPE = ModelShape(layers=1, kv_heads=1, head_dim=8, block_size=4, num_blocks=16384)


def test_a_record_too_large_for_one_write_goes_to_the_queue_and_later_ones_follow_it(daemon):
    """A failed read's block ids over PIPE_BUF: the marker asks for a poll, which takes it, and
    the completions after it queue behind it until then (the engine sees them in order)."""
    geo = build(BIG_SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "engine", 0, 1) as c:
            c.register(geo, shm_fds=[fd], doorbell=True, records=True)
            big = list(range(1000, 3000))  # 3 B each in msgpack: ~6 KB
            c.read("big", NOBODY, 8, [big], [big], DEADLINE_S)
            time.sleep(0.2)
            c.read("small", NOBODY, 8, [[3]], [[3]], DEADLINE_S)  # fails after "big"
            got, poll = pushed_within(c, 10.0)
            assert (got, poll) == ([], True)
            time.sleep(0.5)  # "small" fails meanwhile: queued behind "big", not in the pipe
            assert c.pushed() == ([], False)
            assert [(x.request_id, len(x.block_ids[0])) for x in c.poll(0.0)] == [("big", 2000), ("small", 1)]
            c.read("after", NOBODY, 8, [[5]], [[5]], DEADLINE_S)  # the queue is empty: records again
            [done], poll = pushed_within(c, 10.0)
            assert (done.request_id, poll) == ("after", False)
    finally:
        os.close(fd)
        mm.close()


def test_an_engine_that_stops_reading_fills_a_quarter_of_its_pipe_then_the_queue(daemon):
    geo = build(BIG_SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "engine", 0, 1) as c:
            c.register(geo, shm_fds=[fd], doorbell=True, records=True, ring=False)
            assert c.doorbell is not None and c._ring is None
            n = 40  # ~1 KB records: 40 KB in all, past a quarter of a 64 KiB pipe
            fail_kilobyte_reads(c, daemon, n)
            assert queued_bytes(c.doorbell) <= fcntl.fcntl(c.doorbell, fcntl.F_GETPIPE_SZ) // 4 + 4
            got, poll = c.pushed()
            assert poll and 0 < len(got) < n
            rest = c.poll(0.0)
            names = [x.request_id for x in got + rest]
            assert sorted(names) == sorted(f"r{i}" for i in range(n)) and len(set(names)) == n
    finally:
        os.close(fd)
        mm.close()


def fail_kilobyte_reads(c: EngineClient, daemon: DaemonProcess, n: int) -> None:
    """`n` reads r0.. whose failures carry ~1 KB of block ids each; returns once all have failed
    (at their deadline) and completed."""
    for i in range(n):
        blocks = list(range(1000 + i * 400, 1000 + i * 400 + 350))
        c.read(f"r{i}", NOBODY, 8, [blocks], [blocks], DEADLINE_S)
    deadline = time.monotonic() + 20
    while in_flight(daemon) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert in_flight(daemon) == 0


def in_flight(daemon: DaemonProcess) -> int:
    with EngineClient(daemon.socket, "observer", 0, 1) as o:
        return o.status().totals.in_flight


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
    non-blocking (a separate open file), as /proc shows, and records still arrive."""
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True, records=True)
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
        [done], _ = pushed_within(c, 10.0)
        assert done.request_id == "r"


def test_a_protocol_2_client_has_no_doorbell_and_polls_every_time(daemon, shm):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.rpc.version = 2  # what the client learns from a daemon that speaks protocol 2
        c.register(geo, shm_fds=[fd], doorbell=True, records=True)
        assert c.doorbell is None
        assert c.pushed() == ([], True)  # without a doorbell every poll may find something


def test_an_engine_that_closes_its_end_is_answered_by_polls(daemon, shm):
    """EPIPE: the daemon closes its end and queues what follows for polls."""
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True)
        assert c.doorbell is not None
        os.close(c.doorbell)
        c.doorbell = None
        c.read("r", NOBODY, 8, [[3]], [[3]], DEADLINE_S)
        [done] = c.poll(10.0)
        assert (done.request_id, done.status) == ("r", "failed")


# --- the pipe's format, without a daemon -------------------------------------------------


def records(*completions: P.Completion) -> bytes:
    out = b""
    for c in completions:
        body = msgspec.msgpack.encode(c)
        out += struct.pack("<I", len(body)) + body
    return out


def test_records_cut_anywhere_by_a_read_are_put_back_together():
    a, b = P.Completion("a", "received", nbytes=64), P.Completion("b", "failed", [[1, 2]], "deadline")
    data = records(a, b) + POLL_MARKER
    for cut in range(len(data) + 1):
        r = Records()
        got1, poll1 = r.feed(data[:cut])
        got2, poll2 = r.feed(data[cut:])
        assert (got1 + got2, poll1 or poll2) == ([a, b], True)


@pytest.mark.parametrize("data, why", [
    (struct.pack("<I", 1 << 31) + b"x", "announced"),
    (struct.pack("<I", 4093), "announced"),
    (struct.pack("<I", 3) + b"\xc1\xc1\xc1", "undecodable"),
    # a request id that is not UTF-8: msgspec raises UnicodeDecodeError, not its own DecodeError
    (records(P.Completion("xy", "sent")).replace(b"\xa2xy", b"\xa2\xb3\xe9"), "undecodable"),
    (records(P.Completion("a", "sent"))[:-1], ""),
])
def test_what_is_not_a_record_is_refused_by_name(data, why):
    r = Records()
    if not why:  # a cut record is no error: it waits for the rest
        assert r.feed(data) == ([], False)
        return
    with pytest.raises(DoorbellError, match=why):
        r.feed(data)


def test_a_marker_that_does_not_fit_closes_the_daemon_s_end():
    """The budget keeps room for the marker; were the pipe full anyway, the engine must still
    learn to poll: the daemon's end closes, and the engine reads end-of-file."""
    bell, (read_end,) = Doorbell.make(records=True)
    try:
        while True:
            try:
                os.write(bell.fd, b"\0" * 4096)
            except BlockingIOError:
                break
        assert not bell.push(P.Completion("a", "sent"))  # over the budget: queued
        bell.tell()
        assert bell.fd == -1
        while os.read(read_end, 1 << 16):
            pass  # the pipe's bytes, then end-of-file
    finally:
        bell.close()
        os.close(read_end)


def test_an_engine_that_shrank_its_pipe_still_gets_every_completion(daemon):
    """The budget is a quarter of the pipe as the daemon made it; an engine that shrinks it to
    one page makes records stop fitting early: the rest queue behind the marker, for a poll.
    (Were the marker not to fit either, the daemon's end closes: the test below the daemon's.)"""
    geo = build(BIG_SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "engine", 0, 1) as c:
            c.register(geo, shm_fds=[fd], doorbell=True, records=True, ring=False)
            assert c.doorbell is not None
            fcntl.fcntl(c.doorbell, fcntl.F_SETPIPE_SZ, 4096)
            n = 12  # ~1 KB records: 12 KB, past the one page left
            fail_kilobyte_reads(c, daemon, n)
            got, poll = c.pushed()
            assert poll and 0 < len(got) < n
            names = [x.request_id for x in got + c.poll(0.0)]
            assert sorted(names) == sorted(f"r{i}" for i in range(n)) and len(set(names)) == n
    finally:
        os.close(fd)
        mm.close()


def test_a_reply_carries_only_the_fields_the_client_s_version_knows(daemon, shm, monkeypatch):
    """Clients refuse unknown fields: `registered` leaves out what a version predates. Every
    client here asks for a records doorbell; only a protocol 7 hello gets one (an older client
    could not be told), the others a ring."""
    import kvxferd.client as client_mod

    bodies: list[bytes] = []
    real = client_mod._reply
    monkeypatch.setattr(client_mod, "_reply", lambda body, expect: (bodies.append(bytes(body)), real(body, expect))[1])
    geo, fd = shm
    for version, fields in ((2, {"side_channel", "agent"}),
                            (6, {"side_channel", "agent", "doorbell", "token", "max_lease_s"}),
                            (7, {"side_channel", "agent", "doorbell", "token", "max_lease_s", "doorbell_records"}),
                            (9, {"side_channel", "agent", "doorbell", "token", "max_lease_s", "doorbell_records",
                                 "doorbell_counter"})):
        monkeypatch.setattr(P, "PROTOCOL_VERSION", version)  # the hello this client sends
        with EngineClient(daemon.socket, f"v{version}", 0, 1) as c:
            msg, sent = c.requests.register(geo, shm_fds=[fd])
            msg = msgspec.structs.replace(msg, doorbell_pipe=True, doorbell_records=True, doorbell_counter=True)
            c.rpc.call(msg, P.Registered, sent)
            assert set(msgspec.msgpack.decode(bodies[-1])) - {"op"} == fields
            bells = list(c.rpc.reader.take_fds(len(c.rpc.reader.fds)))
            if version < 5:
                continue
            if version >= 9:  # the counter page's memfd after the pipe
                bell, page = bells
                os.close(page)
            else:
                [bell] = bells
            c.read("r", NOBODY, 8, [[3]], [[3]], DEADLINE_S)
            assert select.select([bell], [], [], 10)[0]
            first = os.read(bell, 4096)
            os.close(bell)
            assert (first == b"\x01") == (version < 7)  # a ring byte, or a record


def test_a_pipe_that_carries_what_is_not_a_record_is_a_lost_connection():
    read_end, write_end = os.pipe2(os.O_NONBLOCK)
    c = EngineClient.of_doorbell(read_end)
    try:
        os.write(write_end, struct.pack("<I", 1 << 20))
        with pytest.raises(ConnectionError, match="announced"):
            c.pushed()
        assert c.doorbell is None  # closed: the engine treats the daemon as gone
    finally:
        os.close(write_end)


def test_a_read_of_the_doorbell_never_waits_even_on_a_blocking_pipe():
    """The engine reads its doorbell keeping the GIL: a read that waited would stop every thread
    of vLLM. O_NONBLOCK belongs to the open file, which whoever else holds it may clear: the
    read must not depend on it."""
    read_end, write_end = os.pipe()  # blocking
    try:
        pipe = PipeReader(1 << 16)
        assert pipe.read(read_end) is None  # empty: at once
        os.write(write_end, b"abc")
        assert pipe.read(read_end) == b"abc"
        os.close(write_end)
        write_end = -1
        assert pipe.read(read_end) == b""  # end of file
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_a_doorbell_that_is_not_a_pipe_is_refused_and_the_engine_polls(tmp_path):
    """A daemon (or whatever answers on its socket) that passes a socket for the doorbell: the
    engine closes it and polls every step instead of reading what it cannot trust not to block."""
    import socket

    decoy, kept = socket.socketpair()
    try:
        reply = P.Registered("127.0.0.1:1", "agent", doorbell=True, doorbell_records=True)
        assert register_with(tmp_path, reply, [decoy.fileno()]) == (False, False, ([], True))  # every step polls
    finally:
        decoy.close()
        kept.close()


@pytest.mark.parametrize("kernel", ["refuses RWF_NOWAIT on pipes", "C library without preadv2"])
def test_a_kernel_without_nowait_pipe_reads_falls_back_to_plain_reads(monkeypatch, kernel):
    """Pipes take RWF_NOWAIT from Linux 6.4 (EOPNOTSUPP before); some C libraries have no
    preadv2. The engine then reads its non-blocking pipe with read(2), still keeping the GIL,
    instead of taking the refusal for a lost daemon at every step."""
    import ctypes
    import errno

    from kvxferd import doorbell

    calls = []

    def refusing(*args):
        calls.append(args)
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(doorbell, "_preadv2", refusing if kernel.startswith("refuses") else None)
    read_end, write_end = os.pipe2(os.O_NONBLOCK)
    try:
        pipe = PipeReader(1 << 16)
        assert pipe.read(read_end) is None
        assert not pipe.nowait and len(calls) <= 1  # asked once at most, then read(2)
        os.write(write_end, b"abc")
        assert pipe.read(read_end) == b"abc"
        os.close(write_end)
        write_end = -1
        assert pipe.read(read_end) == b""
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


# --- the counter page (protocol 9) -------------------------------------------------------------

def HEADER_AND(c: P.Completion) -> bytes:
    """A record as the daemon writes it, without its bump."""
    body = msgspec.msgpack.encode(c)
    return struct.pack("<I", len(body)) + body


def test_a_step_whose_counter_has_not_moved_does_not_read_the_pipe(monkeypatch):
    """What is in the pipe is read only once the counter says the daemon wrote: bytes that came
    without a bump (here, what is not even a record) stay unread until it moves."""
    import kvxferd.client as client_mod

    monkeypatch.setattr(client_mod, "_clock", lambda: 0.0)  # no forced read: the clock stands still
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True)
    engine = EngineClient.of_doorbell(read_end, page_fd)
    try:
        assert engine.pushed() == ([], False)  # the first check reads: the count is seen
        os.write(bell.fd, struct.pack("<I", 1 << 20))  # unreadable as a record, and not counted
        assert engine.pushed() == ([], False)  # not read: reading it would have raised
        bell._bump()
        with pytest.raises(ConnectionError, match="announced"):
            engine.pushed()
    finally:
        bell.close()
        engine._close_doorbell()


def test_the_counter_moves_with_every_write_and_at_close_so_no_completion_waits():
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True)
    engine = EngineClient.of_doorbell(read_end, page_fd)
    try:
        done = [P.Completion(f"r{i}", "received") for i in range(3)]
        for c in done:
            assert bell.push(c)
        assert bell.writes == 3
        assert engine.pushed() == (done, False)
        assert engine.pushed() == ([], False)
        bell.tell()  # the poll marker is a write too
        assert engine.pushed() == ([], True)
        bell.close()  # the engine must learn to poll: the close bumps it once more
        assert engine.pushed() == ([], True) and engine.doorbell is None
    finally:
        bell.close()
        engine._close_doorbell()


def test_a_daemon_killed_before_its_last_bump_is_still_found_by_end_of_file(monkeypatch):
    """A daemon killed (no `close`, so no last bump) has its end closed by the kernel all the
    same: the engine reads the pipe at least every FORCED_READ_S whatever the count, and at
    once when forced (the vLLM worker's last drain)."""
    import kvxferd.client as client_mod

    now = [1000.0]  # a clock of the test's own: the forced read comes when it says, not when a busy CI does
    monkeypatch.setattr(client_mod, "_clock", lambda: now[0])
    for forced in (False, True):
        bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True)
        engine = EngineClient.of_doorbell(read_end, page_fd)
        try:
            assert bell.push(P.Completion("written", "received"))
            assert engine.pushed() == ([P.Completion("written", "received")], False)
            os.write(bell.fd, HEADER_AND(P.Completion("unbumped", "received")))
            os.close(bell.fd)  # killed: the kernel closes its end, nothing bumps the count again
            bell.fd = -1
            if forced:
                got, poll = engine.pushed(force=True)
            else:
                now[0] += client_mod.FORCED_READ_S / 2
                assert engine.pushed() == ([], False)  # the count has not moved: skipped
                now[0] += client_mod.FORCED_READ_S
                got, poll = engine.pushed()
            assert [c.request_id for c in got] == ["unbumped"] and not poll  # every record written
            assert engine.pushed() == ([], False)  # the end-of-file behind them waits for the next forced read
            now[0] += client_mod.FORCED_READ_S
            assert engine.pushed() == ([], True) and engine.doorbell is None  # end-of-file: poll from now on
        finally:
            bell.close()
            engine._close_doorbell()


def test_the_engine_can_neither_shrink_nor_write_the_counter_page():
    """The daemon writes its mapping of the page after each record: an engine that could cut
    the page would kill it with SIGBUS, one that could write it would only fool itself, and the
    daemon never reads it (its count is its own)."""
    import mmap

    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(page_fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(page_fd, 1 << 20)
        if fcntl.fcntl(page_fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE:  # Linux 5.1 and later
            with pytest.raises(PermissionError):
                mmap.mmap(page_fd, 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        read_only = mmap.mmap(page_fd, 8, mmap.MAP_SHARED, mmap.PROT_READ)
        assert bell.push(P.Completion("r", "received"))
        assert struct.unpack("<Q", read_only[:8]) == (1,)
        read_only.close()
    finally:
        bell.close()
        os.close(read_end)
        os.close(page_fd)


def test_a_counter_page_that_could_shrink_is_not_mapped_and_the_pipe_is_read_every_step():
    """The engine's side of the same promise: a page whoever sent it could still cut (not
    sealed), or what is not a page at all, is closed, not mapped."""
    from kvxferd.doorbell import map_counter

    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    r, w = os.pipe()
    tiny = os.memfd_create("y", os.MFD_ALLOW_SEALING)
    fcntl.fcntl(tiny, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    try:
        for fd in (unsealed, r, tiny):
            assert map_counter(fd) is None
            with pytest.raises(OSError):
                os.fstat(fd)  # closed
    finally:
        os.close(w)


@pytest.mark.parametrize("ring", [False, True], ids=["counter", "ring"])
def test_an_engine_takes_a_real_daemon_s_completion_past_its_counter(daemon, shm, ring):
    geo, fd = shm
    with EngineClient(daemon.socket, "engine", 0, 1) as c:
        c.register(geo, shm_fds=[fd], doorbell=True, records=True, ring=ring)
        assert (c._ring is not None, c._counter is not None) == (ring, not ring) and c.doorbell is not None
        assert c.pushed() == ([], False)
        c.read("r1", NOBODY, 8, [[3, 4]], [[3, 4]], DEADLINE_S)
        got: list[P.Completion] = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            got, poll = c.pushed()  # never waits: each call is a step's check
            assert not poll
            time.sleep(0.01)
        assert [(x.request_id, x.status) for x in got] == [("r1", "failed")]
        assert c.pushed() == ([], False)


def test_a_counter_promised_but_not_sent_leaves_the_pipe_alone_and_nothing_open(tmp_path):
    r, w = os.pipe()
    try:
        reply = P.Registered("127.0.0.1:1", "agent", doorbell=True, doorbell_records=True, doorbell_counter=True)
        assert register_with(tmp_path, reply, [r]) == (True, False, ([], False))
    finally:
        os.close(r)
        os.close(w)


def test_a_counter_page_that_could_shrink_is_closed_and_the_pipe_read_every_step(tmp_path):
    r, w = os.pipe()
    page = os.memfd_create("unsealed")
    os.ftruncate(page, 4096)
    try:
        reply = P.Registered("127.0.0.1:1", "agent", doorbell=True, doorbell_records=True, doorbell_counter=True)
        assert register_with(tmp_path, reply, [r, page]) == (True, False, ([], False))
    finally:
        for x in (r, w, page):
            os.close(x)


def test_a_doorbell_that_is_not_a_pipe_closes_the_page_sent_with_it(tmp_path):
    import socket

    from kvxferd.doorbell import counter_page

    decoy, kept = socket.socketpair()
    sealed_page, mapping = counter_page()  # a real page, after what is not a pipe
    try:
        reply = P.Registered("127.0.0.1:1", "agent", doorbell=True, doorbell_records=True, doorbell_counter=True)
        assert register_with(tmp_path, reply, [decoy.fileno(), sealed_page]) == (False, False, ([], True))
    finally:
        decoy.close()
        kept.close()
        os.close(sealed_page)
        mapping.close()
