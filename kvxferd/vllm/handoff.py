"""The `kv_transfer_params` hand-off vLLM's P/D proxies use, and the orders the scheduler
gives its workers. Pure: no vLLM, no I/O.

    proxy -> P: {"do_remote_decode": true}            P computes the prompt, holds its blocks
    P -> proxy: {"do_remote_prefill": true, "remote_engine_id", "remote_request_id",
                 "remote_host", "remote_port", "remote_block_ids", "remote_block_sizes",
                 "remote_num_tokens", "tp_size", "remote_read_token"}
    proxy -> D: those params verbatim                  D reads through its daemon

`remote_read_token` is the hold's capability (docs/security.md): 128 random bits the prefill's
scheduler makes with the hold; only a read presenting it is granted the hold's blocks. It is
as secret as the prompt it belongs to, and travels only with it.

Block lists are vLLM's, per cache group, from the first prompt block, with the null block
(id 0) where a group keeps nothing: a sliding-window group nulls the blocks that left its
window, so only the trailing real blocks hold KV. A state group (Mamba/GDN) holds one state
per request: its last real block, the state after the prompt's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from ..identity import Z85_KEY
from ..protocol import RemoteRef


class HandoffError(ValueError):
    """kv_transfer_params that cannot start a read; the message names the field."""


class HoldOrder(msgspec.Struct, array_like=True):
    """Prefill: hold a finished request's blocks until its consumers have read them."""

    request_id: str
    block_ids: list[list[int]]
    lease_s: float
    read_token: str = ""  # what its reader presents (client.new_read_token)


class ReadOrder(msgspec.Struct, array_like=True):
    """Decode: read `remote.request_id` into `local_blocks` (the missing tail, per group).

    A release is a read with no local blocks: the prefill daemon is only notified, so it frees
    the blocks of a request the decode side computed itself (full hit) or dropped (abort).
    """

    request_id: str
    remote: RemoteRef
    num_tokens: int
    local_blocks: list[list[int]]
    remote_blocks: list[list[int]]
    # Why this read cannot be done: the worker fails it at once (its local blocks reported as
    # load errors, vLLM recomputes or fails them by its policy) and releases the prefill's hold.
    refusal: str = ""

    @property
    def is_release(self) -> bool:
        return not any(self.local_blocks)


class ExpectOrder(msgspec.Struct, array_like=True):
    """Decode: a request that will read `remote` arrived; its read (or release) follows once it
    is scheduled. The daemon keeps the prefill's holds alive meanwhile (a decode busy for longer
    than the prefill's lease still finds the KV)."""

    request_id: str
    remote: RemoteRef


class Orders(msgspec.Struct, array_like=True):
    """What the scheduler tells every worker in one step."""

    holds: list[HoldOrder] = []
    reads: list[ReadOrder] = []
    idle: bool = False  # no tokens scheduled this step: the engine only waits for transfers
    expects: list[ExpectOrder] = []


NULL_BLOCK = 0  # vLLM's placeholder block: in a list, a block the group does not keep


class GroupInfo(msgspec.Struct, frozen=True, array_like=True):
    """What the scheduler knows of one cache group."""

    kind: str  # "attention" or "state"
    block_size: int  # tokens per block
    scratch_blocks: int = 0  # state: speculative-decoding blocks after the state (MambaSpec.num_speculative_blocks)
    # attention: the sliding window in tokens, where a window block may be filled from inside
    # (0: full attention, or a decode caching prefixes: it would cache the block as whole)
    window: int = 0
    sliding_window: int = 0  # attention: the group's sliding window in tokens, caching or not (0: none)


# Bounds on what a hand-off may name, checked in arbitrary precision before use.
MAX_TOKENS = 1 << 24
MAX_BLOCK_ID = (1 << 31) - 1
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_TP = 1024
DAEMON_KEY = re.compile(f"|{Z85_KEY.pattern}")  # "": none named


class RemotePrefill(msgspec.Struct, frozen=True):
    """What a decode request's kv_transfer_params say about its prefill."""

    remote: RemoteRef
    block_ids: tuple[tuple[int, ...], ...]  # per cache group, from the first prompt block
    num_tokens: int  # prompt tokens whose KV the prefill computed; 0: unknown
    block_sizes: tuple[int, ...] = ()  # per cache group; empty: the same as the decode's


