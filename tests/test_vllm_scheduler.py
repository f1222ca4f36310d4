"""The connector's scheduler half, driven the way vLLM's scheduler calls it (no vLLM needed)."""

from dataclasses import dataclass, field

import msgspec
import pytest

from kvxferd.vllm import handoff, versions
from kvxferd.vllm.handoff import GroupInfo
from kvxferd.vllm.options import ConnectorOptions
from kvxferd.vllm.scheduler import SchedulerSide

BS = 32
ATTENTION = [GroupInfo("attention", BS)]
HYBRID = [GroupInfo("state", 4096), GroupInfo("attention", BS)]  # a Mamba2 hybrid: state group first


@dataclass
class Request:  # the fields of vllm.v1.request.Request the connector reads
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16

    def __post_init__(self):
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(range(self.num_prompt_tokens))
        self._all_token_ids = list(self.prompt_token_ids)


@dataclass
class Blocks:  # vllm.v1.core.kv_cache_manager.KVCacheBlocks
    ids: list[list[int]] = field(default_factory=list)

    def get_block_ids(self):
        return tuple(self.ids)


def side(groups=ATTENTION) -> SchedulerSide:
    return SchedulerSide("engine-p", 2, groups, 30.0, lambda: ("10.0.0.1", 5600, DAEMON_KEY))


TOKEN = "ab" * 16


DAEMON_KEY = "rq[:4ikL5ecO=*C@}2uN8#sBzt(}A.T4+/X7{%Fa"  # a CurveZMQ public key, as the daemon registers it


def prefill_params(num_tokens=100, blocks=(4, 5, 6, 7), token=TOKEN) -> dict:
    return handoff.prefill_params("engine-p", "req-p", "10.0.0.1", 5600, 2, [list(blocks)], num_tokens, [BS], token,
                                  DAEMON_KEY)


def test_prefill_holds_and_answers_with_what_decode_needs():
    s = side()
    req = Request("req-p", 100, {"do_remote_decode": True}, num_computed_tokens=100)
    delay, params = s.finished(req, ([4, 5, 6, 7],), completed=True)
    token = params["remote_read_token"]
    assert len(token) == 32 and int(token, 16) >= 0  # 128 bits, as hex
    assert delay and params == prefill_params(token=token)
    assert s.take_orders().holds == [handoff.HoldOrder("req-p", [[4, 5, 6, 7]], 30.0, token)]
    assert s.take_orders().holds == []  # orders go out once
    _, again = side().finished(Request("req-p", 100, {"do_remote_decode": True}, num_computed_tokens=100),
                               ([4, 5, 6, 7],), completed=True)
    assert again["remote_read_token"] != token  # a new capability for every hold


def test_decode_presents_the_read_token_it_was_given():
    assert handoff.parse_remote(prefill_params(), 1).remote.read_token == TOKEN
    assert handoff.parse_remote(prefill_params(), 1).remote.daemon_key == DAEMON_KEY  # the key D's daemon dials
    for bad in ("x" * 39, DAEMON_KEY + "\n", 7):
        with pytest.raises(handoff.HandoffError, match="remote_daemon_key"):
            handoff.parse_remote(dict(prefill_params(), remote_daemon_key=bad), 1)
    with pytest.raises(handoff.HandoffError, match="remote_read_token"):
        handoff.parse_remote(dict(prefill_params(), remote_read_token=["x"]), 1)


@pytest.mark.parametrize("completed,blocks", [(False, ([4],)), (True, ([],))])
def test_prefill_aborted_or_blockless_frees_now(completed, blocks):
    s = side()
    assert s.finished(Request("r", 10, {"do_remote_decode": True}), blocks, completed) == (False, None)
    assert s.take_orders().holds == []


