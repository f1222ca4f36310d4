"""`kvxferd bench footprint`: decode daemon RSS idle, with a 70B-class rank registered, and
after the first read from a 70B-class prefill rank (plan and 4.8M-descriptor lists built).

Engine memory is a sparse memfd (20 GB per rank, never touched): registration maps it without
copying, so the daemon's own footprint is what is measured.
"""

from __future__ import annotations

import time

from ..client import RemoteRef
from ..plan.models import build
from .harness import BenchEngine, daemons, rss_mb
from .plan import LLAMA70B


def run(d_tp: int = 8, p_tp: int = 8) -> dict[str, float]:
    with daemons(2) as (pd, dd):
        time.sleep(0.5)
        out = {"idle_mb": rss_mb(dd.proc.pid)}
        geo = build(LLAMA70B, d_tp, 0)
        d = BenchEngine(dd.socket, "d", geo, touch=False)
        out["registered_mb"] = rss_mb(dd.proc.pid)
        out["registered_gb"] = geo.buffers[0] / 1e9
        p = BenchEngine(pd.socket, "p", build(LLAMA70B, p_tp, 0), touch=False)
        host, port = p.side_channel.rsplit(":", 1)
        ids = [list(range(64))]
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
            f"(plan + descriptor lists, {r['first_read_s']:.2f} s) {r['after_first_read_mb']:.0f} MB")
