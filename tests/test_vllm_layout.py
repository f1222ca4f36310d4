"""vLLM's CPU KV cache layout described as a geometry, planned and executed byte for byte.

The expectation is built independently: a global cache array [layers, blocks, heads, 2*bs, hd]
that each rank's vLLM buffer slices by its heads (as vLLM's TP sharding does), compared with
what the decode rank holds after the descriptors were copied as NIXL pairs them.
"""

import numpy as np
import pytest
from scenario import execute

from kvxferd.plan.descriptors import RequestBlocks
from kvxferd.plan.geometry import GeometryError, shard
from kvxferd.plan.planner import PlanError, plan_rank, targets
from kvxferd.vllm import layout

LAYERS, BLOCKS, BS, HD, ITEM = 3, 12, 4, 8, 2  # bf16


def rank_cache(total_heads: int, tp: int, rank: int, block_size: int = BS):
    """(geometry, buffer) of one vLLM CPU worker: layers back to back, [B, H_local, 2*bs, hd] each."""
    start, stop = shard(total_heads, tp, rank, "heads")
    heads = stop - start
    shape = (BLOCKS, heads, 2 * block_size, HD)
    stride = (heads * 2 * block_size * HD, 2 * block_size * HD, HD, 1)
    layer_bytes = BLOCKS * heads * 2 * block_size * HD * ITEM
    layers = [layout.LayerCache(f"model.layers.{i}.self_attn.attn", 0, 0, i * layer_bytes, shape, stride, ITEM)
              for i in range(LAYERS)]
    spec = layout.GroupSpec("attention", block_size, total_heads, HD, "FullAttentionSpec")
    geo = layout.geometry("vllm:Llama", "bfloat16", tp, rank, [LAYERS * layer_bytes], [spec], layers)
    return geo, (start, stop)


def global_cache(total_heads: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, BLOCKS, total_heads, 2 * BS, HD * ITEM), dtype=np.uint8)


def buffer_of(g: np.ndarray, heads: tuple[int, int]) -> np.ndarray:
    return np.ascontiguousarray(g[:, :, heads[0]:heads[1]]).reshape(-1)


@pytest.mark.parametrize("total_heads", [2, 4])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("hit_blocks", [0, 2])
def test_cpu_layout_byte_exact(total_heads, p_tp, d_tp, hit_blocks):
    num_tokens = 5 * BS - 1  # five blocks, the last one partial
    p_blocks, d_blocks = [7, 2, 9, 0, 4], [3, 11, 5, 8, 1]
    prefill = global_cache(total_heads, seed=1)
    p_geos, p_bufs = {}, {}
    for r in range(p_tp):
        p_geos[r], heads = rank_cache(total_heads, p_tp, r)
        p_bufs[r] = [buffer_of(prefill, heads)]
    for r in range(d_tp):
        geo, heads = rank_cache(total_heads, d_tp, r)
        decode = np.zeros((LAYERS, BLOCKS, total_heads, 2 * BS, HD * ITEM), dtype=np.uint8)
        buf = buffer_of(decode, heads)
        plan = plan_rank(geo, {t: p_geos[t] for t in targets(r, d_tp, p_tp)})
        req = RequestBlocks.of(num_tokens, [np.array(d_blocks[hit_blocks:])], [np.array(p_blocks)])
        moved = execute(plan, req, geo, [buf], p_geos, p_bufs)
        # Independently: the missing blocks hold prefill's bytes for this rank's heads, nothing else changed.
        expected = decode.copy()
        for d_b, p_b in zip(d_blocks[hit_blocks:], p_blocks[hit_blocks:]):
            expected[:, d_b, heads[0]:heads[1]] = prefill[:, p_b, heads[0]:heads[1]]
        got = buf.reshape(LAYERS, BLOCKS, heads[1] - heads[0], 2 * BS, HD * ITEM)
        np.testing.assert_array_equal(got, expected[:, :, heads[0]:heads[1]])
        assert moved == LAYERS * (5 - hit_blocks) * (heads[1] - heads[0]) * 2 * BS * HD * ITEM


def test_block_size_mismatch_refused_at_planning():
    p_geo, _ = rank_cache(2, 1, 0, block_size=BS)
    d_geo, _ = rank_cache(2, 1, 0, block_size=2 * BS)
    with pytest.raises(PlanError, match=r"block-size mismatch.*same block size"):
        plan_rank(d_geo, {0: p_geo})


def test_layouts_that_split_a_head_are_refused():
    shape = (BLOCKS, 2, 2 * BS, HD)
    nhd_like = (2 * 2 * BS * HD, HD, 2 * HD, 1)  # tokens outer, heads inner: a head is not contiguous
    layer = layout.LayerCache("l0", 0, 0, 0, shape, nhd_like, ITEM)
    spec = layout.GroupSpec("attention", BS, 2, HD)
    with pytest.raises(GeometryError, match="LBHNC"):
        layout.geometry("m", "bf16", 1, 0, [1 << 20], [spec], [layer])


def test_state_groups_are_refused_by_name():
    spec = layout.GroupSpec("state", BS, 2, HD, "MambaSpec")
    layer = layout.LayerCache("m0", 0, 0, 0, (BLOCKS, 2, 2 * BS, HD), (2 * 2 * BS * HD, 2 * BS * HD, HD, 1), ITEM)
    with pytest.raises(GeometryError, match="MambaSpec"):
        layout.geometry("m", "bf16", 1, 0, [1 << 20], [spec], [layer])


def test_heads_must_match_tp_sharding():
    with pytest.raises(GeometryError, match="holds 2 kv heads"):
        rank_geo = layout.LayerCache("l0", 0, 0, 0, (BLOCKS, 2, 2 * BS, HD), (4 * BS * HD, 2 * BS * HD, HD, 1), ITEM)
        layout.geometry("m", "bf16", 2, 0, [1 << 20], [layout.GroupSpec("attention", BS, 2, HD)], [rank_geo])


def test_shared_layers_are_one_region():
    shape, stride = (BLOCKS, 2, 2 * BS, HD), (4 * BS * HD, 2 * BS * HD, HD, 1)
    layers = [layout.LayerCache("a", 0, 0, 0, shape, stride, ITEM),
              layout.LayerCache("b", 0, 0, 0, shape, stride, ITEM)]
    geo = layout.geometry("m", "bf16", 1, 0, [1 << 20], [layout.GroupSpec("attention", BS, 2, HD)], layers)
    assert len(geo.regions) == 1 and [v.name for v in geo.groups[0].views] == ["a"]


@pytest.mark.parametrize("name,canonical", [("bfloat16", "bf16"), ("torch.float16", "fp16"), ("float32", "fp32"),
                                            ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"), ("half", "fp16")])
def test_vllm_dtype_names(name, canonical):
    from kvxferd.plan import dtypes
    from kvxferd.plan.models import ModelShape, build
    assert dtypes.canonical(name) == canonical
    assert build(ModelShape(dtype=name), 1, 0).dtype == canonical


def test_unknown_dtype_names_the_choices():
    from kvxferd.plan import dtypes
    with pytest.raises(GeometryError, match=r"unknown dtype 'int3'.*bfloat16"):
        dtypes.canonical("int3")
