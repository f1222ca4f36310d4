"""How often an idle daemon progresses NIXL: often enough that a peer's READ of this daemon's
memory is served at once, rarely enough that an idle daemon costs no core.

A peer's READ of our memory completes only when our UCX worker progresses, even over `cma`
(measured: a 16-block read waits for the serving daemon's next tick). Every READ carries a
notification, so traffic is visible; the pace follows it:

    activity (hold, notification, handshake answered) ─┬─ spin_s: yield to the loop every turn
                                                       ├─ hot_s, or while requests are held:
                                                       │      every idle_poll_s (timer resolution 1 ms)
                                                       └─ then: every idle_max_s
"""

from __future__ import annotations

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

    def idle_wait(self, now: float, holding: bool) -> float:
        """Seconds to wait for a wake-up before progressing NIXL again (SPIN: just yield)."""
        quiet = now - self.last_activity
        if quiet < self.spin_s:
            return SPIN
        if holding or quiet < self.hot_s:
            return self.idle_poll_s
        return self.idle_max_s
