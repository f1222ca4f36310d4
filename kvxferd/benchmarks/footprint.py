"""`kvxferd bench footprint`: decode daemon RSS idle, with a 70B-class rank registered, and
after the first read from a 70B-class prefill rank (plan and 4.8M-descriptor lists built);
the CPU two idle daemons use, against daemons that progress NIXL every 1 ms when idle (the
fixed tick kvxferd had before its idle pace) in the same run.

Engine memory is a sparse memfd (20 GB per rank, never touched): registration maps it without
copying, so the daemon's own footprint is what is measured.
"""

from __future__ import annotations

import time

from ..client import RemoteRef
from ..plan.models import ModelShape, build
from .harness import BenchEngine, daemons, environment, idle_cpu_percent, rss_mb
from .plan import LLAMA70B

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=64, block_size=16, num_blocks=256)


IDLE_S = 5.0


def idle_cpu() -> dict[str, float]:
    """Percent of a core each of two idle daemons uses (one engine rank registered on each)."""
    out: dict[str, float] = {}
    geo = build(SHAPE, 1, 0)
    for label, env in (("fixed_1ms_tick", {"KVXFERD_IDLE_MAX_S": "0.001"}), ("idle_pace", {})):
        with environment(env), daemons(2) as (pd, dd):
            engines = [BenchEngine(pd.socket, "p", geo), BenchEngine(dd.socket, "d", geo)]
            time.sleep(2.0)  # past the start-up activity
            p_cpu, d_cpu = idle_cpu_percent([pd.proc.pid, dd.proc.pid], IDLE_S)
            out[f"{label}_prefill_cpu_pct"], out[f"{label}_decode_cpu_pct"] = p_cpu, d_cpu
            for e in engines:
                e.close()
    return out


def run(d_tp: int = 8, p_tp: int = 8) -> dict[str, float]:
    out = idle_cpu()
    with daemons(2) as (pd, dd):
        time.sleep(0.5)
        out["idle_mb"] = rss_mb(dd.proc.pid)
        geo = build(LLAMA70B, d_tp, 0)
        d = BenchEngine(dd.socket, "d", geo, touch=False)
        out["registered_mb"] = rss_mb(dd.proc.pid)
        out["registered_gb"] = geo.buffers[0] / 1e9
        p = BenchEngine(pd.socket, "p", build(LLAMA70B, p_tp, 0), touch=False)
        host, port = p.side_channel.rsplit(":", 1)
        ids = [list(range(64))]
        p.client.hold("r0", 300.0, ids)
        t0 = time.perf_counter()
        d.client.read("r0", RemoteRef("p", host, int(port), p_tp, "r0"), 64 * 16, ids, ids, deadline_s=300)
        assert d.wait("r0", 300).status == "received"
        out["first_read_s"] = time.perf_counter() - t0
        out["after_first_read_mb"] = rss_mb(dd.proc.pid)
        d.close()
        p.close()
    return out


def render(r: dict[str, float]) -> str:
    return (f"decode daemon RSS: idle {r['idle_mb']:.0f} MB; with a 70B-class rank registered "
            f"({r['registered_gb']:.1f} GB of KV memory) {r['registered_mb']:.0f} MB; after the first read "
            f"(plan + descriptor lists, {r['first_read_s']:.2f} s) {r['after_first_read_mb']:.0f} MB\n"
            f"idle CPU, % of a core (prefill / decode daemon): idle pace "
            f"{r['idle_pace_prefill_cpu_pct']:.2f} / {r['idle_pace_decode_cpu_pct']:.2f}; fixed 1 ms tick "
            f"{r['fixed_1ms_tick_prefill_cpu_pct']:.2f} / {r['fixed_1ms_tick_decode_cpu_pct']:.2f}")
