"""What NIXL or a defect throws on the read path stays with one read (reads.py, postings.py).

NIXL keeps a handle it was asked to release when it cannot cancel the transfer (its
`release_xfer_handle` raises): such a posting stays the read's, quarantined once the read ends,
and is released on a later poll, never twice; and no handle is asked about once released (a use
after free in NIXL). A read whose check raises what no path expects ends `internal`, one whose end
raises is still ended once, and the other reads go on. Neither can be caused on demand with real
NIXL (it needs a transfer NIXL cannot cancel, or a defect), so NIXL's agent is stood in for here,
at its Python API. In real daemons: a progress loop whose poll raises goes on reading, and a
daemon one of whose own loops ends anyway exits, failing, for its supervisor to start again.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from kvxferd import protocol as P
from kvxferd.benchmarks.control import SHAPE, _drive
from kvxferd.benchmarks.harness import BenchEngine, daemons, environment
from kvxferd.logs import Throttle
from kvxferd.nixl_driver import NixlDriver
from kvxferd.plan.models import build
from kvxferd.postings import AgentRead
from kvxferd.reads import Reads, Transfer
from kvxferd.recorder import Recorder


class Agent:
    """NIXL's agent API as `NixlDriver` calls it: handles by name, some refused release."""

    def __init__(self, states: dict[str, str], refuse: dict[str, int]) -> None:
        self.states = states  # handle -> what NIXL reports: DONE, PROC or ERR
        self.refuse = dict(refuse)  # handle -> how many releases NIXL still refuses
        self.freed: list[str] = []
        self.asked_after_free: list[str] = []

    def check_xfer_state(self, handle: str) -> str:
        if handle in self.freed:
            self.asked_after_free.append(handle)
        return self.states[handle]

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


class Engine:
    """An engine rank as `Reads` tells it: the completions it was handed."""

    engine_id, tp_rank, key, uid = "decode", 0, ("decode", 0), None

    def __init__(self) -> None:
        self.completions: list[P.Completion] = []

    def complete(self, completion: P.Completion) -> None:
        self.completions.append(completion)


def transfer(request_id: str, started: float = 1000.0) -> Transfer:
    er = Engine()
    ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 1, "p-" + request_id)
    return Transfer(er, P.Read("decode", 0, request_id, ref, 8, [[1, 2]], [[1, 2]], 30.0), None, 0.0, started,
                    started + 30.0)


class Leases:
    """The leases' answers as `Reads` asks them: vouched for at once, or once confirmed."""

    def __init__(self, vouched: bool, release_raises: bool = False) -> None:
        self.vouched, self.release_raises = vouched, release_raises
        self.released: list[list[tuple[str, ...]]] = []

    def covers(self, keys: object, done_at: float, agent: str, epoch: str) -> bool:
        return self.vouched

    async def confirm(self, keys: object, done_at: float, deadline: object, agent: str, epoch: str) -> str:
        await asyncio.sleep(0)
        return ""  # confirmed: the hold lived through the READs

    def notified(self, claims: object, targets: object) -> None:
        pass

    def release(self, claims: list[tuple[str, ...]], unread: bool) -> None:
        if self.release_raises:
            raise ValueError("a defect in the claims' release")
        self.released.append(claims)


def through_reads(states: dict[str, str], refuse: dict[str, int], leases: Leases | None = None,
                  requests: tuple[str, ...] = ("r",)) -> tuple[Reads, Transfer, Agent]:
    """Reads of three READs each ("a", "b", "c" for the first) posted on NixlDriver over the
    stand-in agent; the first is returned."""
    agent = Agent(states, refuse)
    retired: list[str] = []  # the peers a failed READ retires (their routes handshake again)
    peers = SimpleNamespace(routes={}, keys=None, retire=lambda peer, why: retired.append(why))
    reads = Reads(driver(agent), peers, Recorder(), 60.0, SimpleNamespace(), leases=leases)
    for i, request_id in enumerate(requests):
        t = transfer(request_id)
        t.postings = [AgentRead(reads._nixl, h + str(i or "")) for h in ("a", "b", "c")]
        # notifications would ride the READs; one target rank
        t.route = SimpleNamespace(peer=SimpleNamespace(takes_notices=False, epoch=""), agent="p",
                                  plan=SimpleNamespace(targets=[0]))
        t.claims = [("prefill", "p-" + request_id, "0")]
        reads._in_flight[t.key] = t
    reads._quota._by_rank[("decode", 0)] = len(requests)
    return reads, reads._in_flight[("decode", 0, requests[0])], agent


