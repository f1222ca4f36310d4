"""How often an idle daemon progresses NIXL: often enough that a peer's READ of this daemon's
memory is served at once, rarely enough that an idle daemon costs no core.

A peer's READ of our memory that carries a NIXL notification completes only when our UCX worker
progresses, even over `cma` (measured: a 16-block read waited for the serving daemon's next
tick); over UCX's TCP transport alone, any READ does. READs from daemons that send notices
(notices.py) carry none, and over CMA need nothing of us (measured; over RDMA, one-sided READs
should not either, not measured here). Which of our readers need our progress, and when, is
serving.py's to say; the pace follows it:

    activity (a handshake, a serve request, a claim from     ─┬─ spin_s: yield to the loop every turn
    a reader not known to ask; a hold, claim or notification ├─ hot_s, or while `needed`:
    while a reader before side-channel version 5 reads)      │      every idle_poll_s (timer resolution 1 ms)
                                                             └─ then: every idle_max_s
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

SPIN = 0.0


@dataclass
class Pace:
    spin_s: float
    idle_poll_s: float
    idle_max_s: float
    hot_s: float
    last_activity: float = float("-inf")

    def active(self, now: float) -> None:
        self.last_activity = now

    def idle_wait(self, now: float, needed: bool) -> float:
        """Seconds to wait for a wake-up before progressing NIXL again (SPIN: just yield).
        `needed`: a reader asked for progress, or one that never asks may read what we hold."""
        quiet = now - self.last_activity
        if quiet < self.spin_s:
            return SPIN
        if needed or quiet < self.hot_s:
            return self.idle_poll_s
        return self.idle_max_s


class Wake:
    """The progress loop's sleep, which `set()` cuts short (a READ posted, a hold arrived).

    One future and one timer per sleep: an idle daemon holding requests sleeps 1,000 times a
    second, and `asyncio.wait_for` on an Event (a task, a timer and a cancellation each time)
    made that ~13% of a core on a 2-core VM, taken from the reads it serves.
    """

    def __init__(self) -> None:
        self._sleeping: asyncio.Future[None] | None = None

    def set(self) -> None:
        """End the current sleep now; nothing when the loop is not sleeping (it polls next anyway)."""
        fut = self._sleeping
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        fut = self._sleeping = loop.create_future()
        timer = loop.call_later(seconds, _end, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._sleeping = None


def _end(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
