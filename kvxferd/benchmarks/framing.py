"""`kvxferd bench framing`: a read's block lists on the wire, protocol 7's msgpack ints against
protocol 8's packed ids (PACK_MIN_IDS ids and more), for a 70B-class layout at TP 8: what the
engine pays to build and encode the frame, and what the daemon pays from the frame to the
descriptor ids it posts. The four timings alternate call by call, so a machine that speeds up
or slows down meanwhile moves all four alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .. import protocol as P
from ..client import PACK_MIN_IDS, Requests
from ..plan.descriptors import RequestBlocks, request_reads
from ..plan.models import ModelShape, build
from ..plan.planner import plan_rank
from .plan import LLAMA70B


def run(block_counts: Iterable[int] = (16, 64, 256, 2048, 16384), shape: ModelShape = LLAMA70B
        ) -> list[dict[str, Any]]:
    """Per read of n blocks (TP 8 -> 8): the engine's `Requests.read` and encoding, and the
    daemon's decoding, block arrays and descriptor ids, with each protocol's block lists."""
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


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["a read's block lists, protocol 7 (msgpack ints) against 8 (packed from "
             f"{PACK_MIN_IDS} ids), median us per read:",
             f"{'blocks':>7} {'engine p7':>10} {'engine p8':>10} {'p8/p7':>6} {'daemon p7':>10} {'daemon p8':>10} "
             f"{'p8/p7':>6} {'frame p7':>9} {'frame p8':>9}"]
    for r in rows:
        lines.append(f"{r['blocks']:>7} {r['engine_us_7']:>10.1f} {r['engine_us_8']:>10.1f} "
                     f"{r['engine_us_8'] / r['engine_us_7']:>6.2f} {r['daemon_us_7']:>10.1f} {r['daemon_us_8']:>10.1f} "
                     f"{r['daemon_us_8'] / r['daemon_us_7']:>6.2f} {r['frame_bytes_7']:>9} {r['frame_bytes_8']:>9}")
    return "\n".join(lines)
