"""The doorbell's completion ring (protocol 10): the records in a sealed shared page, so a step
takes them without a system call; the pipe only wakes a waiting engine and says when the daemon
went. Byte-level tests between a real `Doorbell` and a real `EngineClient` in one process, and
one through a real daemon."""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import struct
import threading
import time

import pytest
from fake_daemon import register_with

import kvxferd.client as client_mod
from kvxferd import doorbell as D
from kvxferd import protocol as P
from kvxferd.client import EngineClient
from kvxferd.doorbell import HEAD, RING_BYTES, TAIL, Doorbell, DoorbellError, queued_bytes
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

pytestmark = pytest.mark.skipif(not D.ring_supported(), reason="the daemon offers a ring on x86 hosts only")



@pytest.fixture
def ring(monkeypatch):
    """A ring doorbell and the engine reading it; the forced read's clock stands still unless a
    test moves it (`ring.now`)."""
    now = [1000.0]
    monkeypatch.setattr(client_mod, "_clock", lambda: now[0])
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True, ring=True)
    engine = EngineClient.of_doorbell(read_end, page_fd, ring=True)
    assert bell.ring and engine._ring is not None
    engine._read_at = now[0]  # the first check is not a forced one
    yield bell, engine, now
    bell.close()
    engine._close_doorbell()


def done(i: int, ids: int = 0) -> P.Completion:
    return P.Completion(f"request-{i}", "failed" if ids else "received", [list(range(ids))] if ids else [],
                        nbytes=i, seconds=i / 1000)


def test_records_come_from_the_ring_without_reading_the_pipe(ring):
    bell, engine, _ = ring
    assert engine.pushed() == ([], False)
    sent = [done(i) for i in range(5)]
    for c in sent:
        assert bell.push(c)
    assert engine.doorbell is not None
    woken = queued_bytes(engine.doorbell)
    assert woken == 5  # a wake-up byte per record, for an engine that waits
    assert engine.pushed() == (sent, False)
    assert queued_bytes(engine.doorbell) == woken  # the records came from memory: the pipe was not read
    assert engine.pushed() == ([], False)
    assert bell.counter is not None and bell.counter.w[TAIL] == bell.head  # the engine said how far it took


def test_records_that_wrap_past_the_ring_s_end_arrive_whole_and_in_order(ring):
    """Thousands of records of uneven sizes, taken a few at a time: the ring wraps many times, and
    records straddle its end."""
    bell, engine, _ = ring
    got: list[P.Completion] = []
    sent = [done(i, ids=(i * 37) % 600) for i in range(3000)]
    for i, c in enumerate(sent):
        assert bell.push(c), i
        if i % 7 == 6:
            got += engine.pushed()[0]
    got += engine.pushed()[0]
    assert got == sent
    assert bell.head > 10 * RING_BYTES


def test_a_full_ring_queues_the_rest_behind_the_marker_for_a_poll(ring):
    """An engine that stops taking: records fill the ring save the marker's room, the next one
    goes to the queue (the caller's), and the marker asks the engine to poll for it."""
    bell, engine, _ = ring
    fitted = 0
    while bell.push(done(fitted, ids=300)):
        fitted += 1
    assert fitted > 0 and bell.head - bell.tail <= RING_BYTES - len(D.POLL_MARKER)
    bell.tell()
    got, poll = engine.pushed()
    assert [c.request_id for c in got] == [f"request-{i}" for i in range(fitted)] and poll
    assert not bell.push(done(0))  # told: later completions queue behind the first until a poll
    bell.polled(left=False)
    assert bell.push(done(1)) and engine.pushed() == ([done(1)], False)


def test_an_engine_that_lies_about_its_tail_only_loses_its_own_records(ring):
    """The daemon believes the engine's tail only between its own last word and its head: a tail
    past the head frees nothing unwritten, one that runs back takes nothing back."""
    bell, engine, _ = ring
    assert bell.push(done(1)) and bell.push(done(2))
    engine._ring.w[TAIL] = 1 << 63  # past anything written
    assert bell.push(done(3)) and bell.tail == 0
    assert engine.pushed()[0] == [done(1), done(2), done(3)]
    taken = bell.head
    assert bell.push(done(4)) and bell.tail == taken  # the engine's true word is believed
    engine._ring.w[TAIL] = 0  # back to the start
    assert bell.push(done(5)) and bell.tail == taken
    assert engine.pushed()[0] == [done(4), done(5)]


