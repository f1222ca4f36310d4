"""The concrete cases of reference/vllm-semantics.md §1 and §6, errors, and negative controls."""

import dataclasses

import numpy as np
import pytest
import scenario

from kvxferd.lab.synthetic import testing
from kvxferd.plan.descriptors import RequestBlocks, group_chunks, region_addresses, remote_descs, request_indices
from kvxferd.plan.geometry import STATE, CacheGroup, Geometry, GeometryError, Region, Segment, View
from kvxferd.plan.models import ModelShape, build, state_pages
from kvxferd.plan.planner import GroupPairing, PlanError, consumers, plan_rank, targets


def plan_for(shape, p_tp, d_tp, rank, merge=True):
    remote = {t: build(shape, p_tp, t) for t in targets(rank, d_tp, p_tp)}
    return plan_rank(build(shape, d_tp, rank), remote, merge=merge)


@pytest.mark.parametrize("d_tp,rank,p_tp,want", [(2, 1, 2, (1,)), (4, 2, 2, (1,)), (1, 0, 2, (0, 1))])
def test_source_ranks(d_tp, rank, p_tp, want):
    assert tuple(plan_for(ModelShape(), p_tp, d_tp, rank).peers) == want


def _hybrid(kv_heads):
    return ModelShape(kind="mamba2", layers=1, ssm_layers=1, kv_heads=kv_heads, head_dim=8, block_size=4,
                      layout="blocks-first", ssm_heads=4, ssm_head_dim=4, ssm_state=4, ssm_groups=4)


def _sources(plan, group):
    return sorted(r for r, peer in plan.peers.items() if group in peer.by_group)


@pytest.mark.parametrize("kv,p_tp,d_tp,rank,attn,ssm", [
    (2, 4, 1, 0, [0, 2], [0, 1, 2, 3]),
    (2, 4, 2, 1, [2], [2, 3]),
    (8, 4, 2, 0, [0, 1], [0, 1]),
])
def test_attention_and_ssm_sources(kv, p_tp, d_tp, rank, attn, ssm):
    plan = plan_for(_hybrid(kv), p_tp, d_tp, rank)
    assert _sources(plan, 0) == attn and _sources(plan, 1) == ssm


