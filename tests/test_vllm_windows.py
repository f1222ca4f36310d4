"""Gemma4 with vLLM's defaults: prefix caching on and `kv_load_failure_policy` fail, prefill
TP 1 -> decode TP 2.

    A  TP 1 prefill (daemon a), also the single instance (plain requests)
    C  TP 2 decode  (daemon c)

At TP 2 vLLM gives the decode's sliding-window groups blocks other than the prefill's, so for
some prompt lengths the decode keeps a window block whose first tokens the prefill no longer
holds. A decode that caches prefixes cannot fill such a block from inside (it would cache it as
whole), so that read is refused by design. The connector's scheduler half knows it from the two
sides' block lists before vLLM schedules the request (`get_num_new_matched_tokens`), answers
that nothing is to be loaded, and vLLM computes the prompt itself: every prompt is answered as
the single instance answers it, none with an HTTP error, and no read fails.
"""

from __future__ import annotations

import contextlib

import pytest
from vllm_world import MODELS, daemon_status, start, text, wait_until

from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.vllm_servers import VllmServer, handoff, make_model, prompts

pytestmark = pytest.mark.vllm

LENGTHS = (40, 100, 130, 200, 300, 520)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-windows")
    base = MODELS / "tiny-gemma4"
    model = make_model(base.with_name(base.name + "-seed0"), 0, "gemma4")
    servers: list = []
    try:
        da = DaemonProcess(workdir, "windows-a")
        servers.append(da)
        dc = DaemonProcess(workdir, "windows-c")
        servers.append(dc)
        common = dict(dtype="float32", block_size=32, prefix_caching=True, connector="kvxferd", failure_policy="fail",
                      args=["--num-gpu-blocks-override", "1024"])
        a = VllmServer(workdir, "windows-A", model, role="kv_producer", socket=da.socket, cores="nobind", **common)
        servers.append(a)
        c = VllmServer(workdir, "windows-C", model, role="kv_consumer", socket=dc.socket, tp=2, cores="0|1", **common)
        servers.append(c)
        start(a, c)
        yield a, c, dc
    finally:
        for process in reversed(servers):
            with contextlib.suppress(Exception):
                process.stop()


def test_every_prompt_is_answered_as_a_single_instance_answers_it(world):
    a, c, dc = world
    read_before, bytes_before = daemon_status(dc).counters, c.metric("vllm:kvxferd_read_bytes_sum")
    for n in LENGTHS:
        prompt = prompts(1, n, seed=900 + n)[0]
        want = text(a.complete(prompt, 16))
        _, d = handoff(a, c, prompt)  # an HTTP error raises here
        assert text(d) == want, f"{n} tokens"
    counters = daemon_status(dc).counters
    assert counters.failed == read_before.failed, daemon_status(dc).failures[-3:]
    locally = c.log_path.read_text().count("computing it locally")
    # both ways ran: some prompts were read, the others computed by the decode itself
    assert locally > 0, counters
    wait_until("reads in vLLM's metrics", lambda: c.metric("vllm:kvxferd_read_bytes_sum") > bytes_before, 30)
