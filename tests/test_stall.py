"""The event loop's health (stall.py): a held loop is logged once it lets go, and dumped while held."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvxferd.stall import StallWatch


def test_a_late_tick_is_logged_with_how_long_the_loop_was_held(caplog):
    watch = StallWatch(100.0)
    watch.restart(100.0, cpu=0.0)
    with caplog.at_level(logging.WARNING, logger="kvxferd"):
        assert watch.tick(100.05, 0.05, cpu=0.0).held == 0.0  # on time
        assert not caplog.records
        # 3.45 s late, not running: holds move on by it (holds.py), reads too (reads.py)
        assert watch.tick(103.55, 0.05, cpu=0.0) == pytest.approx((3.45, 3.45))
        watch.restart(110.0)  # catching up on that took until 110: not counted again
        assert watch.tick(110.05, 0.05).held == 0.0
    assert [r.getMessage() for r in caplog.records] == ["event loop held 3.5 s, 3.5 s of it off the CPU"]
    watch.disarm()


def _run_script(body: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def test_a_loop_held_past_the_dump_time_has_its_stacks_written_while_held():
    """In its own process: the watch thread writes the held thread's stack to stderr, naming the
    call, before the call returns."""
    proc = _run_script("""
        import sys, threading, time
        from kvxferd.stall import StallWatch

        def blocking_call():
            time.sleep(3.0)  # the loop's thread, held (a GIL-free call, as NIXL's and I/O are)

        def other_work():
            time.sleep(30)

        threading.Thread(target=other_work, name="a-worker", daemon=True).start()
        watch = StallWatch(time.monotonic(), dump_after_s=0.5)
        watch.arm(time.monotonic())
        blocking_call()
        print("the call returned", watch.dumps, file=sys.stderr, flush=True)
        watch.disarm()
    """)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    dump, returned, after = err.partition("the call returned")
    assert returned and after.strip() == "1", err  # one dump, written while the call held the loop
    assert re.search(r"event loop not back for \d+\.\d s", dump), err
    assert "in blocking_call" in dump and "Thread a-worker" in dump and "in other_work" in dump, err


def test_dumps_while_threads_come_and_go_do_not_break_the_process():
    """Stacks are read holding the GIL: threads starting, running Python and ending meanwhile are
    safe. faulthandler's watchdog walked them without it; a thread ending under its walk
    segfaults (this script with `faulthandler.dump_traceback_later` did, 3 runs of 3)."""
    proc = _run_script("""
        import sys, threading, time
        from kvxferd.stall import StallWatch

        def deep(n):
            return deep(n - 1) if n else sum(range(50))

        def spawn():
            while True:
                t = threading.Thread(target=deep, args=(30,))
                t.start()
                t.join()

        for _ in range(2):
            threading.Thread(target=spawn, daemon=True).start()
        watch = StallWatch(time.monotonic(), dump_after_s=0.01)
        end = time.monotonic() + 60
        while watch.dumps < 100 and time.monotonic() < end:
            watch.arm(time.monotonic())
            time.sleep(0.03)  # held past the dump time: one dump each
        print(watch.dumps, flush=True)
        watch.disarm()
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "100", (proc.returncode, out, err[-2000:])
    assert err.count("event loop not back for") == 100 and "in spawn" in err, err[-2000:]


def test_a_process_stopped_past_the_dump_time_is_not_taken_for_a_held_loop():
    """SIGSTOP stops every thread: the dump deadline counts the process's running time, so a loop
    that has not used up its dump time of running when the process stops is not dumped after
    it resumes, whichever thread runs first."""
    proc = _run_script("""
        import sys, time
        from kvxferd.stall import StallWatch

        def work(cpu_s):  # the loop's turn: CPU time, which a stop does not advance
            end = time.thread_time() + cpu_s
            while time.thread_time() < end:
                pass

        watch = StallWatch(time.monotonic(), dump_after_s=1.0)
        watch.arm(time.monotonic())
        print("armed", flush=True)
        for _ in range(10):
            work(0.2)
            watch.arm(time.monotonic())  # the loop, back
        print(watch.dumps, flush=True)
        watch.disarm()
    """)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "armed"
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGSTOP)  # in the loop's first turn
    time.sleep(2.5)  # past the dump time, and past the turn's end
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "0", (out, err)
    assert "event loop not back" not in err, err


def test_without_a_usable_stderr_there_are_no_dumps_and_no_errors(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)
    watch = StallWatch(0.0)
    watch.tick(5.0, 0.05)  # would arm; nothing to write to
    watch.disarm()
