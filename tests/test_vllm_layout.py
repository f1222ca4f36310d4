"""vLLM's KV caches, as the connector describes them, planned and executed byte for byte.

Every case builds each rank's buffer independently of the layout code: a logical cache
(per layer: [blocks, all heads, tokens, content]; per state layer: the whole model's conv
channels and SSM heads) is written through the strides vLLM's allocation gives that
layout (`strides_of`, from the `[L, B, H, N, C]` permutation) and sliced by TP the way
vLLM shards. After the descriptors are copied as NIXL pairs them, the decode's buffer is
read back through the same strides and compared with the logical cache it should hold.

Covered: every KVCacheLayout a backend of vLLM 0.32 picks (CPU's LBHNC with each head's K
transposed, in rows, or sealed; GPU's LBHNC/LBNHC/BLHNC/BLNHC), heterogeneous TP both ways, GQA
replicas, block-size mismatch on token-addressable layouts (CPU's transposed keys included),
overlaid cache groups with sliding-window trimming, MLA latents, Mamba2 and GDN state in DS and
SD conv layouts.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from scenario import execute

from kvxferd.handshake import compat_fields, compat_hash
from kvxferd.plan.descriptors import RequestBlocks
from kvxferd.plan.geometry import Geometry, GeometryError, shard
from kvxferd.plan.planner import PlanError, plan_rank, targets
from kvxferd.vllm import handoff, layout
from kvxferd.vllm.handoff import GroupInfo, RemotePrefill

ITEM = 2  # bytes per element (bf16)


def strides_of(order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Dense element strides of the [L, B, H, N, C] dims stored in `order` (outermost first)."""
    out, step = {}, 1
    for d in reversed(order):
        out[d] = step
        step *= sizes[d]
    return out


