"""End to end: two daemons and two synthetic engines in separate processes, real NIXL over
loopback, real ZMQ and Unix sockets. The decode engine verifies every byte that arrives
against what it would hold had it computed the cache itself (kvxferd.lab.synthetic.engine)."""

import msgspec
import pytest

from kvxferd.lab.synthetic.demo import Cluster, run_demo
from kvxferd.plan.models import PRESETS
from kvxferd.status import render

replace = msgspec.structs.replace
DENSE = replace(PRESETS["dense"], num_blocks=128, layers=2)


@pytest.mark.parametrize("model,p_tp,d_tp", [
    ("dense", 2, 4),     # D_TP > P_TP
    ("dense", 4, 2),     # P_TP > D_TP
    ("mla", 4, 2),       # one read, the other prefill rank only notified
    ("mla", 1, 2),
    ("mamba2", 2, 4),    # hybrid SSM, both directions
    ("mamba2", 4, 2),
    ("gdn", 2, 1),
    ("gemma4", 2, 4),    # groups with different heads and tokens per block
    ("gemma4", 4, 2),
])
def test_demo_presets_byte_exact(model, p_tp, d_tp):
    shape = replace(PRESETS[model], num_blocks=128)
    result = run_demo(shape, p_tp, d_tp, requests=6, max_tokens=90, hit_ratio=0.5, seed=p_tp * 10 + d_tp)
    assert result.received == 6 and result.failed == 0
    assert result.released == {"sent": 6 * p_tp}  # every prefill rank freed every prompt
    assert result.bytes > 0


def test_replicated_heads_and_block_size_ratio():
    """2 KV heads over 4 decode ranks (replicas), prefill blocks half the decode block size."""
    d = replace(DENSE, kv_heads=2, block_size=16)
    p = replace(d, block_size=8)
    result = run_demo(d, 2, 4, requests=5, max_tokens=100, hit_ratio=0.5, seed=3, p_shape=p)
    assert result.received == 5 and result.released == {"sent": 10}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(DENSE, 2, 4) as c:
        yield c


def test_handshake_reused_by_later_requests(cluster):
    for seq in range(3):
        out = cluster.transfer(100 + seq, num_tokens=40)
        assert out["status"] == "received" and out["released"] == ["sent", "sent"]
    st = cluster.status(1)
    assert st.counters.handshakes == 1
    (peer,) = st.peers
    assert peer.engine == "prefill" and peer.plans == 4  # one cached plan per decode rank
    # every READ posted whole is timed by NIXL's telemetry: what `status` reports as its post call
    lat = st.latency_us
    assert lat.nixl_post.n >= st.counters.received > 0 and 0 < lat.nixl_post.p50 <= lat.nixl_post.p99
    assert lat.rpc_to_completion.n == st.counters.received
    assert "NIXL post call" in render(st) and "NIXL post call -" not in render(st)


def test_partial_and_full_prefix_hits(cluster):
    partial = cluster.transfer(200, num_tokens=70, hit_tokens=32)
    assert partial["status"] == "received"
    full = cluster.transfer(201, num_tokens=64, hit_tokens=64)  # nothing to read: notify only
    assert full["status"] == "received" and full["bytes"] == 0
    assert full["released"] == ["sent", "sent"]
    assert partial["bytes"] > 0


def test_lease_expires_without_consumers(cluster):
    blocks = cluster.prefill.prefill(300, 30, 0.3)
    try:
        assert cluster.prefill.wait_released(300, 10) == ["expired", "expired"]
    finally:
        cluster.prefill.free(blocks)
    assert cluster.status(0).counters.expired >= 2


def test_read_of_unknown_remote_engine_fails_with_block_ids(cluster):
    from kvxferd.client import RemoteRef

    ref = RemoteRef("no-such-engine", cluster.host, cluster.port, 2, "req-x")
    out = cluster.decode.decode(400, 20, ref, [[0, 1]], 0, 5.0, DENSE)
    assert out["status"] == "failed"
    assert "not registered" in out["reason"]
    assert out["block_ids"] == [out["local_blocks"]] * 4  # every decode rank reports its invalid blocks
    st = cluster.status(1)
    fail = st.failures[-1]
    assert fail.request == "d-400" and "not registered" in fail.reason
    # ... and the daemon keeps serving the next valid request
    assert cluster.transfer(401, num_tokens=20)["status"] == "received"


@pytest.mark.parametrize("kind,p_layout,d_layout,p_tp,d_tp,p_block", [
    ("dense", "LBHNC", "LBHNC", 2, 4, 16),   # FlashAttention as the connector asks for it (head-major)
    ("dense", "BLHNC", "LBHNC", 4, 2, 16),   # block-outermost prefill, layer-outermost decode
    ("dense", "LBNHC", "BLNHC", 2, 2, 16),   # token-major (vLLM's default without a connector): same TP
    ("dense", "LBHNC", "BLHNC", 1, 2, 8),    # prefill blocks of 8 tokens into the decode's 16, across TP
    ("mla", "LBNHC", "LBNHC", 2, 1, 16),     # FlashMLA / Triton MLA latents
    ("mla", "LBNHC", "BLNHC", 1, 2, 16),
])
def test_vllm_gpu_layouts_through_real_daemons(kind, p_layout, d_layout, p_tp, d_tp, p_block):
    """Host memory laid out as vLLM 0.32 allocates a GPU backend's cache (kvxferd.vllm.layout.
    layer_caches; tests/test_vllm_gpu_layouts.py checks it against vLLM's own allocator), described
    by the connector's layout code, moved by two daemons and verified byte for byte."""
    base = PRESETS["mla"] if kind == "mla" else replace(DENSE, kv_heads=4, head_dim=32)
    d = replace(base, layout=d_layout, block_size=16, num_blocks=96)
    p = replace(d, layout=p_layout, block_size=p_block, num_blocks=96 * 16 // p_block)
    result = run_demo(d, p_tp, d_tp, requests=4, max_tokens=90, hit_ratio=0.5, seed=p_tp * 7 + d_tp, p_shape=p)
    assert result.received == 4 and result.failed == 0
    assert result.bytes > 0



def test_long_prompts_travel_packed_block_lists():
    """Lists of PACK_MIN_IDS blocks and more go packed (protocol 8), shorter ones as msgpack ints:
    prompts of each, one with a prefix hit, through groups of different heads and block sizes,
    arrive byte-exact."""
    from kvxferd.client import PACK_MIN_IDS

    shape = replace(PRESETS["gemma4"], num_blocks=1024, block_size=2)
    with Cluster(shape, 2, 1) as c:
        for seq, (tokens, hit) in enumerate([(700, 0), (690, 100), (40, 0)]):
            out = c.transfer(seq, tokens, hit)
            assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        # the full-attention group's lists above, local tails included: packed twice, then not
        assert (690 - 100) // shape.block_size > PACK_MIN_IDS > 40 // shape.block_size
