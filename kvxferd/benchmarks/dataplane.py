"""`kvxferd bench data`: one descriptor workload moved several ways in one run.

  kvxferd   engine -> RPC -> decode daemon -> NIXL READ from the prefill daemon's agent, posted
            whole (lanes off: one stream, what raw NIXL does)
  raw NIXL  a reader process and a target process driving nixl._api directly, configured as
            kvxferd configures its agent (no NIXL progress thread; the target progresses
            every millisecond, the reader busy-polls its transfer). Parity is judged against
            raw NIXL moving the same pages, between the same two engines' memfds, alternating
            with kvxferd: on a VM a copy's speed depends on where its pages landed (the same
            READ between two fresh allocations scatters by +-15% here), so memory of the raw
            sides' own is a baseline of other pages (still shown: "own pgs").
  lanes     kvxferd with 2 posting lanes (`lanes = 2`): a read this large split across them
  memcpy    one process copying the same bytes, with 1 and 2 threads (this machine's limits)

`--device cuda-vmm` moves GPU memory instead (engines' KV caches as CUDA VMM allocations; the
copy baseline is a device-to-device cuMemcpy).

Workload per page size: one layer, K and V regions, `total_mib` per request in pages of that
size (HND, one KV head whose page is exactly the page size), TP 1 -> 1.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..client import Client, RemoteRef
from ..memory import create_shm
from ..plan.models import ModelShape, build
from .harness import BenchEngine, daemons, environment, median

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
_engine_pairs = itertools.count()  # through_kvxferd's, numbered


def shape_for(page: int, blocks: int) -> ModelShape:
    return ModelShape(layers=1, kv_heads=1, head_dim=page // 32, block_size=16, num_blocks=blocks)


def _raw_memory(role: str, page: int, n: int, device: str, shared: list[tuple[str, int]] | None) -> tuple[
        Any, list[tuple[int, int]], str]:
    """A raw side's memory: (what keeps it alive, its buffers as (address, bytes), NIXL's kind).
    `shared`: an engine's memfds, as /proc paths, mapped instead of memory of its own (the same
    pages kvxferd moves): the target's read-only; the reader's writable unless the daemon sealed
    them against new writers (memory.map_shm), and then a memfd of its own of the same size."""
    size = 2 * n * page
    if device == "cuda-vmm":
        from ..memory import VmmBuffer
        vmm = VmmBuffer(size)
        return vmm, [(vmm.address, size)], "VRAM"
    maps = []
    writable = role == "reader"
    try:
        for path, nbytes in shared or []:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
            try:
                maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                      mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
            finally:
                os.close(fd)
    except PermissionError:  # sealed by the daemon that maps them
        maps = []
    if not maps:
        fd, mm = create_shm(size, f"raw-{role}")  # memory of the kind engines register (a memfd)
        os.close(fd)  # the mapping keeps it
        np.frombuffer(mm, dtype=np.uint8)[:] = 0x5A
        maps = [mm]
    return maps, [(np.frombuffer(mm, dtype=np.uint8).ctypes.data, len(mm)) for mm in maps], "DRAM"


def _page_rows(buffers: list[tuple[int, int]], page: int) -> np.ndarray:
    """Every buffer, in order, as (address, page, device 0) descriptor rows."""
    rows = [np.stack([addr + np.arange(nbytes // page, dtype=np.int64) * page,
                      np.full(nbytes // page, page, dtype=np.int64),
                      np.zeros(nbytes // page, dtype=np.int64)], 1) for addr, nbytes in buffers]
    return np.concatenate(rows)


def _raw_side(role: str, q_out: Queue[tuple[Any, np.ndarray]], q_in: Queue[tuple[Any, np.ndarray]],
              commands: Queue[int | None], results: Queue[Any], page: int, n: int, device: str,
              agents: int = 1, shared: list[tuple[str, int]] | None = None) -> None:
    """One NIXL agent (the reader: `agents` of them, each reading its slice from its own
    thread). q_out/q_in: (agent metadata, descriptor rows). The reader reads every page of the
    target's buffers into its own, `k` times per command `k`, and puts (seconds post -> DONE,
    seconds in the slowest post call) per READ in `results`; None ends both sides."""

    from ..nixl_driver import nixl_api

    api = nixl_api()
    agent = api.nixl_agent(f"raw-{role}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    keep, buffers, mem = _raw_memory(role, page, n, device, shared)

    def register(a: Any) -> None:
        for addr, nbytes in buffers:
            a.register_memory(a.get_reg_descs([(addr, nbytes, 0, "")], mem), mem)

    register(agent)
    local = _page_rows(buffers, page)
    q_out.put((agent.get_agent_metadata(), local))
    meta, remote = q_in.get()
    if role != "reader":
        import queue

        while True:  # progress like an idle daemon until the reader is done
            agent.get_new_notifs()
            try:
                commands.get(timeout=0.001)
                return
            except queue.Empty:
                pass
    readers = [agent] + [api.nixl_agent(f"raw-reader{k}", api.nixl_agent_config(enable_prog_thread=False,
                                                                                 backends=["UCX"]))
                         for k in range(1, agents)]
    for extra in readers[1:]:
        register(extra)
    lists = []
    for a in readers:
        peer = a.add_remote_agent(meta)
        lists.append((a, a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(local, mem), mem),
                      a.prep_xfer_dlist(peer, a.get_xfer_descs(remote, mem), mem)))
    slices = np.array_split(np.arange(len(local), dtype=np.int32), agents)

    def read(k: int) -> float:
        """One agent's slice, posted and polled to DONE; returns the post call's seconds."""
        a, lh, rh = lists[k]
        t0 = time.perf_counter()
        while True:
            try:
                h = a.make_prepped_xfer("READ", lh, slices[k], rh, slices[k], b"x")
                a.transfer(h)
                break
            except Exception:  # the connection may still be coming up on the first READ
                time.sleep(0.01)
        posted = time.perf_counter() - t0
        while a.check_xfer_state(h) != "DONE":
            pass
        a.release_xfer_handle(h)
        return posted

    with ThreadPoolExecutor(agents) as pool:
        while (count := commands.get()) is not None:
            times: list[float] = []
            posts: list[float] = []
            for _ in range(count):
                t0 = time.perf_counter()
                posts.append(read(0) if agents == 1 else max(pool.map(read, range(agents))))
                times.append(time.perf_counter() - t0)
            results.put((times, posts))
    del keep


# A process busy 0.4 ms of every 1 ms: about what the prefill daemon and the engine cost beside
# kvxferd's copy on this 2-core machine (the prefill daemon ticks NIXL each millisecond while it
# holds, and spins briefly after each hold, claim and notification).
NEIGHBOUR = ("import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < 0.0004: pass\n"
             " time.sleep(0.0006)\n")


class RawPair:
    """A raw NIXL reader and target, each a process of its own, reading `2 n` pages of `page`
    bytes per READ: from memory of their own, or (`memory`: the prefill engine's and the decode
    engine's memfds) the very pages kvxferd moves between those engines."""

    def __init__(self, page: int, n: int, device: str = "cpu", agents: int = 1,
                 memory: tuple[list[tuple[str, int]], list[tuple[str, int]]] | None = None) -> None:
        ctx = mp.get_context("spawn")
        a: Queue[tuple[Any, np.ndarray]] = ctx.Queue()
        b: Queue[tuple[Any, np.ndarray]] = ctx.Queue()
        self.commands: Queue[int | None] = ctx.Queue()
        self.stop_target: Queue[int | None] = ctx.Queue()
        self.results: Queue[tuple[list[float], list[float]]] = ctx.Queue()
        target_memory, reader_memory = memory or (None, None)
        self.reader = ctx.Process(target=_raw_side, args=("reader", a, b, self.commands, self.results, page, n,
                                                          device, agents, reader_memory), daemon=True)
        self.target = ctx.Process(target=_raw_side, args=("target", b, a, self.stop_target, None, page, n,
                                                          device, 1, target_memory), daemon=True)
        try:
            self.reader.start()
            self.target.start()
            self.reads(2)  # the first READs bring the connection up
        except BaseException:
            self.close()
            raise

    def reads(self, count: int, timeout_s: float = 300.0) -> tuple[list[float], list[float]]:
        """Per READ: (seconds from post to DONE, seconds in the (slowest) post call alone).
        RuntimeError when a side died or nothing came back within `timeout_s`."""
        import queue

        self.commands.put(count)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in (self.reader, self.target) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"raw NIXL baseline: {', '.join(dead)} exited") from None
        raise RuntimeError(f"raw NIXL baseline: no READs back within {timeout_s:g} s")

    def close(self) -> None:
        self.commands.put(None)
        self.stop_target.put(None)
        for p in (self.reader, self.target):
            if p.pid is None:  # never started (a failed start): nothing to end
                continue
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def raw_nixl(page: int, n: int, repeats: int, device: str = "cpu", agents: int = 1,
             neighbour: bool = False) -> tuple[list[float], list[float]]:
    """Per READ, `repeats` of them between memory of the raw sides' own: (seconds from post to
    DONE, seconds in the (slowest) post call alone). `neighbour`: with a process busy 0.4 ms of
    every 1 ms beside it (NEIGHBOUR)."""
    busy = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if neighbour else None
    try:
        pair = RawPair(page, n, device, agents)
        try:
            return pair.reads(repeats)
        finally:
            pair.close()
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def memcpy(nbytes: int, repeats: int, device: str = "cpu", threads: int = 1) -> float:
    """Seconds per copy of `nbytes`; on the CPU with `threads` threads, each copying its share
    (numpy releases the GIL while it copies)."""
    if device == "cuda-vmm":  # device-to-device copy between two allocations
        from ..memory import VmmBuffer, _check, _cu
        cu = _cu()
        src_vmm, dst_vmm = VmmBuffer(nbytes), VmmBuffer(nbytes)
        times: list[float] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _check(cu.cuMemcpyDtoD(dst_vmm.address, src_vmm.address, nbytes), "cuMemcpyDtoD")
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            times.append(time.perf_counter() - t0)
        return median(times)
    src = np.full(nbytes, 0x5A, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0
    parts = list(zip(np.array_split(src, threads), np.array_split(dst, threads)))
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda p: np.copyto(p[1], p[0]), parts))
            times.append(time.perf_counter() - t0)
    return median(times)


