"""Byte-exact planner grid: every plan is executed by copying bytes as NIXL pairs
descriptors and every decode rank is compared with an independent expectation."""

import itertools

import msgspec
import pytest
import scenario
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.plan.models import ModelShape
from kvxferd.plan.planner import consumers

TPS = [1, 2, 4, 8]
replace = msgspec.structs.replace


def small(**kw) -> ModelShape:
    base = dict(layers=2, kv_heads=8, head_dim=8, block_size=4, num_blocks=24)
    base.update(kw)
    return ModelShape(**base)


def assert_notified(out: scenario.Outcome, p_tp: int, d_tp: int) -> None:
    assert out.notifications == {r: consumers(d_tp, p_tp) for r in range(p_tp)}


@pytest.mark.parametrize("layout", ["hnd", "blocks-first"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("p_tp,d_tp", list(itertools.product(TPS, TPS)))
def test_dense_grid(p_tp, d_tp, kv_heads, layout):
    shape = small(kv_heads=kv_heads, layout=layout)
    out = scenario.run(shape, p_tp, shape, d_tp, num_tokens=30, hit_tokens=8, seed=p_tp * 31 + d_tp)
    assert_notified(out, p_tp, d_tp)
    # Every decode head is read exactly once: bytes moved = missing tokens of every local head.
    missing_blocks = -(-30 // 4) - 2
    per_rank_heads = max(1, kv_heads // d_tp)
    assert out.moved == d_tp * 2 * 2 * missing_blocks * 4 * per_rank_heads * 8 * 2


@pytest.mark.parametrize("tp", TPS)
def test_nhd_equal_tp(tp):
    shape = small(layout="nhd")
    assert_notified(scenario.run(shape, tp, shape, tp, num_tokens=21, hit_tokens=4), tp, tp)


@pytest.mark.parametrize("p_layout,d_layout", [("hnd", "blocks-first"), ("blocks-first", "hnd")])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_layouts_differ_between_sides(p_layout, d_layout, p_tp, d_tp):
    out = scenario.run(small(layout=p_layout), p_tp, small(layout=d_layout), d_tp, num_tokens=17)
    assert_notified(out, p_tp, d_tp)


@pytest.mark.parametrize("p_tp,d_tp", list(itertools.product(TPS, TPS)))
def test_mla_grid(p_tp, d_tp):
    shape = small(kind="mla", kv_heads=1, latent_dim=24)
    out = scenario.run(shape, p_tp, shape, d_tp, num_tokens=27, hit_tokens=4)
    assert_notified(out, p_tp, d_tp)
    for plan in out.plans:  # one read per decode rank; the other targets are only notified
        assert len(plan.peers) == 1
        assert list(plan.peers) == [plan.local_rank * p_tp // d_tp]


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1)])
def test_prefill_blocks_smaller(ratio, p_tp, d_tp):
    p = small(block_size=4)
    d = small(block_size=4 * ratio)
    assert_notified(scenario.run(p, p_tp, d, d_tp, num_tokens=37, hit_tokens=16), p_tp, d_tp)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 4), (4, 2)])
def test_prefill_blocks_larger(ratio, p_tp, d_tp):
    p = small(block_size=4 * ratio, layout="blocks-first")
    d = small(block_size=4, layout="blocks-first")
    scenario.run(p, p_tp, d, d_tp, num_tokens=37, hit_tokens=20)


@pytest.mark.parametrize("p_kernel,d_kernel", [(8, 4), (4, 8), (2, 4), (8, 8)])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_kernel_blocks(p_kernel, d_kernel, p_tp, d_tp):
    p = small(block_size=8, kernel_block_size=p_kernel, num_blocks=12)
    d = small(block_size=8, kernel_block_size=d_kernel, num_blocks=12)
    scenario.run(p, p_tp, d, d_tp, num_tokens=41, hit_tokens=8)