def parse_remote(params: dict[str, Any], num_groups: int) -> RemotePrefill:
    """Read a decode request's params (as P sent them, through the proxy). Every number is
    bounded before it is used: a router is no more trusted than any other client."""
    missing = [k for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                           "remote_block_ids", "tp_size") if params.get(k) is None]
    if missing:
        raise HandoffError(f"kv_transfer_params lack {missing}")
    try:
        token = params.get("remote_read_token") or ""
        if not isinstance(token, str) or len(token) > 128:
            raise HandoffError("remote_read_token must be a string of at most 128 characters")
        daemon_key = params.get("remote_daemon_key") or ""
        if not isinstance(daemon_key, str) or not DAEMON_KEY.fullmatch(daemon_key):
            raise HandoffError("remote_daemon_key must be a CurveZMQ public key: 40 characters of Z85")
        remote = RemoteRef(str(params["remote_engine_id"])[:256], str(params["remote_host"])[:256],
                           _bounded(params["remote_port"], 1, 65535, "remote_port"),
                           _bounded(params["tp_size"], 1, MAX_TP, "tp_size"), str(params["remote_request_id"])[:256],
                           token, daemon_key)
        blocks = params["remote_block_ids"]
        if not isinstance(blocks, list):
            raise HandoffError("remote_block_ids must be a list")
        if blocks and all(isinstance(b, int) for b in blocks):
            blocks = [blocks]  # one cache group, sent flat
        if len(blocks) != num_groups:
            raise HandoffError(f"remote_block_ids name {len(blocks)} cache groups, this engine has {num_groups}")
        groups = tuple(_block_list(group) for group in blocks)
        num_tokens = _bounded(params.get("remote_num_tokens") or 0, 0, MAX_TOKENS, "remote_num_tokens")
        sizes = tuple(_bounded(b, 1, MAX_TOKENS, "remote_block_sizes") for b in params.get("remote_block_sizes") or ())
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, HandoffError):
            raise
        raise HandoffError(f"kv_transfer_params malformed: {exc}") from None
    if sizes and len(sizes) != num_groups:
        raise HandoffError(f"remote_block_sizes {list(sizes)}: need one positive size per cache group")
    return RemotePrefill(remote, groups, num_tokens, sizes)