def metrics_defect(*args: object) -> None:
    """A recorder method with a defect: it raises whatever it is given."""
    raise ValueError("a defect in the metrics")


def test_a_done_read_whose_handle_nixl_keeps_is_received_quarantined_then_released_once():
    reads, t, agent = through_reads({"a": "DONE", "b": "DONE", "c": "DONE"}, refuse={"b": 3})
    reads.poll(1001.0)  # every READ DONE: told, released but "b" (refused, by `_end` too, and by the
    # same poll's quarantine turn)
    assert [c.status for c in t.engine.completions] == ["received"]
    assert t.key not in reads._in_flight and reads.quarantined == 1 and [p.handle for p in t.postings] == ["b"]
    assert sorted(agent.freed) == ["a", "c"]
    reads.poll(1002.0)  # the quarantine's turn: released now, and the read no longer counts
    assert reads.quarantined == 0 and not t.running and sorted(agent.freed) == ["a", "b", "c"]
    assert reads._quota._by_rank == {} and agent.asked_after_free == []
    assert [c.status for c in t.engine.completions] == ["received"]  # no second completion


def test_a_failed_read_whose_handle_nixl_keeps_is_quarantined_and_nothing_is_asked_after_its_free():
    reads, t, agent = through_reads({"a": "DONE", "b": "ERR", "c": "DONE"}, refuse={"b": 3})
    reads.poll(1001.0)  # raised out of the progress loop before, "a" and "c" left listed once released
    (c,) = t.engine.completions
    assert c.status == "failed" and "transfer" in c.reason and c.block_ids == [[1, 2]]
    assert reads.quarantined == 1 and [p.handle for p in t.postings] == ["b"]
    reads.poll(1002.0)
    assert reads.quarantined == 0 and sorted(agent.freed) == ["a", "b", "c"] and reads._quota._by_rank == {}
    assert agent.asked_after_free == []


def test_a_read_whose_end_raises_is_still_ended_once():
    reads, t, agent = through_reads({"a": "DONE", "b": "DONE", "c": "DONE"}, refuse={})

    reads._recorder.read_received = metrics_defect  # raises after the read is marked done, before `_end`
    reads.poll(1001.0)
    assert [c.status for c in t.engine.completions] == ["received"]  # told before the defect
    assert t.key not in reads._in_flight and reads.quarantined == 0 and reads._quota._by_rank == {}
    assert sorted(agent.freed) == ["a", "b", "c"]


def test_a_read_whose_claims_release_raises_is_still_settled_and_counted():
    leases = Leases(vouched=True, release_raises=True)
    reads, t, agent = through_reads({"a": "DONE", "b": "DONE", "c": "DONE"}, refuse={}, leases=leases)
    reads.poll(1001.0)  # `_end` raises releasing the claims, after taking the read out of flight
    assert [c.status for c in t.engine.completions] == ["received"]
    assert t.key not in reads._in_flight and reads.quarantined == 0 and reads._quota._by_rank == {}
    assert sorted(agent.freed) == ["a", "b", "c"] and agent.asked_after_free == []


def test_shutdown_fails_every_read_even_where_a_defect_raises_on_the_way():
    states = {h + str(i or ""): "PROC" for h in "abc" for i in range(3)}
    reads, _, _ = through_reads(states, refuse={}, requests=("r0", "r1", "r2"))
    ts = list(reads._in_flight.values())

    reads._recorder.read_failed = metrics_defect  # raises after the engine is told, for every read
    reads.fail_all("shutdown", "the daemon is stopping")  # the first raise ended the loop before
    for r in ts:
        assert [(c.status, c.request_id) for c in r.engine.completions] == [("failed", r.msg.request_id)]
        assert "shutdown" in r.engine.completions[0].reason and r.engine.completions[0].block_ids == [[1, 2]]
    assert reads._in_flight == {} and reads.quarantined == 3  # the READs still run: memory kept


