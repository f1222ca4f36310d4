"""The connector's scheduler half: vLLM's request lifecycle turned into holds and reads.

    prefill:  new request (do_remote_decode, a state group) -> stop one token short of the prompt
              request_finished(do_remote_decode) -> delay free, hold order, params for D
    decode:   new request (do_remote_prefill) -> expect order (the prefill's holds kept alive
              while the request waits to be scheduled)
              get_num_new_matched_tokens(do_remote_prefill) -> (missing tokens, async), or 0 and a
              release when the read would be refused (vLLM computes the prompt)
              update_state_after_alloc -> read order (the missing tail) or release (full hit)
              request_finished before any of that (abort) -> release
    each step: build_connector_meta -> Orders for every worker

Duck-typed over vLLM's Request and KVCacheBlocks so it is tested without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..client import new_read_token
from .handoff import (
    ExpectOrder,
    GroupInfo,
    HandoffError,
    HoldOrder,
    Orders,
    RemotePrefill,
    blocks_after_alloc,
    held_blocks,
    parse_remote,
    prefill_params,
    read_order,
    release_order,
)

log = logging.getLogger("kvxferd.vllm")


class SchedulerSide:
    def __init__(self, engine_id: str, tp_size: int, groups: list[GroupInfo], lease_s: float,
                 side_channel: Callable[[], tuple[str, int, str]]) -> None:
        self.engine_id, self.tp_size, self.groups, self.lease_s = engine_id, tp_size, groups, lease_s
        self.side_channel = side_channel  # asked lazily: the daemon may start after vLLM
        self.orders = Orders([], [])
        # A state (Mamba/GDN) holds every token it has seen: the decode must compute the last
        # prompt token on the state before it, so the prefill stops one token short.
        self.backoff = 1 if any(g.kind == "state" for g in groups) else 0

    # --- prefill -------------------------------------------------------------
    def new_request(self, request: Any) -> None:
        """A request about to be scheduled. A decode's: its read is expected (every request
        that names a prefill ends in a read or a release order). A prefill's for a remote
        decode of a state model: it computes all but the last prompt token (vLLM's Request,
        trimmed in place, once)."""
        prefill = self._remote(request)
        if prefill is not None:
            self.orders.expects.append(ExpectOrder(request.request_id, prefill.remote))
            return
        params = request.kv_transfer_params
        if (not self.backoff or not params or not params.get("do_remote_decode")
                or params.get("_kvxferd_truncated") or request.num_prompt_tokens <= self.backoff
                or request.prompt_token_ids is None
                # embeddings or media beside the tokens would need trimming too: leave the prompt
                # whole, and the decode (which then refuses its state) computes it itself
                or getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None)):
            return
        del request.prompt_token_ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params["_kvxferd_truncated"] = True

    # --- decode --------------------------------------------------------------
    def _remote(self, request: Any) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return parse_remote(params, len(self.groups))
        except HandoffError as exc:
            log.warning("request %s: %s; computing it locally", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def _read_tokens(self, request: Any, prefill: RemotePrefill) -> int:
        n = request.num_prompt_tokens - self.backoff
        return min(prefill.num_tokens, n) if prefill.num_tokens else n

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        prefill = self._remote(request)
        if prefill is None:
            return 0, False
        if self.backoff and prefill.num_tokens != request.num_prompt_tokens - self.backoff:
            # its state is after another token count than the one this side continues from
            log.warning("request %s: the prefill computed %d of %d prompt tokens, a state model needs %d; "
                        "computing it locally", request.request_id, prefill.num_tokens, request.num_prompt_tokens,
                        request.num_prompt_tokens - self.backoff)
            self.orders.reads.append(release_order(request.request_id, prefill))
            request.kv_transfer_params["do_remote_prefill"] = False
            return 0, False
        num_tokens = self._read_tokens(request, prefill)
        # vLLM recomputes the last prompt token to sample the next one: when the local
        # prefix cache holds all but that token, there is nothing worth reading. (A state
        # model's prefill stopped short of that token already.)
        if num_computed >= num_tokens - (0 if self.backoff else 1):
            return 0, False
        # A read the two geometries refuse (a window held from later than a block this side
        # keeps, lists too short) is known now: vLLM computes the prompt itself, rather than
        # failing the request when the read is refused after it was scheduled as a load.
        planned = read_order(request.request_id, prefill, self.groups, blocks_after_alloc(self.groups, num_tokens),
                             num_tokens, num_computed)
        if planned.refusal:
            log.warning("request %s: %s; computing it locally", request.request_id, planned.refusal)
            self.orders.reads.append(release_order(request.request_id, prefill))
            request.kv_transfer_params["do_remote_prefill"] = False
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
        self.orders.reads.append(read_order(request.request_id, prefill, self.groups, local, num_tokens,
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
            host, port, daemon_key = self.side_channel()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # no daemon to hold the blocks: free them
            log.warning("request %s: cannot hand off, the kvxferd daemon's side channel is unknown: %s",
                        request.request_id, exc)
            return False, None
        blocks = [list(map(int, ids)) for ids in block_ids]
        token = new_read_token()  # made here: the params leave with this step, the hold with the next
        self.orders.holds.append(HoldOrder(request.request_id, held_blocks(self.groups, blocks), self.lease_s, token))
        return True, prefill_params(self.engine_id, request.request_id, host, port, self.tp_size, blocks,
                                    request.num_computed_tokens, [g.block_size for g in self.groups], token,
                                    daemon_key)

    def take_orders(self, idle: bool = False) -> Orders:
        """This step's orders; `idle`: the step schedules no tokens (workers may wait for the daemon)."""
        orders, self.orders = self.orders, Orders([], [])
        orders.idle = idle
        return orders
