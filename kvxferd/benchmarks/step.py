"""`kvxferd bench step`: what the vLLM connector's worker costs an engine per scheduler step
while transfers are pending, timed around `WorkerSide.results()`. Each call follows 2 ms of
busy CPU, as an engine's own step would.

* Nothing finishes (holds whose consumers have not come). Baseline, in the same run: one bare
  poll RPC to the daemon, what the worker paid per step before the doorbell.
* The doorbell check alone, nothing finishing, with a second thread of the engine's busy 0.3 ms
  of every 1 ms, as vLLM's output thread is. Baseline, in the same run: the pipe checked with
  poll(2), which lets go of the GIL and so may wait for that thread; the worker reads the pipe
  keeping it (doorbell.PipeReader).
* One read finishes each step (16 blocks from a prefill on a second daemon, posted before the
  step's busy CPU, untimed). Baseline, in the same run: protocol 6's doorbell, a byte that says a
  poll would find something, then the poll (a bare client: no bookkeeping). The worker as it
  ships gets the completion itself from the doorbell (protocol 7).
* The floor: one record written to a doorbell and read back with `EngineClient.pushed()` in one
  process, no daemon between, through the pipe (protocol 7), behind the counter page (9) and in
  the ring (10), each against the one before: warm (what the mechanism costs on a quiet core),
  and with caches flushed between the write and the read (what a step after a forward pass pays).
"""

from __future__ import annotations

import itertools
import mmap
import select
import threading
import time
from collections.abc import Callable

from .. import protocol as P
from ..client import EngineClient
from ..doorbell import Doorbell
from ..memory import buffer_address, create_shm
from ..plan.models import ModelShape, build
from ..vllm.handoff import HoldOrder, Orders, ReadOrder
from ..vllm.shared_kv import SharedBuffer
from ..vllm.worker import WorkerSide
from .harness import BenchEngine, daemons, pct

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=64)
READ_SHAPE = ModelShape(layers=2, kv_heads=1, head_dim=64, block_size=16, num_blocks=64)
BLOCKS = 16
WORK_S = 0.002

Row = dict[str, float | str]


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed(call: Callable[[], object], n: int, before: Callable[[int], object] | None = None) -> list[float]:
    """Seconds per call; before each, `before(i)` (untimed) and the engine's own step (busy CPU)."""
    out = []
    for i in range(n):
        if before is not None:
            before(i)
        _busy(WORK_S)
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def _naming(post: Callable[[str], None], prefix: str) -> Callable[[int], None]:
    """`post` for step i's own request id."""
    return lambda i: post(f"{prefix} {i}")