class AttentionRank:
    """One rank's attention layers in one buffer: logical [L][B, heads, N, C] through `order`'s strides."""

    def __init__(self, order: str, layers: int, blocks: int, heads: tuple[int, int], tokens: int, content: int):
        self.order, self.heads = order, heads
        self.sizes = dict(L=layers, B=blocks, H=heads[1] - heads[0], N=tokens, C=content)
        self.strides = strides_of(order, self.sizes)
        self.buffer = np.zeros(math.prod(self.sizes.values()) * ITEM, dtype=np.uint8)

    def layer_view(self, layer: int) -> np.ndarray:
        s = self.sizes
        elems = self.buffer.view(np.uint16)
        start = elems[layer * self.strides["L"]:]
        return np.lib.stride_tricks.as_strided(
            start, (s["B"], s["H"], s["N"], s["C"]), tuple(self.strides[d] * ITEM for d in "BHNC"), writeable=True)

    def layer_caches(self, group: int = 0, prefix: str = "model.layers") -> list[layout.LayerCache]:
        return [layout.LayerCache(f"{prefix}.{i}.attn", group, 0, i * self.strides["L"] * ITEM,
                                  tuple(self.sizes[d] for d in "BHNC"), tuple(self.strides[d] for d in "BHNC"),
                                  ITEM) for i in range(self.sizes["L"])]

    def fill(self, logical: np.ndarray) -> None:
        """logical: [L, B, all heads, N, C]."""
        for i in range(self.sizes["L"]):
            self.layer_view(i)[...] = logical[i, :, self.heads[0]:self.heads[1]]

    kernel_pages = 1

    def read(self) -> np.ndarray:
        """The logical cache this rank holds: [L, blocks, local heads, tokens per block, C]."""
        pages = np.stack([self.layer_view(i).copy() for i in range(self.sizes["L"])])
        k = self.kernel_pages
        layers, n, heads, kt, c = pages.shape
        return pages.reshape(layers, n // k, k, heads, kt, c).transpose(0, 1, 3, 2, 4, 5) \
            .reshape(layers, n // k, heads, k * kt, c)


class CpuAttentionRank(AttentionRank):
    """vLLM's CPU attention: the view [B, H, N, K|V] vLLM hands out, but each head's area holds
    its N keys (transposed: element-major; or in rows), then its N values in rows."""

    def __init__(self, kv_split: str, *args) -> None:
        super().__init__("LBHNC", *args)
        self.kv_split = kv_split

    def _areas(self, layer: int) -> np.ndarray:  # [B, H, K|V, N * D]
        s = self.sizes
        return self.layer_view(layer).reshape(s["B"], s["H"], 2, s["N"] * s["C"] // 2)

    def fill(self, logical: np.ndarray) -> None:
        b, h, n, d = self.sizes["B"], self.sizes["H"], self.sizes["N"], self.sizes["C"] // 2
        for i in range(self.sizes["L"]):
            heads = logical[i, :, self.heads[0]:self.heads[1]]  # [B, H, N, 2D]
            keys = heads[..., :d].transpose(0, 1, 3, 2) if self.kv_split == "k_transposed" else heads[..., :d]
            self._areas(i)[:, :, 0] = keys.reshape(b, h, n * d)
            self._areas(i)[:, :, 1] = heads[..., d:].reshape(b, h, n * d)

    def read(self) -> np.ndarray:
        b, h, n, d = self.sizes["B"], self.sizes["H"], self.sizes["N"], self.sizes["C"] // 2
        out = []
        for i in range(self.sizes["L"]):
            k, v = self._areas(i)[:, :, 0], self._areas(i)[:, :, 1]
            keys = k.reshape(b, h, d, n).transpose(0, 1, 3, 2) if self.kv_split == "k_transposed" \
                else k.reshape(b, h, n, d)
            out.append(np.concatenate([keys, v.reshape(b, h, n, d)], axis=-1))
        return np.stack(out)


def attention_world(order: str, total_heads: int, tp: int, tokens: int, seed: int, kv_split: str = "",
                    layers: int = 2, blocks: int = 10, head: int = 8, kernel_pages: int = 1):
    """(geometries, ranks, logical cache) of one engine: every rank filled from one logical cache.

    `kernel_pages` > 1: the backend's kernel pages hold tokens / kernel_pages tokens each, a block
    spans that many consecutive pages (vLLM's kernel block size below its block size). `kv_split`:
    CPU attention's heads (K then V; `order` must be LBHNC)."""
    content = 2 * head  # K|V of one token of one head
    rng = np.random.default_rng(seed)
    logical = rng.integers(0, 2**16, (layers, blocks, total_heads, tokens, content), dtype=np.uint16)
    spec = layout.GroupSpec("attention", tokens, "FullAttentionSpec", total_kv_heads=total_heads,
                            head_bytes=content * ITEM, kv_split=kv_split)
    kt = tokens // kernel_pages
    pages = logical.reshape(layers, blocks, total_heads, kernel_pages, kt, content).transpose(0, 1, 3, 2, 4, 5) \
        .reshape(layers, blocks * kernel_pages, total_heads, kt, content)
    geos, ranks = {}, {}
    for r in range(tp):
        heads = shard(total_heads, tp, r, "heads")
        dims = (layers, blocks * kernel_pages, heads, kt, content)
        rank = CpuAttentionRank(kv_split, *dims) if kv_split and kv_split != "sealed" else AttentionRank(order, *dims)
        rank.fill(pages)
        rank.kernel_pages = kernel_pages
        geos[r] = layout.geometry("m", "bf16", tp, r, [rank.buffer.nbytes], [spec], rank.layer_caches())
        ranks[r] = rank
    return geos, ranks, logical


def run_reads(p_geos, p_ranks, d_geos, d_ranks, req: RequestBlocks) -> int:
    moved = 0
    for r, geo in d_geos.items():
        plan = plan_rank(geo, {t: p_geos[t] for t in targets(r, len(d_geos), len(p_geos))})
        moved += execute(plan, req, geo, [d_ranks[r].buffer], p_geos, {t: [x.buffer] for t, x in p_ranks.items()})
    return moved


TP_CASES = [(2, 1, 1), (4, 2, 1), (4, 1, 2), (4, 4, 2), (2, 1, 4), (2, 4, 1)]  # (kv heads, prefill TP, decode TP)
CPU_SPLITS = ["k_transposed", "k_rows", "sealed"]
LAYOUT_CASES = [(order, split, *tp) for order, split in [*(("LBHNC", s) for s in CPU_SPLITS), ("LBHNC", ""),
                                                         ("BLHNC", "")] for tp in TP_CASES]
# token-major pages interleave heads per token: same TP only (test_token_major_refuses_heterogeneous_tp)
LAYOUT_CASES += [(order, "", 2, tp, tp) for order in ("LBNHC", "BLNHC") for tp in (1, 2)]


@pytest.mark.parametrize("order,kv_split,heads,p_tp,d_tp", LAYOUT_CASES)
@pytest.mark.parametrize("hit", [0, 2])
def test_attention_layouts_byte_exact(order, kv_split, heads, p_tp, d_tp, hit):
    bs, num_tokens = 4, 5 * 4 - 1  # five blocks, the last one partial
    p_geos, p_ranks, p_logical = attention_world(order, heads, p_tp, bs, seed=1, kv_split=kv_split)
    d_geos, d_ranks, d_logical = attention_world(order, heads, d_tp, bs, seed=2, kv_split=kv_split)
    p_blocks, d_blocks = [7, 2, 9, 0, 4], [3, 1, 5, 8, 6]
    moved = run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(num_tokens, [d_blocks[hit:]], [p_blocks]))
    expected = d_logical.copy()
    for d_b, p_b in zip(d_blocks[hit:], p_blocks[hit:]):
        expected[:, d_b] = p_logical[:, p_b]
    for rank in d_ranks.values():
        np.testing.assert_array_equal(rank.read(), expected[:, :, rank.heads[0]:rank.heads[1]])
    heads_read = sum(x.heads[1] - x.heads[0] for x in d_ranks.values())
    assert moved == 2 * (5 - hit) * heads_read * bs * 2 * 8 * ITEM  # layers x blocks x heads x tokens x K|V


def test_token_major_refuses_heterogeneous_tp():
    p_geos, _, _ = attention_world("LBNHC", 4, 1, 4, seed=1)
    d_geos, _, _ = attention_world("LBNHC", 4, 2, 4, seed=2)
    with pytest.raises(PlanError, match="token-major"):
        plan_rank(d_geos[0], {0: p_geos[0]})


@pytest.mark.parametrize("order,kv_split", [("LBHNC", ""), ("BLHNC", ""), ("LBHNC", "k_transposed"),
                                            ("LBHNC", "k_rows")])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_block_size_translation_on_token_addressable_pages(order, kv_split, p_tp, d_tp):
    """The prefill's blocks of 4 tokens land in the decode's blocks of 8 (GPU backends' rows, and
    CPU attention's heads: keys a lane per element, or rows)."""
    p_geos, p_ranks, p_logical = attention_world(order, 4, p_tp, 4, seed=3, blocks=12, kv_split=kv_split)
    d_geos, d_ranks, d_logical = attention_world(order, 4, d_tp, 8, seed=4, blocks=6, kv_split=kv_split)
    num_tokens = 21  # P: 6 blocks; D: 3 blocks
    p_blocks, d_blocks = [11, 3, 8, 0, 5, 2], [4, 1, 2]
    run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(num_tokens, [d_blocks], [p_blocks]))
    expected = d_logical.copy()
    for t in range(-(-num_tokens // 4) * 4):  # the prefill's whole last block moves, as on any read
        expected[:, d_blocks[t // 8], :, t % 8] = p_logical[:, p_blocks[t // 4], :, t % 4]
    for rank in d_ranks.values():
        np.testing.assert_array_equal(rank.read(), expected[:, :, rank.heads[0]:rank.heads[1]])


@pytest.mark.parametrize("p_kernel,d_kernel", [(2, 1), (1, 4), (4, 2)])
def test_kernel_pages_smaller_than_blocks(p_kernel, d_kernel):
    """A backend whose kernel block is a fraction of vLLM's block (hybrid models on GPU): a block
    is that many consecutive kernel pages, on either side, across TP."""
    p_geos, p_ranks, p_logical = attention_world("LBHNC", 4, 2, 8, seed=11, kernel_pages=p_kernel)
    d_geos, d_ranks, d_logical = attention_world("LBHNC", 4, 1, 8, seed=12, kernel_pages=d_kernel)
    run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(21, [[4, 1, 2]], [[7, 3, 9]]))
    chunk = min(8 // p_kernel, 8 // d_kernel)  # tokens per descriptor; the prompt's last chunk moves whole
    moved = -(-21 // chunk) * chunk
    expected = d_logical.copy()
    for t in range(moved):
        expected[:, [4, 1, 2][t // 8], :, t % 8] = p_logical[:, [7, 3, 9][t // 8], :, t % 8]
    np.testing.assert_array_equal(d_ranks[0].read(), expected)


def test_block_size_mismatch_on_sealed_heads_is_refused_naming_it():
    p_geos, _, _ = attention_world("LBHNC", 2, 1, 4, seed=1, kv_split="sealed")
    d_geos, _, _ = attention_world("LBHNC", 2, 1, 8, seed=2, kv_split="sealed")
    with pytest.raises(PlanError, match=r"block-size mismatch.*same block size"):
        plan_rank(d_geos[0], {0: p_geos[0]})


def test_layouts_that_spread_a_blocks_heads_are_refused():
    rank = AttentionRank("LHBNC", 2, 10, (0, 2), 4, 16)
    spec = layout.GroupSpec("attention", 4, "FullAttentionSpec", total_kv_heads=2, head_bytes=32)
    with pytest.raises(GeometryError, match="LHBNC"):
        layout.geometry("m", "bf16", 1, 0, [rank.buffer.nbytes], [spec], rank.layer_caches())


def test_heads_must_match_tp_sharding():
    rank = AttentionRank("LBHNC", 1, 10, (0, 2), 4, 16)
    spec = layout.GroupSpec("attention", 4, "FullAttentionSpec", total_kv_heads=2, head_bytes=32)
    with pytest.raises(GeometryError, match="holds 2 kv heads"):
        layout.geometry("m", "bf16", 2, 0, [rank.buffer.nbytes], [spec], rank.layer_caches())


def test_cross_layer_sharing_is_one_view_and_overlaid_groups_keep_theirs():
    rank = AttentionRank("LBHNC", 1, 10, (0, 2), 4, 16)
    (cache,) = rank.layer_caches()
    shared = layout.LayerCache("model.layers.1.attn", 0, cache.buffer, cache.offset, cache.shape, cache.stride, ITEM)
    other_group = layout.LayerCache("model.layers.2.attn", 1, cache.buffer, cache.offset, cache.shape, cache.stride,
                                    ITEM)
    spec = layout.GroupSpec("attention", 4, "FullAttentionSpec", total_kv_heads=2, head_bytes=32)
    geo = layout.geometry("m", "bf16", 1, 0, [rank.buffer.nbytes], [spec, spec], [cache, shared, other_group])
    assert len(geo.regions) == 1
    assert [[v.name for v in g.views] for g in geo.groups] == [["model.layers.0.attn"], ["model.layers.2.attn"]]


# --- overlaid groups, sliding window (Gemma3/Gemma4 under vLLM's hybrid allocator) -------------

def test_sliding_window_group_reads_only_its_window_into_the_decodes_window():
    """Two groups over one buffer (block ids from one pool). The prefill's window group nulls
    the blocks that left the window; the decode allocates nulls for them too. Through the
    hand-off's trimming, only the window's blocks move, into the decode's window blocks."""
    bs, num_tokens = 4, 19  # 5 blocks; a window of 8 tokens keeps the last 3 (vLLM: skip tokens < 19-8+1)
    p_geos, p_ranks, p_logical = overlaid_world(bs, seed=5)
    d_geos, d_ranks, d_logical = overlaid_world(bs, seed=6)
    p_lists = [[0, 0, 11, 12, 13], [1, 2, 3, 4, 5]]  # [window group, full group], nulls where vLLM freed
    d_lists = [[0, 0, 21, 22, 23], [6, 7, 8, 9, 10]]
    groups = [GroupInfo("attention", bs), GroupInfo("attention", bs)]
    prefill = RemotePrefill(handoff.RemoteRef("p", "h", 1, 1, "r"), tuple(map(tuple, p_lists)), num_tokens)
    order = handoff.read_order("d", prefill, groups, d_lists, num_tokens, 0)
    assert order.local_blocks == [[21, 22, 23], [6, 7, 8, 9, 10]]
    assert order.remote_blocks == [[11, 12, 13], [1, 2, 3, 4, 5]]
    assert handoff.held_blocks(groups, p_lists) == order.remote_blocks
    run_reads(p_geos, p_ranks, d_geos, d_ranks,
              RequestBlocks.of(num_tokens, order.local_blocks, order.remote_blocks))
    expected = d_logical.copy()
    for d_b, p_b in zip(order.local_blocks[0] + order.local_blocks[1], order.remote_blocks[0] + order.remote_blocks[1]):
        expected[:, d_b] = p_logical[:, p_b]  # a block id belongs to one group: its page is that group's
    np.testing.assert_array_equal(d_ranks[0].read(), expected)
    assert not np.array_equal(d_ranks[0].read()[:, 0], p_logical[:, 0])  # the null block was not written


def test_a_window_that_leaves_needed_local_blocks_unfilled_is_refused_with_them():
    """The decode keeps blocks 41, 42 (its window reaches further back) that the prefill dropped:
    vLLM would count them computed, so the read is refused and names them for recomputation."""
    groups = [GroupInfo("attention", 4)]
    prefill = RemotePrefill(handoff.RemoteRef("p", "h", 1, 1, "r"), ((0, 0, 0, 31, 32),), 19)
    order = handoff.read_order("d", prefill, groups, [[0, 41, 42, 43, 44]], 19, 0)
    assert "window" in order.refusal and order.local_blocks == [[41, 42, 43, 44]]



def test_a_window_starting_inside_a_larger_local_block_fills_it_from_there():
    """Gemma4 at TP 2: the decode's window blocks hold 8 tokens, the prefill's 4. With a window of
    7, no query of a 19-token prompt (vLLM recomputes token 18) looks before token 12, so block 51
    is read from token 12; a full attention group, a wider window (token 11 would be trusted
    unread), or a decode that caches prefixes (window 0 from the connector) is refused."""
    prefill = RemotePrefill(handoff.RemoteRef("p", "h", 1, 1, "r"), ((0, 0, 0, 31, 32),), 19, (4,))
    order = handoff.read_order("d", prefill, [GroupInfo("attention", 8, window=7)], [[0, 51, 52]], 19, 0)
    assert not order.refusal and (order.local_blocks, order.remote_blocks) == ([[51, 52]], [[31, 32]])
    for group in (GroupInfo("attention", 8), GroupInfo("attention", 8, window=8)):
        refused = handoff.read_order("d", prefill, [group], [[0, 51, 52]], 19, 0)
        assert "window" in refused.refusal and refused.local_blocks == [[51, 52]], group
    nothing = handoff.read_order("d", RemotePrefill(prefill.remote, ((0, 0, 0, 0, 0),), 19, (4,)),
                                 [GroupInfo("attention", 8, window=7)], [[0, 0, 52]], 19, 0)
    assert nothing.refusal and nothing.local_blocks == [[52]]  # no block held: none of it is read
    p_geos, p_ranks, p_logical = attention_world("LBHNC", 2, 1, 4, seed=5, blocks=40, kv_split="k_transposed")
    d_geos, d_ranks, d_logical = attention_world("LBHNC", 2, 1, 8, seed=6, blocks=60, kv_split="k_transposed")
    run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(19, order.local_blocks, order.remote_blocks))
    expected = d_logical.copy()
    for t in range(12, 20):  # the prefill's last block moves whole
        expected[:, [51, 52][t // 8 - 1], :, t % 8] = p_logical[:, [31, 32][t // 4 - 3], :, t % 4]
    np.testing.assert_array_equal(d_ranks[0].read(), expected)  # tokens 8..11 of block 51 untouched


def test_lists_too_short_for_the_tokens_or_nothing_to_read_are_refused():
    groups = [GroupInfo("attention", 4)]
    ref = handoff.RemoteRef("p", "h", 1, 1, "r")
    short = handoff.read_order("d", RemotePrefill(ref, ((1, 2),), 19), groups, [[5, 6, 7, 8, 9]], 19, 12)
    assert "2 blocks" in short.refusal and short.local_blocks == [[8, 9]]
    empty = handoff.read_order("d", RemotePrefill(ref, ((0, 0, 0, 0, 0),), 19), groups, [[0, 0, 0, 0, 0]], 19, 0)
    assert "nothing" in empty.refusal  # the worker fails it (never a silent release of a promised read)


def test_state_block_skips_speculative_scratch_blocks():
    state = GroupInfo("state", 4096, scratch_blocks=2)
    assert handoff.held_blocks([state], [[7, 8, 9]]) == [[7]]  # mamba_cache_mode none: the state, 2 scratch
    assert handoff.held_blocks([state], [[0, 0, 4, 5, 6]]) == [[4]]  # align: the prompt's last, then scratch


def test_sliding_window_with_a_local_prefix_hit_reads_the_missing_window_tail():
    """The decode caches the first 3 blocks; the window (last 3 blocks) needs blocks 2..4, of which
    only 3 and 4 are missing."""
    groups = [GroupInfo("attention", 4), GroupInfo("attention", 4)]
    prefill = RemotePrefill(handoff.RemoteRef("p", "h", 1, 1, "r"), ((0, 0, 11, 12, 13), (1, 2, 3, 4, 5)), 19)
    order = handoff.read_order("d", prefill, groups, [[0, 0, 21, 22, 23], [6, 7, 8, 9, 10]], 19, 12)
    assert order.local_blocks == [[22, 23], [9, 10]]
    assert order.remote_blocks == [[11, 12, 13], [1, 2, 3, 4, 5]]  # the daemon skips the cached ones
    chunks = group_chunks_for(order, 19)
    assert [c.remote_page.tolist() for c in chunks] == [[12, 13], [4, 5]]


def group_chunks_for(order, num_tokens):
    from kvxferd.plan.descriptors import group_chunks
    from kvxferd.plan.planner import GroupPairing
    pairing = GroupPairing("g", "attention", 4, 4, 1, 1, 64, 64, 4, 1, 1)
    return [group_chunks(pairing, num_tokens, np.array(lo), np.array(re))
            for lo, re in zip(order.local_blocks, order.remote_blocks)]


def overlaid_world(bs: int, seed: int):
    """One rank, one buffer, two cache groups each with one layer viewing the whole buffer."""
    rank = AttentionRank("LBHNC", 1, 24, (0, 2), bs, 16)
    rng = np.random.default_rng(seed)
    logical = rng.integers(0, 2**16, (1, 24, 2, bs, 16), dtype=np.uint16)
    rank.fill(logical)
    (cache,) = rank.layer_caches()
    full = layout.LayerCache("model.layers.1.attn", 1, cache.buffer, cache.offset, cache.shape, cache.stride, ITEM)
    specs = [layout.GroupSpec("attention", bs, "SlidingWindowSpec", total_kv_heads=2, head_bytes=32),
             layout.GroupSpec("attention", bs, "FullAttentionSpec", total_kv_heads=2, head_bytes=32)]
    geo = layout.geometry("m", "bf16", 1, 0, [rank.buffer.nbytes], specs, [cache, full])
    return {0: geo}, {0: rank}, logical


# --- MLA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_mla_latent_is_one_unit_every_rank_holds(p_tp, d_tp):
    """[B, 1, N, 576] per layer (CPU_MLA, FlashMLA, Triton MLA): each decode rank reads the whole
    latent from one prefill rank."""
    def world(tp, seed):
        rng = np.random.default_rng(seed)
        logical = rng.integers(0, 2**16, (2, 8, 1, 4, 576), dtype=np.uint16)
        spec = layout.GroupSpec("attention", 4, "MLAAttentionSpec", total_kv_heads=1, head_bytes=576 * ITEM)
        geos, ranks = {}, {}
        for r in range(tp):
            rank = AttentionRank("LBNHC", 2, 8, (0, 1), 4, 576)
            rank.fill(logical)
            geos[r] = layout.geometry("m", "bf16", tp, r, [rank.buffer.nbytes], [spec], rank.layer_caches())
            ranks[r] = rank
        return geos, ranks, logical

    p_geos, p_ranks, p_logical = world(p_tp, 7)
    d_geos, d_ranks, d_logical = world(d_tp, 8)
    moved = run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(10, [[5, 1, 6]], [[2, 7, 3]]))
    expected = d_logical.copy()
    expected[:, [5, 1, 6]] = p_logical[:, [2, 7, 3]]
    for rank in d_ranks.values():
        np.testing.assert_array_equal(rank.read(), expected)
    assert moved == d_tp * 2 * 3 * 4 * 576 * ITEM  # every decode rank, once: layers x blocks x tokens x latent


# --- Mamba2 / GDN state ----------------------------------------------------------------------

MAMBA2 = dict(parts=[("x", 8, 4), ("B", 2, 4), ("C", 2, 4)], ssm=(8, 4, 4))  # (name, units, channels/unit)
GDN = dict(parts=[("q", 2, 8), ("k", 2, 8), ("v", 4, 8)], ssm=(4, 8, 8))
WIDTH, PAGE = 3, 4096


class StateRank:
    """One rank's state layers: per page, the conv state (this rank's channels of every part, in
    DS or SD) then the SSM state (this rank's heads), padded to PAGE bytes."""

    def __init__(self, model: dict, conv_layout: str, tp: int, rank: int, layers: int = 2, blocks: int = 6):
        self.model, self.conv_layout, self.tp, self.rank = model, conv_layout, tp, rank
        self.layers, self.blocks = layers, blocks
        self.buffer = np.zeros(layers * blocks * PAGE, dtype=np.uint8)

    def local_channels(self, logical_conv: np.ndarray) -> np.ndarray:
        """This rank's conv channels [local channels, WIDTH] from the model's [all channels, WIDTH]."""
        out, at = [], 0
        for _, units, per in self.model["parts"]:
            start, stop = shard(units, self.tp, self.rank, "units")
            out.append(logical_conv[at + start * per: at + stop * per])
            at += units * per
        return np.concatenate(out)

    def page(self, logical_conv: np.ndarray, logical_ssm: np.ndarray) -> np.ndarray:
        conv = self.local_channels(logical_conv)
        conv = conv if self.conv_layout == "DS" else conv.T
        heads = shard(self.model["ssm"][0], self.tp, self.rank, "heads")
        data = np.concatenate([np.ascontiguousarray(conv).view(np.uint8).ravel(),
                               np.ascontiguousarray(logical_ssm[heads[0]:heads[1]]).view(np.uint8).ravel()])
        return np.pad(data, (0, PAGE - len(data)))

    def fill(self, conv: np.ndarray, ssm: np.ndarray) -> None:
        """conv: [L, B, all channels, WIDTH] uint16; ssm: [L, B, heads, d1, d2] float32."""
        for layer in range(self.layers):
            for b in range(self.blocks):
                at = (layer * self.blocks + b) * PAGE
                self.buffer[at:at + PAGE] = self.page(conv[layer, b], ssm[layer, b])

    def spec(self, kind: str) -> layout.GroupSpec:
        channels = sum((stop - start) * per for _, units, per in self.model["parts"]
                       for start, stop in [shard(units, self.tp, self.rank, "u")])
        heads, d1, d2 = self.model["ssm"]
        conv_shape = (channels, WIDTH) if self.conv_layout == "DS" else (WIDTH, channels)
        return layout.GroupSpec("state", 1024, "MambaSpec", mamba_type=kind, conv_layout=self.conv_layout,
                                states=(layout.StateTensor(conv_shape, ITEM),
                                        layout.StateTensor((heads // self.tp, d1, d2), 4)))

    def geometry(self, kind: str):
        caches = [layout.LayerCache(f"model.layers.{i}.mixer", 0, 0, i * self.blocks * PAGE,
                                    (self.blocks, 1, 1, PAGE), (PAGE, PAGE, PAGE, 1), 1) for i in range(self.layers)]
        return layout.geometry("m", "bf16", self.tp, self.rank, [self.buffer.nbytes], [self.spec(kind)], caches)


def state_world(model: dict, kind: str, conv_layout: str, tp: int, seed: int):
    rng = np.random.default_rng(seed)
    channels = sum(units * per for _, units, per in model["parts"])
    conv = rng.integers(0, 2**16, (2, 6, channels, WIDTH), dtype=np.uint16)
    ssm = rng.standard_normal((2, 6, *model["ssm"]), dtype=np.float32)
    ranks = {r: StateRank(model, conv_layout, tp, r) for r in range(tp)}
    for rank in ranks.values():
        rank.fill(conv, ssm)
    return {r: x.geometry(kind) for r, x in ranks.items()}, ranks, (conv, ssm)


@pytest.mark.parametrize("model,kind", [(MAMBA2, "mamba2"), (GDN, "gdn")])
@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_state_of_the_last_block_moves_whole_across_tp(model, kind, conv_layout, p_tp, d_tp):
    p_geos, p_ranks, (p_conv, p_ssm) = state_world(model, kind, conv_layout, p_tp, seed=9)
    d_geos, d_ranks, (d_conv, d_ssm) = state_world(model, kind, conv_layout, d_tp, seed=10)
    run_reads(p_geos, p_ranks, d_geos, d_ranks, RequestBlocks.of(99, [[4]], [[2]]))
    conv, ssm = d_conv.copy(), d_ssm.copy()
    conv[:, 4], ssm[:, 4] = p_conv[:, 2], p_ssm[:, 2]
    for rank in d_ranks.values():
        want = StateRank(model, conv_layout, d_tp, rank.rank)
        want.fill(conv, ssm)
        np.testing.assert_array_equal(rank.buffer, want.buffer)


def test_conv_layouts_must_agree_between_the_engines():
    p_geos, _, _ = state_world(MAMBA2, "mamba2", "DS", 1, seed=1)
    d_geos, _, _ = state_world(MAMBA2, "mamba2", "SD", 1, seed=1)
    with pytest.raises(PlanError, match="segments differ"):
        plan_rank(d_geos[0], {0: p_geos[0]})


def test_a_conv_state_that_does_not_split_is_refused_naming_it():
    spec = layout.GroupSpec("state", 1024, "MambaSpec", mamba_type="mamba2",
                            states=(layout.StateTensor((33, WIDTH), ITEM), layout.StateTensor((8, 4, 4), 4)))
    with pytest.raises(GeometryError, match="Mamba2 conv state of 33 channels"):
        layout.state_segments(spec, 1, 0)


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


def test_misread_sharing_and_empty_groups_are_refused_at_start():
    rank = AttentionRank("LBHNC", 1, 10, (0, 2), 4, 16)
    (cache,) = rank.layer_caches()
    spec = layout.GroupSpec("attention", 4, "FullAttentionSpec", total_kv_heads=2, head_bytes=32)
    other_shape = layout.LayerCache("model.layers.1.attn", 0, cache.buffer, cache.offset, (5, 2, 4, 16),
                                    cache.stride, ITEM)
    with pytest.raises(GeometryError, match=r"starts where model\.layers\.0\.attn does"):
        layout.geometry("m", "bf16", 1, 0, [rank.buffer.nbytes], [spec], [cache, other_shape])
    with pytest.raises(GeometryError, match=r"cache group 1 .* has no layers"):
        layout.geometry("m", "bf16", 1, 0, [rank.buffer.nbytes], [spec, spec], [cache])


def test_the_compatibility_hash_tells_lanes_and_spacing_but_not_the_page():
    """Segments with lanes or spaced units hash apart from what a daemon before protocol 4 reads
    of them (it drops both fields); plain segments hash as before; the spacing's value (it
    follows the block size) does not count."""
    tp1, _, _ = attention_world("LBHNC", 2, 1, 4, seed=1, kv_split="k_transposed")
    tp2, _, _ = attention_world("LBHNC", 2, 2, 8, seed=1, kv_split="k_transposed")
    assert compat_hash(tp1[0]) == compat_hash(tp2[1])
    plain = msgspec.to_builtins(tp1[0])
    for group in plain["groups"]:
        for view in group["views"]:
            for seg in view["segments"]:
                seg.pop("lanes", None), seg.pop("stride", None)
    dropped = msgspec.convert(plain, Geometry)
    assert compat_hash(dropped) != compat_hash(tp1[0])
    gpu, _, _ = attention_world("LBHNC", 2, 1, 4, seed=1)
    assert all(s.endswith(":unit_major") for s in compat_fields(gpu[0])["segments"].split(","))  # as before
