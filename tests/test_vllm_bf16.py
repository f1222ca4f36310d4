"""Real vLLM prefill and decode in bf16, TP 1 -> 1, through kvxferd: the decode's greedy tokens
equal a single bf16 instance's, and every prompt block arrives."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest
from vllm_world import daemon_status, model, start, text, wait_until

from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.vllm_servers import VllmServer, handoff, prompts

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    wd = tmp_path_factory.mktemp("vllm-bf16")
    with contextlib.ExitStack() as running:  # each process stopped, also when a later one fails to start

        def own(process):
            running.callback(process.stop)
            return process

        pd, dd = own(DaemonProcess(wd, "p-daemon")), own(DaemonProcess(wd, "d-daemon"))
        ref = own(VllmServer(wd, "single", model(0), cores="nobind", worker_in_engine=True))
        p = own(VllmServer(wd, "prefill", model(0), role="kv_producer", connector="kvxferd", socket=pd.socket,
                           cores="0"))
        d = own(VllmServer(wd, "decode", model(0), role="kv_consumer", connector="kvxferd", socket=dd.socket,
                           cores="1"))
        start(ref, p, d)
        yield ref, p, d, dd, pd


def test_bf16_decode_equals_single_instance(pair):
    ref, p, d, dd, _pd = pair
    for n in (33, 100, 257):
        prompt = prompts(1, n, seed=n)[0]
        _, out = handoff(p, d, prompt)
        assert text(out) == text(ref.complete(prompt, 16)), f"{n} tokens"
    assert daemon_status(dd).counters.received == 3


def _workers(server: VllmServer) -> list[int]:
    """The pids of a server's model workers (vLLM titles them VLLM::Worker...): its session's."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0]
            sid = os.getsid(int(entry))
        except (OSError, ProcessLookupError):
            continue
        if sid == server.proc.pid and title.startswith(b"VLLM::Worker"):
            pids.append(int(entry))
    return pids


def test_a_prefill_worker_that_dies_leaves_no_hold_and_the_decode_recomputes(pair):
    """Last in the module: it kills the prefill's worker. A worker dying (SIGILL, as vLLM CPU's AMX
    kernels die unpermitted) while its engine holds a request: the prefill daemon ends that hold
    and marks the engine's ranks closing, as for any engine that goes away; the decode's read of
    the dead engine's blocks fails at once and vLLM recomputes: the single instance's tokens."""
    ref, p, d, dd, pd = pair
    prompt = prompts(1, 100, seed=7)[0]
    first = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    # the hold leaves with the prefill's next step, after its answer
    wait_until("the prefill holds the request for its decode", lambda: daemon_status(pd).held, 30)
    workers = _workers(p)
    assert workers, "the prefill's worker process"
    for pid in workers:
        os.kill(pid, signal.SIGILL)
    st = wait_until("the dead engine's hold ended and its ranks closing",
                    lambda: (s := daemon_status(pd)) and not s.held and all(e.state == "closing" for e in s.engines)
                    and s, 60)
    assert st.counters.failed == 0  # nothing read yet: nothing failed on this side
    before = daemon_status(dd).counters
    out = d.complete(prompt, 16, kv_transfer_params=first["kv_transfer_params"])
    assert text(out) == text(ref.complete(prompt, 16))
    after = daemon_status(dd).counters
    assert after.failed > before.failed and after.received == before.received, (before, after)
    st = daemon_status(dd)
    assert st.in_flight == [] and "no longer holds request" in st.failures[-1].reason, st.failures