def _worker(socket: str, engine_id: str, shape: ModelShape) -> tuple[WorkerSide, mmap.mmap]:
    geo = build(shape, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    worker = WorkerSide(socket, engine_id, 0, 1, read_deadline_s=30.0)
    worker.register(geo, [SharedBuffer(fd, geo.buffers[0], buffer_address(mm), "shm", 0, [mm])], timeout_s=10)
    assert worker.client is not None and worker.client.doorbell is not None
    return worker, mm


def _row(name: str, scenario: str, t: list[float], steps: int, **extra: float) -> Row:
    return {"per_step": name, "scenario": scenario, "steps": steps, "p50_us": pct(t, 50) * 1e6,
            "p99_us": pct(t, 99) * 1e6, **extra}


def _nothing_finishes(socket: str, steps: int, pending: int) -> list[Row]:
    worker, mm = _worker(socket, "engine", SHAPE)
    worker.start(Orders([HoldOrder(f"r{i}", [[i]], 600.0) for i in range(pending)], []))
    polling = BenchEngine(socket, "engine-rpc", build(SHAPE, 1, 0))  # the baseline's engine: no doorbell
    rpc = polling.client
    rows = []
    for name, call in (("bare poll RPC (baseline)", lambda: rpc.poll(0.0)),
                       ("worker.results() (ships)", worker.results)):
        _timed(call, steps // 10)  # warm up
        rows.append(_row(name, "nothing finishes", _timed(call, steps), steps, pending=pending))
    polling.close()
    worker.close()
    mm.close()
    return rows


def _busy_thread(socket: str, steps: int, pending: int) -> list[Row]:
    """The worker's doorbell check alone, nothing finishing, with a second thread of the engine
    busy 0.3 ms in every 1 ms (vLLM's output thread, serializing the last step's tokens).
    Baseline, in the same run: the same pipe checked by poll(2), which lets go of the GIL."""
    worker, mm = _worker(socket, "engine-threads", SHAPE)
    worker.start(Orders([HoldOrder(f"t{i}", [[i]], 600.0) for i in range(pending)], []))
    assert worker.client is not None and worker.client.doorbell is not None
    watch = select.poll()
    watch.register(worker.client.doorbell, select.POLLIN)
    stop = threading.Event()

    def output_thread() -> None:
        while not stop.is_set():
            _busy(0.0003)
            time.sleep(0.0007)

    thread = threading.Thread(target=output_thread, daemon=True)
    thread.start()
    rows = []
    try:
        client = worker.client
        for name, call in (("poll(2), the GIL let go (baseline)", lambda: watch.poll(0)),
                           ("EngineClient.pushed(): the GIL kept (ships)", lambda: client.pushed(0.0))):
            _timed(call, steps // 10)
            rows.append(_row(name, "nothing finishes, a busy second thread", _timed(call, steps), steps,
                             pending=pending))
    finally:
        stop.set()
        thread.join()
        worker.close()
        mm.close()
    return rows


def _one_read_finishes(decode_socket: str, prefill_socket: str, steps: int) -> list[Row]:
    """A read posted before each step's busy CPU, done by the time the step asks."""
    geo = build(READ_SHAPE, 1, 0)
    prefill = BenchEngine(prefill_socket, "prefill", geo)
    host, port = prefill.side_channel.rsplit(":", 1)
    blocks = [list(range(BLOCKS))]
    worker, mm = _worker(decode_socket, "decode", READ_SHAPE)
    ring = BenchEngine(decode_socket, "decode-ring", geo, doorbell="ring")
    rows: list[Row] = []
    found = {"n": 0}

    def remote(rid: str) -> P.RemoteRef:
        return P.RemoteRef("prefill", host, int(port), 1, rid)

    def hold(rid: str) -> None:
        prefill.client.hold(rid, 60.0, blocks)
        prefill.client.poll(0.0)  # the prefill's own completions ("sent"), untimed

    def post_worker(rid: str) -> None:
        hold(rid)
        worker.start(Orders([], [ReadOrder(rid, remote(rid), BLOCKS * READ_SHAPE.block_size, blocks, blocks)]))

    def step_worker() -> None:
        found["n"] += len(worker.results().recving)

    def post_ring(rid: str) -> None:
        hold(rid)
        ring.client.read(rid, remote(rid), BLOCKS * READ_SHAPE.block_size, blocks, blocks)

    def step_ring() -> None:
        _, poll = ring.client.pushed()
        if poll:
            found["n"] += sum(c.status == "received" for c in ring.client.poll(0.0))

    for name, post, call in (("doorbell ring + poll (protocol 6, baseline)", post_ring, step_ring),
                             ("worker.results() (ships: records)", post_worker, step_worker)):
        _timed(call, steps // 10, _naming(post, f"warm {name}"))
        found["n"] = 0
        t = _timed(call, steps, _naming(post, name))
        rows.append(_row(name, "one read finishes", t, steps, found=found["n"] / steps))
    ring.close()
    worker.close()
    mm.close()
    prefill.close()
    return rows


# How a step learns what finished, in the floor: the records in the pipe (protocol 7), the same
# behind the counter page (9), and in the ring (10), each the baseline of the next.
MECHANISMS: tuple[tuple[str, bool, bool], ...] = (("pipe (7)", False, False), ("counter + pipe (9)", True, False),
                                                  ("ring (10)", True, True))
FLUSH_BYTES = 64 << 20  # more than this VM's caches: what a forward pass leaves of them


def _floor(steps: int) -> list[Row]:
    """In one process, per mechanism: a record written (`Doorbell.push()`), read back
    (`EngineClient.pushed()`), and a check that then finds nothing. Warm, and with 64 MiB of
    memory touched between the write and the read (untimed), as an engine step's forward pass
    leaves the caches: what a real decode's steps pay."""
    import numpy as np

    junk = np.ones(FLUSH_BYTES, dtype=np.uint8)
    done = P.Completion("a-request-id-of-typical-length-0123456789", "received", [], "", 1 << 20, 0.0003)
    rows = []
    for scenario, cold in (("in one process (the floor)", False),
                           ("in one process, caches flushed before each read", True)):
        for name, counter, ring in MECHANISMS:
            bell, fds = Doorbell.make(records=True, counter=counter, ring=ring)
            if len(fds) != 1 + counter:
                raise RuntimeError(f"{name}: the doorbell's page could not be made (no fd left?)")
            engine = EngineClient.of_doorbell(fds[0], fds[1] if counter else None, ring=ring)
            write, read, idle = [], [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                bell.push(done)
                write.append(time.perf_counter() - t0)
                if cold:
                    junk[::64] += 1  # a byte per cache line
                t1 = time.perf_counter()
                got, _ = engine.pushed()
                t2 = time.perf_counter()
                nothing, _ = engine.pushed()
                idle.append(time.perf_counter() - t2)
                read.append(t2 - t1)
                assert got == [done] and nothing == [], name
            bell.close()
            engine._close_doorbell()
            rows += [_row(f"{name}: daemon's push()", scenario, write, steps),
                     _row(f"{name}: pushed(), one record", scenario, read, steps),
                     _row(f"{name}: pushed(), nothing new", scenario, idle, steps)]
    return rows


def run(steps: int = 2000, pending: int = 16) -> list[Row]:
    with daemons(2) as (decode, prefill):
        rows = [*_nothing_finishes(decode.socket, steps, pending),
                *_busy_thread(decode.socket, steps, pending),
                *_one_read_finishes(decode.socket, prefill.socket, steps)]
    return rows + _floor(steps)


def render(rows: list[Row]) -> str:
    lines = [f"{'per engine step, transfers pending':<46} {'p50 us':>8} {'p99 us':>8}  found"]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        group = [r for r in rows if r["scenario"] == scenario]
        lines.append(f"{scenario}:")
        for r in group:
            found = f"{r['found']:.2f}" if "found" in r else "-"
            lines.append(f"  {r['per_step']!s:<44} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f}  {found}")
        if "baseline" in str(group[0]["per_step"]):
            base, worker = group[0]["p50_us"], group[1]["p50_us"]
            assert isinstance(base, float) and isinstance(worker, float)
            lines.append(f"  worker / baseline (p50): {worker / base:.3f}")
        by_name = {str(r["per_step"]): float(r["p50_us"]) for r in group}
        for (before, _, _), (after, _, _) in itertools.pairwise(MECHANISMS):
            for what in ("pushed(), one record", "pushed(), nothing new"):
                if f"{before}: {what}" in by_name:
                    ratio = by_name[f"{after}: {what}"] / by_name[f"{before}: {what}"]
                    lines.append(f"  {what}, {after} / {before} (p50): {ratio:.3f}")
    return "\n".join(lines)
