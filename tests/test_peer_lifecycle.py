"""The decode daemon's peers over their life, with real daemons and engines in their own processes:
a remote engine that left, restarted, went silent or idle is retired (its routes, lists and
metadata released once no read uses them) and the next read handshakes anew; two engines behind
one prefill daemon share one NIXL agent, and retiring one leaves the other reading.

Probes run every 0.2 s here (default 10 s) so that each case takes seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import msgspec
import pytest
from vllm_world import wait_until

from kvxferd import protocol as P
from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, EngineProcess
from kvxferd.plan.models import PRESETS

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64, layers=2)


def liveness(monkeypatch: pytest.MonkeyPatch, dead_after_s: float = 5.0, idle_ttl_s: float = 0.0) -> None:
    monkeypatch.setenv("KVXFERD_PEER_PROBE_INTERVAL_S", "0.2")
    monkeypatch.setenv("KVXFERD_PEER_DEAD_AFTER_S", str(dead_after_s))
    monkeypatch.setenv("KVXFERD_PEER_IDLE_TTL_S", str(idle_ttl_s))


def metrics(c: Cluster, which: int) -> dict[str, float]:
    """A daemon's Prometheus samples, by their exposition name and labels."""
    with urllib.request.urlopen(f"http://{c.status(which).metrics}/metrics", timeout=10) as r:
        rows = [line.rsplit(" ", 1) for line in r.read().decode().splitlines() if not line.startswith("#")]
    return {name: float(value) for name, value in rows}


def read(c: Cluster, engine: EngineProcess, seq: int, num_tokens: int = 40) -> None:
    """Prefill on `engine`, read on the decode side (every byte verified there), holds released."""
    blocks = engine.prefill(seq, num_tokens, 30.0)
    try:
        out = c.decode.decode(seq, num_tokens, RemoteRef(engine.engine_id, c.host, c.port, c.p_tp, f"req-{seq}"),
                              blocks, 0, 30.0, SHAPE)
        assert out["status"] == "received", out
        assert engine.wait_released(seq, 10) == ["sent"] * c.p_tp
    finally:
        engine.free(blocks)


def peers(c: Cluster) -> list[tuple[str, str]]:
    return sorted((p.engine, p.state) for p in c.status(1).peers)


def retired(c: Cluster, engine: str, reason: str) -> P.Status:
    """The decode daemon retired `engine`'s peer for `reason` and released it."""
    def gone() -> P.Status | None:
        st = c.status(1)
        return st if all(p.engine != engine for p in st.peers) else None

    st = wait_until(f"{engine}'s peer retired ({reason}) and released", gone, 15, 0.05)
    assert metrics(c, 1)[f'kvxferd_peers_retired_total{{reason="{reason}"}}'] == 1
    return st


def test_an_engine_leaving_a_shared_daemon_leaves_the_other_reading(monkeypatch):
    liveness(monkeypatch)
    with Cluster(SHAPE, 2, 4, metrics=True) as c:
        b = EngineProcess(c.daemons[0].socket, "prefill-b", SHAPE, 2)
        c.engines.append(b)
        read(c, c.prefill, 0)
        read(c, b, 1)
        st = c.status(1)
        assert peers(c) == [("prefill", "ready"), ("prefill-b", "ready")]
        assert len({p.agent for p in st.peers}) == 1 and st.totals.remote_agents == 1
        c.prefill.close()  # unregisters both ranks
        st = retired(c, "prefill", "engine_gone")
        assert peers(c) == [("prefill-b", "ready")] and st.totals.remote_agents == 1
        for seq in (2, 3):
            read(c, b, seq)
        st = c.status(1)
        assert (st.counters.handshakes, st.counters.peers_retired, st.counters.failed) == (2, 1, 0)
        m = metrics(c, 1)
        assert m['kvxferd_peers{state="ready"}'] == 1 and m['kvxferd_peers{state="retired"}'] == 0
        assert m["kvxferd_nixl_remote_agents"] == 1 and m['kvxferd_peer_probes_total{outcome="engine_gone"}'] == 1
        text = subprocess.run([sys.executable, "-m", "kvxferd", "status", "--socket", c.daemons[1].socket],
                              capture_output=True, text=True, check=True).stdout
        assert "1 retired so far; NIXL remote agents loaded: 1" in text
        (row,) = [line for line in text.splitlines() if "prefill-b" in line]
        assert " ready " in row


