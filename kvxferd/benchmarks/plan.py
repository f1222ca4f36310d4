"""`kvxferd bench plan`: descriptor arrays and per-request indices for a 70B-class layout.

Both sides of every figure come from the same run: the vectorized planner against the
obvious baseline (a Python list of (addr, len, dev) tuples, ids by list comprehension).

`framing`: a read's block lists on the wire, protocol 7's msgpack ints against protocol 8's
packed ids: what the engine pays to build the frame, and what the daemon pays from the frame
to the descriptor ids it posts.
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

from .. import protocol as P
from ..client import PACK_MIN_IDS, Requests
from ..plan.descriptors import (
    RequestBlocks,
    local_descs,
    region_addresses,
    remote_descs,
    request_indices,
    request_reads,
)
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


def framing(block_counts: Iterable[int] = (16, 64, 256, 2048, 16384), shape: ModelShape = LLAMA70B
            ) -> list[dict[str, Any]]:
    """Per read of n blocks (TP 8 -> 8): the engine's `Requests.read` and encoding, and the
    daemon's decoding, block arrays and descriptor ids, with each protocol's block lists. The
    four timings alternate call by call, so a machine that speeds up or slows down meanwhile
    moves all four alike."""
    geo = build(shape, 8, 0)
    plan = plan_rank(geo, {0: geo})
    ref = P.RemoteRef("p", "127.0.0.1", 5555, 8, "r")
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for n in block_counts:
        blocks = rng.choice(shape.num_blocks, n, replace=False).tolist()
        calls: dict[str, Callable[[], object]] = {}
        row: dict[str, Any] = {"blocks": n}
        for version in (7, 8):
            req = Requests("d", 0, 8, version)

            def engine(req: Requests = req, n: int = n, blocks: list[int] = blocks) -> bytes:
                return P.encoder.encode(req.read("r", ref, n * shape.block_size, [blocks], [blocks], 30.0))

            frame = engine()

            def daemon(frame: bytes = frame) -> None:
                msg = P.request_decoder.decode(frame)
                assert isinstance(msg, P.Read)
                P.check_blocks(msg.local_blocks)  # as Reads.check, then Reads.start
                P.check_blocks(msg.remote_blocks)
                rb = RequestBlocks(msg.num_tokens, P.block_arrays(msg.local_blocks), P.block_arrays(msg.remote_blocks))
                for _ in request_reads(plan, rb):
                    pass

            calls[f"engine_us_{version}"], calls[f"daemon_us_{version}"] = engine, daemon
            row[f"frame_bytes_{version}"] = len(frame)
        samples: dict[str, list[int]] = {k: [] for k in calls}
        for _ in range(max(50, min(2000, 200_000 // n))):
            for key, fn in calls.items():
                t0 = time.perf_counter_ns()
                fn()
                samples[key].append(time.perf_counter_ns() - t0)
        row.update({key: statistics.median(ns) / 1000 for key, ns in samples.items()})
        rows.append(row)
    return rows


def render_framing(rows: list[dict[str, Any]]) -> str:
    lines = ["a read's block lists, protocol 7 (msgpack ints) against 8 (packed from "
             f"{PACK_MIN_IDS} ids), median us per read:",
             f"{'blocks':>7} {'engine p7':>10} {'engine p8':>10} {'p8/p7':>6} {'daemon p7':>10} {'daemon p8':>10} "
             f"{'p8/p7':>6} {'frame p7':>9} {'frame p8':>9}"]
    for r in rows:
        lines.append(f"{r['blocks']:>7} {r['engine_us_7']:>10.1f} {r['engine_us_8']:>10.1f} "
                     f"{r['engine_us_8'] / r['engine_us_7']:>6.2f} {r['daemon_us_7']:>10.1f} {r['daemon_us_8']:>10.1f} "
                     f"{r['daemon_us_8'] / r['daemon_us_7']:>6.2f} {r['frame_bytes_7']:>9} {r['frame_bytes_8']:>9}")
    return "\n".join(lines)