class Stream(NamedTuple):
    """One engine pair's requests through kvxferd, and raw NIXL's over the same memory."""

    times: list[float]  # read call -> completion in the engine
    acks: list[float]  # read call -> its `ok` reply
    raw_times: list[float]  # raw NIXL over the engines' own pages: post -> DONE
    raw_posts: list[float]  # the post call alone


def through_kvxferd(sockets: list[str], page: int, n: int, repeats: int, device: str = "cpu",
                    raw_first: bool | None = None, announce: bool = True, scatter: bool = False,
                    lane: str = "") -> Stream:
    """`repeats` requests through kvxferd. The decode engine learns of completions from its
    doorbell's records, and announces each read `ANNOUNCE_S` before it (`announce`), as the vLLM
    worker does (its prefill's holds are then vouched for before the READ ends, docs/reliability.md;
    unannounced, each read's lease claim travels with it). `raw_first` True / False: also `repeats` raw
    NIXL READs between the same two engines' memory, before / after kvxferd's (the speed of a
    copy on this VM depends on the pages it lands on: only the same pages compare the two).
    `scatter`: the prefill's blocks in a random order (no two of a read's pages adjacent on both
    sides, as a cache in use has them), not 0..n-1 on both sides. `lane`: the lane the route must
    have taken (RuntimeError otherwise: the figures would be another path's)."""
    shape = shape_for(page, n)
    # Each round's engines are new engines, with ids of their own (as vLLM's are at each start):
    # a registration under an id a daemon served before is a restart, its routes retired.
    engines = next(_engine_pairs)
    prefill_id = f"p{page}-{engines}"
    keep = raw_first is not None
    p = BenchEngine(sockets[0], prefill_id, build(shape, 1, 0), device=device, keep_fds=keep)
    d = BenchEngine(sockets[1], f"d{page}-{engines}", build(shape, 1, 0), device=device, doorbell="records",
                    keep_fds=keep)

    def raw_reads() -> tuple[list[float], list[float]]:
        """Its processes live only around their READs: the target's progress would weigh on kvxferd's."""
        pair = RawPair(page, n, device, memory=(p.memfds(), d.memfds()))
        try:
            return pair.reads(repeats)
        finally:
            pair.close()

    try:
        raw_times, raw_posts = raw_reads() if raw_first else ([], [])
        host, port = p.side_channel.rsplit(":", 1)
        blocks = [list(range(n))]
        held = [np.random.default_rng(engines).permutation(n).tolist()] if scatter else blocks
        times: list[float] = []
        acks: list[float] = []
        for i in range(repeats + 2):
            remote = RemoteRef(prefill_id, host, int(port), 1, f"r{i}")
            p.client.hold(f"r{i}", 300.0, held)  # what a prefill does first (untimed)
            if announce:  # as the request reaches the decode's scheduler, before its read (untimed)
                d.client.expect(f"r{i}", remote)
                time.sleep(ANNOUNCE_S)
            t0 = time.perf_counter()
            d.client.read(f"r{i}", remote, n * 16, blocks, held, deadline_s=120)
            ack = time.perf_counter() - t0
            c = d.wait(f"r{i}")
            elapsed = time.perf_counter() - t0
            assert c.status == "received", c
            if i >= 2:  # the first reads include the handshake and descriptor preparation
                times.append(elapsed)
                acks.append(ack)
        if lane:
            with Client(sockets[1]) as client:
                lanes = [peer.lanes for peer in client.status().peers if peer.engine == prefill_id]
            if lanes != [[lane]]:
                raise RuntimeError(f"the reads took lanes {lanes}, not {lane}")
        if raw_first is False:
            raw_times, raw_posts = raw_reads()
        return Stream(times, acks, raw_times, raw_posts)
    finally:
        d.close()
        p.close()


