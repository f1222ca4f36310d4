"""`kvxferd bench step`: what the vLLM connector's worker costs an engine per scheduler step
when nothing finishes, with requests pending (held blocks whose consumers have not come).

Baseline, in the same run: one bare poll RPC to the daemon (what the worker paid per step
before the doorbell). The worker as it ships reads its doorbell, a pipe the daemon writes a
byte to when completions wait (`EngineClient.rung`), and polls only when it rang. Each call
follows 2 ms of busy CPU, as an engine's own step would.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..client import EngineClient
from ..memory import buffer_address, create_shm
from ..plan.models import ModelShape, build
from ..vllm.handoff import HoldOrder, Orders
from ..vllm.shared_kv import SharedBuffer
from ..vllm.worker import WorkerSide
from .harness import daemons, pct

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=64)


def _timed(call: Callable[[], object], n: int, work_s: float = 0.0) -> list[float]:
    """Seconds per call; `work_s` of busy CPU between calls (the engine's own step)."""
    out = []
    for _ in range(n):
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


WORK_S = 0.002


def run(steps: int = 2000, pending: int = 16) -> list[dict[str, float | str]]:
    with daemons(1) as (daemon,):
        geo = build(SHAPE, 1, 0)
        fd, mm = create_shm(geo.buffers[0])
        worker = WorkerSide(daemon.socket, "engine", 0, 1, read_deadline_s=30.0)
        worker.register(geo, [SharedBuffer(fd, geo.buffers[0], buffer_address(mm), "shm", 0, [mm])], timeout_s=10)
        worker.start(Orders([HoldOrder(f"r{i}", [[i]], 600.0) for i in range(pending)], []))
        assert worker.client is not None and worker.client.doorbell is not None
        fd2, mm2 = create_shm(geo.buffers[0])
        rpc = EngineClient(daemon.socket, "engine-rpc", 0, 1)
        rpc.register(geo, shm_fds=[fd2])
        rows: list[dict[str, float | str]] = []
        for name, call in (("bare poll RPC (baseline)", lambda: rpc.poll(0.0)),
                           ("worker.results() (ships: doorbell)", worker.results)):
            _timed(call, steps // 10, WORK_S)  # warm up
            t = _timed(call, steps, WORK_S)
            rows.append({"per_step": name, "pending": pending, "steps": steps,
                         "p50_us": pct(t, 50) * 1e6, "p99_us": pct(t, 99) * 1e6})
        rpc.close()
        mm2.close()
        worker.close()
        mm.close()
    return rows


def render(rows: list[dict[str, float | str]]) -> str:
    lines = [f"{'per engine step, nothing finishing':<38} {'p50 us':>8} {'p99 us':>8}"]
    for r in rows:
        lines.append(f"{r['per_step']!s:<38} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f}")
    base, worker = rows[0]["p50_us"], rows[1]["p50_us"]
    assert isinstance(base, float) and isinstance(worker, float)
    lines.append(f"worker / baseline (p50): {worker / base:.3f}")
    return "\n".join(lines)
