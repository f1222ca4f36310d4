"""Engine isolation (protocol 3): a rank belongs to the process that registered it. Another
process on the same socket that names it is refused `forbidden` for every request, and counted;
the owner's own second connection (a long poll) keeps working, and a process given the rank's
token may `attach` and act for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from kvxferd import protocol as P
from kvxferd.client import EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)

# Runs in its own process: every request an engine can make, against the rank it does not own.
HOSTILE = textwrap.dedent("""
    import json, sys
    from kvxferd import protocol as P
    from kvxferd.client import Client, DaemonError, EngineClient
    socket, token = sys.argv[1], sys.argv[2]
    c = EngineClient(socket, "victim", 0, 1)
    r = c.requests
    remote = P.RemoteRef("prefill", "127.0.0.1", 1, 1, "x")
    attempts = {
        "unregister": r.unregister(),
        "hold": r.hold("h", 30.0, [[1]]),
        "read": r.read("x", remote, 8, [[2, 3]], [[2, 3]], 5.0),
        "poll": r.poll(0.0, 16),
        "long poll": r.poll(0.5, 16),
    }
    codes = {}
    for name, msg in attempts.items():
        try:
            c.rpc.call(msg, P.Ok if name not in ("poll", "long poll") else P.Completions)
            codes[name] = "served"
        except DaemonError as exc:
            codes[name] = exc.code
    results = c.rpc.call(P.Batch([r.hold("b1", 30.0, [[4]]), r.read("b2", remote, 8, [[5]], [[5]], 5.0)]), P.Results)
    codes["batch"] = [x.code if isinstance(x, P.Error) else "served" for x in results.items]
    try:
        c.attach("0" * 32)
        codes["attach, wrong token"] = "served"
    except DaemonError as exc:
        codes["attach, wrong token"] = exc.code
    if token:
        c.attach(token)
        c.hold("granted", 30.0, [[6]])
        codes["after attach"] = [x.request_id for x in c.poll(0.0)] == [] and "served"
    print(json.dumps(codes))
""")


def other_process(socket: str, token: str = "") -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", HOSTILE, socket, token], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def world(tmp_path):
    daemon = DaemonProcess(tmp_path, "daemon", metrics_port=0)
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    owner = EngineClient(daemon.socket, "victim", 0, 1)
    owner.register(geo, shm_fds=[fd])
    os.close(fd)
    yield daemon, owner
    owner.close()
    mm.close()
    daemon.stop()


def test_another_process_is_refused_every_request_and_counted(world):
    daemon, owner = world
    owner.hold("mine", 30.0, [[7]])
    codes = other_process(daemon.socket)
    assert codes == {"unregister": "forbidden", "hold": "forbidden", "read": "forbidden", "poll": "forbidden",
                     "long poll": "forbidden", "batch": ["forbidden", "forbidden"],
                     "attach, wrong token": "forbidden"}
    st = owner.rpc.status()
    assert st.counters.forbidden == 8
    assert [h.request for h in st.held] == ["mine"]  # nothing the other process tried took effect
    assert [e.engine for e in st.engines] == ["victim"]
    metrics = urllib.request.urlopen(f"http://{st.metrics}/metrics", timeout=10).read().decode()
    assert 'kvxferd_forbidden_requests_total{method="unregister"} 1.0' in metrics
    assert 'kvxferd_forbidden_requests_total{method="poll"} 2.0' in metrics
    owner.hold("still mine", 30.0, [[8]])  # the owner is untouched


def test_the_owner_s_second_connection_long_polls_for_it(world):
    daemon, owner = world
    with EngineClient(daemon.socket, "victim", 0, 1) as second:
        assert second.poll(0.05) == []  # same process: served
        nobody = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")
        owner.read("r", nobody, 8, [[2]], [[2]], 5.0)
        [done] = second.poll(10.0)
        assert (done.request_id, done.status) == ("r", "failed")
    assert owner.rpc.status().counters.forbidden == 0


def test_a_process_with_the_token_attaches_and_acts_for_the_rank(world):
    daemon, owner = world
    assert len(owner.token) == 32
    codes = other_process(daemon.socket, owner.token)
    assert codes["after attach"] == "served" and codes["hold"] == "forbidden"  # refused until attached
    assert "granted" in [h.request for h in owner.rpc.status().held]