def small_reads_meanwhile(sockets: list[str], page: int, n: int, repeats: int) -> list[float]:
    """Seconds from read call to completion of a one-block read by a second engine on the same
    decode daemon, issued 1 ms after a large read (`n` blocks) of the first engine was sent."""
    shape, small = shape_for(page, n), shape_for(page, 16)
    p = BenchEngine(sockets[0], "pbig", build(shape, 1, 0))
    ps = BenchEngine(sockets[0], "psmall", build(small, 1, 0))
    d = BenchEngine(sockets[1], "dbig", build(shape, 1, 0))
    ds = BenchEngine(sockets[1], "dsmall", build(small, 1, 0))
    try:
        host, port = p.side_channel.rsplit(":", 1)
        big, one = [list(range(n))], [[0]]
        latencies: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            for i in range(repeats + 2):
                p.client.hold(f"b{i}", 300.0, big)
                ps.client.hold(f"s{i}", 300.0, one)

                def large(i: int = i) -> str:
                    d.client.read(f"b{i}", RemoteRef("pbig", host, int(port), 1, f"b{i}"), n * 16, big, big, 120)
                    return d.wait(f"b{i}").status
                pending = pool.submit(large)
                time.sleep(0.001)
                t0 = time.perf_counter()
                ds.client.read(f"s{i}", RemoteRef("psmall", host, int(port), 1, f"s{i}"), 16, one, one, 120)
                status = ds.wait(f"s{i}").status
                took = time.perf_counter() - t0
                assert status == "received" and pending.result() == "received"
                if i >= 2:
                    latencies.append(took)
        return latencies
    finally:
        for e in (ds, d, ps, p):
            e.close()


