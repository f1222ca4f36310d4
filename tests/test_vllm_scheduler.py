"""The connector's scheduler half, driven the way vLLM's scheduler calls it (no vLLM needed)."""

from dataclasses import dataclass, field

import msgspec
import pytest

from kvxferd.vllm import handoff, versions
from kvxferd.vllm.options import ConnectorOptions
from kvxferd.vllm.scheduler import SchedulerSide

BS = 32


@dataclass
class Request:  # the fields of vllm.v1.request.Request the connector reads
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0


@dataclass
class Blocks:  # vllm.v1.core.kv_cache_manager.KVCacheBlocks
    ids: list[list[int]] = field(default_factory=list)

    def get_block_ids(self):
        return tuple(self.ids)


def side() -> SchedulerSide:
    return SchedulerSide("engine-p", 2, [BS], 30.0, lambda: ("10.0.0.1", 5600))


def prefill_params(num_tokens=100, blocks=(4, 5, 6, 7)) -> dict:
    return handoff.prefill_params("engine-p", "req-p", "10.0.0.1", 5600, 2, [list(blocks)], num_tokens)


def test_prefill_holds_and_answers_with_what_decode_needs():
    s = side()
    req = Request("req-p", 100, {"do_remote_decode": True}, num_computed_tokens=100)
    delay, params = s.finished(req, ([4, 5, 6, 7],), completed=True)
    assert delay and params == prefill_params()
    assert s.take_orders().holds == [handoff.HoldOrder("req-p", [[4, 5, 6, 7]], 30.0)]
    assert s.take_orders().holds == []  # orders go out once


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
    assert read.remote == handoff.RemoteRef("engine-p", "10.0.0.1", 5600, 2, "req-p")
    assert req.kv_transfer_params["do_remote_prefill"] is False  # read once, not again after a preemption


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


def test_params_parse_flat_block_lists_and_refuse_wrong_group_counts():
    flat = dict(prefill_params(), remote_block_ids=[1, 2, 3])
    assert handoff.parse_remote(flat, 1).block_ids == ((1, 2, 3),)
    with pytest.raises(handoff.HandoffError, match="2 cache groups"):
        handoff.parse_remote(dict(prefill_params(), remote_block_ids=[[1], [2]]), 1)
    with pytest.raises(handoff.HandoffError, match="remote_port"):
        handoff.parse_remote(dict(prefill_params(), remote_port=70000), 1)


def test_orders_survive_the_trip_to_workers():
    orders = handoff.Orders([handoff.HoldOrder("a", [[1]], 5.0)],
                            [handoff.read_order("b", handoff.parse_remote(prefill_params(), 1), [BS], [[9, 8, 7, 6]],
                                                100, 32)])
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
    s = SchedulerSide("engine-p", 1, [BS], 30.0, nowhere)
    req = Request("req-p", 100, {"do_remote_decode": True}, num_computed_tokens=100)
    assert s.finished(req, ([4, 5, 6, 7],), completed=True) == (False, None)
    assert s.take_orders().holds == []
