"""What a daemon grants over the network, with real daemons and engines in their own processes and
real NIXL agents (UCX over loopback):

* a handshake for one engine carries NIXL metadata for that engine's memory only: an agent that
  handshook for engine A of a daemon that also serves B cannot READ B's memory (NIXL refuses it)
  until it handshakes for B, and then it reads both;
* a notification counts only from an agent that handshook for the engine it names: a forged one
  from an agent that never did leaves the hold alone (counted `unauthorized`), early ones from a
  consumer that did still end holds;
* `allowed_peers` bounds the side-channel addresses a read may name: a read naming another one
  fails `handshake`, naming it, before anything is dialed.
"""

from __future__ import annotations

import asyncio
import mmap
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
import numpy as np
import pytest
import zmq.asyncio

from kvxferd import handshake as hs
from kvxferd.client import RemoteRef
from kvxferd.config import ConfigError, load
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess
from kvxferd.memory import buffer_address
from kvxferd.nixl_driver import DONE, NixlDriver, TransferError
from kvxferd.plan.models import PRESETS

replace = msgspec.structs.replace
SHAPE = replace(PRESETS["dense"], num_blocks=64, layers=2)
ROW = 4096  # bytes a probe READ moves
T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, what: str, pump: NixlDriver | None = None) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pump is not None:
            pump.notifications()  # progress our agent: its notifications leave
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def handshake(c: Cluster, engine_id: str, requester: str) -> hs.HandshakeReply:
    """Ask the prefill daemon's side channel about an engine, as a decode daemon does."""
    async def ask() -> hs.HandshakeReply:
        ctx = zmq.asyncio.Context()
        try:
            return await hs.request(ctx, c.host, c.port, engine_id, 10.0, requester)
        finally:
            ctx.term()
    return asyncio.run(ask())


def metric(c: Cluster, which: int, line: str) -> float:
    """A sample of a daemon's Prometheus exposition (0 when absent)."""
    return c.daemons[which].metric(line)


class Probe:
    """A NIXL agent of our own with one registered local buffer, reading like a decode daemon."""

    def __init__(self, name: str) -> None:
        self.nixl = NixlDriver(name, progress_thread=False)
        self.mem = mmap.mmap(-1, ROW)
        self.view = np.frombuffer(self.mem, dtype=np.uint8)
        self.reg = self.nixl.register(buffer_address(self.mem), ROW)

    def read(self, agent: str, remote_addr: int) -> str:
        """READ ROW bytes at `remote_addr` of the peer; DONE, or TransferError if NIXL refuses."""
        local = np.array([[buffer_address(self.mem), ROW, 0]], dtype=np.int64)
        handle = self.nixl.read_rows(local, "DRAM", np.array([[remote_addr, ROW, 0]], dtype=np.int64), "DRAM", agent)
        try:
            return wait_for(lambda: self.nixl.state(handle) == DONE and DONE, 10, "the probe READ")
        finally:
            self.nixl.release(handle)

    def close(self) -> None:
        self.nixl.deregister(self.reg)
        del self.view
        self.mem.close()


def test_a_handshake_grants_the_memory_of_the_engine_it_names_only():
    with Cluster(SHAPE, 2, 2) as c:
        b = EngineProcess(c.daemons[0].socket, "prefill-b", SHAPE, 2)
        c.engines.append(b)
        probe = Probe("probe")
        try:
            reply_a = handshake(c, "prefill", probe.nixl.name)
            for blob in reply_a.all_metadata:
                agent = probe.nixl.add_peer(blob)
            assert agent == reply_a.agent
            reply_b = handshake(c, "prefill-b", "")  # where B's memory lies; its metadata not loaded
            a_addr, b_addr = reply_a.ranks[1].buffer_addrs[0], reply_b.ranks[1].buffer_addrs[0]
            assert probe.read(agent, a_addr) == DONE
            # B's memory is registered with the same agent, but A's handshake gave no key for it
            with pytest.raises(TransferError, match="NIXL_ERR_NOT_FOUND"):
                probe.read(agent, b_addr)
            with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
                probe.nixl.prep_remote(agent, np.array([[b_addr, ROW, 0]], dtype=np.int64))
            # B's own handshake adds B's memory to the agent loaded; A's stays readable
            for blob in handshake(c, "prefill-b", probe.nixl.name).all_metadata:
                assert probe.nixl.add_peer(blob) == agent
            assert probe.read(agent, b_addr) == DONE
            assert probe.read(agent, a_addr) == DONE
        finally:
            probe.close()

        # The decode daemon: engine A, then B (its own handshake, same remote agent), then A again,
        # every byte verified by the decode engine, every hold released by its consumers.
        assert c.transfer(0, num_tokens=40)["status"] == "received"
        blocks = b.prefill(1, 40, 30.0)
        out = c.decode.decode(1, 40, RemoteRef("prefill-b", c.host, c.port, 2, "req-1"), blocks, 0, 30.0, SHAPE)
        assert out["status"] == "received", out
        assert b.wait_released(1, 10) == ["sent", "sent"]
        b.free(blocks)
        out = c.transfer(2, num_tokens=70, hit_tokens=16)
        assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        st = c.status(1)
        assert st.counters.handshakes == 2 and st.counters.failed == 0
        assert {p.agent for p in st.peers} == {reply_a.agent}  # two engines, one remote agent


