"""Engine isolation (protocol 3): a rank belongs to the connection that registered it. Another
process on the same socket that names it is refused `forbidden` for every request, and counted;
so is the owner's own second connection until it attaches with the rank's token, as any process
given the token may. A pid is never an identity: a daemon in its own PID namespace (a DaemonSet
pod beside engine pods) sees every client as pid 0, and isolation holds there too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

import pytest

from kvxferd import protocol as P
from kvxferd import rpc
from kvxferd.client import Client, DaemonError, EngineClient
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


def test_the_owner_s_second_connection_long_polls_for_it_once_attached(world):
    daemon, owner = world
    with EngineClient(daemon.socket, "victim", 0, 1) as second:
        with pytest.raises(DaemonError) as refused:
            second.poll(0.0)  # the same process is no identity
        assert refused.value.code == "forbidden"
        second.attach(owner.token)
        assert second.poll(0.05) == []
        nobody = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")
        owner.read("r", nobody, 8, [[2]], [[2]], 5.0)
        [done] = second.poll(10.0)
        assert (done.request_id, done.status) == ("r", "failed")
    assert owner.rpc.status().counters.forbidden == 1


def test_a_process_with_the_token_attaches_and_acts_for_the_rank(world):
    daemon, owner = world
    assert len(owner.token) == 32
    codes = other_process(daemon.socket, owner.token)
    assert codes["after attach"] == "served" and codes["hold"] == "forbidden"  # refused until attached
    assert "granted" in [h.request for h in owner.rpc.status().held]


def test_isolation_holds_for_a_daemon_in_its_own_pid_namespace(tmp_path):
    """The Helm DaemonSet and sidecar deployments: engines run in other PID namespaces than the
    daemon, so SO_PEERCRED reports pid 0 for every one of them. Another process still cannot act
    for a rank it did not register, and the owner keeps it."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not permitted here")
    daemon = DaemonProcess(tmp_path, "daemon", metrics_port=0, prefix=["unshare", "--pid", "--fork", "--kill-child"])
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    owner = EngineClient(daemon.socket, "victim", 0, 1)
    try:
        owner.register(geo, shm_fds=[fd])
        os.close(fd)
        owner.hold("mine", 30.0, [[7]])
        codes = other_process(daemon.socket)
        assert set(codes) >= {"unregister", "hold", "read", "poll", "long poll"}
        assert {k: v for k, v in codes.items() if k != "batch"} == dict.fromkeys(codes.keys() - {"batch"},
                                                                                 "forbidden")
        assert codes["batch"] == ["forbidden", "forbidden"]
        st = owner.rpc.status()
        assert [e.engine for e in st.engines] == ["victim"] and [h.request for h in st.held] == ["mine"]
        owner.hold("still mine", 30.0, [[8]])
    finally:
        owner.close()
        mm.close()
        daemon.stop()


def test_an_engine_that_dies_in_a_long_poll_is_unregistered_at_once_and_may_register_again(tmp_path):
    """Its connection closing ends the long poll: the rank stops serving then, not when the poll
    would have timed out, and the restarted engine registers at once although a hold's lease
    still pins the old memory."""
    daemon = DaemonProcess(tmp_path, "daemon")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        first = EngineClient(daemon.socket, "victim", 0, 1)
        first.register(geo, shm_fds=[fd])
        first.hold("pinned", 600.0, [[1]])
        first.rpc.sock.sendall(rpc.frame(P.encoder.encode(first.requests.poll(55.0, 16))))
        time.sleep(0.2)  # the long poll is waiting in the daemon
        first.close()
        with Client(daemon.socket, 10) as watcher:
            deadline = time.monotonic() + 20  # well before the poll's 55 s
            while any(e.state == "serving" for e in watcher.status().engines) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [e.state for e in watcher.status().engines] == ["closing"]
        again = EngineClient(daemon.socket, "victim", 0, 1)
        again.register(geo, shm_fds=[fd])  # the restart is not refused "already registered"
        states = sorted(e.state for e in again.rpc.status().engines)
        assert states == ["closing", "serving"]
        again.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def test_another_user_cannot_add_ranks_to_an_engine(tmp_path):
    """With several uids allowed, a second user registering a rank under an engine id someone
    else serves would have its memory read as that engine's KV: refused."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    from test_exhaustion import as_user_register

    root_dir = tempfile.mkdtemp(prefix="kvx-users-")
    os.chmod(root_dir, 0o755)
    os.environ["KVXFERD_ALLOWED_UIDS"] = "0,65534"
    try:
        daemon = DaemonProcess(tmp_path, "daemon", socket=f"{root_dir}/run/kvxferd.sock")
    finally:
        del os.environ["KVXFERD_ALLOWED_UIDS"]
    geo = build(SHAPE, 2, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        os.chmod(f"{root_dir}/run", 0o755)  # the file modes let the other user in: the daemon decides
        os.chmod(daemon.socket, 0o666)
        owner = EngineClient(daemon.socket, "victim", 0, 2)
        owner.register(geo, shm_fds=[fd])
        assert as_user_register(daemon.socket, 65534, 65534, "victim", 1, 2) == "forbidden"
        assert as_user_register(daemon.socket, 65534, 65534, "its-own", 0, 1) == "served"
        assert [e.engine for e in owner.rpc.status().engines].count("victim") == 1
        owner.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()
        shutil.rmtree(root_dir, ignore_errors=True)
