"""A plan as data for people and machines (`kvxferd plan`). Schema: docs/plan.md."""

from __future__ import annotations

from typing import Any

from .geometry import Geometry
from .planner import RankPlan

SCHEMA_VERSION = 2  # what each version changed: docs/plan.md


def rank_plan_dict(plan: RankPlan, local: Geometry, remotes: dict[int, Geometry]) -> dict[str, Any]:
    peers: list[dict[str, Any]] = []
    for rank in plan.targets:
        peer = plan.peers.get(rank)
        entry: dict[str, Any] = {"remote_rank": rank, "read": peer is not None, "pieces": [], "local_descs": 0,
                                 "remote_descs": 0}
        if peer is not None:
            entry["local_descs"], entry["remote_descs"] = peer.num_local_descs, peer.num_remote_descs
            for i, p in enumerate(peer.pieces):
                group = local.groups[p.group]
                entry["pieces"].append({
                    "group": group.name,
                    "segment": p.key,
                    "local_region": int(peer.local_region[i]),
                    "remote_region": int(peer.remote_region[i]),
                    "phases": {"local": int(peer.local_phases[i]), "remote": int(peer.remote_phases[i])},
                    "local_offset": p.local_offset,
                    "remote_offset": p.remote_offset,
                    "length": p.length,
                    "local_step": p.local_step,
                    "remote_step": p.remote_step,
                })
        peers.append(entry)
    groups = [{"name": g.name, "kind": g.kind, "chunk_tokens": g.chunk_tokens,
               "local_tokens_per_block": g.local_tokens_per_block,
               "remote_tokens_per_block": g.remote_tokens_per_block} for g in plan.groups]
    return {"local_rank": plan.local_rank, "targets": list(plan.targets), "notify_only": list(plan.notify_only),
            "consumers_per_remote_rank": plan.consumers_per_remote_rank, "groups": groups, "peers": peers}


def render_table(doc: dict[str, Any]) -> str:
    """Readable text: one block per decode rank, one line per piece."""
    lines = [f"prefill TP {doc['prefill']['tp']} -> decode TP {doc['decode']['tp']}   model {doc['model']}"]
    for rp in doc["ranks"]:
        groups = ", ".join(f"{g['name']}({g['kind']}, {g['remote_tokens_per_block']}->{g['local_tokens_per_block']} "
                           f"tok/block, chunk {g['chunk_tokens']})" for g in rp["groups"])
        lines.append("")
        lines.append(f"decode rank {rp['local_rank']}: targets {rp['targets']}  groups: {groups}")
        for peer in rp["peers"]:
            if not peer["read"]:
                lines.append(f"  prefill rank {peer['remote_rank']}: notify only")
                continue
            lines.append(f"  prefill rank {peer['remote_rank']}: read {len(peer['pieces'])} pieces, "
                         f"{peer['local_descs']} local / {peer['remote_descs']} remote descriptors")
            lines.append(f"    {'group':<6} {'segment':<28} {'reg L/R':>8} {'phase L/R':>9} "
                         f"{'local off':>10} {'remote off':>10} {'length':>8}")
            for p in peer["pieces"]:
                seg = p["segment"] if len(p["segment"]) <= 28 else p["segment"][:25] + "..."
                lines.append(f"    {p['group']:<6} {seg:<28} {p['local_region']:>3}/{p['remote_region']:<4} "
                             f"{p['phases']['local']:>4}/{p['phases']['remote']:<4} "
                             f"{p['local_offset']:>10} {p['remote_offset']:>10} {p['length']:>8}")
    return "\n".join(lines)