def _bounded(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise HandoffError(f"{what} must be an integer, got {type(value).__name__}")
    number = int(value)  # arbitrary precision: compared before anything else sees it
    if not low <= number <= high:
        raise HandoffError(f"{what} {str(number)[:20]} out of range {low}..{high}")
    return number


def _block_list(ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, list) or len(ids) > MAX_BLOCKS_PER_GROUP:
        raise HandoffError(f"remote_block_ids: each group's list holds at most {MAX_BLOCKS_PER_GROUP} block ids")
    blocks = tuple(_bounded(b, 0, MAX_BLOCK_ID, "remote_block_ids") for b in ids)
    real = [b for b in blocks if b != NULL_BLOCK]
    if len(set(real)) != len(real):  # the daemon refuses a read naming one twice: known here already
        twice = next(b for i, b in enumerate(real) if b in real[:i])
        raise HandoffError(f"remote_block_ids name block {twice} twice")
    return blocks


def prefill_params(engine_id: str, request_id: str, host: str, port: int, tp_size: int,
                   block_ids: list[list[int]], num_tokens: int, block_sizes: list[int],
                   read_token: str, daemon_key: str = "") -> dict[str, Any]:
    """The params P's response carries; the proxy hands them to D verbatim."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_host": host, "remote_port": port,
            "remote_block_ids": block_ids, "remote_block_sizes": block_sizes, "remote_num_tokens": num_tokens,
            "tp_size": tp_size, "transfer_mode": "pull", "remote_read_token": read_token,
            "remote_daemon_key": daemon_key}


def held_blocks(groups: list[GroupInfo], block_ids: list[list[int]]) -> list[list[int]]:
    """The blocks that hold a finished prompt's KV, per group: an attention group's real
    blocks, a state group's last one."""
    return [state_block(info, ids) if info.kind == "state" else [b for b in ids if b != NULL_BLOCK]
            for info, ids in zip(groups, block_ids)]


def state_block(info: GroupInfo, ids: Sequence[int]) -> list[int]:
    """The block that holds a request's state: the last real one before the speculative-decoding
    scratch blocks vLLM appends (mamba_cache_mode none: the first; align: the prompt's last)."""
    real = [b for b in ids if b != NULL_BLOCK]
    at = len(real) - 1 - info.scratch_blocks
    return real[at:at + 1] if at >= 0 else []


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_after_alloc(groups: list[GroupInfo], num_tokens: int) -> list[list[int]]:
    """The block lists vLLM gives a request of `num_tokens` computed tokens (prefix hit and read),
    as placeholders: NULL_BLOCK where a sliding window skips the block, 1 where a block is kept.
    vLLM 0.32's SlidingWindowManager skips the blocks wholly before token
    num_tokens - sliding_window + 1 (`get_num_skipped_tokens`)."""
    lists = []
    for info in groups:
        blocks = cdiv(num_tokens, info.block_size)
        skipped = 0
        if info.kind == "attention" and info.sliding_window:
            skipped = min(blocks, max(0, num_tokens - info.sliding_window + 1) // info.block_size)
        lists.append([NULL_BLOCK] * skipped + [1] * (blocks - skipped))
    return lists


def read_order(request_id: str, prefill: RemotePrefill, groups: list[GroupInfo], local_block_ids: list[list[int]],
               num_tokens: int, num_computed: int) -> ReadOrder:
    """Read tokens [num_computed, num_tokens) into this request's blocks.

    `local_block_ids` are all of the request's blocks per group (from token 0, nulls included);
    `num_computed` (a multiple of every block size) is what the local prefix cache holds. Each
    attention list goes out as its missing tail: the local blocks from the first token both
    sides hold (a sliding window starts late) to the one holding token num_tokens-1, and the
    prefill's real blocks up to there. A state group pairs the two sides' state blocks.

        tokens:        0      32     64     96     128 (num_tokens)
        prefill SWA:  | null | null |  p2  |  p3  |        remote -> [p2, p3] (first held token 64)
        decode SWA:   | null |  d1  |  d2  |  d3  |        local  -> [d2, d3]

    A window held in smaller blocks there may start inside a local block: that block is read
    from the first held token on, if every token before it is outside the window of every query
    this request makes (vLLM recomputes the prompt's last token: from num_tokens - window on),
    and only on a decode that caches no prefixes (`GroupInfo.window`).

        prefill SWA:  | null |  p1  |  p2  |  p3  |        remote -> [p1, p2, p3]
        decode SWA:   |      d0     |      d1     |        local  -> [d0, d1] (d0 from token 32)

    A read that cannot fill every local block it would be trusted for (the prefill's lists too
    short for the tokens, its window starting after a block this side needs, nothing left to
    read) comes back refused, naming why, with those local blocks: vLLM recomputes them (or
    fails the request, by its kv_load_failure_policy).
    """
    local, remote, owed = [], [], []
    sizes = prefill.block_sizes or tuple(g.block_size for g in groups)
    refusal = ""
    for info, rbs, ids, rids in zip(groups, sizes, local_block_ids, prefill.block_ids):
        if info.kind == "state":
            local.append(state_block(info, ids))
            remote.append(state_block(info, rids))
            owed.append(local[-1])
            continue
        bs = info.block_size
        end = cdiv(num_tokens, bs)
        owed.append([b for b in ids[num_computed // bs:end] if b != NULL_BLOCK])
        need = cdiv(num_tokens, rbs)
        held = list(rids[:need])
        if len(held) < need:
            refusal = refusal or (f"the prefill names {len(held)} blocks of {rbs} tokens for {num_tokens} tokens; "
                                  f"{need} needed")
        first_held = next((i for i, b in enumerate(held) if b != NULL_BLOCK), len(held))
        from_token = first_held * rbs
        outside_window = info.window and from_token <= max(0, num_tokens - info.window)
        first = max(num_computed // bs, from_token // bs if outside_window else cdiv(from_token, bs))
        if any(b != NULL_BLOCK for b in ids[num_computed // bs:first]):  # needed here, not (wholly) held there
            refusal = refusal or (f"the prefill holds tokens from {first_held * rbs} on (its window); this side "
                                  f"needs blocks of {bs} tokens from {num_computed // bs * bs}")
        wanted = list(ids[first:end])
        while wanted and wanted[0] == NULL_BLOCK:  # tokens this side's window no longer needs
            wanted.pop(0)
        if wanted and first_held == len(held):
            refusal = refusal or f"the prefill holds no block of a group this side needs {len(wanted)} blocks of"
        local.append(wanted)
        remote.append(held[first_held:])
    if not refusal and num_tokens > num_computed and not any(local):
        refusal = "nothing the prefill holds is missing here, yet tokens were promised to vLLM"
    if refusal:
        return ReadOrder(request_id, prefill.remote, num_tokens, owed, [[] for _ in owed], refusal)
    return ReadOrder(request_id, prefill.remote, num_tokens, local, remote)


def release_order(request_id: str, prefill: RemotePrefill) -> ReadOrder:
    groups: list[list[int]] = [[] for _ in prefill.block_ids]
    return ReadOrder(request_id, prefill.remote, prefill.num_tokens, groups, [[] for _ in groups])