def test_forged_notifications_leave_holds_alone_and_consumers_still_end_them():
    with Cluster(SHAPE, 2, 2, metrics=True) as c:
        # The prefill agent's connection info, as anyone who reaches the side channel (or
        # sniffed a handshake) has it; the forging agent itself never handshook.
        reply = handshake(c, "prefill", "")
        forger = NixlDriver("forger", progress_thread=False)
        agent = forger.add_peer(reply.metadata)
        blocks = c.prefill.prefill(1, 40, 3.0)
        for rank in (0, 1):  # "the one consumer of req-1 is done": would end both holds
            forger.notify(agent, msgspec.msgpack.encode(hs.Notification("prefill", rank, "req-1", 1)))
        forger.notify(agent, msgspec.msgpack.encode(hs.Notification("prefill", 0, "req-2", 1)))  # before its hold
        wait_for(lambda: c.status(0).counters.unauthorized_notifs == 3, 10, "the forged notifications to arrive",
                 pump=forger)
        assert sorted((h.rank, h.request, h.consumers) for h in c.status(0).held) == \
            [(0, "req-1", "0/?"), (1, "req-1", "0/?")]
        assert c.prefill.wait_released(1, 15) == ["expired", "expired"]  # the lease, not the forger, ended them
        c.prefill.free(blocks)
        blocks = c.prefill.prefill(2, 40, 1.0)  # the forged early one was not kept for it either
        assert c.prefill.wait_released(2, 15) == ["expired", "expired"]
        c.prefill.free(blocks)
        assert metric(c, 0, 'kvxferd_notifications_received_total{kind="unauthorized"}') == 3

        # An agent that handshook for the engine: its notifications count, early ones included.
        consumer = NixlDriver("consumer", progress_thread=False)
        for blob in handshake(c, "prefill", consumer.name).all_metadata:
            assert consumer.add_peer(blob) == agent
        for rank in (0, 1):
            consumer.notify(agent, msgspec.msgpack.encode(hs.Notification("prefill", rank, "req-3", 1)))
        wait_for(lambda: metric(c, 0, 'kvxferd_notifications_received_total{kind="early"}') == 2, 10,
                 "the consumer's early notifications", pump=consumer)
        blocks = c.prefill.prefill(3, 40, 30.0)
        assert c.prefill.wait_released(3, 10) == ["sent", "sent"]  # at once: both consumers had finished
        c.prefill.free(blocks)
        # ... for that engine only: for another one of the same daemon it is a stranger
        b = EngineProcess(c.daemons[0].socket, "prefill-b", SHAPE, 2)
        c.engines.append(b)
        blocks = b.prefill(4, 40, 1.0)
        consumer.notify(agent, msgspec.msgpack.encode(hs.Notification("prefill-b", 0, "req-4", 1)))
        wait_for(lambda: c.status(0).counters.unauthorized_notifs == 4, 10, "the notification for engine B",
                 pump=consumer)
        assert b.wait_released(4, 15) == ["expired", "expired"]
        b.free(blocks)

        # A decode daemon's reads notify as before.
        out = c.transfer(5, num_tokens=40)
        assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        assert c.status(0).counters.unauthorized_notifs == 4


def test_allowed_peers_refuses_other_addresses_before_dialing(tmp_path, monkeypatch):
    stranger = socket.socket()
    stranger.bind(("127.0.0.2", 0))  # another loopback address: what a read could be pointed at
    stranger.listen()
    stranger.setblocking(False)
    port = stranger.getsockname()[1]
    prefill = DaemonProcess(tmp_path, "prefill-daemon")
    with monkeypatch.context() as m:
        m.setenv("KVXFERD_ALLOWED_PEERS", "127.0.0.1/32,10.9.0.0/16")
        decode = DaemonProcess(tmp_path, "decode-daemon", extra=["--handshake-timeout", "1"])
    try:
        with Cluster(SHAPE, 2, 2, workdir=str(tmp_path), daemons=[prefill, decode]) as c:
            cases = [("127.0.0.2", "address 127.0.0.2 is outside allowed_peers (127.0.0.1/32, 10.9.0.0/16)"),
                     ("localhost", "'localhost' is not an IP address, and names are not resolved")]
            for seq, (host, why) in enumerate(cases):
                local = c.decode.post_read(seq, 40, RemoteRef("prefill", host, port, 2, f"req-{seq}"),
                                           [list(range(3))], 0, 10.0)
                outcomes = c.decode.wait_read(seq, 10)
                assert [o[0] for o in outcomes] == ["failed", "failed"], outcomes
                for _, block_ids, reason, _ in outcomes:
                    assert block_ids == local
                    assert reason.startswith(f"handshake: peer {host}:{port} refused, not dialed: "), reason
                    assert why in reason, reason
                c.decode.free(c.decode.drop(seq))
            with pytest.raises(BlockingIOError):
                stranger.accept()  # nobody dialed it
            st = c.status(1)
            assert st.counters.handshakes == 0 and st.counters.handshake_failures == 0 and st.counters.failed == 4
            assert "outside allowed_peers" in st.failures[0].reason
            # an address inside the list: read as before
            out = c.transfer(2, num_tokens=40)
            assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
    finally:
        stranger.close()


def test_allowed_peers_are_networks():
    assert load(env={"KVXFERD_ALLOWED_PEERS": "10.0.0.0/8,fd00::/8,192.168.1.7"}).allowed_peers == \
        ["10.0.0.0/8", "fd00::/8", "192.168.1.7"]
    assert load(env={}).allowed_peers == []  # any address, as before
    for bad in ("10.0.0.1/8", "peer.example", "10.0.0.0/33"):
        with pytest.raises(ConfigError, match="allowed_peers"):
            load(env={"KVXFERD_ALLOWED_PEERS": bad})