def test_decode_reads_the_missing_tail_only():
    s = side()
    req = Request("req-d", 100, prefill_params())
    assert s.matched_tokens(req, 64) == (36, True)  # two blocks cached locally
    s.after_alloc(req, Blocks([[10, 11, 12, 13]]), 36)
    (read,) = s.take_orders().reads
    assert read.local_blocks == [[12, 13]] and read.remote_blocks == [[4, 5, 6, 7]] and read.num_tokens == 100
    assert read.remote == handoff.RemoteRef("engine-p", "10.0.0.1", 5600, 2, "req-p", TOKEN, DAEMON_KEY)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # read once, not again after a preemption


def test_a_decode_request_is_expected_as_it_arrives_and_then_read_or_released():
    """The daemon keeps the prefill's holds alive from the request's arrival (an expect order)
    until the read or release that every such request ends in."""
    s = side()
    read_req, aborted = Request("req-d", 100, prefill_params()), Request("req-a", 100, prefill_params())
    s.new_request(read_req)
    s.new_request(aborted)
    s.new_request(Request("req-local", 100, None))  # nothing to read: nothing expected
    orders = s.take_orders()
    assert [(e.request_id, e.remote.request_id) for e in orders.expects] == [("req-d", "req-p"), ("req-a", "req-p")]
    assert orders.reads == []
    assert s.matched_tokens(read_req, 0) == (100, True)
    s.after_alloc(read_req, Blocks([[10, 11, 12, 13]]), 100)
    s.finished(aborted, ([],), completed=False)
    assert [(r.request_id, r.is_release) for r in s.take_orders().reads] == [("req-d", False), ("req-a", True)]


def _window_params(num_tokens: int, window: int, block_size: int) -> dict:
    """A prefill's params for one sliding-window group: the blocks it nulled before its window."""
    skipped = max(0, num_tokens - window + 1) // block_size
    blocks = [0] * skipped + list(range(100, 100 + handoff.cdiv(num_tokens, block_size) - skipped))
    return handoff.prefill_params("engine-p", "req-p", "10.0.0.1", 5600, 2, [blocks], num_tokens, [block_size], TOKEN,
                                  DAEMON_KEY)


@pytest.mark.parametrize("decode_block,read", [(64, True), (256, False)])
def test_a_read_the_window_would_refuse_is_computed_locally_from_the_start(decode_block, read):
    """The prefill keeps a window of 64 tokens in blocks of 32: of a 200-token prompt, tokens
    from 128 on. A decode caching prefixes, whose window blocks are 64 tokens, needs them from 128
    as well: read. One of 256-token blocks keeps its block 0..255 whole, which the prefill cannot
    fill: vLLM is told there is nothing to load (it computes the prompt), the prefill's hold is
    released, and nothing is refused after the request was scheduled (a failed request)."""
    s = side([GroupInfo("attention", decode_block, sliding_window=64)])  # window 0: caching prefixes
    req = Request("req-d", 200, _window_params(200, 64, 32))
    s.new_request(req)
    matched = s.matched_tokens(req, 0)
    orders = s.take_orders()
    if read:
        assert matched == (200, True) and [r.is_release for r in orders.reads] == []
        s.after_alloc(req, Blocks([handoff.blocks_after_alloc(s.groups, 200)[0]]), 200)
        (order,) = s.take_orders().reads
        assert not order.refusal and order.remote_blocks == [[100, 101, 102]]
    else:
        assert matched == (0, False) and [r.is_release for r in orders.reads] == [True]
        assert req.kv_transfer_params["do_remote_prefill"] is False
        s.after_alloc(req, Blocks([[7]]), 0)  # vLLM computes it: nothing more is ordered
        assert s.take_orders().reads == []


def test_blocks_after_alloc_null_what_vllm_s_sliding_window_skips():
    groups = [GroupInfo("attention", 32, sliding_window=64), GroupInfo("attention", 32), GroupInfo("state", 4096)]
    # 200 tokens: blocks wholly before token 137 are skipped (vLLM: num_tokens - window + 1)
    assert handoff.blocks_after_alloc(groups, 200) == [[0, 0, 0, 0, 1, 1, 1], [1] * 7, [1]]
    assert handoff.blocks_after_alloc(groups, 40) == [[1, 1], [1, 1], [1]]


