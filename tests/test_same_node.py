"""One daemon serving prefill and decode engines of its node (peers.py, local Peers; copier.py).

Real daemon, real synthetic engines in their own processes: every read is checked byte for
byte by the decode engine against what it would hold had it computed the cache itself. The
daemon never handshakes with itself over its side channel, nor loads its own NIXL metadata:
its routes to its own engines are copied by it (lane `copy`, host memory).
"""

from __future__ import annotations

import time

import msgspec
import pytest
from test_faults import wait_for

from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess, run_demo
from kvxferd.plan.models import PRESETS

replace = msgspec.structs.replace
SHAPE = replace(PRESETS["dense"], num_blocks=256, layers=2)
BIG = replace(PRESETS["dense"], num_blocks=1024, layers=8, block_size=16)
BIG_TOKENS = 16 * 1000  # ~260 MB per prompt over 4 ranks: the copy runs on the daemon's threads


@pytest.mark.parametrize(("preset", "p_tp", "d_tp"), [
    ("dense", 2, 4), ("dense", 4, 2), ("mla", 1, 2), ("mamba2", 2, 1), ("gdn", 1, 2), ("gemma4", 2, 2),
])
def test_every_family_and_tp_moves_byte_exact_through_one_daemon(preset, p_tp, d_tp):
    shape = replace(PRESETS[preset], num_blocks=128)
    result = run_demo(shape, p_tp, d_tp, requests=6, max_tokens=150, hit_ratio=0.5, seed=3, same_node=True)
    assert (result.received, result.failed) == (6, 0), result
    assert result.released == {"sent": 6 * p_tp}, result.released


def test_the_daemon_shows_its_own_lane_and_loads_no_metadata_of_its_own():
    with Cluster(SHAPE, 2, 2, metrics=True, same_node=True) as c:
        for seq in range(3):
            out = c.transfer(seq, num_tokens=70, hit_tokens=16 if seq else 0)
            assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        st = c.status(0)
        (peer,) = st.peers
        assert (peer.engine, peer.agent, peer.lanes, peer.state) == ("prefill", st.agent, ["copy"], "ready")
        assert st.totals.remote_agents == 0  # its own metadata never loaded as a peer's
        d = c.daemons[0]
        assert d.metric('kvxferd_transfers_total{lane="copy",outcome="received",peer="prefill"}') == 6


def test_a_read_of_an_engine_the_daemon_does_not_have_is_refused_at_once():
    with Cluster(SHAPE, 1, 1, same_node=True) as c:
        remote = RemoteRef("no-such-engine", c.host, c.port, 1, "req-0")
        c.decode.post_read(0, 40, remote, [list(range(3))], 0, 30.0)
        (outcome,) = c.decode.wait_read(0, 40)
        assert outcome[0] == "failed" and "not registered with this daemon" in outcome[2], outcome


def test_a_hold_that_expired_fails_the_read_expired_and_the_next_one_is_received():
    with Cluster(SHAPE, 1, 1, same_node=True) as c:
        blocks = c.prefill.prefill(0, 40, 0.3)
        assert c.prefill.wait_released(0, 10) == ["expired"]
        c.decode.post_read(0, 40, c.remote(0), blocks, 0, 30.0)
        (outcome,) = c.decode.wait_read(0, 40)
        assert outcome[0] == "failed" and outcome[2].startswith("expired"), outcome
        c.prefill.free(blocks)
        out = c.transfer(1, num_tokens=40)
        assert out["status"] == "received" and out["released"] == ["sent"], out


def test_every_read_audited_against_the_holds_digests():
    with Cluster(SHAPE, 2, 1, same_node=True, metrics=True, daemon_args=["--integrity-audit"]) as c:
        for seq in range(3):
            out = c.transfer(seq, num_tokens=90)
            assert out["status"] == "received", out
        assert c.daemons[0].metric('kvxferd_audits_total{outcome="ok"}') == 3


def test_a_prefill_engine_killed_mid_copy_keeps_its_memory_until_the_copy_ends(tmp_path):
    """The prefill engine dies while the daemon copies from its memory: the memory stays mapped
    until no read uses it, the reads end (received: the bytes were there; or failed), nothing
    crashes, and the node serves the next engines."""
    d = DaemonProcess(tmp_path, "node")
    with Cluster(BIG, 2, 4, daemons=[d, d]) as c:
        blocks = c.prefill.prefill(0, BIG_TOKENS, 30.0)
        c.decode.post_read(0, BIG_TOKENS, c.remote(0), blocks, 0, 60.0)
        c.prefill.proc.kill()
        outcomes = c.decode.wait_read(0, 70)
        assert len(outcomes) == 4 and {o[0] for o in outcomes} <= {"received", "failed"}, outcomes
        st = wait_for(lambda: (s := c.status(0)) and all(e.state == "closing" for e in s.engines
                                                          if e.engine == "prefill") and s, 15, "prefill closing")
        assert st.in_flight == [] and st.held == []
        assert not [p for p in st.peers if p.state == "ready"]  # its local peer retired with it
        c.prefill = EngineProcess(d.socket, "prefill", BIG, 2)
        c.engines.append(c.prefill)
        c.decode.drop(0)
        out = c.transfer(1, num_tokens=37, hit_tokens=16)
        assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        assert d.proc.poll() is None


