"""The idle pace (pace.py): spin right after activity, the short tick while hot or holding,
the long tick once quiet; the progress loop's sleep, cut short by a wake."""

import asyncio
import time

from kvxferd.pace import SPIN, Pace, Wake


def pace() -> Pace:
    return Pace(spin_s=0.002, idle_poll_s=0.001, idle_max_s=0.05, hot_s=1.0)


def test_never_active_is_cold_unless_holding():
    p = pace()
    assert p.idle_wait(100.0, needed=False) == 0.05
    assert p.idle_wait(100.0, needed=True) == 0.001


def test_activity_spins_then_ticks_then_cools():
    p = pace()
    p.active(10.0)
    assert p.idle_wait(10.001, needed=False) == SPIN
    assert p.idle_wait(10.5, needed=False) == 0.001
    assert p.idle_wait(11.5, needed=False) == 0.05
    assert p.idle_wait(11.5, needed=True) == 0.001
    p.active(11.5)
    assert p.idle_wait(11.5005, needed=False) == SPIN


def test_a_wake_ends_the_sleep_and_a_timeout_ends_it_without_one():
    async def main() -> None:
        wake = Wake()
        wake.set()  # not sleeping: nothing to end, nothing remembered
        t0 = time.monotonic()
        await wake.sleep(0.05)
        assert time.monotonic() - t0 >= 0.045  # the timeout ended it
        sleeper = asyncio.ensure_future(wake.sleep(30.0))
        await asyncio.sleep(0.01)
        wake.set()
        for _ in range(3):  # the sleeper's task resumes within a few loop turns, not 30 s on
            await asyncio.sleep(0)
        assert sleeper.done()  # the wake ended it
        cancelled = asyncio.ensure_future(wake.sleep(30.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        wake.set()  # a cancelled sleep leaves nothing behind to wake
        await wake.sleep(0.01)
    asyncio.run(main())
