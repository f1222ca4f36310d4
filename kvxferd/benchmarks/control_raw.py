"""The control path's ceiling on this machine: raw NIXL posting the control bench's reads.

A reader process and a target process drive nixl._api directly, configured as kvxferd's agents
are (UCX, no progress thread). The target progresses without pause, as a prefill daemon does
under traffic (it spins `spin_s` after every hold, claim and notification): a READ of its memory
completes with the target's progress (measured: with a target ticking every millisecond
instead, one read's post -> DONE is ~1.2 ms against ~80 us, and one in flight reads ~500/s
against ~11,000). The reader keeps
`concurrency` READs in flight, each the same 64 descriptors a 16-block read of `control.SHAPE`
names (2 layers, K and V, one 2 KiB page per block and region), with a notification as kvxferd
sends one, and polls their states in a loop.

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


MAX_CONCURRENCY = BLOCKS_PER_REGION // BLOCKS  # a slot of blocks per read in flight
SETUP_S = 120.0  # the other side's metadata, the first READ: a side that dies must not hang the other
RUN_S = 600.0  # the whole run


class RawError(Exception):
    """The raw baseline could not run (NIXL refused, a side died)."""


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
    meta, raddr = q_in.get(timeout=SETUP_S)
    if role != "reader":
        parent = os.getppid()
        while os.getppid() == parent:  # a parent killed before its `finally` must not leave a core spinning
            for _ in range(256):  # progress without pause, as a daemon under traffic does
                agent.get_new_notifs()
            try:
                results.get_nowait()  # the reader is done
                return
            except queue.Empty:
                pass
        return
    offs = np.arange(REGIONS * BLOCKS_PER_REGION, dtype=np.int64) * PAGE
    n = len(offs)

    def rows(base: int) -> np.ndarray:
        return np.stack([base + offs, np.full(n, PAGE), np.zeros(n, dtype=np.int64)], 1)

    peer = agent.add_remote_agent(meta)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(rows(addr), "DRAM"), "DRAM")
    remote = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(rows(raddr), "DRAM"), "DRAM")
    ids = [read_ids(slot) for slot in range(concurrency)]
    give_up = time.monotonic() + SETUP_S
    while True:  # the first READ may find the connection still coming up
        try:
            h = agent.make_prepped_xfer("READ", local, ids[0], remote, ids[0], b"warm")
            agent.transfer(h)
            break
        except Exception as exc:
            if time.monotonic() > give_up:
                raise RawError(f"no READ could be posted within {SETUP_S:g} s: {exc}") from exc
            time.sleep(0.01)
    while not _done(agent, h):
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
            if _done(agent, h):
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


def _done(agent: Any, handle: Any) -> bool:
    state = agent.check_xfer_state(handle)
    if state not in ("DONE", "PROC"):
        raise RawError(f"a raw READ ended {state}")
    return bool(state == "DONE")


def run(concurrency: int, requests: int) -> dict[str, float]:
    """Raw NIXL's reads/s, post-call and post -> DONE latency for the control bench's reads."""
    if not 0 < concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency} outside 1..{MAX_CONCURRENCY} (a slot of blocks per read)")
    ctx = mp.get_context("spawn")
    a: Queue[tuple[Any, int]] = ctx.Queue()
    b: Queue[tuple[Any, int]] = ctx.Queue()
    results: Queue[Any] = ctx.Queue()
    done: Queue[None] = ctx.Queue()
    reader = ctx.Process(target=_side, args=("reader", a, b, results, concurrency, requests))
    target = ctx.Process(target=_side, args=("target", b, a, done, concurrency, requests))
    reader.start()
    target.start()
    give_up = time.monotonic() + RUN_S
    try:
        while True:  # a side that died or hangs ends the wait (a traceback is on stderr)
            try:
                out: dict[str, float] = results.get(timeout=1.0)
                return out
            except queue.Empty:
                if reader.exitcode is not None or target.exitcode is not None:
                    try:  # the reader may have put its result and exited since the get timed out
                        return results.get(timeout=1.0)
                    except queue.Empty:
                        raise RawError(f"raw NIXL baseline: reader exited {reader.exitcode}, "
                                       f"target {target.exitcode}") from None
                if time.monotonic() > give_up:
                    raise RawError(f"raw NIXL baseline: no result within {RUN_S:g} s") from None
    finally:
        done.put(None)
        for proc in (reader, target):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
