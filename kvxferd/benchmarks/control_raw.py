"""The control path's ceiling on this machine: raw NIXL posting the control bench's reads.

A reader process and a target process drive nixl._api directly, configured as kvxferd's agents
are (UCX, no progress thread). The target progresses as a prefill daemon that holds requests
does (every millisecond); the reader keeps `concurrency` READs in flight, each the same 64
descriptors a 16-block read of `control.SHAPE` names (2 layers, K and V, one 2 KiB page per
block and region), with a notification as kvxferd sends one, and polls their states in a loop.

What kvxferd adds to this is everything between an engine's read RPC and NIXL: the RPC, the
request's checks and descriptor ids, the lease claim, the completion and its delivery.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..memory import create_shm
from .harness import pct

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

PAGE = 2 << 10  # control.SHAPE's page: 16 tokens x 1 head x 64 x bf16
REGIONS = 4  # 2 layers, K and V
BLOCKS_PER_REGION = 8192
BLOCKS = 16  # per read


def read_ids(slot: int) -> np.ndarray:
    """The 64 descriptor ids of one read: its slot's 16 blocks in every region."""
    blocks = np.arange(slot * BLOCKS, (slot + 1) * BLOCKS, dtype=np.int32)
    return (np.arange(REGIONS, dtype=np.int32)[:, None] * BLOCKS_PER_REGION + blocks).ravel()


def _side(role: str, q_out: Queue[tuple[Any, int]], q_in: Queue[tuple[Any, int]], results: Queue[Any],
          concurrency: int, requests: int) -> None:
    from ..nixl_driver import nixl_api

    api = nixl_api()
    agent = api.nixl_agent(f"rawctl-{role}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    size = REGIONS * BLOCKS_PER_REGION * PAGE
    fd, mm = create_shm(size, f"rawctl-{role}")
    os.close(fd)  # the mapping keeps it
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[:] = 0x5A
    addr = buf.ctypes.data
    agent.register_memory(agent.get_reg_descs([(addr, size, 0, "")], "DRAM"), "DRAM")
    q_out.put((agent.get_agent_metadata(), addr))
    meta, raddr = q_in.get()
    if role != "reader":
        while True:  # progress as a daemon holding requests does, until the reader is done
            agent.get_new_notifs()
            try:
                results.get(timeout=0.001)
                return
            except queue.Empty:
                pass
    offs = np.arange(REGIONS * BLOCKS_PER_REGION, dtype=np.int64) * PAGE
    n = len(offs)

    def rows(base: int) -> np.ndarray:
        return np.stack([base + offs, np.full(n, PAGE), np.zeros(n, dtype=np.int64)], 1)

    peer = agent.add_remote_agent(meta)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(rows(addr), "DRAM"), "DRAM")
    remote = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(rows(raddr), "DRAM"), "DRAM")
    ids = [read_ids(slot) for slot in range(concurrency)]
    while True:  # the first READ may find the connection still coming up
        try:
            h = agent.make_prepped_xfer("READ", local, ids[0], remote, ids[0], b"warm")
            agent.transfer(h)
            break
        except Exception:
            time.sleep(0.01)
    while agent.check_xfer_state(h) != "DONE":
        pass
    agent.release_xfer_handle(h)

    posts: list[float] = []
    latencies: list[float] = []
    in_flight: list[tuple[Any, int, float]] = []  # (handle, slot, posted at)
    free = list(range(concurrency))
    sent = 0
    t0 = time.perf_counter()
    while sent < requests or in_flight:
        while free and sent < requests:
            slot = free.pop()
            a = time.perf_counter()
            h = agent.make_prepped_xfer("READ", local, ids[slot], remote, ids[slot], f"r{sent}".encode())
            agent.transfer(h)
            posts.append(time.perf_counter() - a)
            in_flight.append((h, slot, a))
            sent += 1
        still = []
        for h, slot, a in in_flight:
            if agent.check_xfer_state(h) == "DONE":
                latencies.append(time.perf_counter() - a)
                agent.release_xfer_handle(h)
                free.append(slot)
            else:
                still.append((h, slot, a))
        in_flight = still
    elapsed = time.perf_counter() - t0
    results.put({"req_per_s": requests / elapsed, "post_p50_us": pct(posts, 50) * 1e6,
                 "post_p99_us": pct(posts, 99) * 1e6, "done_p50_us": pct(latencies, 50) * 1e6,
                 "done_p99_us": pct(latencies, 99) * 1e6})


def run(concurrency: int, requests: int) -> dict[str, float]:
    """Raw NIXL's reads/s, post-call and post -> DONE latency for the control bench's reads."""
    ctx = mp.get_context("spawn")
    a: Queue[tuple[Any, int]] = ctx.Queue()
    b: Queue[tuple[Any, int]] = ctx.Queue()
    results: Queue[Any] = ctx.Queue()
    done: Queue[None] = ctx.Queue()
    reader = ctx.Process(target=_side, args=("reader", a, b, results, concurrency, requests))
    target = ctx.Process(target=_side, args=("target", b, a, done, concurrency, requests))
    reader.start()
    target.start()
    try:
        out: dict[str, float] = results.get(timeout=300)
    finally:
        done.put(None)
        reader.join(10)
        target.join(10)
    return out
