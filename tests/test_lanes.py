"""Posting lanes: reads split across extra NIXL agents, each slice posted from its own thread,
between two real daemons and synthetic engines in separate processes. The decode engine checks
every byte against what it would hold had it computed the cache itself; the prefill side must
see every consumer's notification (its blocks are `sent`), which lanes send only once every
slice is in place."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, EngineProcess, run_demo
from kvxferd.plan.models import PRESETS

replace = msgspec.structs.replace
SMALL_SPLIT = str(64 << 10)  # a read of 128 KiB or more is split


@pytest.fixture
def small_split(monkeypatch):
    monkeypatch.setenv("KVXFERD_LANES", "2")
    monkeypatch.setenv("KVXFERD_LANE_SPLIT_BYTES", SMALL_SPLIT)


def test_split_reads_arrive_byte_exact_and_release_the_prefill_blocks(small_split):
    shape = replace(PRESETS["dense"], num_blocks=128)
    with Cluster(shape, 2, 4) as c:
        for seq in range(4):
            out = c.transfer(seq, num_tokens=90 + 10 * seq, hit_tokens=16 * (seq % 2))
            assert out["status"] == "received", out
            assert out["released"] == ["sent", "sent"], out  # every consumer's notification arrived
        counters = c.status(1).counters
        assert counters.split_reads == 4 * 4, counters  # every decode rank's read was split
        assert counters.received == 16 and counters.failed == 0


def test_an_engine_registered_after_the_first_handshake_is_read_on_lanes(small_split):
    """One prefill daemon, two engines: the second registers after the lanes loaded the daemon's
    agent for the first; its split reads need the newer metadata (same agent name)."""
    shape = replace(PRESETS["dense"], num_blocks=128)
    with Cluster(shape, 2, 4) as c:
        assert c.transfer(0, num_tokens=100)["status"] == "received"
        second = EngineProcess(c.daemons[0].socket, "prefill-b", shape, 2)
        c.engines.append(second)
        blocks = second.prefill(1, 100, 30.0)
        out = c.decode.decode(1, 100, RemoteRef("prefill-b", c.host, c.port, 2, "req-1"), blocks, 0, 30.0,
                            shape)
        assert out["status"] == "received", out  # and verified byte for byte
        assert second.wait_released(1, 10) == ["sent", "sent"]
        assert c.status(1).counters.split_reads == 8


@pytest.mark.parametrize("model,p_tp,d_tp,tokens", [
    ("mla", 4, 2, 120),      # one rank read (split), the others notified alone
    ("gemma4", 2, 4, 1000),  # groups with different heads and tokens per block
    ("mamba2", 4, 2, 1000),  # state groups beside attention
])
def test_split_reads_across_model_kinds(small_split, model, p_tp, d_tp, tokens):
    shape = replace(PRESETS[model], num_blocks=256)
    result = run_demo(shape, p_tp, d_tp, requests=4, max_tokens=tokens, hit_ratio=0.0, seed=p_tp * 10 + d_tp)
    assert result.received == 4 and result.failed == 0
    assert result.released == {"sent": 4 * p_tp}
    assert result.split_reads > 0


def test_no_lanes_posts_every_read_whole(monkeypatch):
    monkeypatch.setenv("KVXFERD_LANE_SPLIT_BYTES", SMALL_SPLIT)
    monkeypatch.setenv("KVXFERD_LANES", "0")
    with Cluster(replace(PRESETS["dense"], num_blocks=128), 1, 1) as c:
        assert c.transfer(1, num_tokens=100)["status"] == "received"
        assert c.status(1).counters.split_reads == 0
