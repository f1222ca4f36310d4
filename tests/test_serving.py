"""Serving on request (serving.py, side-channel version 5): a daemon progresses NIXL for the
readers that ask, and unasked only while a reader from before that version reads it."""

from __future__ import annotations

import time

import pytest

from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.plan.models import ModelShape
from kvxferd.serving import LEGACY_S, MAX_READERS, Readers

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=32, block_size=16, num_blocks=128)
TOKENS = 40


def test_a_reader_whose_notices_say_it_asks_is_never_taken_for_one_that_does_not():
    r = Readers()
    assert not r.unasked(0.0) and not r.serving(0.0)  # no reader yet: nothing to progress for
    assert not r.heard("new", 10.0, asks=True)
    assert not r.heard("new", 11.0)  # its NIXL notification (a full hit) as well
    assert not r.unasked(11.0)


def test_a_reader_that_never_asks_keeps_the_old_pace_for_legacy_s():
    r = Readers()
    assert r.heard("old", 10.0)  # a version 4 notice, or a notification on a READ
    assert r.unasked(10.0 + LEGACY_S - 0.001) and not r.unasked(10.0 + LEGACY_S)


def test_a_serve_request_asks_for_progress_until_its_time_is_up():
    r = Readers()
    r.serve(1.0, 5.0)
    r.serve(0.2, 5.5)  # a shorter one does not cut the first short
    assert r.serving(5.999) and not r.serving(6.0)


def test_the_readers_remembered_are_bounded_and_the_forgotten_count_as_legacy():
    r = Readers()
    for i in range(MAX_READERS + 1):
        r.heard(f"agent-{i}", 1.0, asks=True)
    assert r.heard("agent-0", 2.0)  # the oldest was forgotten: taken for a reader that never asks
    assert not r.heard(f"agent-{MAX_READERS}", 2.0)


def _serve_requests(c: Cluster, daemon: int, way: str) -> float:
    return c.daemons[daemon].metric(f'kvxferd_serve_requests_total{{way="{way}"}}')


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_an_idle_prefill_daemon_is_asked_for_its_progress_only_when_a_read_needs_it(transport):
    """Real daemons. The prefill daemon holds a request, quiet past its hot window after the
    handshake: it progresses for no one. Over UCX's TCP transport the read needs that progress
    (every READ waits on the target there), asks for it, and is received byte for byte; over
    CMA the read asks nothing once its endpoint is wired up (the copy runs inside the post)."""
    args = ["--ucx", "UCX_TLS=tcp"] if transport == "tcp" else []
    with Cluster(SHAPE, 1, 1, metrics=True, daemon_args=args) as c:
        c.transfer(0, TOKENS)  # the handshake, and the endpoint's wire-up
        time.sleep(1.5)  # past the prefill daemon's hot window (idle_hot_s 1 s) and SERVE_S / 2
        before = _serve_requests(c, 1, "sent")
        out = c.transfer(1, TOKENS)  # verified byte for byte by the decode engine
        assert out["released"], out
        sent, received = _serve_requests(c, 1, "sent") - before, _serve_requests(c, 0, "received")
        if transport == "tcp":
            assert sent >= 1 and received >= sent, (sent, received)
        else:
            assert sent == 0, sent