def test_decode_full_hit_releases_without_reading():
    s = side()
    req = Request("req-d", 97, prefill_params(97))
    assert s.matched_tokens(req, 96) == (0, False)  # all but the token vLLM recomputes anyway
    s.after_alloc(req, Blocks([[10, 11, 12, 13]]), 0)
    (release,) = s.take_orders().reads
    assert release.is_release and release.remote.request_id == "req-p"


def test_decode_aborted_before_scheduling_releases_prefill_blocks():
    s = side()
    req = Request("req-d", 100, prefill_params())
    assert s.finished(req, ([],), completed=False) == (False, None)
    (release,) = s.take_orders().reads
    assert release.is_release and release.request_id == "req-d"
    assert s.finished(req, ([],), completed=False) == (False, None)  # once only
    assert s.take_orders().reads == []


def test_bad_params_compute_locally():
    s = side()
    req = Request("req-d", 100, {"do_remote_prefill": True, "remote_engine_id": "p"})
    assert s.matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_a_block_named_twice_is_computed_locally_before_scheduling():
    """The decode daemon refuses a read naming a remote block twice; the scheduler half knows it
    from the params (nulls may repeat: they are what a window dropped)."""
    s = side()
    assert handoff.parse_remote(prefill_params(blocks=(0, 0, 6, 7)), 1).block_ids == ((0, 0, 6, 7),)
    req = Request("req-d", 100, prefill_params(blocks=(4, 5, 5, 7)))
    assert s.matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_params_parse_flat_block_lists_and_refuse_wrong_group_counts():
    flat = dict(prefill_params(), remote_block_ids=[1, 2, 3])
    assert handoff.parse_remote(flat, 1).block_ids == ((1, 2, 3),)
    with pytest.raises(handoff.HandoffError, match="2 cache groups"):
        handoff.parse_remote(dict(prefill_params(), remote_block_ids=[[1], [2]]), 1)
    with pytest.raises(handoff.HandoffError, match="remote_port"):
        handoff.parse_remote(dict(prefill_params(), remote_port=70000), 1)


def test_orders_survive_the_trip_to_workers():
    orders = handoff.Orders([handoff.HoldOrder("a", [[1]], 5.0)],
                            [handoff.read_order("b", handoff.parse_remote(prefill_params(), 1), ATTENTION,
                                                [[9, 8, 7, 6]], 100, 32)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(orders), type=handoff.Orders) == orders


def test_versions_outside_the_range_are_refused_by_name():
    versions.check("0.32.0")
    versions.check("0.33.1+cu129")
    with pytest.raises(RuntimeError, match=r">=0.32,<0.34.*0.31.2"):
        versions.check("0.31.2")


def test_unknown_options_are_named():
    assert ConnectorOptions.from_extra({"socket": "/s", "lease_s": "12"}).lease_s == 12.0
    with pytest.raises(ValueError, match="lease"):
        ConnectorOptions.from_extra({"lease": 3})


def test_prefill_without_a_daemon_frees_at_once():
    def nowhere():
        raise ConnectionError("no kvxferd daemon at /nowhere")
    s = SchedulerSide("engine-p", 1, ATTENTION, 30.0, nowhere)
    req = Request("req-p", 100, {"do_remote_decode": True}, num_computed_tokens=100)
    assert s.finished(req, ([4, 5, 6, 7],), completed=True) == (False, None)
    assert s.take_orders().holds == []


def test_state_model_prefill_stops_one_token_short_once():
    """A state holds every token it saw: the decode computes the last prompt token on h(N-1)."""
    s = side(HYBRID)
    req = Request("req-p", 100, {"do_remote_decode": True})
    s.new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids)) == (99, 99, 99)
    assert req.max_tokens == 1
    s.new_request(req)  # preempted and scheduled again: not twice
    assert req.num_prompt_tokens == 99
    plain = Request("req-x", 100, {"do_remote_decode": True})
    side().new_request(plain)  # attention only: the prefill computes the whole prompt
    assert plain.num_prompt_tokens == 100


