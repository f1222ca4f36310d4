"""Protocol 2's `batch`: an engine step's holds and reads in one frame, one result each, against
a real daemon; a protocol-1 daemon gets the same orders one call each."""

from __future__ import annotations

import os

import pytest

from kvxferd import protocol as P
from kvxferd.client import DaemonError, EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)


@pytest.fixture
def client(tmp_path):
    daemon = DaemonProcess(tmp_path, "daemon")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    c = EngineClient(daemon.socket, "engine", 0, 1)
    c.register(geo, shm_fds=[fd])
    os.close(fd)
    yield c
    c.close()
    mm.close()
    daemon.stop()


def orders(c: EngineClient) -> list[P.Hold | P.Read]:
    nobody = P.RemoteRef("nobody", "127.0.0.1", 1, 1, "x")  # nothing listens: the read fails at its deadline
    return [c.requests.hold("a", 30.0, [[1]]),
            c.requests.hold("b", 10_000.0, [[2]]),  # over the daemon's max_lease_s
            c.requests.read("c", nobody, 8, [[3, 4]], [[3, 4]], 1.0),
            c.requests.read("c", nobody, 8, [[3, 4]], [[3, 4]], 1.0)]  # already being read


@pytest.mark.parametrize("version", [2, 1])
def test_each_order_gets_its_own_outcome(client, version):
    client.rpc.version = version  # 1: as against a daemon that speaks protocol 1 only
    outcomes = client.batch(orders(client))
    assert [type(o).__name__ if o else None for o in outcomes] == [None, "DaemonError", None, "DaemonError"]
    assert isinstance(outcomes[1], DaemonError) and outcomes[1].code == "bad_request" and "lease_s" in str(outcomes[1])
    assert isinstance(outcomes[3], DaemonError) and "already being read" in str(outcomes[3])
    st = client.status()
    assert [h.request for h in st.held] == ["a"]
    failed = client.poll(wait_s=10.0)  # the read of an unknown peer ends failed, with its blocks
    assert [(c.request_id, c.status, c.block_ids) for c in failed] == [("c", "failed", [[3, 4]])]


def test_a_batch_is_one_round_trip(client, monkeypatch):
    calls = []
    real = client.rpc.call
    monkeypatch.setattr(client.rpc, "call", lambda msg, *a, **k: calls.append(type(msg).__name__) or real(msg, *a, **k))
    assert client.batch([client.requests.hold(f"h{i}", 30.0, [[i]]) for i in range(8)]) == [None] * 8
    assert calls == ["Batch"]
    assert len(client.status().held) == 8
