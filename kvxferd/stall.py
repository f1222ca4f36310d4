"""The event loop's own health: a loop held by a blocking call (a NIXL call, a page fault on
engine memory, a thread holding the GIL) delays every engine and peer at once.

    housekeeping tick every HOUSEKEEPING_S ──► gap over LOG_AFTER_S: "event loop held N s" logged
                                          └──► once a second: faulthandler re-armed for DUMP_AFTER_S
    loop held DUMP_AFTER_S ──► faulthandler's own thread writes every thread's stack to stderr

The dump comes while the loop is still held (a log line can only come after), and names the
call holding it. faulthandler's watchdog is one per process: kvxferd runs one daemon per process.
Without a usable stderr (closed, or not a file) there are no dumps; the log lines remain.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import time
from typing import NamedTuple

log = logging.getLogger("kvxferd")

LOG_AFTER_S = 1.0  # a tick this late is logged with how long the loop was held
DUMP_AFTER_S = 10.0  # held this long (9 to 10 s: re-armed each second): every thread's stack to stderr
REARM_S = 1.0


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
        self._armed = -REARM_S  # when faulthandler was last armed

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
        log.warning("event loop held %.1f s, %.1f s of it off the CPU%s", held, gap.stopped,
                    " (every thread's stack is on stderr)" if held >= self._dump_after_s and self._fd else "")
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
        if self._fd is None:
            return
        try:
            faulthandler.dump_traceback_later(self._dump_after_s, file=self._fd)
            self._armed = now
        except Exception as exc:  # no thread left for the watchdog (a pids limit): go on without dumps
            log.warning("stall dumps off: %s", exc)
            self._fd = None

    def disarm(self) -> None:
        if self._fd is not None:
            faulthandler.cancel_dump_traceback_later()


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno() if sys.stderr is not None else None
    except (AttributeError, OSError, ValueError):  # closed, or not a file (captured, embedded)
        return None
