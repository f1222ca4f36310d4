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
  process, no daemon and no busy CPU between (what the mechanism costs on a quiet core).
"""

from __future__ import annotations

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


def _floor(steps: int) -> list[Row]:
    """In one process: a record written and read back, and a check that finds nothing, through
    the pipe alone (protocol 7) and past the counter page (protocol 9)."""
    bell, (read_end, page_fd) = Doorbell.make(records=True, counter=True)
    engine = EngineClient.of_doorbell(read_end, page_fd)
    plain_bell, (plain_end,) = Doorbell.make(records=True)
    plain = EngineClient.of_doorbell(plain_end)
    done = P.Completion("a-request-id-of-typical-length-0123456789", "received", [], "", 1 << 20, 0.0003)
    write, read, idle_pipe, idle_counter = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        bell.push(done)
        t1 = time.perf_counter()
        got, _ = engine.pushed()
        t2 = time.perf_counter()
        nothing, _ = engine.pushed()
        t3 = time.perf_counter()
        plain.pushed()
        idle_pipe.append(time.perf_counter() - t3)
        idle_counter.append(t3 - t2)
        read.append(t2 - t1)
        write.append(t1 - t0)
        assert got == [done] and nothing == []
    for b in (bell, plain_bell):
        b.close()
    for e in (engine, plain):
        e._close_doorbell()
    return [_row("daemon: Doorbell.push()", "in one process (the floor)", write, steps),
            _row("engine: EngineClient.pushed()", "in one process (the floor)", read, steps),
            _row("nothing new: the pipe read (protocol 7)", "in one process (the floor)", idle_pipe, steps),
            _row("nothing new: the counter (protocol 9)", "in one process (the floor)", idle_counter, steps)]


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
    return "\n".join(lines)