def test_state_model_prefill_holds_the_last_state_block_and_real_attention_blocks():
    s = side(HYBRID)
    req = Request("req-p", 99, {"do_remote_decode": True}, num_computed_tokens=99)
    delay, params = s.finished(req, ([7], [4, 5, 6, 8]), completed=True)
    assert delay and params["remote_block_ids"] == [[7], [4, 5, 6, 8]]
    assert params["remote_block_sizes"] == [4096, BS] and params["remote_num_tokens"] == 99
    assert s.take_orders().holds == [handoff.HoldOrder("req-p", [[7], [4, 5, 6, 8]], 30.0,
                                                       params["remote_read_token"])]


def test_state_model_decode_reads_all_but_the_last_token():
    s = side(HYBRID)
    params = handoff.prefill_params("engine-p", "req-p", "h", 5600, 1, [[7], [4, 5, 6, 8]], 99, [4096, BS], TOKEN)
    req = Request("req-d", 100, params)
    assert s.matched_tokens(req, 0) == (99, True)  # vLLM then computes token 99 itself (no rewind)
    s.after_alloc(req, Blocks([[3], [10, 11, 12, 13]]), 99)
    (read,) = s.take_orders().reads
    assert (read.num_tokens, read.local_blocks, read.remote_blocks) == (99, [[3], [10, 11, 12, 13]],
                                                                        [[7], [4, 5, 6, 8]])


def test_state_model_decode_computes_locally_when_the_prefill_ran_the_whole_prompt():
    s = side(HYBRID)
    params = handoff.prefill_params("engine-p", "req-p", "h", 5600, 1, [[7], [4, 5, 6, 8]], 100, [4096, BS], TOKEN)
    req = Request("req-d", 100, params)
    assert s.matched_tokens(req, 0) == (0, False)  # its state includes the token this side would add again
    (release,) = s.take_orders().reads
    assert release.is_release and req.kv_transfer_params["do_remote_prefill"] is False


def test_block_sizes_in_params_are_checked():
    with pytest.raises(handoff.HandoffError, match="remote_block_sizes"):
        handoff.parse_remote(dict(prefill_params(), remote_block_sizes=[0]), 1)
    assert handoff.parse_remote(dict(prefill_params(), remote_block_sizes=None), 1).block_sizes == ()


@pytest.mark.parametrize("field,value,match", [
    ("remote_num_tokens", float("inf"), "remote_num_tokens must be an integer"),
    ("remote_num_tokens", 10**400, "out of range"),
    ("tp_size", 2**70, "tp_size"),
    ("remote_port", True, "remote_port must be an integer"),
    ("remote_block_ids", [[2**70]], "remote_block_ids"),
    ("remote_block_ids", [[-1]], "remote_block_ids"),
    ("remote_block_ids", "1,2", "must be a list"),
    ("remote_block_sizes", [0], "remote_block_sizes"),
    ("remote_block_sizes", [1e400], "remote_block_sizes must be an integer"),
])
def test_hostile_params_are_refused_before_use(field, value, match):
    """A router is a client like any other: what it names is bounded before anything uses it,
    and the request is computed locally instead of crashing the engine."""
    with pytest.raises(handoff.HandoffError, match=match):
        handoff.parse_remote(dict(prefill_params(), **{field: value}), 1)
    s = side()
    req = Request("req-d", 100, dict(prefill_params(), **{field: value}))
    assert s.matched_tokens(req, 0) == (0, False)



def test_state_model_prefill_with_embeddings_keeps_its_prompt_whole():
    s = side(HYBRID)
    req = Request("req-p", 100, {"do_remote_decode": True})
    req.prompt_embeds = object()  # embeddings beside the tokens: trimming the ids alone would tear them apart
    s.new_request(req)
    assert req.num_prompt_tokens == 100 and "_kvxferd_truncated" not in req.kv_transfer_params
