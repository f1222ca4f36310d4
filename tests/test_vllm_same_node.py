"""Real vLLM prefill and decode (CPU build, float32) sharing one kvxferd daemon: the node's
daemon, as the chart's DaemonSet runs it. The decode's greedy tokens equal a single instance's,
every read is copied by the daemon itself (lane `copy`) and audited against the prefill's
digests, and a prefill with other weights on the same daemon changes the output (the negative
control: the decode really uses the KV it was handed)."""

from __future__ import annotations

import pytest
from vllm_world import daemon_status, daemon_warnings, model, start, text

from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.vllm_servers import VllmServer, handoff, prompts

pytestmark = pytest.mark.vllm

DTYPE = "float32"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    wd = tmp_path_factory.mktemp("vllm-same-node")
    running = []
    try:
        daemon = DaemonProcess(wd, "node-daemon", metrics_port=0, extra=["--integrity-audit"])
        running.append(daemon)
        ref = VllmServer(wd, "single", model(0), cores="nobind", dtype=DTYPE, worker_in_engine=True)
        running.append(ref)
        p = VllmServer(wd, "prefill", model(0), role="kv_producer", connector="kvxferd", dtype=DTYPE,
                       socket=daemon.socket, cores="0")
        running.append(p)
        d = VllmServer(wd, "decode", model(0), role="kv_consumer", connector="kvxferd", dtype=DTYPE,
                       socket=daemon.socket, cores="1", extra_config={"enforce_handshake_compat": False})
        running.append(d)
        other = VllmServer(wd, "prefill-other-weights", model(1), role="kv_producer", connector="kvxferd",
                           dtype=DTYPE, socket=daemon.socket, cores="0")
        running.append(other)
        start(ref, p, d, other)
        yield daemon, ref, p, d, other
    finally:
        for process in reversed(running):
            process.stop()


def test_decode_through_the_nodes_daemon_equals_a_single_instance(node):
    daemon, ref, p, d, _ = node
    before = daemon_status(daemon).counters
    for n in (40, 100, 257):
        prompt = prompts(1, n, seed=n)[0]
        _, out = handoff(p, d, prompt)
        assert text(out) == text(ref.complete(prompt, 16)), (n, daemon_status(daemon).failures[-3:],
                                                             daemon_warnings(daemon))
    st = daemon_status(daemon)
    assert st.counters.received == before.received + 3 and st.counters.failed == before.failed
    assert daemon.metric('kvxferd_audits_total{outcome="ok"}') >= 3
    lanes = {tuple(peer.lanes) for peer in st.peers if peer.state == "ready"}
    assert lanes == {("copy",)}, st.peers
    assert st.totals.remote_agents == 0  # no NIXL metadata of its own loaded as a peer's
    assert st.held == [] and st.in_flight == []


def test_other_prefill_weights_on_the_same_daemon_change_the_output(node):
    daemon, ref, _, d, other = node
    for n in (64, 150):
        prompt = prompts(1, n, seed=200 + n)[0]
        received = daemon_status(daemon).counters.received
        _, out = handoff(other, d, prompt)
        # the read arrived (a failed one is recomputed with the decode's own weights: no control then)
        assert daemon_status(daemon).counters.received == received + 1, daemon_status(daemon).failures[-3:]
        assert text(out) != text(ref.complete(prompt, 16))
