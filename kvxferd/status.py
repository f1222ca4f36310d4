"""Text rendering of `kvxferd status` (its --json is the `protocol.Status` Struct itself).

Engine ids, request ids, model names, peer addresses and reasons come from engines and peers:
every string is rendered through `logs.escape`, so none can send escape sequences or line breaks
to the operator's terminal. JSON needs nothing (json.dumps escapes control characters)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .logs import escape
from .protocol import Percentiles, Status


def _table(rows: Sequence[msgspec.Struct], cols: list[tuple[str, str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    cells = [[_fmt(getattr(r, key)) for key, _ in cols] for r in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (_, title) in enumerate(cols)]
    out = ["  " + "  ".join(t.ljust(w) for (_, t), w in zip(cols, widths))]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return out


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return escape(",".join(map(str, v)))
    return escape(str(v))


def _more(shown: int, total: int) -> list[str]:
    return [f"  ... {total - shown} more (oldest shown)"] if total > shown else []


def _us(p: Percentiles) -> str:
    if not p.n or p.p50 is None or p.p99 is None:
        return "-"
    return f"{p.p50 / 1e3:.3g}/{p.p99 / 1e3:.3g} ms"


def render(st: Status) -> str:
    c, rec, lat = st.counters, st.recent, st.latency_us
    lines = [f"kvxferd {escape(st.version)}  agent {escape(st.agent)}  up {st.uptime_s:.0f}s",
             f"socket {escape(st.socket)}  side channel {escape(st.side_channel)}",
             f"reads: {c.received} received ({c.split_reads} split), {c.failed} failed "
             f"({c.integrity_failures} integrity)   "
             f"holds: {c.sent} sent, {c.expired} "
             f"expired   last {rec.window_s}s: {rec.reads} reads, {rec.bytes_per_s / 1e6:.1f} MB/s"
             f"   quarantined: {st.quarantined}",
             f"read latency p50/p99: request -> READ posted "
             f"{_us(lat.rpc_to_post)}, request -> completion {_us(lat.rpc_to_completion)}, "
             f"NIXL post call {_us(lat.nixl_post)}", "", "engines"]
    lines += _table(st.engines, [("engine", "ENGINE"), ("rank", "RANK"), ("tp_size", "TP"), ("memory", "MEM"),
                                 ("bytes", "BYTES"), ("state", "STATE"), ("pinned", "PINNED"), ("rdma", "RDMA")])
    t = st.totals
    lines += _more(len(st.engines), t.engines)
    lines += ["", f"peers ({c.peers_retired} retired so far; NIXL remote agents loaded: {t.remote_agents}, "
                  f"on lanes {t.lane_remote_agents})"]
    lines += _table(st.peers, [("engine", "ENGINE"), ("address", "ADDRESS"), ("agent", "AGENT"),
                               ("state", "STATE"), ("retired", "WHY"), ("handshake_age_s", "AGE s"),
                               ("heard_s", "HEARD s"), ("idle_s", "IDLE s"), ("plans", "PLANS"),
                               ("ranks", "RANKS"), ("lanes", "LANE"), ("active", "ACTIVE"),
                               ("read_gbps", "GB/s"), ("slow", "SLOW")])
    lines += _more(len(st.peers), t.peers)
    lines += ["", "in flight"]
    lines += _table(st.in_flight, [("engine", "ENGINE"), ("rank", "RANK"), ("request", "REQUEST"),
                                   ("peer", "PEER"), ("age_s", "AGE s")])
    lines += _more(len(st.in_flight), t.in_flight)
    lines += ["", "held"]
    lines += _table(st.held, [("engine", "ENGINE"), ("rank", "RANK"), ("request", "REQUEST"),
                              ("consumers", "CONSUMERS"), ("age_s", "AGE s"), ("expires_in_s", "EXPIRES s")])
    lines += _more(len(st.held), t.held)
    lines += ["", "recent failures"]
    lines += _table(st.failures, [("engine", "ENGINE"), ("rank", "RANK"), ("request", "REQUEST"),
                                  ("peer", "PEER"), ("reason", "REASON")])
    return "\n".join(lines)