def test_a_peer_answering_with_this_daemons_own_agent_is_refused():
    """A hostile prefill daemon answers a handshake with the decode daemon's own NIXL agent (no
    secret: every request of ours names it), to have the decode daemon copy its own engines'
    memory for it: refused, nothing read."""
    import threading

    import zmq

    from kvxferd import handshake as hs

    with Cluster(SHAPE, 1, 1) as c:
        own_agent = c.status(1).agent
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REP)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sock.setsockopt(zmq.RCVTIMEO, 20000)

        def impostor() -> None:
            try:
                sock.recv()
                sock.send(hs.encode(hs.HandshakeReply(True, agent=own_agent, metadata=b"x", notices=4, serve=5)))
            except zmq.ZMQError:
                pass

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        try:
            remote = RemoteRef("prefill", "127.0.0.1", port, 1, "req-0")
            c.decode.post_read(0, 40, remote, [list(range(3))], 0, 30.0)
            (outcome,) = c.decode.wait_read(0, 40)
            assert outcome[0] == "failed" and "this daemon's own NIXL agent" in outcome[2], outcome
            st = c.status(1)
            assert st.counters.received == 0 and st.peers == [], st.peers
        finally:
            thread.join(25)
            sock.close(0)
            ctx.term()


def _read_as(uid: int, socket: str, remote: RemoteRef) -> str:
    """A decode engine of `uid` on the daemon reads `remote`: its completion's status and reason."""
    from test_exhaustion import _answer_as

    from kvxferd.client import EngineClient
    from kvxferd.memory import create_shm
    from kvxferd.plan.models import build

    geo = build(SHAPE, 1, 0)

    def read() -> str:
        fd, _mapping = create_shm(geo.buffers[0])
        with EngineClient(socket, f"reader-{uid}", 0, 1) as c:
            c.register(geo, shm_fds=[fd])
            c.read(remote.request_id, remote, 32, [[0, 1]], [[0, 1]], deadline_s=20.0)
            deadline = time.monotonic() + 30
            done = []
            while not done and time.monotonic() < deadline:
                done = c.poll(1.0)
            return f"{done[0].status}: {done[0].reason}" if done else "none"
    return _answer_as(uid, uid, read)


@pytest.mark.parametrize("uids", ["same", "any"])
def test_an_engine_of_another_user_is_read_only_where_the_operator_allows_it(tmp_path, uids):
    """The daemon maps every engine's memory: an engine of another uid reading one of root's on
    the same daemon is refused before a byte moves (same_node_uids = "same", the default), read
    where the operator said any."""
    import os
    import shutil
    import tempfile

    from kvxferd.client import EngineClient
    from kvxferd.memory import create_shm
    from kvxferd.plan.models import build

    if os.getuid() != 0:
        pytest.skip("needs root to run an engine as another user")
    root_dir = tempfile.mkdtemp(prefix="kvx-uids-")
    os.chmod(root_dir, 0o755)
    os.environ.update(KVXFERD_ALLOWED_UIDS="0,65534", KVXFERD_SAME_NODE_UIDS=uids)
    try:
        daemon = DaemonProcess(tmp_path, "node", socket=f"{root_dir}/run/kvxferd.sock")
    finally:
        del os.environ["KVXFERD_ALLOWED_UIDS"], os.environ["KVXFERD_SAME_NODE_UIDS"]
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        os.chmod(f"{root_dir}/run", 0o755)
        os.chmod(daemon.socket, 0o666)
        victim = EngineClient(daemon.socket, "victim", 0, 1)
        side = victim.register(geo, shm_fds=[fd])
        victim.hold("r-1", 30.0, [[0, 1]])
        host, port = side.rsplit(":", 1)
        answer = _read_as(65534, daemon.socket, RemoteRef("victim", host, int(port), 1, "r-1"))
        if uids == "same":
            assert answer.startswith("failed") and "registered by another user (uid 0)" in answer, answer
        else:
            assert answer.startswith("received"), answer
        victim.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()
        shutil.rmtree(root_dir, ignore_errors=True)
