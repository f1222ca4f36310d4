"""The idle pace (pace.py): spin right after activity, the short tick while hot or holding,
the long tick once quiet."""

from kvxferd.pace import SPIN, Pace


def pace() -> Pace:
    return Pace(spin_s=0.002, idle_poll_s=0.001, idle_max_s=0.05, hot_s=1.0)


def test_never_active_is_cold_unless_holding():
    p = pace()
    assert p.idle_wait(100.0, holding=False) == 0.05
    assert p.idle_wait(100.0, holding=True) == 0.001


def test_activity_spins_then_ticks_then_cools():
    p = pace()
    p.active(10.0)
    assert p.idle_wait(10.001, holding=False) == SPIN
    assert p.idle_wait(10.5, holding=False) == 0.001
    assert p.idle_wait(11.5, holding=False) == 0.05
    assert p.idle_wait(11.5, holding=True) == 0.001
    p.active(11.5)
    assert p.idle_wait(11.5005, holding=False) == SPIN