def test_a_confirmed_read_whose_end_raises_in_its_task_is_still_ended_once():
    async def main() -> tuple[Reads, Transfer, Agent]:
        reads, t, agent = through_reads({"a": "DONE", "b": "DONE", "c": "DONE"}, refuse={},
                                        leases=Leases(vouched=False))

        reads._recorder.read_received = metrics_defect  # raises in the confirmation's task, after `done`
        reads.poll(1001.0)  # DONE, not vouched: the confirmation runs as a task
        assert not t.engine.completions and t.key in reads._in_flight
        for _ in range(5):
            await asyncio.sleep(0)
        return reads, t, agent

    reads, t, agent = asyncio.run(main())
    assert [c.status for c in t.engine.completions] == ["received"]
    assert t.key not in reads._in_flight and reads._quota._by_rank == {} and reads.quarantined == 0
    assert sorted(agent.freed) == ["a", "b", "c"]


class Checked:
    """A posting the loop checks, counting its checks: still running, or (`defect`) raising what no
    path expects."""

    wakes_loop = False

    def __init__(self, defect: bool) -> None:
        self.defect, self.checked = defect, 0

    def ended(self) -> bool:
        self.checked += 1
        if self.defect:
            raise KeyError("a defect")
        return False

    def release_if_ended(self) -> bool:
        return self.defect  # a defective one has nothing of NIXL's left; a running one stays

    def cancel(self) -> bool:
        return False


def test_a_read_whose_check_raises_ends_internal_and_the_others_are_still_checked():
    reads = Reads(SimpleNamespace(), SimpleNamespace(routes={}, keys=None), Recorder(), 60.0, SimpleNamespace())
    broken, fine = transfer("broken"), transfer("fine")
    broken.postings, fine.postings = [Checked(defect=True)], [Checked(defect=False)]
    for t in (broken, fine):
        reads._in_flight[t.key] = t
    reads._quota._by_rank[("decode", 0)] = 2
    reads.poll(1001.0)  # raised out of the progress loop before
    assert broken.done and broken.key not in reads._in_flight and not broken.running
    (c,) = broken.engine.completions
    assert c.status == "failed" and c.request_id == "broken" and "internal" in c.reason and "a defect" in c.reason
    assert c.block_ids == [[1, 2]]
    assert fine.postings[0].checked == 1 and fine.key in reads._in_flight and not fine.engine.completions
    reads.poll(1002.0)
    assert fine.postings[0].checked == 2 and not broken.engine.completions[1:]
    assert reads._quota._by_rank == {("decode", 0): 1}


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


def test_a_poll_that_raises_is_logged_and_the_daemon_goes_on_reading(tmp_path):
    """The progress loop outlives a `Reads.poll` that raises (its first 30 calls, in both real
    daemons, injected at start through sitecustomize): the reads after it are all received."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        from kvxferd import reads
        calls, poll = [0], reads.Reads.poll
        def defect(self, now):
            calls[0] += 1
            if calls[0] <= 30:
                raise RuntimeError("injected defect")
            return poll(self, now)
        reads.Reads.poll = defect
    """))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    with environment({"PYTHONPATH": path}), daemons(2) as (pd, dd):
        geo = build(SHAPE, 1, 0)
        p = BenchEngine(pd.socket, "p", geo)
        d = BenchEngine(dd.socket, "d", geo)
        host, port = p.side_channel.rsplit(":", 1)
        # `_drive` asserts that every read came back `received`
        _, latencies = asyncio.run(_drive(dd.socket, d.client.token, geo, host, int(port), 2, 10, 1,
                                          (pd.socket, p.client.token)))
        assert len(latencies) == 10 and dd.proc.poll() is None and pd.proc.poll() is None
        d.close()
        p.close()
        log = Path(dd.log.name).read_text()
    assert "polling reads failed" in log and "RuntimeError: injected defect" in log
