"""`KvxferdConnector`: vLLM's KV connector interface (v1) over a local kvxferd daemon.

    --kv-transfer-config '{"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvxferd/kvxferd.sock"}}'

vLLM builds it twice: in the scheduler (SchedulerSide: requests -> holds and reads) and in
every worker (WorkerSide: memory, RPCs, completions). This class only adapts vLLM's calls;
options are in `ConnectorOptions` (docs/vllm.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs
from vllm.v1.request import RequestStatus

from ..client import EngineClient
from .handoff import GroupInfo, Orders
from .options import ConnectorOptions
from .scheduler import SchedulerSide
from .stats import KvxferdPromMetrics, KvxferdStats
from .versions import check_vllm_version

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from .worker import WorkerSide

SIDE_CHANNEL_S = 30.0  # how long the daemon's address and key are used before it is asked again
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _group_info(spec: Any, prefix_caching: bool) -> GroupInfo:
    if isinstance(spec, UniformTypeKVCacheSpecs):  # one spec type in per-layer detail
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, MambaSpec):
        return GroupInfo("state", spec.block_size, spec.num_speculative_blocks)
    # A window block filled from inside would be cached as whole: a later, shorter prompt with the
    # same prefix would attend to its unwritten tokens. Only a decode without a prefix cache may.
    sliding = getattr(spec, "sliding_window", None) or 0
    return GroupInfo("attention", spec.block_size, window=0 if prefix_caching else sliding, sliding_window=sliding)


class KvxferdMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: the orders, msgpack-encoded (small, and safe to send anywhere)."""

    def __init__(self, orders: Orders) -> None:
        self.payload = msgspec.msgpack.encode(orders)

    def orders(self) -> Orders:
        return msgspec.msgpack.decode(self.payload, type=Orders)


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.options = ConnectorOptions.from_extra(tc.kv_connector_extra_config or {})
        self.engine_id = str(tc.engine_id)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        if role == KVConnectorRole.SCHEDULER:
            caching = bool(vllm_config.cache_config.enable_prefix_caching)
            groups = [_group_info(g.kv_cache_spec, caching) for g in kv_cache_config.kv_cache_groups] \
                if kv_cache_config is not None else [GroupInfo("attention", vllm_config.cache_config.block_size)]
            self.scheduler = SchedulerSide(self.engine_id, self.tp_size, groups, self.options.lease_s,
                                           self._side_channel)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from .cpu_tiles import request_amx_tiles
            from .worker import WorkerSide
            if vllm_config.device_config.device_type == "cpu":
                request_amx_tiles()  # before any forward; again if VLLM_PLUGINS left out our plugin
            self.worker = WorkerSide(self.options.socket, self.engine_id, get_tensor_model_parallel_rank(),
                                     self.tp_size, self.options.read_deadline_s, self.options.idle_wait_ms / 1e3)
        # When a step's orders leave (see bind_connector_metadata): before a CPU forward, which runs
        # to its end before vLLM calls start_load_kv; after a GPU forward is launched, so the round
        # trip to the daemon overlaps the kernels.
        self._orders_before_forward = vllm_config.device_config.device_type == "cpu"
        self._side: tuple[str, int, str] | None = None
        self._side_asked = float("-inf")  # monotonic: when the daemon was last asked
        self._load_errors: set[int] = set()

    def _side_channel(self) -> tuple[str, int, str]:
        """Where decode daemons handshake with ours (configured, or asked from the daemon), and our
        daemon's public key, which they dial ("": it has none). Asked again every SIDE_CHANNEL_S:
        a daemon restarted with new keys hands out its new key."""
        now = time.monotonic()
        if self._side is None or now - self._side_asked > SIDE_CHANNEL_S:
            self._side_asked = now
            with EngineClient(self.options.socket, self.engine_id, -1, self.tp_size, timeout=5.0) as client:
                status = client.status()
            host, _, port = (self.options.side_channel or status.side_channel).rpartition(":")
            self._side = (host, int(port), status.side_channel_key)
        return self._side

    # --- scheduler ---------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return KvxferdMetadata(self.scheduler.take_orders(idle=scheduler_output.total_num_scheduled_tokens == 0))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request, block_ids, request.status in _COMPLETED)

    # --- worker ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        from .registration import register_worker
        register_worker(self.worker, self._vllm_config, self._kv_cache_config, kv_caches, self.options)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """On CPU a step's orders leave here, before the forward. vLLM 0.32 calls `start_load_kv`
        after the forward for asynchronous loads (kvxferd's are always asynchronous); a CPU forward
        is synchronous, so from there the holds of the requests the last step answered would wait
        out this step's whole forward (a batch of prefills: over a second) and a decode's reads with
        them. A read may land while the forward runs: its request waits for its KV and is not in
        this step, and vLLM neither caches nor zeroes its blocks meanwhile."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and self._orders_before_forward:
            self._send_orders()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self._orders_before_forward:  # GPU: the forward is launched, the round trip overlaps it
            self._send_orders()

    def _send_orders(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferdMetadata)
        self.worker.start(meta.orders())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # reads are asynchronous: vLLM waits for finished_recving instead

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the decode side pulls; nothing to push

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        done = self.worker.results()
        self._load_errors = done.load_errors
        # One cache group: vLLM maps failed block ids back to requests (kv_load_failure_policy).
        # Several groups share block ids, so there a failed read is reported by request.
        failed = done.failed if self.num_groups > 1 else set()
        return KVConnectorTransferResults(done.sending, done.recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors if self.num_groups == 1 else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        stats = self.worker.take_stats()
        return None if stats.empty() else KvxferdStats.of(stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferdStats(data=dict(data)) if data is not None else KvxferdStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KvxferdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBHNC"  # heads outermost inside a block: a head's K|V is one contiguous unit
