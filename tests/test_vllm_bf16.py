"""Real vLLM prefill and decode in bf16, TP 1 -> 1, through kvxferd: the decode's greedy tokens
equal a single bf16 instance's, and every prompt block arrives."""

from __future__ import annotations

import contextlib

import pytest
from vllm_world import daemon_status, model, start, text

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
        yield ref, p, d, dd


def test_bf16_decode_equals_single_instance(pair):
    ref, p, d, dd = pair
    for n in (33, 100, 257):
        prompt = prompts(1, n, seed=n)[0]
        _, out = handoff(p, d, prompt)
        assert text(out) == text(ref.complete(prompt, 16)), f"{n} tokens"
    assert daemon_status(dd).counters.received == 3
