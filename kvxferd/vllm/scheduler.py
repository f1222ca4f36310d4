"""The connector's scheduler half: vLLM's request lifecycle turned into holds and reads.

    prefill:  request_finished(do_remote_decode) -> delay free, hold order, params for D
    decode:   get_num_new_matched_tokens(do_remote_prefill) -> (missing tokens, async)
              update_state_after_alloc -> read order (the missing tail) or release (full hit)
              request_finished before any of that (abort) -> release
    each step: build_connector_meta -> Orders for every worker

Duck-typed over vLLM's Request and KVCacheBlocks so it is tested without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .handoff import (
    HandoffError,
    HoldOrder,
    Orders,
    RemotePrefill,
    parse_remote,
    prefill_params,
    read_order,
    release_order,
)

log = logging.getLogger("kvxferd.vllm")


class SchedulerSide:
    def __init__(self, engine_id: str, tp_size: int, block_sizes: list[int], lease_s: float,
                 side_channel: Callable[[], tuple[str, int]]) -> None:
        self.engine_id, self.tp_size, self.block_sizes, self.lease_s = engine_id, tp_size, block_sizes, lease_s
        self.side_channel = side_channel  # asked lazily: the daemon may start after vLLM
        self.orders = Orders([], [])

    # --- decode --------------------------------------------------------------
    def _remote(self, request: Any) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return parse_remote(params, len(self.block_sizes))
        except HandoffError as exc:
            log.warning("request %s: %s; computing it locally", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def _read_tokens(self, request: Any, prefill: RemotePrefill) -> int:
        n = request.num_prompt_tokens
        return min(prefill.num_tokens, n) if prefill.num_tokens else n

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        prefill = self._remote(request)
        if prefill is None:
            return 0, False
        num_tokens = self._read_tokens(request, prefill)
        # vLLM recomputes the last prompt token to sample the next one: when the local
        # prefix cache holds all but that token, there is nothing worth reading.
        if num_computed >= num_tokens - 1:
            return 0, False
        return num_tokens - num_computed, True

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        prefill = self._remote(request)
        if prefill is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # once: not again after a preemption
        if num_external_tokens <= 0:
            self.orders.reads.append(release_order(request.request_id, prefill))
            return
        num_tokens = self._read_tokens(request, prefill)
        local = [list(ids) for ids in blocks.get_block_ids()]
        self.orders.reads.append(read_order(request.request_id, prefill, self.block_sizes, local, num_tokens,
                                            num_tokens - num_external_tokens))

    # --- both ----------------------------------------------------------------
    def finished(self, request: Any, block_ids: tuple[list[int], ...],
                 completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """`completed`: the request stopped or hit its length (not aborted, not an error)."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # decode request dropped before its read was planned
            prefill = self._remote(request)
            if prefill is not None:
                params["do_remote_prefill"] = False
                self.orders.reads.append(release_order(request.request_id, prefill))
            return False, None
        if not params.get("do_remote_decode") or not completed or not any(block_ids):
            return False, None
        try:
            host, port = self.side_channel()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # no daemon to hold the blocks: free them
            log.warning("request %s: cannot hand off, the kvxferd daemon's side channel is unknown: %s",
                        request.request_id, exc)
            return False, None
        blocks = [list(map(int, ids)) for ids in block_ids]
        self.orders.holds.append(HoldOrder(request.request_id, blocks, self.lease_s))
        return True, prefill_params(self.engine_id, request.request_id, host, port, self.tp_size, blocks,
                                    request.num_computed_tokens)

    def take_orders(self) -> Orders:
        orders, self.orders = self.orders, Orders([], [])
        return orders
