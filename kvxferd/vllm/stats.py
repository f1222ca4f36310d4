"""kvxferd's transfers in vLLM's own metrics: what a vLLM `/metrics` scrape shows.

Each worker hands vLLM its `TransferStats` every step (`get_kv_connector_stats`); vLLM
aggregates them across workers and steps (`KvxferdStats.aggregate`) and records them with
`KvxferdPromMetrics.observe`, per engine:

    vllm:kvxferd_read_seconds            histogram  a received read, post to arrival (decode)
    vllm:kvxferd_read_bytes              histogram  bytes of a received read (decode)
    vllm:kvxferd_failed_reads_total      counter    reads that ended failed (decode)
    vllm:kvxferd_sent_holds_total        counter    holds all consumers read (prefill)
    vllm:kvxferd_expired_holds_total     counter    holds whose lease passed first (prefill)
    vllm:kvxferd_step_seconds            histogram  what a step that schedules tokens paid the
                                                    connector to learn about finished transfers
                                                    while transfers were pending (doorbell read,
                                                    and a poll when it asked for one)

The daemon's own `kvxferd_*` series (per peer, per outcome) stay on its metrics port.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from .worker import TransferStats

_COUNTS = ("failed_reads", "sent", "expired")


@dataclasses.dataclass
class KvxferdStats(KVConnectorStats):
    """`TransferStats` as vLLM carries them from workers to its logger (a plain dict)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def of(cls, stats: TransferStats) -> KvxferdStats:
        return cls(data=dataclasses.asdict(stats))

    def reset(self) -> None:
        self.data = dataclasses.asdict(TransferStats())

    def aggregate(self, other: KVConnectorStats) -> KvxferdStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0 if key in _COUNTS else []) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds, nbytes = self.data["read_seconds"], self.data["read_bytes"]
        steps = sorted(self.data.get("step_seconds", ()))
        return {"reads": len(seconds), "read_bytes": sum(nbytes),
                "avg_read_ms": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
                "step_us_p50": round(1e6 * steps[len(steps) // 2], 1) if steps else 0.0,
                **{key: self.data[key] for key in _COUNTS}}

    def is_empty(self) -> bool:
        return TransferStats(**self.data).empty()


class KvxferdPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(kind: Any, name: str, doc: str, **kw: Any) -> dict[int, Any]:
            return create_metric_per_engine(kind(name=name, documentation=doc, labelnames=labelnames, **kw),
                                            per_engine_labelvalues)

        self.read_seconds = per_engine(self._histogram_cls, "vllm:kvxferd_read_seconds",
                                       "kvxferd reads received: post to arrival, seconds",
                                       buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                1.0, 2.5, 5.0])
        self.step_seconds = per_engine(self._histogram_cls, "vllm:kvxferd_step_seconds",
                                       "kvxferd's cost to an engine step with transfers pending, seconds",
                                       buckets=[2e-6, 5e-6, 1e-5, 1.5e-5, 2e-5, 2.5e-5, 3e-5, 4e-5, 5e-5, 7.5e-5,
                                                1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3])
        self.read_bytes = per_engine(self._histogram_cls, "vllm:kvxferd_read_bytes",
                                     "kvxferd reads received: bytes", buckets=[2 ** (12 + 2 * i) for i in range(11)])
        self.counters = {
            "failed_reads": per_engine(self._counter_cls, "vllm:kvxferd_failed_reads",
                                       "kvxferd reads that ended failed (their blocks reported as load errors)"),
            "sent": per_engine(self._counter_cls, "vllm:kvxferd_sent_holds",
                               "kvxferd holds whose consumers all read them"),
            "expired": per_engine(self._counter_cls, "vllm:kvxferd_expired_holds",
                                  "kvxferd holds whose lease passed before their consumers read them"),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("read_seconds", ()):
            self.read_seconds[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get("step_seconds", ()):
            self.step_seconds[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get("read_bytes", ()):
            self.read_bytes[engine_idx].observe(nbytes)
        for key, counters in self.counters.items():
            if transfer_stats_data.get(key):
                counters[engine_idx].inc(transfer_stats_data[key])
