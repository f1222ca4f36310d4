"""`kvxferd bench handshake`: the first request to a new peer, end to end (handshake, plan,
descriptor lists, READ, completion), against the next request to the same peer."""

from __future__ import annotations

import time

from ..client import RemoteRef
from ..plan.models import ModelShape, build
from .harness import BenchEngine, daemons, median

SHAPE = ModelShape(layers=32, kv_heads=8, head_dim=128, block_size=16, num_blocks=1024)


def run(peers: int = 5, blocks: int = 16) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    with daemons(1) as (pd,):
        p = BenchEngine(pd.socket, "p", build(SHAPE, 1, 0), touch=False)
        host, port = p.side_channel.rsplit(":", 1)
        ids = [list(range(blocks))]
        for i in range(peers):
            with daemons(1) as (dd,):  # a fresh decode daemon: the prefill daemon is a new peer
                d = BenchEngine(dd.socket, "d", build(SHAPE, 1, 0), touch=False)
                times: list[float] = []
                for j in range(2):
                    rid = f"h{i}-{j}"
                    p.client.hold(rid, 300.0, ids)
                    t0 = time.perf_counter()
                    d.client.read(rid, RemoteRef("p", host, int(port), 1, rid), blocks * 16, ids, ids)
                    c = d.wait(rid)
                    times.append(time.perf_counter() - t0)
                    assert c.status == "received", c
                peer = d.client.status().peers[0]
                rows.append({"peer": i, "first_ms": times[0] * 1e3, "second_ms": times[1] * 1e3,
                             "handshake_ms": peer.handshake_s * 1e3})
                d.close()
        p.close()
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: median([r[k] for r in rows]) for k in ("first_ms", "second_ms", "handshake_ms")}


def render(rows: list[dict[str, float]]) -> str:
    s = summary(rows)
    lines = [f"{'peer':>4} {'first request ms':>17} {'handshake ms':>13} {'next request ms':>16}"]
    lines += [f"{r['peer']:>4} {r['first_ms']:>17.1f} {r['handshake_ms']:>13.1f} {r['second_ms']:>16.2f}" for r in rows]
    lines.append(f"{'med':>4} {s['first_ms']:>17.1f} {s['handshake_ms']:>13.1f} {s['second_ms']:>16.2f}")
    return "\n".join(lines)