@pytest.mark.parametrize("head", ["past a ring", "backwards", "mid-record"])
def test_a_head_that_is_not_the_daemon_s_is_a_lost_connection(ring, head):
    bell, engine, _ = ring
    assert bell.push(done(1))
    assert engine.pushed()[0] == [done(1)]
    page, w = engine._ring.page, engine._ring.w
    at = w[HEAD]
    w[HEAD] = {"past a ring": at + RING_BYTES + 1, "backwards": at - 1, "mid-record": at}[head]
    if head == "mid-record":  # a header announcing more than the head covers
        page[D.RING_DATA + at:D.RING_DATA + at + 4] = struct.pack("<I", 40)
        w[HEAD] = at + 10
    bell._bump()
    with pytest.raises(DoorbellError):
        engine.pushed()
    assert engine.doorbell is None and engine._ring is None  # closed: the worker treats it as a lost daemon


def test_the_daemon_s_close_is_seen_by_the_step_that_takes_the_records_before_it(ring):
    bell, engine, _ = ring
    assert bell.push(done(1))
    bell.close()
    assert engine.pushed() == ([done(1)], True) and engine.doorbell is None  # kept, then end of file: poll


def test_a_close_alone_moves_the_count_and_ends_the_doorbell(ring):
    bell, engine, _ = ring
    assert engine.pushed() == ([], False)
    bell.close()
    assert engine.pushed() == ([], True) and engine.doorbell is None


def test_a_daemon_killed_after_its_last_record_is_found_by_the_forced_read(ring):
    """Killed (no close: `closed` never set, no last bump): the kernel closes its end all the same."""
    bell, engine, now = ring
    assert bell.push(done(1))
    os.close(bell.fd)  # killed: the kernel closes its end, nothing bumps the count
    bell.fd = -1
    assert engine.pushed() == ([done(1)], False)
    assert engine.pushed() == ([], False)  # the count has not moved: skipped
    now[0] += client_mod.FORCED_READ_S
    assert engine.pushed() == ([], True) and engine.doorbell is None


def test_a_forced_read_empties_the_pipe_and_a_wait_sleeps_until_a_record(ring):
    bell, engine, _ = ring
    for i in range(3):
        assert bell.push(done(i))
    assert len(engine.pushed()[0]) == 3
    assert engine.doorbell is not None and queued_bytes(engine.doorbell) == 3
    assert engine.pushed(force=True) == ([], False)
    assert queued_bytes(engine.doorbell) == 0  # stale wake-ups gone: a wait would not end at once
    started = time.monotonic()
    assert engine.pushed(wait_s=0.05) == ([], False)
    assert time.monotonic() - started >= 0.04
    later = threading.Timer(0.05, lambda: bell.push(done(9)))
    later.start()
    got, _ = engine.pushed(wait_s=5.0)
    later.join()
    assert got == [done(9)]


def test_an_engine_that_closed_its_pipe_gets_later_completions_by_poll(ring):
    """EPIPE on the wake-up byte: the daemon closes its end and the record it wrote is not
    counted as delivered (the engine that closed its pipe no longer reads the ring)."""
    bell, engine, _ = ring
    assert engine.doorbell is not None
    os.close(engine.doorbell)
    engine.doorbell = None
    assert not bell.push(done(1)) and bell.fd == -1


