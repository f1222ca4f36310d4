"""`kvxferd bench integrity`: what the KV integrity audit costs.

Digesting: GB/s of `integrity.digest_rows` over a rank's blocks (the rows a hold digests),
against a memcpy of the same bytes in the same run. Per request, through two daemons: the
hold RPC with and without digests, and read call -> `received` with and without the audit,
alternating so both see the same machine.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import integrity
from ..client import RemoteRef
from ..memory import Mapping
from ..plan.models import build
from .dataplane import memcpy, shape_for
from .harness import BenchEngine, daemons, median

PAGE = 64 << 10  # bytes per block: a 64 KiB KV page per layer


def digest_rate(nbytes: int, repeats: int) -> dict[str, float]:
    """Digest GB/s over the rows of `nbytes` of blocks, and memcpy GB/s of as many bytes."""
    blocks = nbytes // PAGE
    geo = build(shape_for(PAGE, blocks), 1, 0)
    buf = np.full(geo.buffers[0], 0x5A, dtype=np.uint8)
    m = Mapping("DRAM", buf.ctypes.data, len(buf), 0, buf)
    region_addr = np.array([m.address + r.offset for r in geo.regions], dtype=np.int64)
    rows, _, _ = integrity.block_rows(geo, region_addr, [list(range(blocks))])
    total = int(rows[:, 1].sum())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        integrity.digest_rows([m], rows)
        times.append(time.perf_counter() - t0)
    return {"bytes": total, "digest_gb_s": total / median(times) / 1e9,
            "memcpy_gb_s": total / memcpy(total, repeats) / 1e9}


def per_request(sockets: list[str], mib: int, repeats: int) -> dict[str, float]:
    n = (mib << 20) // PAGE
    geo = build(shape_for(PAGE, n), 1, 0)
    p = BenchEngine(sockets[0], f"p{mib}", geo)
    d = BenchEngine(sockets[1], f"d{mib}", geo)
    hold: dict[bool, list[float]] = {False: [], True: []}
    read: dict[bool, list[float]] = {False: [], True: []}
    try:
        host, port = p.side_channel.rsplit(":", 1)
        blocks = [list(range(n))]
        for i in range(2 * repeats + 2):
            audit = bool(i % 2)
            rid = f"r{i}"
            t0 = time.perf_counter()
            p.client.hold(rid, 60.0, blocks, digest=audit)
            held = time.perf_counter() - t0
            t0 = time.perf_counter()
            d.client.read(rid, RemoteRef(f"p{mib}", host, int(port), 1, rid), n * 16, blocks, blocks,
                          deadline_s=120, audit=audit)
            c = d.wait(rid)
            elapsed = time.perf_counter() - t0
            assert c.status == "received", c
            assert p.wait(rid).status == "sent"
            if i >= 2:  # the first of each kind pays the handshake and descriptor preparation
                hold[audit].append(held)
                read[audit].append(elapsed)
    finally:
        d.close()
        p.close()
    plain, audited = median(read[False]), median(read[True])
    return {"mib": mib, "read_ms": plain * 1e3, "audited_read_ms": audited * 1e3,
            "added_ms": (audited - plain) * 1e3, "ratio": audited / plain,
            "hold_ms": median(hold[False]) * 1e3, "digesting_hold_ms": median(hold[True]) * 1e3}


def run(sizes_mib: list[int], repeats: int = 7) -> dict[str, Any]:
    rate = digest_rate(64 << 20, repeats)
    with daemons(2) as procs:
        rows = [per_request([d.socket for d in procs], mib, repeats) for mib in sizes_mib]
    return {"digest": rate, "requests": rows}


def render(result: dict[str, Any]) -> str:
    r = result["digest"]
    out = [f"digest: {r['digest_gb_s']:.2f} GB/s over {r['bytes'] >> 20} MiB of 64 KiB rows "
           f"(memcpy of the same bytes: {r['memcpy_gb_s']:.2f} GB/s, ratio {r['digest_gb_s'] / r['memcpy_gb_s']:.2f})",
           "", "  MiB  read ms  audited ms  added ms  ratio  hold ms  digesting hold ms"]
    for row in result["requests"]:
        out.append(f"{row['mib']:>5}  {row['read_ms']:>7.2f}  {row['audited_read_ms']:>10.2f}  "
                   f"{row['added_ms']:>8.2f}  {row['ratio']:>5.2f}  {row['hold_ms']:>7.2f}  "
                   f"{row['digesting_hold_ms']:>17.2f}")
    return "\n".join(out)