@pytest.mark.parametrize("kv,p_tp,d_tp,factors", [
    (8, 2, 4, [0, 1, 0, 1]),
    (4, 2, 8, [0, 0, 1, 1, 0, 0, 1, 1]),
    (2, 2, 4, [0, 0, 0, 0]),
])
def test_rank_offset_factor(kv, p_tp, d_tp, factors):
    for rank, factor in enumerate(factors):
        plan = plan_for(ModelShape(kv_heads=kv, block_size=16, head_dim=8), p_tp, d_tp, rank)
        (peer,) = plan.peers.values()
        local_block_bytes = max(1, kv // d_tp) * 16 * 8 * 2  # vLLM's L: one K (or V) block of this rank
        assert peer.remote_offset.tolist() == [factor * local_block_bytes] * len(peer.pieces)


def test_mla_reads_one_rank_notifies_the_rest():
    shape = ModelShape(kind="mla", kv_heads=1)
    for rank in range(2):
        plan = plan_for(shape, 4, 2, rank)
        assert list(plan.peers) == [2 * rank] and plan.notify_only == (2 * rank + 1,)


def test_consumers():
    assert [consumers(d, p) for d, p in [(4, 2), (2, 4), (8, 1), (1, 8)]] == [2, 1, 8, 1]


def test_tp_gt_heads_block_length():
    """P TP8 -> D TP16 with 8 KV heads (a length check once broke here)."""
    scenario.run(ModelShape(kv_heads=8, head_dim=4, block_size=4, num_blocks=8, layers=1), 8,
                 ModelShape(kv_heads=8, head_dim=4, block_size=4, num_blocks=8, layers=1), 16, num_tokens=9)


def test_hybrid_descriptor_ids():
    # 2 attention pieces, 4 SSM pieces, N=100, attention [3,5], SSM [1,2]
    shape = ModelShape(kind="mamba2", layers=1, ssm_layers=1, kv_heads=4, head_dim=8, block_size=4,
                       layout="blocks-first", ssm_heads=2, ssm_head_dim=2, ssm_state=2, ssm_groups=2,
                       num_blocks=100)
    geo = build(shape, 1, 0)
    assert geo.groups[0].pages_per_block == 1
    plan = plan_rank(geo, {0: geo}, merge=False)
    req = RequestBlocks.of(2 * 4, [[3, 5], [1, 2]], [[3, 5], [1, 2]])
    lids, rids = request_indices(plan, req)[0]
    assert lids.tolist() == [3, 5, 103, 105, 201, 202, 301, 302, 401, 402, 501, 502]
    assert rids.tolist() == lids.tolist()


def test_kernel_mismatch_descriptor_ids():
    # attention kernel ratio 4, N=400 kernel pages; SSM pages span 4 kernel pages (100 of them)
    shape = ModelShape(kind="mamba2", layers=1, ssm_layers=1, kv_heads=1, head_dim=4, block_size=4,
                       layout="blocks-first", ssm_heads=2, ssm_head_dim=4, ssm_state=4, ssm_groups=2,
                       conv_kernel=4, num_blocks=100)
    geo = build(shape, 1, 0)
    assert geo.groups[0].pages_per_block == 4 and geo.groups[1].views[0].num_pages == 100
    plan = plan_rank(geo, {0: geo}, merge=False)
    lids, _ = request_indices(plan, RequestBlocks.of(2 * 16, [[0, 1], [1, 2]], [[0, 1], [1, 2]]))[0]
    attn, ssm = lids[:16].tolist(), lids[16:].tolist()
    assert attn == list(range(0, 8)) + list(range(400, 408))
    assert ssm == [801, 802, 901, 902, 1001, 1002, 1101, 1102]


def _pairing(local_ppb, remote_ppb, kind="attention"):
    return GroupPairing("g", kind, 4 * local_ppb, 4 * remote_ppb, local_ppb, remote_ppb, 1000, 1000, 4, 1, 1)


def test_local_logical_to_kernel():
    ch = group_chunks(_pairing(2, 2), 24, np.array([0, 1, 2]), np.array([0, 1, 2]))
    assert ch.local_page.tolist() == list(range(6))
    ch = group_chunks(_pairing(2, 2), 16, np.array([3, 4]), np.array([0, 1]))
    assert ch.local_page.tolist() == list(range(6, 10))


@pytest.mark.parametrize("remote_ppb,blocks,want", [(34, [5, 6], list(range(170, 238))),
                                                    (10, [0], list(range(10))), (6, [0, 1], list(range(12)))])
def test_remote_expansion_uses_remote_phys(remote_ppb, blocks, want):
    tokens = len(want) * 4
    p = GroupPairing("g", "attention", tokens, 4 * remote_ppb, tokens // 4, remote_ppb, 1, 1000, 4, 1, 1)
    ch = group_chunks(p, tokens, np.array([0]), np.array(blocks))
    assert ch.remote_page.tolist() == want
    state = group_chunks(_pairing(1, 1, STATE), 0, np.array([10]), np.array([2]))
    assert state.remote_page.tolist() == [2]


@pytest.mark.parametrize("sizes,block_len,want", [((36864, 2097152), 8192, 261), ((9216, 524288), 4096, 131)])
def test_state_pages(sizes, block_len, want):
    assert state_pages(sum(sizes), block_len) == want


@pytest.mark.parametrize("kind,tp,heads,head_dim,state,groups,want", [
    ("mamba2", 1, 128, 64, 128, 8, (8192, 1024, 1024)),
    ("mamba2", 4, 128, 64, 128, 8, (2048, 256, 256)),
    ("gdn", 1, 16, 128, 128, 16, (2048, 2048, 2048)),
])
def test_conv_split(kind, tp, heads, head_dim, state, groups, want):
    shape = ModelShape(kind=kind, layers=1, ssm_layers=1, kv_heads=8, head_dim=128, block_size=16,
                       layout="blocks-first", ssm_heads=heads, ssm_head_dim=head_dim, ssm_state=state,
                       ssm_groups=groups, num_blocks=2)
    segs = build(shape, tp, 0).groups[1].views[0].segments
    rows = (shape.conv_kernel - 1) * 2
    assert tuple(s.nbytes // rows for s in segs[:3]) == want


def test_remote_mamba_descriptors():
    segs = (Segment("conv_x", 0, 1, 0, 1, 1, 60), Segment("conv_B", 60, 1, 0, 1, 1, 30),
            Segment("conv_C", 90, 1, 0, 1, 1, 30), Segment("ssm", 120, 1, 0, 1, 1, 200))
    geo = Geometry("m", "bf16", 1, 0, (640,), (Region(0, 0, 640),),
                   (CacheGroup("ssm", STATE, 0, 1, (View("S0", 0, 320, 2, segs),)),))
    plan = plan_rank(geo, {0: geo}, merge=False)
    rows = remote_descs(plan.peers[0], region_addresses(geo, [1000]))
    got = sorted((int(a), int(n)) for a, n, _ in rows)
    assert got == [(1000, 60), (1060, 30), (1090, 30), (1120, 200), (1320, 60), (1380, 30), (1410, 30), (1440, 200)]
    merged = plan_rank(geo, {0: geo}).peers[0]
    assert merged.length.tolist() == [320]  # equal TP: one descriptor per state page


# --- errors name the case ---------------------------------------------------

def test_nhd_with_heterogeneous_tp_is_refused():
    shape = ModelShape(layout="nhd")
    with pytest.raises(PlanError, match="NHD"):
        plan_for(shape, 2, 4, 0)


def test_tp_sizes_that_do_not_divide():
    with pytest.raises(PlanError, match="do not divide"):
        targets(0, 3, 2)


def test_heads_that_do_not_divide():
    with pytest.raises(GeometryError, match="kv heads"):
        build(ModelShape(kv_heads=6), 4, 0)


def test_block_ids_out_of_range():
    plan = plan_for(ModelShape(num_blocks=8), 1, 1, 0)
    with pytest.raises(PlanError, match=r"local block ids \[9\] out of range"):
        request_indices(plan, RequestBlocks.of(32, [[0, 9]], [[0, 1]]))


def test_remote_blocks_must_cover_missing_tokens():
    plan = plan_for(ModelShape(num_blocks=8), 1, 1, 0)
    with pytest.raises(PlanError, match="remote blocks start at token 32"):
        request_indices(plan, RequestBlocks.of(48, [[0, 1]], [[5]]))


def test_state_blocks_must_pair():
    plan = plan_for(_hybrid(4), 1, 1, 0)
    with pytest.raises(PlanError, match="state group ssm: 2 local blocks but 1 remote"):
        request_indices(plan, RequestBlocks.of(4, [[0], [1, 2]], [[0], [1]]))


def test_mismatched_models_refused():
    with pytest.raises(PlanError, match=r"segment L0.k"):
        plan_rank(build(ModelShape(head_dim=64), 1, 0), {0: build(ModelShape(head_dim=128), 1, 0)})


# --- negative controls: the checker catches what a wrong plan does -----------

def test_checker_catches_a_shifted_piece(monkeypatch):
    import kvxferd.plan.planner as planner
    real = planner._pieces

    def off_by_one_head(*args):
        return [dataclasses.replace(p, remote_offset=p.remote_offset + args[5].token_bytes)
                for p in real(*args)]

    monkeypatch.setattr(planner, "_pieces", off_by_one_head)
    shape = ModelShape(layers=1, kv_heads=4, head_dim=4, block_size=4, num_blocks=8)
    # the remote rows now straddle two units: the audit's row -> block check sees it first ...
    with pytest.raises(AssertionError, match="a row leaves the block span"):
        scenario.run(shape, 2, shape, 2, num_tokens=8)
    # ... and, without it, the byte comparison
    monkeypatch.setattr(scenario, "assert_rows_in_blocks", lambda *args: None)
    with pytest.raises(AssertionError, match="decode rank 0"):
        scenario.run(shape, 2, shape, 2, num_tokens=8)


def test_checker_catches_stray_writes():
    geo = build(ModelShape(layers=1, kv_heads=2, head_dim=4, block_size=4, num_blocks=8), 1, 0)
    bufs = testing.allocate(geo)
    want = [b.copy() for b in bufs]
    bufs[0][123] ^= 1
    (bad,) = testing.check(bufs, want, geo)
    assert bad.offset == 123 and bad.count == 1 and "segment k" in bad.where
