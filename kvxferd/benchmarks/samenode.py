"""`kvxferd bench data --same-node`: a read between two engines of one daemon, by each lane, in one run.

  copy      one daemon with both engines registered: its own memcpy (lane `copy`, copy_threads)
  loop      the same with host_lane = "loop": a READ on its own NIXL agent (UCX, its own memory)
  raw NIXL  a reader and a target process, two agents (UCX's CMA), moving the same engines' pages:
            what two daemons on one host do
  gather    one process gathering the same pages with the copier's number of threads (numpy's
            take, a C loop per row)
  readv     the same pages copied in one process by the copier's own copy (process_vm_readv on
            itself, the same threads) without a daemon around it: what is left is the daemon's
Both baselines copy between memfds, the memory engines share (as kvxferd's copy does).

The prefill's blocks are in a random order, so no two rows of a read are adjacent on both sides
(a cache in use has them scattered; adjacent rows would merge into one copy).

Targets (docs/benchmarks.md): copy >= 1.2x raw NIXL between two agents, >= 0.8x a copy of the
same rows by the same threads (the faster of gather and readv).
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..copier import Copier, copy_runs
from ..memory import create_shm
from .dataplane import through_kvxferd
from .harness import daemons, environment, median


def _memfd_pages(rows: int, page: int, fill: int, name: str) -> tuple[mmap.mmap, np.ndarray]:
    """Pages in a memfd, the memory engines register (shared, not private: no huge pages here)."""
    fd, mm = create_shm(rows * page, name)
    os.close(fd)  # the mapping keeps it
    pages = np.frombuffer(mm, dtype=np.uint8).reshape(rows, page)
    pages[:] = fill
    return mm, pages


def gather(page: int, rows: int, repeats: int, threads: int) -> float:
    """Seconds per gather of `rows` scattered pages into place, `threads` threads each a share."""
    _src_map, src = _memfd_pages(rows, page, 0x5A, "gather-src")
    _dst_map, dst = _memfd_pages(rows, page, 0, "gather-dst")
    order = np.random.default_rng(0).permutation(rows)
    parts = [p for p in np.array_split(np.arange(rows), threads) if len(p)]
    times: list[float] = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.take(src, order[p], axis=0, out=dst[p[0]:p[-1] + 1]), parts))
            times.append(time.perf_counter() - t0)
    return median(times)


def readv(page: int, rows: int, repeats: int, threads: int) -> float:
    """Seconds per copy of `rows` scattered pages by the copier's own copy function, `threads`
    threads each a share of the rows, in this process."""
    _src_map, src = _memfd_pages(rows, page, 0x5A, "readv-src")
    _dst_map, dst = _memfd_pages(rows, page, 0, "readv-dst")
    order = np.random.default_rng(0).permutation(rows)
    to = dst.ctypes.data + np.arange(rows, dtype=np.int64) * page
    start = src.ctypes.data + order.astype(np.int64) * page
    length = np.full(rows, page, dtype=np.int64)
    parts = [p for p in np.array_split(np.arange(rows), threads) if len(p)]
    times: list[float] = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda p: copy_runs(to[p], start[p], length[p]), parts))
            times.append(time.perf_counter() - t0)
    if not np.array_equal(dst, src[order]):
        raise RuntimeError("readv baseline: the pages did not arrive")
    return median(times)


def run(page_sizes: Iterable[int], total_mib: int = 64, repeats: int = 10, rounds: int = 5) -> list[dict[str, Any]]:
    """Medians over `rounds` alternating runs of each lane; raw NIXL over the same pages, before
    the copy lane in odd rounds and after it in even ones."""
    rows: list[dict[str, Any]] = []
    nbytes = total_mib << 20
    threads = Copier().threads  # the copier's default, as the daemons run it
    for page in page_sizes:
        n = nbytes // (2 * page)
        copy: list[float] = []
        loop: list[float] = []
        raw: list[float] = []
        with ExitStack() as stack:
            with environment({"KVXFERD_HOST_LANE": "copy"}):
                copying = stack.enter_context(daemons(1))[0].socket
            with environment({"KVXFERD_HOST_LANE": "loop"}):
                looping = stack.enter_context(daemons(1))[0].socket
            for i in range(rounds):
                stream = through_kvxferd([copying, copying], page, n, repeats, raw_first=i % 2 == 1, scatter=True,
                                         lane="copy")
                copy += stream.times
                raw += stream.raw_times
                loop += through_kvxferd([looping, looping], page, n, repeats, scatter=True, lane="loop").times
        c, lo, r = median(copy), median(loop), median(raw)
        g = gather(page, 2 * n, repeats * rounds, threads)
        rv = readv(page, 2 * n, repeats * rounds, threads)
        rows.append({"page_kib": page >> 10, "descriptors": 2 * n, "mib": total_mib, "rounds": rounds,
                     "threads": threads, "copy_gb_s": nbytes / c / 1e9, "loop_gb_s": nbytes / lo / 1e9,
                     "raw_nixl_gb_s": nbytes / r / 1e9, "gather_gb_s": nbytes / g / 1e9,
                     "readv_gb_s": nbytes / rv / 1e9,
                     "copy_over_raw": r / c, "loop_over_raw": r / lo, "copy_of_memcpy": min(g, rv) / c,
                     "copy_ms": c * 1e3, "loop_ms": lo * 1e3, "raw_ms": r * 1e3, "gather_ms": g * 1e3,
                     "readv_ms": rv * 1e3})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'page':>8} {'descs':>6} {'copy':>7} {'loop':>7} {'raw NIXL':>9} {'gather':>7} {'readv':>7} "
             f"{'copy/':>7} {'loop/':>7} {'copy/':>7}",
             f"{'':>8} {'':>6} {'GB/s':>7} {'GB/s':>7} {'2 agents':>9} {'GB/s':>7} {'GB/s':>7} {'raw':>7} "
             f"{'raw':>7} {'memcpy':>7}"]
    for r in rows:
        lines.append(f"{r['page_kib']:>5}KiB {r['descriptors']:>6} {r['copy_gb_s']:>7.2f} {r['loop_gb_s']:>7.2f} "
                     f"{r['raw_nixl_gb_s']:>9.2f} {r['gather_gb_s']:>7.2f} {r['readv_gb_s']:>7.2f} "
                     f"{r['copy_over_raw']:>7.2f} {r['loop_over_raw']:>7.2f} {r['copy_of_memcpy']:>7.2f}")
    if rows:
        r = rows[0]
        lines.append(f"({r['mib']} MiB a read, pages scattered, {r['rounds']} rounds; copy, gather and readv with "
                     f"{r['threads']} threads; read call -> completion in the engine; copy/memcpy: against the "
                     f"faster of gather and readv)")
    return "\n".join(lines)
