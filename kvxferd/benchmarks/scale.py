"""`kvxferd bench scale`: what the daemon's bookkeeping costs as requests and peers grow.

* holds: one real daemon, one engine rank, N concurrent holds: hold RPCs/s, the daemon's CPU
  while it holds them, `status` time and reply size, `/metrics` time and size; against the
  same daemon holding nothing and holding one request (the same 1 ms progress pace), in the
  same run.
* ranks: a 70B-class engine, 8 decode ranks on one daemon reading from 4 prefill ranks on
  another: each decode rank's first read (handshake, plan, 4.8M-descriptor lists on both
  sides), and the decode daemon's RSS before and after, against one rank alone.
* peers (simulated in process): the recorder after reads from P peers, with the `peer` label
  bounded (recorder.PEER_LABELS) against unbounded, in the same run: series and bytes of
  `/metrics`, and its render time.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import msgspec

from .. import recorder as rec
from ..client import Client, EngineClient, RemoteRef
from ..plan.models import ModelShape, build
from .harness import BenchEngine, daemons, idle_cpu_percent, median, rss_mb
from .plan import LLAMA70B

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=64, block_size=16, num_blocks=256)


def _daemon_view(socket: str, pid: int) -> dict[str, float]:
    with Client(socket) as c:
        times, size, metrics = [], 0, ""
        for _ in range(10):
            t0 = time.perf_counter()
            st = c.status()
            times.append(time.perf_counter() - t0)
            size, metrics = len(msgspec.msgpack.encode(st)), st.metrics or ""
    t0 = time.perf_counter()
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read()
    metrics_s = time.perf_counter() - t0
    return {"status_ms": median(times) * 1e3, "status_bytes": size, "metrics_ms": metrics_s * 1e3,
            "metrics_bytes": len(body), "cpu_pct": idle_cpu_percent([pid], 3.0)[0]}


def holds(n: int) -> dict[str, Any]:
    with daemons(1, ["--metrics-port", "0"]) as (daemon,):
        engine = BenchEngine(daemon.socket, "p", build(SHAPE, 1, 0))
        time.sleep(1.5)  # quiet: the idle pace, as a daemon holding nothing runs
        empty = _daemon_view(daemon.socket, daemon.proc.pid)
        client: EngineClient = engine.client
        client.hold("r0", 600.0, [[0]])
        one = _daemon_view(daemon.socket, daemon.proc.pid)
        t0 = time.perf_counter()
        for i in range(1, n):
            client.hold(f"r{i}", 600.0, [[i % SHAPE.num_blocks]])
        rate = (n - 1) / (time.perf_counter() - t0)
        full = _daemon_view(daemon.socket, daemon.proc.pid)
        engine.close()
    return {"holds": n, "holds_per_s": rate, "empty": empty, "one": one, "holding": full}


def ranks(d_tp: int = 8, p_tp: int = 4, blocks: int = 64) -> dict[str, Any]:
    """Every decode rank's first read of `blocks` blocks, one rank after another."""
    with daemons(2) as (pd, dd):
        prefill = [BenchEngine(pd.socket, "p", build(LLAMA70B, p_tp, r), touch=False) for r in range(p_tp)]
        decode = [BenchEngine(dd.socket, "d", build(LLAMA70B, d_tp, r), touch=False) for r in range(d_tp)]
        time.sleep(0.5)
        before = rss_mb(dd.proc.pid)
        host, port = prefill[0].side_channel.rsplit(":", 1)
        ids = [list(range(blocks))]
        firsts, rss = [], []
        for d in decode:
            rid = f"r{d.geo.tp_rank}"
            for p in prefill:  # every prefill rank holds the request, as a prefill engine's do
                p.client.hold(rid, 300.0, ids)
            t0 = time.perf_counter()
            d.client.read(rid, RemoteRef("p", host, int(port), p_tp, rid), blocks * 16, ids, ids, deadline_s=300)
            assert d.wait(rid, 300).status == "received"
            firsts.append(time.perf_counter() - t0)
            rss.append(rss_mb(dd.proc.pid))
        for e in decode + prefill:
            e.close()
    return {"d_tp": d_tp, "p_tp": p_tp, "rank_gb": decode[0].geo.buffers[0] / 1e9,
            "descriptors_per_side": LLAMA70B.layers * 2 * LLAMA70B.num_blocks,
            "first_read_s": firsts, "rss_before_mb": before, "rss_after_mb": rss}


def peers(n: int, reads_per_peer: int = 3) -> dict[str, Any]:
    out: dict[str, Any] = {"peers": n}
    for label, cap in (("unbounded", 1 << 30), ("bounded", rec.PEER_LABELS)):
        saved, rec.PEER_LABELS = rec.PEER_LABELS, cap
        try:
            r = rec.Recorder()
            for p in range(n):
                for _ in range(reads_per_peer):
                    r.read_posted(f"peer-{p}", 16, 1, 1e-4)
                    r.read_received(f"peer-{p}", "nixl", 1 << 16, 1e-3, 1e-3)
                r.handshake_ran(f"peer-{p}", 0.01)
            t0 = time.perf_counter()
            body = r.metrics.render()
            render_s = time.perf_counter() - t0
        finally:
            rec.PEER_LABELS = saved
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        out[label] = {"series": series, "bytes": len(body), "render_ms": render_s * 1e3}
    return out


def run(n_holds: int = 10_000, n_peers: int = 1_000) -> dict[str, Any]:
    return {"holds": holds(n_holds), "peers": peers(n_peers), "ranks": ranks()}


def render(r: dict[str, Any]) -> str:
    h, p = r["holds"], r["peers"]
    lines = [f"{h['holds']} concurrent holds: {h['holds_per_s']:.0f} hold RPCs/s (one client, one at a time)",
             f"{'':<14} {'status ms':>10} {'status KB':>10} {'metrics ms':>11} {'metrics KB':>11} {'CPU %':>6}"]
    for key in ("empty", "one", "holding"):
        v = h[key]
        lines.append(f"{key:<14} {v['status_ms']:>10.2f} {v['status_bytes'] / 1e3:>10.1f} {v['metrics_ms']:>11.2f} "
                     f"{v['metrics_bytes'] / 1e3:>11.1f} {v['cpu_pct']:>6.1f}")
    lines.append(f"{p['peers']} peers, /metrics:  {'series':>8} {'KB':>8} {'render ms':>10}")
    for key in ("unbounded", "bounded"):
        v = p[key]
        lines.append(f"  peer label {key:<10} {v['series']:>8} {v['bytes'] / 1e3:>8.0f} {v['render_ms']:>10.1f}")
    k = r["ranks"]
    lines.append(f"70B-class, {k['d_tp']} decode ranks on one daemon reading from {k['p_tp']} prefill ranks "
                 f"({k['rank_gb']:.1f} GB of KV per decode rank); decode daemon RSS {k['rss_before_mb']:.0f} MB "
                 f"registered, before any read")
    lines.append(f"{'decode rank':>11} {'first read s':>13} {'daemon RSS MB':>14}")
    for i, (t, m) in enumerate(zip(k["first_read_s"], k["rss_after_mb"])):
        lines.append(f"{i:>11} {t:>13.2f} {m:>14.0f}")
    return "\n".join(lines)
