"""What NIXL or a defect throws on the read path stays with one read (reads.py, postings.py).

NIXL keeps a handle it was asked to release when it cannot cancel the transfer (its
`release_xfer_handle` raises): such a posting stays the read's, as if still running, and is
released later, never twice; and no handle is asked about once released (a use after free in
NIXL). A read whose check raises what no path expects ends `internal`; the progress loop and the
other reads go on. Neither can be caused on demand with real NIXL (it needs a transfer NIXL
cannot cancel, or a defect), so NIXL's agent is stood in for here, at its Python API. And a
daemon one of whose own loops ends anyway exits, failing, for its supervisor to start again.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

from kvxferd import protocol as P
from kvxferd.logs import Throttle
from kvxferd.nixl_driver import NixlDriver
from kvxferd.postings import AgentRead
from kvxferd.reads import Reads, Transfer
from kvxferd.recorder import Recorder


class Agent:
    """NIXL's agent API as `NixlDriver` calls it: handles by name, some refused release."""

    def __init__(self, refuse: dict[str, int]) -> None:
        self.refuse = dict(refuse)  # handle -> how many releases NIXL still refuses
        self.freed: list[str] = []
        self.asked_after_free: list[str] = []

    def check_xfer_state(self, handle: str) -> str:
        if handle in self.freed:
            self.asked_after_free.append(handle)
        return "DONE"

    def release_xfer_handle(self, handle: str) -> None:
        assert handle not in self.freed, f"{handle} released twice"
        if self.refuse.get(handle, 0) > 0:
            self.refuse[handle] -= 1
            raise RuntimeError(f"NIXL_ERR_REPOST_ACTIVE: {handle} could not be cancelled")
        self.freed.append(handle)


def driver(agent: Agent) -> NixlDriver:
    nixl = NixlDriver.__new__(NixlDriver)  # its agent stood in for; the rest is NixlDriver's own
    nixl.agent, nixl.telemetry, nixl._refusals = agent, False, Throttle(60.0)
    return nixl


def transfer(request_id: str, started: float = 1000.0) -> Transfer:
    er = SimpleNamespace(engine_id="decode", tp_rank=0, completions=[])
    er.complete = er.completions.append
    ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 1, "p-" + request_id)
    return Transfer(er, P.Read("decode", 0, request_id, ref, 8, [[1, 2]], [[1, 2]], 30.0), None, 0.0, started,
                    started + 30.0)


def test_a_handle_nixl_keeps_stays_with_its_read_until_released_and_none_is_freed_twice():
    agent = Agent(refuse={"b": 2})
    nixl = driver(agent)
    t = transfer("r")
    t.postings = [AgentRead(nixl, h) for h in ("a", "b", "c")]
    assert t.poll()  # every READ DONE
    t.release_all()
    assert sorted(agent.freed) == ["a", "c"]
    assert [p.handle for p in t.postings] == ["b"] and t.running  # kept: NIXL still has it
    t.settle()  # as `_end` does: refused once more, so it stays (quarantined by the caller)
    assert [p.handle for p in t.postings] == ["b"]
    t.release_ended()  # the quarantine's turn: released now
    assert not t.running and sorted(agent.freed) == ["a", "b", "c"]
    assert agent.asked_after_free == []


class Raising:
    """A posting whose state check raises what no path expects."""

    wakes_loop = False

    def __init__(self) -> None:
        self.checked = 0

    def ended(self) -> bool:
        self.checked += 1
        raise KeyError("a defect")

    def release_if_ended(self) -> bool:
        return True  # nothing of NIXL's is left

    def cancel(self) -> bool:
        return False


class Running:
    wakes_loop = False

    def __init__(self) -> None:
        self.checked = 0

    def ended(self) -> bool:
        self.checked += 1
        return False


def test_a_read_whose_check_raises_ends_internal_and_the_others_are_still_checked():
    reads = Reads(SimpleNamespace(), SimpleNamespace(routes={}), Recorder(), 60.0, SimpleNamespace())
    broken, fine = transfer("broken"), transfer("fine")
    broken.postings, fine.postings = [Raising()], [Running()]
    for t in (broken, fine):
        reads._in_flight[t.key] = t
    reads._per_rank[("decode", 0)] = 2
    reads.poll(1001.0)  # raised out of the progress loop before
    assert broken.done and broken.key not in reads._in_flight and not broken.running
    (c,) = broken.engine.completions
    assert c.status == "failed" and c.request_id == "broken" and "internal" in c.reason and "a defect" in c.reason
    assert c.block_ids == [[1, 2]]
    assert fine.postings[0].checked == 1 and fine.key in reads._in_flight and not fine.engine.completions
    reads.poll(1002.0)
    assert broken.postings == [] and fine.postings[0].checked == 2
    assert reads._per_rank == {("decode", 0): 1}


def test_a_daemon_whose_loop_ends_exits_failing_rather_than_answer_without_progress(tmp_path):
    """A defect injected where no guard stands (housekeeping's stall check, its 20th turn)."""
    script = textwrap.dedent(f"""
        import sys
        from kvxferd import stall
        from kvxferd.cli import app
        turns, tick = [0], stall.StallWatch.tick
        def defect(self, *a, **k):
            turns[0] += 1
            if turns[0] == 20:
                raise RuntimeError("injected defect")
            return tick(self, *a, **k)
        stall.StallWatch.tick = defect
        sys.argv = ["kvxferd", "serve", "--socket", {str(tmp_path / "d.sock")!r}, "--side-channel-port", "0",
                    "--metrics-port", "-1"]
        app()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "a daemon loop ended (RuntimeError('injected defect'))" in done.stderr
    assert "kvxferd stopped" in done.stderr  # stopped in order: socket unlinked, engines released
    assert not (tmp_path / "d.sock").exists()
