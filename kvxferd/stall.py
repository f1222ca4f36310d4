"""The event loop's own health: a loop held by a blocking call (a NIXL call, a page fault on
engine memory, a thread holding the GIL) delays every engine and peer at once.

    housekeeping tick every HOUSEKEEPING_S ──► gap over LOG_AFTER_S: "event loop held N s" logged
                                          └──► once a second: the dump deadline moved DUMP_AFTER_S on
    deadline passes, not moved ──► the watch thread writes every thread's stack to stderr

The dump comes while the loop is still held (a log line can only come after), and names the
call holding it. The watch thread reads the stacks with `sys._current_frames()` holding the GIL:
faulthandler's watchdog walks other threads' frames without it, and a thread running meanwhile
can free a frame under the walk (it crashed a daemon resuming from a host pause). The price: a
call that holds the GIL also holds the dump until it returns, so such a hold is only logged.

When the watch thread itself wakes over LATE_S past its deadline, it did not run either: the
process or host was stopped, which says nothing of the loop. The loop then gets GRACE_S to move
the deadline on before a dump. Without a usable stderr (closed, or not a file) there are no
dumps; the log lines remain.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import NamedTuple

log = logging.getLogger("kvxferd")

LOG_AFTER_S = 1.0  # a tick this late is logged with how long the loop was held
DUMP_AFTER_S = 10.0  # held this long (9 to 10 s: re-armed each second): every thread's stack to stderr
REARM_S = 1.0
LATE_S = 1.0  # the watch thread woke this late: the whole process was stopped
GRACE_S = 2 * REARM_S  # after such a stop, the time the loop has to show it runs


class Gap(NamedTuple):
    """How late a housekeeping tick came, when over LOG_AFTER_S (else both 0)."""

    held: float  # seconds the loop ran nothing else past the tick's time
    stopped: float  # of them, the loop's thread off the CPU (the process or host stopped, the
                    # GIL elsewhere): the rest is the loop's own work


class StallWatch:
    def __init__(self, now: float, dump_after_s: float = DUMP_AFTER_S) -> None:
        self._dump_after_s = dump_after_s
        self._fd = _stderr_fd()
        self._last = now  # the last tick
        self._cpu = time.thread_time()  # the loop thread's CPU time then
        self._armed = -REARM_S  # when the deadline was last moved
        self._dumps: _DumpThread | None = None

    def tick(self, now: float, expected_s: float, cpu: float | None = None) -> Gap:
        """A housekeeping tick that meant to come `expected_s` after the last one: how long the
        loop was held, and for how much of that its thread did not run (`cpu`: the thread's CPU
        time now, read here unless given)."""
        cpu = time.thread_time() if cpu is None else cpu
        held, ran = now - self._last - expected_s, cpu - self._cpu
        self._last, self._cpu = now, cpu
        if now - self._armed >= REARM_S:
            self.arm(now)
        if held <= LOG_AFTER_S:
            return Gap(0.0, 0.0)
        gap = Gap(held, min(held, max(held - ran, 0.0)))
        log.warning("event loop held %.1f s, %.1f s of it off the CPU", held, gap.stopped)
        return gap

    def behind(self, now: float, expected_s: float) -> bool:
        """The tick due `expected_s` after the last one is more than LOG_AFTER_S late: the loop is
        coming out of a pause that `tick` has not counted yet (whoever runs first must not
        judge a deadline by a clock that the pause moved on)."""
        return now - self._last - expected_s > LOG_AFTER_S

    def restart(self, now: float, cpu: float | None = None) -> None:
        """The next tick is late from `now` on: what ran since the last tick (catching up on a
        pause) is not counted as the loop held."""
        self._last, self._cpu = now, time.thread_time() if cpu is None else cpu

    def arm(self, now: float) -> None:
        """Dump every stack unless the loop comes back (calls this again) within DUMP_AFTER_S."""
        if self._fd is None:
            return
        if self._dumps is None:
            try:
                self._dumps = _DumpThread(self._fd, self._dump_after_s)
            except RuntimeError as exc:  # no thread left for the watch (a pids limit): go on without dumps
                log.warning("stall dumps off: %s", exc)
                self._fd = None
                return
        self._dumps.move(time.monotonic() + self._dump_after_s)
        self._armed = now

    def disarm(self) -> None:
        """No more dumps; the watch thread ends (a later `arm` starts another)."""
        if self._dumps is not None:
            self._dumps.stop()
            self._dumps = None


class _DumpThread:
    """Owns the deadline: the loop's thread moves it on, the watch thread dumps when it passes."""

    def __init__(self, fd: int, dump_after_s: float) -> None:
        self._fd, self._dump_after_s = fd, dump_after_s
        self._cond = threading.Condition()
        self._deadline: float | None = None  # None: nothing to watch until moved
        self._stopped = False
        threading.Thread(target=self._run, name="kvxferd-stall-watch", daemon=True).start()

    def move(self, deadline: float) -> None:
        with self._cond:  # a thread sleeping to the old deadline finds this one when it wakes
            if self._deadline is None:
                self._cond.notify()  # not sleeping to any
            self._deadline = deadline

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while (held_s := self._wait_for_a_hold()) is not None:
            self._dump(held_s)  # the lock is free: a full stderr pipe blocks this thread, not the loop

    def _wait_for_a_hold(self) -> float | None:
        """Sleeps until the deadline passes unmoved (how long the loop has been away), or until
        stopped (None)."""
        with self._cond:
            while not self._stopped:
                deadline = self._deadline
                if deadline is None:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if now < deadline:
                    self._cond.wait(deadline - now)
                    continue
                if now - deadline > LATE_S:  # this thread was stopped too: the loop gets its chance
                    self._deadline = now + GRACE_S
                    continue
                self._deadline = None  # one dump per hold; the loop's next arm watches again
                return now - deadline + self._dump_after_s
            return None

    def _dump(self, held_s: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"kvxferd: event loop not back for {held_s:.1f} s; every thread's stack "
                 f"(most recent call last):\n"]
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():  # not this thread, dumping
                parts.append(f"\nThread {names.get(ident, '?')} ({ident}):\n")
                parts.extend(traceback.format_stack(frame))
        text = "".join(parts).encode(errors="replace")
        try:
            while text:
                text = text[os.write(self._fd, text):]
        except OSError:
            pass  # stderr gone: the log line after the hold remains


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno() if sys.stderr is not None else None
    except (AttributeError, OSError, ValueError):  # closed, or not a file (captured, embedded)
        return None
