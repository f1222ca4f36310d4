"""`kvxferd bench plan`: descriptor arrays and per-request indices for a 70B-class layout.

Both sides of every figure come from the same run: the vectorized planner against the
obvious baseline (a Python list of (addr, len, dev) tuples, ids by list comprehension).
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from ..plan.descriptors import RequestBlocks, local_descs, region_addresses, remote_descs, request_indices
from ..plan.geometry import Geometry
from ..plan.models import ModelShape, build
from ..plan.planner import PeerPlan, plan_rank, targets

T = TypeVar("T")

LLAMA70B = ModelShape(layers=80, kv_heads=8, head_dim=128, dtype="bf16", block_size=16, num_blocks=30_000)


def _measure(fn: Callable[[], T]) -> tuple[T, float, int]:
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, elapsed, peak


def _baseline_descs(geo: Geometry, region_addr: np.ndarray, peer: PeerPlan) -> list[tuple[int, int, int]]:
    """The obvious way: loop over pieces and pages, append tuples."""
    out: list[tuple[int, int, int]] = []
    for t in range(len(peer.pieces)):
        base = int(region_addr[peer.local_region[t]]) + int(peer.local_offset[t])
        stride, length = int(peer.local_stride[t]), int(peer.length[t])
        for page in range(int(peer.local_pages[t])):
            out.append((base + page * stride, length, 0))
    return out


def _descs(peer: PeerPlan, laddr: np.ndarray, raddr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return local_descs(peer, laddr), remote_descs(peer, raddr)


def _baseline_ids(shape: ModelShape, regions: int, blist: list[int]) -> list[int]:
    """The obvious way to per-request ids: a list comprehension over regions and blocks."""
    return [r * shape.num_blocks + b for r in range(regions) for b in blist]


def _per_request_us(fn: Callable[[], object], repeat: int = 2000) -> float:
    samples: list[int] = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000


def run(p_tps: Iterable[int] = (4, 8), d_tp: int = 8, blocks_per_request: int = 64,
        shape: ModelShape = LLAMA70B) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for p_tp in p_tps:
        local = build(shape, d_tp, 0)
        remotes = {t: build(shape, p_tp, t) for t in targets(0, d_tp, p_tp)}
        plan, plan_s, _ = _measure(partial(plan_rank, local, remotes))
        rank, peer = next(iter(plan.peers.items()))
        laddr = region_addresses(local, [1 << 40])
        raddr = region_addresses(remotes[rank], [1 << 41])
        arrays, cold_s, fast_peak = _measure(partial(_descs, peer, laddr, raddr))
        n = len(arrays[0])
        del arrays
        fast_s = min(_measure(partial(_descs, peer, laddr, raddr))[1] for _ in range(3))
        base, base_s, base_peak = _measure(partial(_baseline_descs, local, laddr, peer))
        assert len(base) == n
        del base
        blocks = rng.choice(shape.num_blocks, blocks_per_request, replace=False)
        req = RequestBlocks.of(blocks_per_request * shape.block_size, [blocks], [blocks])
        fast_us = _per_request_us(partial(request_indices, plan, req))
        regions = len(peer.pieces)
        blist = blocks.tolist()
        base_us = _per_request_us(partial(_baseline_ids, shape, regions, blist), 200)
        rows.append({
            "case": f"P_TP={p_tp} -> D_TP={d_tp}", "descriptors": n, "plan_s": plan_s,
            "arrays_s": fast_s / 2, "arrays_cold_s": cold_s / 2, "baseline_s": base_s, "speedup": base_s / (fast_s / 2),
            "arrays_peak_mib": fast_peak / 2**20 / 2, "baseline_peak_mib": base_peak / 2**20,
            "request_us": fast_us, "baseline_request_us": base_us,
        })
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':<18} {'descs/side':>10} {'plan':>7} {'arrays':>8} {'cold':>7} {'baseline':>9} {'speedup':>8} "
            f"{'peak MiB':>9} {'base MiB':>9} {'req us':>7} {'base us':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['case']:<18} {r['descriptors']:>10} {r['plan_s']*1e3:>5.1f}ms {r['arrays_s']:>7.3f}s "
                     f"{r['arrays_cold_s']:>6.3f}s {r['baseline_s']:>8.3f}s {r['speedup']:>7.1f}x "
                     f"{r['arrays_peak_mib']:>9.1f} {r['baseline_peak_mib']:>9.1f} {r['request_us']:>7.1f} "
                     f"{r['baseline_request_us']:>8.1f}")
    return "\n".join(lines)
