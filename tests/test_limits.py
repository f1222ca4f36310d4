"""Per-engine limits and whole batches against a real daemon: holds and reads per engine rank
are capped with an error naming the setting, a `batch` is applied all or nothing (the client
library still gives each order its own outcome), and digesting a large hold does not stop the
daemon answering others."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest

from kvxferd import protocol as P
from kvxferd import rpc
from kvxferd.client import Client, DaemonError, EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)
NOBODY = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")


@pytest.fixture
def limited(tmp_path):
    env = {"KVXFERD_MAX_HOLDS_PER_ENGINE": "3", "KVXFERD_MAX_READS_PER_ENGINE": "2"}
    os.environ.update(env)
    try:
        daemon = DaemonProcess(tmp_path, "daemon")
    finally:
        for key in env:
            del os.environ[key]
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    c = EngineClient(daemon.socket, "engine", 0, 1)
    c.register(geo, shm_fds=[fd])
    os.close(fd)
    yield c
    c.close()
    mm.close()
    daemon.stop()


def test_holds_per_engine_are_capped_and_free_again_when_they_end(limited):
    c = limited
    for i in range(3):
        c.hold(f"h{i}", 30.0, [[i]])
    c.hold("h0", 30.0, [[0]])  # a renewal is no new hold
    with pytest.raises(DaemonError) as refused:
        c.hold("h3", 30.0, [[3]])
    assert refused.value.code == "bad_request" and "max_holds_per_engine 3" in str(refused.value)
    assert sorted(h.request for h in c.status().held) == ["h0", "h1", "h2"]


def test_reads_per_engine_are_capped(limited):
    c = limited
    slow = P.RemoteRef("slow", "192.0.2.1", 5600, 1, "x")  # TEST-NET: the handshake waits its timeout
    c.read("r0", slow, 8, [[2]], [[2]], 30.0)
    c.read("r1", slow, 8, [[3]], [[3]], 30.0)
    with pytest.raises(DaemonError) as refused:
        c.read("r2", slow, 8, [[4]], [[4]], 30.0)
    assert "max_reads_per_engine 2" in str(refused.value)


def test_a_batch_is_applied_all_or_nothing(limited):
    c = limited
    orders = [c.requests.hold("a", 30.0, [[1]]),
              c.requests.hold("b", 30.0, [[99]]),  # no block 99: refused
              c.requests.read("c", NOBODY, 8, [[3]], [[3]], 1.0)]  # fails at its deadline
    results = c.rpc.call(P.Batch(orders), P.Results).items
    assert isinstance(results[1], P.Error) and "out of range" in results[1].message
    assert all(isinstance(r, P.Error) and r.message.startswith(P.NOT_APPLIED) for r in (results[0], results[2]))
    assert c.status().held == [] and c.poll(0.3) == []  # nothing held, nothing read
    # The client library sends the innocent orders again: each gets its own outcome.
    outcomes = c.batch(orders)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], DaemonError) and "out of range" in str(outcomes[1])
    assert [h.request for h in c.status().held] == ["a"]
    [done] = c.poll(10.0)
    assert (done.request_id, done.status) == ("c", "failed")


def test_a_batch_over_a_cap_is_refused_whole(limited):
    c = limited
    c.hold("h0", 30.0, [[0]])
    results = c.rpc.call(P.Batch([c.requests.hold(f"n{i}", 30.0, [[i + 1]]) for i in range(3)]), P.Results).items
    assert [isinstance(r, P.Error) for r in results] == [True, True, True]
    assert "max_holds_per_engine" in results[2].message
    assert [h.request for h in c.status().held] == ["h0"]


def test_a_large_hold_is_digested_off_the_daemon_s_loop(tmp_path):
    """A hold with digests answers once its blocks are digested (the engine may then reuse
    nothing it held), but the digest runs on a thread: another client's status is answered while
    a 512 MiB hold is being digested, not after it."""
    shape = ModelShape(layers=4, kv_heads=8, head_dim=128, block_size=16, num_blocks=2048)
    geo = build(shape, 1, 0)
    daemon = DaemonProcess(tmp_path, "daemon")
    fd, mm = create_shm(geo.buffers[0])
    try:
        owner = EngineClient(daemon.socket, "big", 0, 1, timeout=120)
        owner.register(geo, shm_fds=[fd])
        everything = [list(range(shape.num_blocks))]
        order: list[str] = []
        hold = P.encoder.encode(owner.requests.hold("all", 60.0, everything, digest=True))
        with Client(daemon.socket, 60) as other:
            other.status()  # connected and answered once before the race
            owner.rpc.sock.sendall(rpc.frame(hold))
            waiter = threading.Thread(target=lambda: (owner.rpc.sock.recv(1 << 16), order.append("hold")))
            waiter.start()
            other.status()
            order.append("status")
            waiter.join(120)
        assert order == ["status", "hold"]
        owner.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def _daemon_with(tmp_path, socket: str | None = None, **env: str) -> DaemonProcess:
    """A daemon started with these settings in its environment (KVXFERD_<KEY>)."""
    os.environ.update(env)
    try:
        return DaemonProcess(tmp_path, "daemon", socket=socket)
    finally:
        for key in env:
            del os.environ[key]


def test_ranks_per_uid_are_capped_across_engine_ids_and_connections(tmp_path):
    """Each registered rank maps its memory: one uid registering engine ids without end would
    use up the node's mappings (vm.max_map_count) for every other engine. Refused past
    max_ranks_per_uid, on any connection of that uid, with the setting named; a rank released
    makes room again."""
    daemon = _daemon_with(tmp_path, KVXFERD_MAX_RANKS_PER_UID="3")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        engines = []
        for i in range(3):
            e = EngineClient(daemon.socket, f"e{i}", 0, 1)
            e.register(geo, shm_fds=[fd])
            engines.append(e)
        for who in ("e3", "e4"):  # a fourth rank, on a new connection each time
            with EngineClient(daemon.socket, who, 0, 1) as e, pytest.raises(DaemonError) as refused:
                e.register(geo, shm_fds=[fd])
            assert refused.value.code == "bad_request" and "max_ranks_per_uid 3" in str(refused.value)
        engines.pop().close()  # unregistered with its connection: nothing holds its memory
        deadline = time.monotonic() + 10
        while True:
            try:
                with EngineClient(daemon.socket, "e3", 0, 1) as e:
                    e.register(geo, shm_fds=[fd])
                break
            except DaemonError:
                assert time.monotonic() < deadline, "the released rank's room never came back"
                time.sleep(0.05)
        for e in engines:
            e.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def test_buffers_per_uid_are_capped_across_ranks(tmp_path):
    """Each buffer is a mapping, and a host memfd's fd stays open with the daemon (it looks for
    holes at each hold): one uid's ranks of many buffers are refused past max_buffers_per_uid,
    with the setting named, before anything is mapped."""
    daemon = _daemon_with(tmp_path, KVXFERD_MAX_BUFFERS_PER_UID="3")
    one = build(SHAPE, 1, 0)
    two = msgspec.structs.replace(one, buffers=(one.buffers[0], one.buffers[0]))  # a second buffer, unused
    fd, mm = create_shm(one.buffers[0])
    try:
        with EngineClient(daemon.socket, "e0", 0, 1) as e0:
            e0.register(two, shm_fds=[fd, fd])
            with EngineClient(daemon.socket, "e1", 0, 1) as e1:
                e1.status()  # its connection is open at the daemon
                before = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
                with pytest.raises(DaemonError) as refused:
                    e1.register(two, shm_fds=[fd, fd])
                assert refused.value.code == "bad_request" and "max_buffers_per_uid 3" in str(refused.value)
                assert len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) <= before  # the fds sent: closed
            with EngineClient(daemon.socket, "e2", 0, 1) as e2:
                e2.register(one, shm_fds=[fd])  # the third buffer: room for it
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def test_holds_and_reads_are_capped_per_uid_across_its_engines_never_another_s(tmp_path):
    """One uid opening engine ids and connections without end would take every hold, read and
    expectation the daemon has room for: past max_holds_per_uid / max_reads_per_uid a new one of
    that uid is refused, naming the setting, on any of its connections; another uid's are still
    served (expectations: test_lease_races)."""
    import shutil
    import tempfile

    from test_exhaustion import _answer_as

    if os.getuid() != 0:
        pytest.skip("needs root to run an engine as another user")
    run = tempfile.mkdtemp(prefix="kvx-quota-")
    os.chmod(run, 0o755)
    daemon = _daemon_with(tmp_path, f"{run}/run/kvxferd.sock", KVXFERD_MAX_HOLDS_PER_UID="3",
                          KVXFERD_MAX_READS_PER_UID="2", KVXFERD_ALLOWED_UIDS="0,65534")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    slow = P.RemoteRef("slow", "192.0.2.1", 5600, 1, "x")  # TEST-NET: the handshake waits its timeout
    try:
        os.chmod(daemon.socket, 0o666)
        os.chmod(os.path.dirname(daemon.socket), 0o755)
        mine = [EngineClient(daemon.socket, f"e{i}", 0, 1) for i in range(3)]  # three connections, one uid
        for e in mine:
            e.register(geo, shm_fds=[fd])
        mine[0].hold("h0", 30.0, [[0]])
        mine[1].hold("h1", 30.0, [[1]])
        mine[2].hold("h2", 30.0, [[2]])
        mine[2].hold("h2", 30.0, [[2]])  # a renewal is no new hold
        with pytest.raises(DaemonError) as refused:
            mine[1].hold("h3", 30.0, [[3]])
        assert refused.value.code == "bad_request" and "max_holds_per_uid 3" in str(refused.value)
        mine[0].read("r0", slow, 8, [[4]], [[4]], 30.0)
        mine[1].read("r1", slow, 8, [[5]], [[5]], 30.0)
        with pytest.raises(DaemonError) as refused:
            mine[2].read("r2", slow, 8, [[6]], [[6]], 30.0)
        assert "max_reads_per_uid 2" in str(refused.value)

        def other_user() -> str:
            other_fd, _mapping = create_shm(geo.buffers[0])
            with EngineClient(daemon.socket, "other", 0, 1) as c:
                c.register(geo, shm_fds=[other_fd])
                c.hold("theirs", 30.0, [[0]])
                c.read("theirs-read", slow, 8, [[1]], [[1]], 30.0)
                return f"held {[h.request for h in c.status().held if h.engine == 'other']}"
        assert _answer_as(65534, 65534, other_user) == "held ['theirs']"
        for e in mine:
            e.close()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()
        shutil.rmtree(run, ignore_errors=True)


def test_open_holds_are_refused_where_the_operator_says_so(tmp_path):
    """`open_holds = false`: a hold without a read_token (which any reader naming the request
    could read) is refused, naming the setting; one with a token is kept."""
    from kvxferd.client import new_read_token

    daemon = _daemon_with(tmp_path, KVXFERD_OPEN_HOLDS="false")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "e0", 0, 1) as e:
            e.register(geo, shm_fds=[fd])
            with pytest.raises(DaemonError) as refused:
                e.hold("open", 30.0, [[0]])
            assert refused.value.code == "bad_request" and "open_holds = false" in str(refused.value)
            e.hold("capability", 30.0, [[1]], read_token=new_read_token())
            assert [h.request for h in e.status().held] == ["capability"]
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def test_a_batch_is_checked_against_the_uid_s_quota_and_its_own_earlier_holds(tmp_path):
    """A batch over several ranks of one uid counted only each rank's earlier items against the
    uid's quota, so it passed max_holds_per_uid; and two holds of one new request under two
    tokens both passed the check, the second failing as it was applied (half a batch kept, a
    traceback logged per item). Both are refused whole now, naming why."""
    from kvxferd.client import new_read_token

    daemon = _daemon_with(tmp_path, KVXFERD_MAX_HOLDS_PER_UID="3")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "e0", 0, 1) as e0, EngineClient(daemon.socket, "e1", 0, 1) as e1:
            e0.register(geo, shm_fds=[fd])
            e1.register(geo, shm_fds=[fd])
            e0.hold("h0", 30.0, [[0]])
            e0.rpc.call(e1.requests.attach(e1.token), P.Ok)  # e0's connection acts for e1 too
            spread = [e0.requests.hold("a", 30.0, [[1]]), e1.requests.hold("b", 30.0, [[2]]),
                      e1.requests.hold("c", 30.0, [[3]])]  # 1 + 3 holds of one uid, over two ranks
            results = e0.rpc.call(P.Batch(spread), P.Results).items
            assert isinstance(results[2], P.Error) and "max_holds_per_uid 3" in results[2].message, results
            assert sorted(h.request for h in e0.status().held) == ["h0"]
            twice = [e0.requests.hold("d", 30.0, [[4]], read_token=new_read_token()),
                     e0.requests.hold("d", 30.0, [[4]], read_token=new_read_token())]
            results = e0.rpc.call(P.Batch(twice), P.Results).items
            assert isinstance(results[1], P.Error) and "another read_token" in results[1].message, results
            assert sorted(h.request for h in e0.status().held) == ["h0"]
        assert "Traceback" not in (tmp_path / "daemon.log").read_text()
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()