HYBRID_TPS = [(2, 1), (4, 1), (4, 2), (1, 2), (2, 4), (1, 1)]


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
@pytest.mark.parametrize("p_tp,d_tp", HYBRID_TPS)
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_hybrid_ssm(kind, p_tp, d_tp, kv_heads):
    shape = ModelShape(kind=kind, layers=2, ssm_layers=3, kv_heads=kv_heads, head_dim=8, block_size=4,
                       layout="blocks-first", ssm_heads=8, ssm_head_dim=4, ssm_state=4, ssm_groups=4,
                       num_blocks=40)
    out = scenario.run(shape, p_tp, shape, d_tp, num_tokens=23, hit_tokens=0)
    assert_notified(out, p_tp, d_tp)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_hybrid_partial_prefix_hit(p_tp, d_tp):
    shape = ModelShape(kind="mamba2", layers=2, ssm_layers=2, kv_heads=4, head_dim=8, block_size=4,
                       layout="blocks-first", ssm_heads=4, ssm_head_dim=4, ssm_state=4, ssm_groups=2,
                       num_blocks=40)
    scenario.run(shape, p_tp, shape, d_tp, num_tokens=29, hit_tokens=64)


GEMMA = ModelShape(kind="gemma4", layers=2, full_layers=1, kv_heads=8, head_dim=8, full_kv_heads=2,
                   full_head_dim=16, block_size=4, layout="blocks-first", num_blocks=32)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (4, 1), (1, 4), (2, 2), (8, 2)])
@pytest.mark.parametrize("hit", [0, 8])
def test_gemma4_groups(p_tp, d_tp, hit):
    out = scenario.run(GEMMA, p_tp, GEMMA, d_tp, num_tokens=35, hit_tokens=hit)
    assert_notified(out, p_tp, d_tp)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_remote_list_trimmed_to_tail(p_tp, d_tp):
    scenario.run(small(), p_tp, small(block_size=8), d_tp, num_tokens=40, hit_tokens=16, remote_tail_only=True)
    scenario.run(GEMMA, p_tp, GEMMA, d_tp, num_tokens=40, hit_tokens=8, remote_tail_only=True)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2), (1, 1)])
def test_full_prefix_hit_notifies_only(p_tp, d_tp):
    shape = small()
    out = scenario.run(shape, p_tp, shape, d_tp, num_tokens=16, hit_tokens=16)
    assert out.moved == 0
    assert_notified(out, p_tp, d_tp)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["dense", "mla", "mamba2", "gdn", "gemma4"]),
    p_tp=st.sampled_from(TPS), d_tp=st.sampled_from(TPS),
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    layout=st.sampled_from(["hnd", "blocks-first"]),
    p_block=st.sampled_from([2, 4, 8]), d_block=st.sampled_from([2, 4, 8]),
    num_tokens=st.integers(1, 40), hit_blocks=st.integers(0, 6), seed=st.integers(0, 1000),
    tail=st.booleans(),
)
def test_random_shapes(kind, p_tp, d_tp, heads, layout, p_block, d_block, num_tokens, hit_blocks, seed, tail):
    common = dict(kind=kind, layers=2, head_dim=4, num_blocks=64, ssm_layers=2, ssm_heads=8,
                  ssm_head_dim=2, ssm_state=2, ssm_groups=8, full_kv_heads=heads, full_head_dim=8,
                  kv_heads=16 if kind == "gemma4" else heads)
    if kind in ("mamba2", "gdn", "gemma4"):
        layout, d_block = "blocks-first", p_block  # hybrid block sizes follow from the page size
    p = ModelShape(layout=layout, block_size=p_block, **common)
    d = ModelShape(layout=layout, block_size=d_block, **common)
    hit = hit_blocks * max(p_block, d_block) * (4 if kind in ("mamba2", "gdn", "gemma4") else 1)
    out = scenario.run(p, p_tp, d, d_tp, num_tokens=num_tokens, hit_tokens=hit if kind not in ("mamba2", "gdn") else 0,
                       remote_tail_only=tail, seed=seed)
    assert_notified(out, p_tp, d_tp)
