"""Serving on request (serving.py, side-channel version 5): a daemon progresses NIXL for the
readers that ask, and unasked only while a reader from before that version reads it."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from kvxferd import handshake as hs
from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.plan.models import ModelShape
from kvxferd.serving import LEGACY_S, MAX_READERS, Readers

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=32, block_size=16, num_blocks=128)
TOKENS = 40


def test_a_reader_whose_notices_say_it_asks_is_known_to_and_a_version_4_notice_unsays_it():
    r = Readers()
    assert not r.unasked(0.0) and not r.serving(0.0)  # no reader yet: nothing to progress for
    r.notified("new", 10.0, asks=True)
    assert r.asks("new") and not r.unasked(10.0)
    r.notified("new", 11.0, asks=False)  # a notice of version 4 under that name
    assert not r.asks("new") and r.unasked(11.0)


def test_a_reader_that_does_not_ask_keeps_the_old_pace_for_legacy_s():
    r = Readers()
    r.notified("old", 10.0, asks=False)  # a version 4 notice, or a notification on a READ
    assert r.unasked(10.0 + LEGACY_S - 0.001) and not r.unasked(10.0 + LEGACY_S)


def test_a_serve_request_asks_for_progress_until_its_time_is_up():
    r = Readers()
    r.serve(1.0, 5.0)
    r.serve(0.2, 5.5)  # a shorter one does not cut the first short
    assert r.serving(5.999) and not r.serving(6.0)


def test_the_readers_remembered_are_bounded():
    r = Readers()
    for i in range(MAX_READERS + 1):
        r.notified(f"agent-{i}", 1.0, asks=True)
    assert not r.asks("agent-0") and r.asks(f"agent-{MAX_READERS}")  # the oldest forgotten


def _serve_requests(c: Cluster, daemon: int, way: str) -> float:
    return c.daemons[daemon].metric(f'kvxferd_serve_requests_total{{way="{way}"}}')


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_an_idle_prefill_daemon_progresses_for_a_read_that_asks_and_only_then(transport, tmp_path):
    """Real daemons whose idle pace is one NIXL progress every 30 s. The prefill daemon holds a
    request, quiet past its hot window after the handshake, its reader known to ask: it
    progresses for no one. Over UCX's TCP transport a READ runs only with its progress (there the
    target serves the copy), so every read asks, and is received byte for byte, well within its
    10 s deadline, only because it asked. Over CMA a read asks nothing once its endpoint is wired
    up (the copy runs inside the post): a read received without one serve request shows that the
    prefill's progress was not needed. When UCX finishes the wire-up depends on the peer's
    progress and the host's load (a loaded host has seen the second and third reads still ask),
    so the CMA case reads until one asks nothing, at most READS times."""
    config = tmp_path / "pace.toml"
    config.write_text("idle_max_s = 30.0\n")
    args = ["--config", str(config), *(["--ucx", "UCX_TLS=tcp"] if transport == "tcp" else [])]
    with Cluster(SHAPE, 1, 1, metrics=True, daemon_args=args) as c:
        # The handshake, a version 5 notice, and the first endpoint's wire-up
        c.transfer(0, TOKENS)
        asked = []
        for seq in range(1, 1 + READS):
            time.sleep(1.5)  # past the prefill daemon's hot window (idle_hot_s 1 s) and SERVE_S / 2
            sent, received = _serve_requests(c, 1, "sent"), _serve_requests(c, 0, "received")
            out = c.transfer(seq, TOKENS, deadline_s=10.0)  # verified byte for byte by the decode engine
            assert out["status"] == "received" and out["released"] == ["sent"], out
            sent, received = _serve_requests(c, 1, "sent") - sent, _serve_requests(c, 0, "received") - received
            assert received <= sent, (seq, sent, received)  # the prefill served only when asked
            asked.append(sent)
            if transport == "tcp":
                assert sent >= 1 and received >= 1, (seq, sent, received)
            if (transport == "tcp" and seq == 2) or (transport == "cma" and sent == 0):
                break
        if transport == "cma":
            assert asked[-1] == 0, f"every CMA read after the first asked for the prefill's progress: {asked}"


READS = 6


def _side_channel(c: Cluster, *requests: hs.SideRequest) -> hs.HandshakeReply:
    """As a reader would: handshake for the prefill engine (its first request), then the rest on
    a link of its own, unanswered."""
    async def talk() -> hs.HandshakeReply:
        ctx = zmq.asyncio.Context()
        link = ctx.socket(zmq.DEALER)
        link.setsockopt(zmq.LINGER, 1000)
        try:
            first = requests[0]
            assert isinstance(first, hs.HandshakeRequest)
            reply = await hs.request(ctx, c.host, c.port, first.engine_id, 10.0, first.requester)
            link.connect(f"tcp://{c.host}:{c.port}")
            for req in requests[1:]:
                await link.send_multipart([b"", hs.encode(req)])
            return reply
        finally:
            link.close()
            ctx.term()
    return asyncio.run(talk())


def _unasked(c: Cluster) -> float:
    return c.daemons[0].metric("kvxferd_serving_unasked")


def test_a_reader_before_version_5_turns_on_the_old_pace_and_one_that_asks_does_not():
    """Real daemons. The decode daemon's reads (version 5 notices) leave the prefill daemon
    progressing for no one. A reader that handshook and sends a version 4 notice, as a daemon
    before version 5 does, turns on the old pace (`kvxferd_serving_unasked`); notices from a
    stranger (no handshake) do not."""
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)
        assert _unasked(c) == 0
        done = hs.Notification("prefill", 0, "not-held", 1)  # early: counted, kept for its hold
        _side_channel(c, hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", "a-stranger"),
                      hs.NoticeRequest(hs.NOTICE_VERSION, "never-handshook", [done]))
        time.sleep(0.5)  # the notice is in (or never counted)
        assert _unasked(c) == 0
        _side_channel(c, hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", "a-reader-before-5"),
                      hs.NoticeRequest(hs.NOTICE_VERSION, "a-reader-before-5", [done]))
        deadline = time.monotonic() + 10
        while _unasked(c) != 1:
            assert time.monotonic() < deadline, "a version 4 notice did not turn on the old pace"
            time.sleep(0.05)