def test_an_engine_restarted_under_its_id_is_retired_and_read_anew(monkeypatch):
    """Its new registration has another epoch: the probe after the restart says so. (The decode
    daemon is stopped meanwhile, so that no probe catches the engine between its two lives.)"""
    liveness(monkeypatch, dead_after_s=30.0)
    with Cluster(SHAPE, 2, 4, metrics=True) as c:
        read(c, c.prefill, 0)
        decode = c.daemons[1].proc
        os.kill(decode.pid, signal.SIGSTOP)
        try:
            c.prefill.proc.kill()
            c.prefill = wait_until("the engine registered again", lambda: _register(c), 15, 0.05)
            c.engines.append(c.prefill)
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        retired(c, "prefill", "restarted")
        read(c, c.prefill, 1)
        st = c.status(1)
        assert st.counters.handshakes == 2 and peers(c) == [("prefill", "ready")]


def _register(c: Cluster) -> EngineProcess | None:
    """A new "prefill" engine, once the killed one's ranks have left its daemon."""
    if any(e.engine == "prefill" and e.state == "serving" for e in c.status(0).engines):
        return None
    return EngineProcess(c.daemons[0].socket, "prefill", SHAPE, 2)


def test_a_silent_peer_daemon_is_retired_and_read_anew_once_back(monkeypatch):
    liveness(monkeypatch, dead_after_s=1.0)
    with Cluster(SHAPE, 2, 4, metrics=True) as c:
        read(c, c.prefill, 0)
        prefill = c.daemons[0].proc
        os.kill(prefill.pid, signal.SIGSTOP)  # its side channel answers nothing
        try:
            t0 = time.monotonic()
            st = retired(c, "prefill", "silent")
            assert time.monotonic() - t0 < 1.0 + 1.5 and st.totals.remote_agents == 0
            wait_until("the unanswered probe counted",
                       lambda: metrics(c, 1).get('kvxferd_peer_probes_total{outcome="no_answer"}'), 5, 0.05)
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        read(c, c.prefill, 1)
        assert c.status(1).counters.handshakes == 2


def test_a_decode_daemon_paused_past_the_deadline_keeps_its_peers(monkeypatch):
    """The decode daemon itself stopped (SIGSTOP, a frozen container) for longer than
    peer_dead_after_s: it asked its peers nothing meanwhile, so on waking it probes them rather
    than retiring them; the next read needs no new handshake."""
    liveness(monkeypatch, dead_after_s=2.0)
    with Cluster(SHAPE, 2, 4, metrics=True) as c:
        read(c, c.prefill, 0)
        decode = c.daemons[1].proc
        alive = metrics(c, 1).get('kvxferd_peer_probes_total{outcome="alive"}', 0)
        os.kill(decode.pid, signal.SIGSTOP)  # a probe may be out: its answer waits, or it times out
        try:
            time.sleep(4.5)
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        wait_until("a probe answered since the pause",
                   lambda: metrics(c, 1).get('kvxferd_peer_probes_total{outcome="alive"}', 0) > alive, 5, 0.05)
        time.sleep(2.5)  # past peer_dead_after_s after waking, probes answered all along
        assert peers(c) == [("prefill", "ready")]
        read(c, c.prefill, 1)
        st = c.status(1)
        assert st.counters.handshakes == 1 and st.counters.peers_retired == 0


def test_an_idle_peer_is_evicted_and_read_anew(monkeypatch):
    liveness(monkeypatch, idle_ttl_s=1.0)
    with Cluster(SHAPE, 2, 4, metrics=True) as c:
        read(c, c.prefill, 0)
        st = c.status(1)
        assert peers(c) == [("prefill", "ready")] and st.peers[0].idle_s is not None
        st = retired(c, "prefill", "idle")
        assert st.totals.remote_agents == 0 and metrics(c, 1)["kvxferd_nixl_remote_agents"] == 0
        read(c, c.prefill, 1)
        assert c.status(1).counters.handshakes == 2