ANNOUNCE_S = 0.002  # between a read's announcement and the read: its claims' answers arrive meanwhile
WHOLE = {"KVXFERD_LANES": "0"}  # every read posted whole on the decode daemon's agent (one stream)
LANES = 2  # the lanes pair: a 64 MiB read split across 2 posting lanes


def run(page_sizes: Iterable[int] = PAGE_SIZES, total_mib: int = 64, repeats: int = 10, rounds: int = 5,
        device: str = "cpu", lane_split_bytes: int | None = None, announce: bool = True) -> list[dict[str, Any]]:
    """Medians over `rounds` alternating runs of each path, so that a noisy neighbour on this
    machine weighs on all alike. Per page size, fresh daemons: one pair posting every read whole
    (lanes off), one pair with 2 posting lanes (a 64 MiB read split across them); the
    whole pair's own latency figures (RPC -> READ posted, RPC -> completion, NIXL's post call)
    cover that page size alone. On the CPU, parity is judged against raw NIXL reading the same
    engines' pages, before kvxferd in odd rounds and after it in even ones. `announce`: the
    engines announce their reads (`through_kvxferd`)."""
    rows: list[dict[str, Any]] = []
    nbytes = total_mib << 20
    same_pages = device == "cpu"  # a VMM allocation has no fd a raw process could map here
    for page in page_sizes:
        n = nbytes // (2 * page)
        whole: list[float] = []
        acks: list[float] = []
        split: list[float] = []
        same: list[float] = []
        same_posts: list[float] = []
        raw: list[float] = []
        raw_posts: list[float] = []
        raw_busy: list[float] = []
        raw2: list[float] = []
        small_whole: list[float] = []
        small_split: list[float] = []
        laned_env = {"KVXFERD_LANES": str(LANES)}
        if lane_split_bytes:
            laned_env["KVXFERD_LANE_SPLIT_BYTES"] = str(lane_split_bytes)
        with ExitStack() as stack:
            with environment(WHOLE):  # only while the one-stream pair starts
                one_stream = stack.enter_context(daemons(2))
            with environment(laned_env):
                laned = stack.enter_context(daemons(2))
            one_stream_sockets, laned_sockets = [d.socket for d in one_stream], [d.socket for d in laned]
            for i in range(rounds):
                stream = through_kvxferd(one_stream_sockets, page, n, repeats, device,
                                         raw_first=i % 2 == 1 if same_pages else None, announce=announce)
                whole += stream.times
                acks += stream.acks
                same += stream.raw_times
                same_posts += stream.raw_posts
                split += through_kvxferd(laned_sockets, page, n, repeats, device, announce=announce).times
                times, posts = raw_nixl(page, n, repeats, device)
                raw += times
                raw_posts += posts
                if device == "cpu":
                    raw_busy += raw_nixl(page, n, repeats, device, neighbour=True)[0]
                raw2 += raw_nixl(page, n, repeats, device, agents=2)[0]
            with Client(one_stream[1].socket) as c:
                daemon = c.status().latency_us
            with Client(laned[1].socket) as c:
                split_reads = c.status().counters.split_reads
            if device == "cpu":
                small_whole = small_reads_meanwhile(one_stream_sockets, page, n, repeats)
                small_split = small_reads_meanwhile(laned_sockets, page, n, repeats)
        k, sk, r, r2 = median(whole), median(split), median(raw), median(raw2)
        rs = median(same) if same else r  # the baseline parity is judged against
        post = (daemon.nixl_post.p50 or 0) / 1e6
        same_post = median(same_posts or raw_posts)
        m1, m2 = memcpy(nbytes, repeats, device), memcpy(nbytes, repeats, device, threads=2)
        rows.append({"page_kib": page >> 10, "descriptors": 2 * n, "mib": total_mib, "rounds": rounds,
                     "announced": announce,
                     "parity_baseline": "same pages" if same else "own pages",
                     "kvxferd_gb_s": nbytes / k / 1e9, "lanes_gb_s": nbytes / sk / 1e9,
                     "raw_same_pages_gb_s": nbytes / rs / 1e9, "raw_nixl_gb_s": nbytes / r / 1e9,
                     "raw_nixl_2_agents_gb_s": nbytes / r2 / 1e9,
                     "memcpy_gb_s": nbytes / m1 / 1e9, "memcpy2_gb_s": nbytes / m2 / 1e9,
                     "kvxferd_over_raw": rs / k, "kvxferd_over_raw_own_pages": r / k,
                     "lanes_over_raw": r / sk, "lanes_of_memcpy2": m2 / sk,
                     "raw_busy_over_raw": r / median(raw_busy) if raw_busy else 0.0,
                     "raw_2_agents_over_raw": r / r2, "split_reads": split_reads,
                     "kvxferd_ms": k * 1e3, "read_call_ms": median(acks) * 1e3,
                     "raw_ms": rs * 1e3, "raw_post_ms": same_post * 1e3,
                     "daemon_post_ms": post * 1e3,
                     "post_over_raw_post": same_post / post if post and same_post else 0.0,
                     "around_copy_ms": (k - post) * 1e3 if post else 0.0,
                     "daemon_rpc_to_post_ms": (daemon.rpc_to_post.p50 or 0) / 1e3,
                     "daemon_rpc_to_done_ms": (daemon.rpc_to_completion.p50 or 0) / 1e3,
                     "small_read_whole_ms": median(small_whole) * 1e3 if small_whole else 0.0,
                     "small_read_lanes_ms": median(small_split) * 1e3 if small_split else 0.0})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """Three tables: throughput and ratios; where one stream's time goes; a small read's wait."""
    lines = [f"{'page':>8} {'descs':>6} {'kvxferd':>8} {'raw NIXL':>9} {'kvxferd/':>9} {'raw NIXL':>9} {'lanes':>7} "
             f"{'lanes/':>8} {'raw NIXL':>9} {'memcpy':>7} {'memcpy':>7} {'lanes/':>8}",
             f"{'':>8} {'':>6} {'1 stream':>8} {'same pgs':>9} {'raw':>9} {'own pgs':>9} {'GB/s':>7} "
             f"{'raw own':>8} {'2 agents':>9} {'1 thr':>7} {'2 thr':>7} {'memcpy2':>8}"]
    for r in rows:
        lines.append(f"{r['page_kib']:>5}KiB {r['descriptors']:>6} {r['kvxferd_gb_s']:>8.2f} "
                     f"{r['raw_same_pages_gb_s']:>9.2f} {r['kvxferd_over_raw']:>9.2f} {r['raw_nixl_gb_s']:>9.2f} "
                     f"{r['lanes_gb_s']:>7.2f} {r['lanes_over_raw']:>8.2f} {r['raw_nixl_2_agents_gb_s']:>9.2f} "
                     f"{r['memcpy_gb_s']:>7.2f} {r['memcpy2_gb_s']:>7.2f} {r['lanes_of_memcpy2']:>8.2f}")
    own = any(r["parity_baseline"] != "same pages" for r in rows)
    if own:
        lines.append("(no raw process can map this device's memory: 'same pgs' and 'kvxferd/raw' here, and every "
                     "raw column below, are raw NIXL between pages of its own)")
    announced = "reads announced, as vLLM's connector does" if rows and rows[0]["announced"] else "reads unannounced"
    pages = "its own" if own else "the same"
    lines += ["", f"one stream, medians in ms per request (raw: {pages} pages; {announced}):",
              f"{'page':>8} {'kvxferd':>8} {'read':>6} {'NIXL post':>10} {'raw post':>9} {'copy':>8} {'around':>7} "
              f"{'rpc>post':>9} {'rpc>done':>9} {'raw':>7} {'raw, busy':>10}",
              f"{'':>8} {'client':>8} {'call':>6} {'daemon':>10} {'call':>9} {'raw/kvx':>8} {'copy':>7} "
              f"{'daemon':>9} {'daemon':>9} {'READ':>7} {'nbr / raw':>10}"]
    for r in rows:
        lines.append(f"{r['page_kib']:>5}KiB {r['kvxferd_ms']:>8.2f} {r['read_call_ms']:>6.2f} "
                     f"{r['daemon_post_ms']:>10.2f} {r['raw_post_ms']:>9.2f} {r['post_over_raw_post']:>8.2f} "
                     f"{r['around_copy_ms']:>7.2f} {r['daemon_rpc_to_post_ms']:>9.2f} "
                     f"{r['daemon_rpc_to_done_ms']:>9.2f} {r['raw_ms']:>7.2f} {r['raw_busy_over_raw']:>10.2f}")
    if any(r["small_read_whole_ms"] for r in rows):
        lines += ["", "another engine's one-block read, sent 1 ms into a large read (median ms):",
                  f"{'page':>8} {'whole':>8} {'lanes':>8}"]
        for r in rows:
            lines.append(f"{r['page_kib']:>5}KiB {r['small_read_whole_ms']:>8.2f} {r['small_read_lanes_ms']:>8.2f}")
    return "\n".join(lines)


__all__ = ["render", "run"]
