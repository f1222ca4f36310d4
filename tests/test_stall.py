"""The event loop's health (stall.py): a held loop is logged once it lets go, and dumped while held."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

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


def test_a_loop_held_past_the_dump_time_has_its_stacks_written_while_held():
    """In its own process: faulthandler writes the held thread's stack to stderr, naming the call."""
    script = textwrap.dedent("""
        import time
        from kvxferd.stall import StallWatch

        def blocking_call():
            time.sleep(1.5)  # the loop's thread, held

        watch = StallWatch(time.monotonic(), dump_after_s=0.5)
        watch.arm(time.monotonic())
        blocking_call()
        watch.disarm()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Timeout (0:00:00.500000)!" in out.stderr and "blocking_call" in out.stderr, out.stderr


def test_without_a_usable_stderr_there_are_no_dumps_and_no_errors(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)
    watch = StallWatch(0.0)
    watch.tick(5.0, 0.05)  # would arm; nothing to write to
    watch.disarm()