def test_the_engine_can_write_its_tail_but_never_cut_the_page():
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True, ring=True)
    try:
        for size in (0, D.RING_PAGE - 1, D.RING_PAGE + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(page_fd, size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(page_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed against more seals
        page = D.SharedWords(mmap.mmap(page_fd, D.RING_PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), 4096)
        assert bell.push(done(1))
        taken = bell.head
        page.w[TAIL] = taken
        assert bell.push(done(2)) and bell.tail == taken  # read back: the engine's own mapping writes it
        page.close()
    finally:
        bell.close()
        os.close(read_end)
        os.close(page_fd)


def test_a_ring_page_that_could_shrink_or_is_too_small_is_not_mapped():
    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, D.RING_PAGE)
    small = os.memfd_create("y", os.MFD_ALLOW_SEALING)
    os.ftruncate(small, 4096)
    fcntl.fcntl(small, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    for fd in (unsealed, small):
        assert D.map_ring(fd) is None
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_a_ring_promised_but_unusable_leaves_no_doorbell_and_the_engine_polls(tmp_path):
    """Without a ring it can map, an engine cannot read the records the daemon puts there: it
    closes the pipe too (the daemon's next wake-up gets EPIPE and it queues for polls)."""
    r, w = os.pipe()
    page = os.memfd_create("unsealed")
    os.ftruncate(page, D.RING_PAGE)
    try:
        reply = P.Registered("127.0.0.1:1", "agent", doorbell=True, doorbell_records=True, doorbell_counter=True,
                             doorbell_ring=True)
        for case, fds in (("unsealed", [r, page]), ("no page sent at all", [r])):
            (tmp_path / case).mkdir()
            assert register_with(tmp_path / case, reply, fds) == (False, False, ([], True))
    finally:
        for x in (r, w, page):
            os.close(x)


def test_only_hosts_that_keep_stores_in_order_offer_a_ring(monkeypatch):
    import platform

    for machine, offered in (("x86_64", True), ("AMD64", True), ("aarch64", False), ("ppc64le", False)):
        monkeypatch.setattr(platform, "machine", lambda m=machine: m)
        assert D.ring_supported() is offered


def test_a_real_daemon_s_failures_come_through_the_ring_in_order(tmp_path):
    geo = build(ModelShape(layers=1, kv_heads=1, head_dim=8, block_size=4, num_blocks=64), 1, 0)
    nobody = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")  # nothing listens: reads fail at their deadline
    fd, mm = create_shm(geo.buffers[0])
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        with EngineClient(daemon.socket, "engine", 0, 1) as c:
            c.register(geo, shm_fds=[fd], doorbell=True, records=True)
            assert c._ring is not None and c._counter is None
            for i in range(8):  # deadlines 50 ms apart: the daemon fails them in that order
                c.read(f"r{i}", nobody, 4, [[i]], [[i]], 1.0 + 0.05 * i)
            got: list[P.Completion] = []
            end = time.monotonic() + 20
            while len(got) < 8 and time.monotonic() < end:
                items, poll = c.pushed(0.05)
                assert not poll
                got += items
            assert [(x.request_id, x.status, x.block_ids) for x in got] == [
                (f"r{i}", "failed", [[i]]) for i in range(8)], [(x.request_id, x.reason) for x in got]
    finally:
        daemon.stop()
        os.close(fd)
        mm.close()


def _racing(engine: EngineClient, daemon_side) -> None:
    """The daemon acts between the step's first look at the ring and its read of the pipe (once)."""
    drain, pending = engine._drain, [daemon_side]

    def racing() -> bool:
        while pending:
            pending.pop()()
        return drain()

    engine._drain = racing  # type: ignore[method-assign]


def test_a_record_written_just_before_the_daemon_closes_is_not_lost(ring):
    """The end of file the drain finds may follow a record the ring did not hold a moment
    before: the step takes the ring again after the pipe, and nothing lands after an end of file."""
    bell, engine, _ = ring
    assert engine.pushed() == ([], False)
    _racing(engine, lambda: (bell.push(done(1)), bell.close()))
    assert engine.pushed(force=True) == ([done(1)], True) and engine.doorbell is None


def test_a_wait_does_not_sleep_past_a_record_whose_wake_up_the_drain_took(ring):
    bell, engine, _ = ring
    assert engine.pushed() == ([], False)
    _racing(engine, lambda: bell.push(done(1)))
    started = time.monotonic()
    assert engine.pushed(wait_s=5.0) == ([done(1)], False)
    assert time.monotonic() - started < 2.5  # it did not sleep the wait out


def test_a_page_that_is_no_doorbell_page_is_refused_by_name():
    r, w = os.pipe()
    unsealed = os.memfd_create("x")
    os.ftruncate(unsealed, D.RING_PAGE)
    try:
        with pytest.raises(ValueError, match="not a sealed doorbell page"):
            EngineClient.of_doorbell(r, unsealed, ring=True)
        with pytest.raises(OSError):
            os.fstat(r)  # closed with the refusal
    finally:
        os.close(w)


def test_a_head_stored_without_its_bump_is_found_by_the_forced_read(ring):
    """A daemon killed between a record's `head` and its bump: the count says nothing new, the
    forced read takes the record all the same."""
    bell, engine, now = ring
    assert engine.pushed() == ([], False)
    bell._bump = lambda: None  # type: ignore[method-assign]
    assert bell.push(done(1))
    assert engine.pushed() == ([], False)
    now[0] += client_mod.FORCED_READ_S
    assert engine.pushed() == ([done(1)], False)


def test_fields_another_process_stores_are_never_read_half_written():
    """Two processes, as deployed: the daemon's side pushes records as fast as the ring has room
    while the engine's reader takes them as fast as it can. Each u64 field must be read whole:
    with `struct.pack_into` (which zeroes a field before it writes it) and `unpack_from` (a byte at
    a time) the reader caught `head` as 0 within ~9,000 takes here, and ended a healthy doorbell."""
    n = 100_000
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True, ring=True)
    reader = D.map_ring(page_fd)
    assert reader is not None
    pid = os.fork()
    if pid == 0:  # the daemon's side
        code = 1
        try:
            for i in range(n):
                while not bell.push(done(i)):  # the ring is full: the reader takes, then there is room
                    pass
            code = 0
        finally:
            os._exit(code)
    got: list[P.Completion] = []
    reaped = False
    try:
        end = time.monotonic() + 120
        while len(got) < n and time.monotonic() < end:
            got += D.parse_whole(reader.take())[0]  # a torn head raises DoorbellError here
        assert got == [done(i) for i in range(n)]
        _, status = os.waitpid(pid, 0)
        reaped = True
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if not reaped:  # stuck pushing into a ring no one takes from any more
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        reader.close()
        os.close(read_end)
        bell.close()
