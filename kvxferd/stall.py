"""The event loop's own health: a loop held by a blocking call (a NIXL call, a page fault on
engine memory, a thread holding the GIL) delays every engine and peer at once.

    housekeeping tick every HOUSEKEEPING_S ──► gap over LOG_AFTER_S: "event loop held N s" logged
                                          └──► once a second: the dump deadline moved DUMP_AFTER_S on
    the process runs DUMP_AFTER_S, deadline not moved ──► the watch thread writes every thread's
                                                          stack to stderr, once

The dump comes while the loop is still held (a log line can only come after), and names the
call holding it. The watch thread reads the stacks with `sys._current_frames()` holding the GIL:
faulthandler's watchdog walks other threads' thread states without it, and one ending under the
walk segfaults the process (it killed a daemon resuming from a host pause).

The deadline counts the process's running time, as a read's deadline does: the watch thread
wakes every SLICE_S, and a wake-up over SLACK_S late moves the deadline on by the lateness. That
time the thread did not run: the process or host was stopped, or another thread held the GIL. A
stop says nothing of the loop; a call holding the GIL cannot be dumped while it runs (the watch
thread needs the GIL), and a dump after it would name the wrong place, so such a hold is only
logged, by the tick that follows it. Without a usable stderr (closed, or not a file) there are
no dumps; the log lines remain.
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
SLICE_S = 0.25  # the watch thread's longest sleep (at most a quarter of the dump time)
SLACK_S = 0.1  # a wake-up later than this: the watch thread did not run, nor perhaps the loop


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
        self._dumps_seen = 0  # of its dumps, those a tick has logged

    def tick(self, now: float, expected_s: float, cpu: float | None = None) -> Gap:
        """A housekeeping tick that meant to come `expected_s` after the last one: how long the
        loop was held, and for how much of that its thread did not run (`cpu`: the thread's CPU
        time now, read here unless given)."""
        cpu = time.thread_time() if cpu is None else cpu
        held, ran = now - self._last - expected_s, cpu - self._cpu
        self._last, self._cpu = now, cpu
        dumped, self._dumps_seen = self.dumps > self._dumps_seen, self.dumps
        if now - self._armed >= REARM_S:
            self.arm(now)
        if held <= LOG_AFTER_S:
            return Gap(0.0, 0.0)
        gap = Gap(held, min(held, max(held - ran, 0.0)))
        log.warning("event loop held %.1f s, %.1f s of it off the CPU%s", held, gap.stopped,
                    " (every thread's stack, written while it was held, is on stderr)" if dumped else "")
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
        if self._dumps is None or not self._dumps.alive():
            try:
                self._dumps, self._dumps_seen = _DumpThread(self._fd, self._dump_after_s), 0
            except RuntimeError as exc:  # no thread left for the watch (a pids limit): go on without dumps
                log.warning("stall dumps off: %s", exc)
                self._fd = None
                return
        self._dumps.move()
        self._armed = now

    def disarm(self) -> None:
        """No more dumps; the watch thread ends (a later `arm` starts another)."""
        if self._dumps is not None:
            self._dumps.stop()
            self._dumps, self._dumps_seen = None, 0

    @property
    def dumps(self) -> int:
        return self._dumps.count if self._dumps is not None else 0


class _DumpThread:
    """Owns the deadline: the loop's thread moves it on, the watch thread dumps when it passes."""

    def __init__(self, fd: int, dump_after_s: float) -> None:
        self._fd, self._dump_after_s = fd, dump_after_s
        self._slice_s = min(SLICE_S, dump_after_s / 4)
        self._cond = threading.Condition()
        self._deadline: float | None = None  # None: nothing to watch until moved
        self._moved_at = 0.0
        self._not_run = 0.0  # of the time since then, the watch thread's lateness (not the loop's)
        self._stopped = False
        self.count = 0  # dumps written
        self._thread = threading.Thread(target=self._run, name="kvxferd-stall-watch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def move(self) -> None:
        with self._cond:
            if self._deadline is None:
                self._cond.notify()  # the thread waits for a deadline to watch
            self._moved_at = time.monotonic()
            self._deadline, self._not_run = self._moved_at + self._dump_after_s, 0.0

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while (held_s := self._wait_for_a_hold()) is not None:
            try:  # the lock is free: a full stderr pipe blocks this thread, not the loop
                self._dump(held_s)
            except Exception as exc:  # the watch outlives one dump that failed
                log.warning("stall dump failed: %s: %s", type(exc).__name__, exc)

    def _wait_for_a_hold(self) -> float | None:
        """Sleeps until the deadline passes unmoved, counting only the time this thread ran;
        returns the loop's running time since it last moved it (None: stopped)."""
        with self._cond:
            planned: float | None = None  # when this sleep was to end
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    planned = None
                    continue
                now = time.monotonic()
                if planned is not None and now - planned > SLACK_S:  # not run: not counted
                    self._deadline += now - planned
                    self._not_run += now - planned
                if now >= self._deadline:
                    self._deadline = None  # one dump per hold; the loop's next move watches again
                    self.count += 1
                    return now - self._moved_at - self._not_run
                planned = now + min(self._slice_s, self._deadline - now)
                self._cond.wait(planned - now)
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
