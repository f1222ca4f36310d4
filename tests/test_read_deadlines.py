"""A read's deadline counts the decode daemon's running time (reads.py, stall.py): a pause moves
it on, a pause not counted yet judges no deadline, and neither outlives max_deadline_s."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvxferd import protocol as P
from kvxferd.deadline import until_deadline
from kvxferd.reads import PAUSE_GRACE_S, Reads, Transfer
from kvxferd.recorder import Recorder
from kvxferd.stall import StallWatch

MAX_DEADLINE_S = 60.0


def reads_with(pausing=lambda now: False) -> Reads:
    return Reads(SimpleNamespace(), SimpleNamespace(routes={}, keys=None), Recorder(), MAX_DEADLINE_S,
                 SimpleNamespace(), pausing=pausing)


def transfer(reads: Reads, request_id: str, started: float, deadline_s: float) -> Transfer:
    er = SimpleNamespace(engine_id="decode", tp_rank=0, key=("decode", 0), uid=None)
    ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 1, "p-" + request_id)
    t = Transfer(er, P.Read("decode", 0, request_id, ref, 8, [[1]], [[1]], deadline_s), None, 0.0, started,
                 started + deadline_s)
    reads._in_flight[t.key] = t
    return t


def test_a_pause_moves_each_read_on_by_what_it_lived_of_it_never_past_max_deadline():
    reads = reads_with()
    now = 1000.0
    old = transfer(reads, "old", now - 20.0, 30.0)  # lived through the whole pause
    new = transfer(reads, "new", now - 0.5, 30.0)  # started as the loop woke, before the pause was counted
    capped = transfer(reads, "capped", now - 20.0, 55.0)
    done = transfer(reads, "done", now - 20.0, 30.0)
    done.done = True
    reads.paused(10.0, now)
    assert old.deadline == pytest.approx(now - 20.0 + 30.0 + 10.0) and old.paused == pytest.approx(10.0)
    assert new.deadline == pytest.approx(now - 0.5 + 30.0 + 0.5)
    assert capped.deadline == pytest.approx(capped.started + MAX_DEADLINE_S)  # moved 5 s, not 10
    assert done.deadline == pytest.approx(now - 20.0 + 30.0) and done.paused == 0.0
    reads.paused(10.0, now + 1.0)
    assert capped.deadline == pytest.approx(capped.started + MAX_DEADLINE_S)  # at the cap: stays


def test_no_deadline_is_judged_while_a_pause_is_not_counted_yet_but_the_cap_holds():
    pausing = False
    reads = reads_with(lambda now: pausing)
    now = 1000.0
    late = transfer(reads, "late", now - 40.0, 30.0)  # its deadline passed by the host's clock
    at_cap = transfer(reads, "at-cap", now - MAX_DEADLINE_S + 0.05, 30.0)
    assert reads._deadline(late, now) == late.deadline
    pausing = True
    assert reads._deadline(late, now) == pytest.approx(now + PAUSE_GRACE_S)
    assert reads._deadline(at_cap, now) == pytest.approx(at_cap.started + MAX_DEADLINE_S)


def test_waiting_until_a_deadline_follows_it_as_it_moves():
    async def main() -> None:
        reads = reads_with()
        t = transfer(reads, "r", time.monotonic() - 1.0, 1.2)  # 0.2 s left
        job = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.1, reads.paused, 0.5, time.monotonic() + 0.1)
        asyncio.get_running_loop().call_later(0.4, job.set_result, "answered")
        assert await until_deadline(job, lambda: reads._deadline(t)) == "answered"  # past 0.2 s: moved on to 0.7 s
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await until_deadline(never, lambda: reads._deadline(t))
        assert never.cancelled()
    asyncio.run(main())


def test_a_gap_counts_as_stopped_only_the_time_the_loop_thread_did_not_run():
    watch = StallWatch(100.0)
    try:
        watch.restart(100.0, cpu=5.0)
        assert watch.tick(100.05, 0.05, cpu=5.01) == (0.0, 0.0)  # on time
        assert not watch.behind(100.5, 0.05)
        assert watch.behind(101.2, 0.05)  # a tick over a second late has not come: a pause may be under way
        gap = watch.tick(104.05, 0.05, cpu=5.51)  # 4 s late, of which it ran 0.5 s (its own work)
        assert gap.held == pytest.approx(3.95) and gap.stopped == pytest.approx(3.45)
        gap = watch.tick(108.10, 0.05, cpu=9.51)  # 4 s late, all of it spent running
        assert gap.held == pytest.approx(4.0) and gap.stopped == 0.0
    finally:
        watch.disarm()  # a failed assert must not leave a stack dump armed for the next test
