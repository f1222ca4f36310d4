"""`kvxferd proxy` over real HTTP: fake vLLM prefill and decode servers on ephemeral ports, the proxy in front."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvxferd.proxy import (  # noqa: E402
    ROUTER,
    Pool,
    Settings,
    correlation_id,
    decode_body,
    make_app,
    normalize_url,
    prefill_body,
    redact,
)

T = TypeVar("T")
WORDS = ["The", " cache", " moved", " over", "."]


def run(coro: Awaitable[T]) -> T:
    """Each test is one event loop; a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, 10))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class FakeVllm:
    """A vLLM OpenAI server with a P/D connector, as far as a proxy can tell. The prompt picks the behaviour:
    "bad" (400), "nokv" (prefill answers without kv_transfer_params), "hold" (decode waits for `hold`),
    "gate" (decode streams one chunk, then waits for `release`), "die" (decode drops the connection mid-stream),
    "slow" (prefill waits for `hold`)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[Any] = []  # case-insensitive copies
        self.hold = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.active = 0
        self.last_chunk_sent: float | None = None
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        self.runner, self.url = await serve(app)
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
            self.runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": self.url}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        if prompt == "bad":
            return web.json_response({"object": "error", "message": "prompt is bad", "type": "BadRequestError",
                                      "code": 400}, status=400)
        if self.role == "prefill":
            if prompt == "slow":
                await self.hold.wait()
            if prompt == "nokv":
                return web.json_response({"choices": [{"index": 0, "text": "x"}]})
            return web.json_response({
                "id": "cmpl-p", "choices": [{"index": 0, "text": "The", "finish_reason": "length"}],
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": "p-engine",
                                       "remote_request_id": request.headers["X-Request-Id"],
                                       "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                                       "remote_port": 5600, "tp_size": 1}})
        self.active += 1
        try:
            if prompt == "hold":
                await self.hold.wait()
            if not body.get("stream"):
                return web.json_response({"id": "cmpl-d", "choices": [{"index": 0, "text": "".join(WORDS)}],
                                          "served_by": self.url})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, word in enumerate(WORDS):
                await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': word}]})}\n\n".encode())
                if i == 0 and prompt == "gate":
                    await self.release.wait()
                elif i == 1 and prompt == "die":
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                else:
                    await asyncio.sleep(0.01)
            self.last_chunk_sent = time.monotonic()
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.active -= 1


@dataclass
class Stack:
    prefill: list[FakeVllm]
    decode: list[FakeVllm]
    app: web.Application
    url: str
    client: aiohttp.ClientSession

    @property
    def p(self) -> FakeVllm:
        return self.prefill[0]

    @property
    def d(self) -> FakeVllm:
        return self.decode[0]

    async def post(self, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any, Any]:
        async with self.client.post(self.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None), r.headers

    async def get(self, path: str, **headers: str) -> tuple[int, Any, Any]:
        async with self.client.get(self.url + path, headers=headers) as r:
            return r.status, await r.json(content_type=None), r.headers


@contextlib.asynccontextmanager
async def stack(n_prefill: int = 1, n_decode: int = 1, extra_prefill: tuple[str, ...] = (),
                extra_decode: tuple[str, ...] = (), **options: Any) -> AsyncIterator[Stack]:
    prefill = [await FakeVllm("prefill").start() for _ in range(n_prefill)]
    decode = [await FakeVllm("decode").start() for _ in range(n_decode)]
    app = make_app([f.url for f in prefill] + list(extra_prefill), [f.url for f in decode] + list(extra_decode),
                   health_timeout=1.0, **options)
    runner, url = await serve(app)
    client = aiohttp.ClientSession()
    try:
        yield Stack(prefill, decode, app, url, client)
    finally:
        for f in prefill + decode:  # let held handlers finish so cleanup does not wait on them
            f.hold.set()
            f.release.set()
        await client.close()
        await runner.cleanup()
        for f in prefill + decode:
            await f.stop()


async def read_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for line in resp.content:
        if line.startswith(b"data: "):
            yield line[6:].decode().strip()


# ---- the pure parts ---------------------------------------------------------------------------------------

def test_prefill_body_asks_for_one_token_and_a_remote_decode():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.3}
    original = json.loads(json.dumps(body))
    out = prefill_body(body)
    assert body == original, "the client's body must stay as it was: the decode hop sends it"
    assert out == {"model": "m", "prompt": "hi", "max_tokens": 1, "min_tokens": 1, "stream": False,
                   "temperature": 0.3,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}}
    chat = prefill_body({"messages": [], "max_completion_tokens": 80})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body({"messages": []})


def test_decode_body_is_the_original_plus_the_params_verbatim():
    body = {"prompt": "hi", "stream": True, "kv_transfer_params": {"stale": 1}}
    kv = {"remote_engine_id": "p", "remote_block_ids": [3], "extra": {"x": 1}}
    out = decode_body(body, kv)
    assert out == {"prompt": "hi", "stream": True, "kv_transfer_params": kv}
    assert out["kv_transfer_params"] is kv and body["kv_transfer_params"] == {"stale": 1}


def test_pick_least_in_flight_then_round_robin():
    pool = Pool("decode", ["a:1", "http://b:2/", "a:1", "c:3"])
    assert pool.urls == ["http://a:1", "http://b:2", "http://c:3"]
    assert [pool.pick() for _ in range(4)] == ["http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    with pool.lease() as first, pool.lease() as second:
        assert (first, second) == ("http://b:2", "http://c:3")
        assert [pool.pick() for _ in range(3)] == ["http://a:1"] * 3  # the only idle one
    assert pool.inflight == dict.fromkeys(pool.urls, 0)
    with pytest.raises(ValueError, match="at least one prefill"):
        Pool("prefill", [])


def test_normalize_url():
    assert normalize_url(" 10.0.0.1:8100/ ") == "http://10.0.0.1:8100"
    assert normalize_url("https://gw/prefill-0") == "https://gw/prefill-0"
    for bad in ("ftp://h:1", "http://h:8100/v1", "http://"):
        with pytest.raises(ValueError):
            normalize_url(bad)


# ---- over HTTP --------------------------------------------------------------------------------------------

def test_completion_hand_off():
    async def go() -> None:
        async with stack() as s:
            body = {"model": "m", "prompt": "hello", "max_tokens": 40, "temperature": 0}
            status, answer, headers = await s.post("/v1/completions", body, Authorization="Bearer client-key")
            assert status == 200 and answer["id"] == "cmpl-d" and answer["choices"][0]["text"] == "".join(WORDS)
            (p_body,), (d_body,) = s.p.bodies, s.d.bodies
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False
            assert p_body["kv_transfer_params"]["do_remote_decode"] is True
            rid = s.p.headers[0]["X-Request-Id"]
            assert len(rid) == 32 and s.d.headers[0]["X-Request-Id"] == rid == headers["X-Request-Id"]
            assert d_body == {**body, "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
                "remote_request_id": rid, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
                "remote_port": 5600, "tp_size": 1}}
            # No --upstream-api-key: the engines get no key, and never the client's
            assert "Authorization" not in s.p.headers[0] and "Authorization" not in s.d.headers[0]
            assert s.app[ROUTER].stats()["decode"][s.d.url] == {"inflight": 0, "requests": 1, "errors": 0}
    run(go())


def test_chat_stream_passes_chunks_through_as_they_arrive():
    async def go() -> None:
        async with stack() as s:
            body = {"model": "m", "messages": [{"role": "user", "content": "gate"}], "max_completion_tokens": 30,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with s.client.post(s.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                events = read_events(r)
                first = await anext(events)  # the decode server sends nothing more until released
                first_at = time.monotonic()
                s.d.release.set()
                rest = [e async for e in events]
            texts = [json.loads(e)["choices"][0]["text"] for e in [first, *rest[:-1]]]
            assert texts == WORDS and rest[-1] == "[DONE]"
            assert s.d.last_chunk_sent is not None and first_at < s.d.last_chunk_sent
            (p_body,), (d_body,) = s.p.bodies, s.d.bodies
            assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
            assert p_body["stream"] is False and "stream_options" not in p_body
            assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == body
            assert s.app[ROUTER].decode.inflight[s.d.url] == 0
    run(go())


def test_client_leaving_mid_stream_aborts_the_decode_request():
    async def go() -> None:
        async with stack() as s:
            body = {"prompt": "gate", "stream": True}
            async with s.client.post(s.url + "/v1/completions", json=body) as r:
                await anext(read_events(r))
                r.close()  # drop the connection with the decode still generating
            await asyncio.wait_for(s.d.cancelled.wait(), 3)
            for _ in range(100):
                if s.app[ROUTER].decode.inflight[s.d.url] == 0:
                    break
                await asyncio.sleep(0.01)
            assert s.app[ROUTER].decode.inflight[s.d.url] == 0
    run(go())


def test_decode_dying_mid_stream_ends_with_an_error_event():
    async def go() -> None:
        async with stack() as s:
            async with s.client.post(s.url + "/v1/completions", json={"prompt": "die", "stream": True}) as r:
                events = [e async for e in read_events(r)]
            assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == WORDS[:2]
            error = json.loads(events[-1])["error"]
            assert s.d.url in error["message"] and error["code"] == 502
            assert s.app[ROUTER].decode.errors[s.d.url] == 1
    run(go())


def test_prefill_error_is_returned_and_counted():
    async def go() -> None:
        async with stack() as s:
            status, answer, _ = await s.post("/v1/completions", {"prompt": "bad"})
            assert status == 400 and answer["message"] == "prompt is bad"
            assert s.d.bodies == []
            assert s.app[ROUTER].prefill.errors[s.p.url] == 1

            status, answer, _ = await s.post("/v1/completions", {"prompt": "nokv"})
            assert status == 502 and s.p.url in answer["error"]["message"]
            assert "kv_transfer_params" in answer["error"]["message"] and s.d.bodies == []

            for raw in (b"[1, 2]", b"{not json"):
                async with s.client.post(s.url + "/v1/completions", data=raw) as r:
                    assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
            assert len(s.p.bodies) == 2
    run(go())


def test_unreachable_upstream_is_502_naming_it():
    async def go() -> None:
        dead = f"http://127.0.0.1:{closed_port()}"
        async with stack(n_prefill=0, extra_prefill=(dead,)) as s:
            status, answer, _ = await s.post("/v1/completions", {"prompt": "hi"})
            assert status == 502 and dead in answer["error"]["message"] and "prefill" in answer["error"]["message"]
            assert s.app[ROUTER].prefill.errors[dead] == 1 and s.d.bodies == []
        async with stack(n_decode=0, extra_decode=(dead,)) as s:
            status, answer, _ = await s.post("/v1/completions", {"prompt": "hi", "stream": True})
            assert status == 502 and dead in answer["error"]["message"] and "decode" in answer["error"]["message"]
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 502 and dead in (await r.json())["error"]["message"]
    run(go())


def test_health():
    async def go() -> None:
        dead = f"http://127.0.0.1:{closed_port()}"
        async with stack() as s, s.client.get(s.url + "/health") as r:
            assert r.status == 200
            assert await r.json() == {"prefill": {s.p.url: "ok"}, "decode": {s.d.url: "ok"}}
        async with stack(n_prefill=2, n_decode=0, extra_decode=(dead,)) as s:
            await s.prefill[1].stop()
            async with s.client.get(s.url + "/health") as r:
                assert r.status == 503
                doc = await r.json()
            assert doc["prefill"][s.p.url] == "ok" and doc["prefill"][s.prefill[1].url] != "ok"
            assert list(doc["decode"]) == [dead] and doc["decode"][dead] != "ok"
    run(go())


def test_least_in_flight_spreads_decode_requests():
    async def go() -> None:
        async with stack(n_decode=2) as s:
            a, b = s.decode
            held = [asyncio.create_task(s.post("/v1/completions", {"prompt": "hold"})) for _ in range(4)]
            while a.active + b.active < 4:
                await asyncio.sleep(0.01)
            assert (a.active, b.active) == (2, 2)
            a.hold.set()
            b.hold.set()
            assert [r[0] for r in await asyncio.gather(*held)] == [200] * 4

            a.hold.clear()  # one long request on a; round robin alone would send every other one to a
            first = asyncio.create_task(s.post("/v1/completions", {"prompt": "hold"}))
            while a.active + b.active < 1:
                await asyncio.sleep(0.01)
            busy, idle = (a, b) if a.active else (b, a)
            for _ in range(3):
                _, answer, _ = await s.post("/v1/completions", {"prompt": "quick"})
                assert answer["served_by"] == idle.url
            busy.hold.set()
            assert (await first)[0] == 200
    run(go())


def test_models_and_upstream_api_key():
    async def go() -> None:
        async with stack(upstream_api_key="upstream-secret") as s:
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["owned_by"] == s.d.url
            await s.post("/v1/completions", {"prompt": "hi"}, Authorization="Bearer client-key")
            assert s.p.headers[0]["Authorization"] == s.d.headers[0]["Authorization"] == "Bearer upstream-secret"
    run(go())


# ---- as a front door --------------------------------------------------------------------------------------

def test_redact_correlation_id_and_settings():
    assert redact("http://eng:s3cret@10.0.0.1:8100/p") == "http://10.0.0.1:8100/p"
    assert redact("https://tok@gw") == "https://gw" and redact("http://h:1") == "http://h:1"
    assert correlation_id(None) is None and correlation_id("") is None and correlation_id("<> ;") is None
    assert correlation_id("trace-1.a:b_c") == "trace-1.a:b_c"
    assert correlation_id("a b\t<c>" + "9" * 100) == "abc" + "9" * 61
    for bad in ({"api_key": ""}, {"upstream_api_key": ""}, {"max_concurrency": 0}, {"max_body_bytes": 0},
                {"prefill_timeout": 0}, {"decode_timeout": -1}):
        with pytest.raises(ValueError):
            Settings(**bad)
    assert Settings(decode_timeout=0).decode_timeout == 0
    with pytest.raises(ValueError, match="credentials"):  # both would be the Authorization header
        make_app(["http://u:p@h:1"], ["h:2"], upstream_api_key="k")


def test_client_api_key_is_checked_and_never_sent_upstream():
    async def go() -> None:
        async with stack(api_key="client-secret", upstream_api_key="engine-secret") as s:
            routes = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                      ("GET", "/proxy/stats"))
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer client-secret2"},
                            {"Authorization": "client-secret"}, {"Authorization": "Basic client-secret"},
                            {"Authorization": "Bearer engine-secret"}):
                for method, path in routes:
                    async with s.client.request(method, s.url + path, json={"prompt": "hi"}, headers=headers) as r:
                        assert r.status == 401, (method, path, headers)
                        assert r.headers["WWW-Authenticate"] == "Bearer"
                        error = (await r.json())["error"]
                        assert error["code"] == 401 and error["type"] == "authentication_error"
                        assert "API key" in error["message"]
            assert s.p.bodies == [] and s.d.bodies == []

            good = {"Authorization": "Bearer client-secret"}
            status, answer, _ = await s.post("/v1/completions", {"prompt": "hi"}, **good)
            assert status == 200 and answer["id"] == "cmpl-d"
            assert s.p.headers[0]["Authorization"] == s.d.headers[0]["Authorization"] == "Bearer engine-secret"
            assert (await s.get("/v1/models", **good))[0] == 200
            status, stats, _ = await s.get("/proxy/stats", **good)
            assert status == 200 and stats["decode"][s.d.url]["requests"] == 2

            # /health stays open to probes, and tells them only whether the proxy can serve
            status, doc, _ = await s.get("/health")
            assert status == 200 and doc == {"status": "ok"}
            status, doc, _ = await s.get("/health", **good)
            assert status == 200 and doc == {"prefill": {s.p.url: "ok"}, "decode": {s.d.url: "ok"}}

        async with stack(api_key="client-secret") as s:  # no upstream key: the engines get none
            status, _, _ = await s.post("/v1/completions", {"prompt": "hi"}, Authorization="Bearer client-secret")
            assert status == 200
            assert "Authorization" not in s.p.headers[0] and "Authorization" not in s.d.headers[0]
    run(go())


def test_engines_get_the_proxys_own_request_ids(caplog):
    caplog.set_level(logging.DEBUG, logger="kvxferd.proxy")

    async def go() -> None:
        async with stack() as s:
            answered = []
            for _ in range(2):
                status, _, headers = await s.post("/v1/completions", {"prompt": "hi"},
                                                  **{"X-Request-Id": "client-chosen"})
                assert status == 200
                answered.append(headers["X-Request-Id"])
            ids = [h["X-Request-Id"] for h in s.p.headers]
            assert [h["X-Request-Id"] for h in s.d.headers] == ids == answered
            assert "client-chosen" not in ids and len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
            assert [b["kv_transfer_params"]["remote_request_id"] for b in s.d.bodies] == ids
            await s.post("/v1/completions", {"prompt": "hi"}, **{"X-Request-Id": "a b<c>" + "9" * 100})
            assert s.p.headers[2]["X-Request-Id"] not in ids and len(s.p.headers[2]["X-Request-Id"]) == 32
    run(go())
    assert "client's id client-chosen" in caplog.text  # kept for correlation, in the proxy's logs only
    assert "client's id abc" + "9" * 61 + ")" in caplog.text and "<c>" not in caplog.text


def test_over_max_concurrency_is_503_at_once():
    async def go() -> None:
        async with stack(max_concurrency=2) as s:
            held = asyncio.create_task(s.post("/v1/completions", {"prompt": "hold"}))
            async with s.client.post(s.url + "/v1/completions", json={"prompt": "gate", "stream": True}) as r:
                events = read_events(r)
                await anext(events)  # a stream holds its slot until its last byte
                while s.d.active < 2:
                    await asyncio.sleep(0.01)
                status, answer, headers = await s.post("/v1/completions", {"prompt": "hi"})
                assert status == 503 and headers["Retry-After"] == "1" and answer["error"]["code"] == 503
                assert (await s.get("/v1/models"))[0] == 503
                assert len(s.p.bodies) == 2  # the refused request reached no engine
                assert (await s.get("/health"))[0] == 200  # probes and stats are not capped
                status, stats, _ = await s.get("/proxy/stats")
                assert stats["proxy"] == {"inflight": 2, "max_concurrency": 2, "rejected": 2}
                s.d.release.set()
                assert [e async for e in events][-1] == "[DONE]"
            s.d.hold.set()
            assert (await held)[0] == 200
            assert (await s.post("/v1/completions", {"prompt": "hi"}))[0] == 200  # the slots came back
            assert (await s.get("/proxy/stats"))[1]["proxy"]["inflight"] == 0
    run(go())


def test_body_over_the_limit_is_413_without_reading_it_all():
    async def go() -> None:
        async with stack(max_body_bytes=1000) as s:
            assert (await s.post("/v1/completions", {"prompt": "x" * 900}))[0] == 200
            status, answer, _ = await s.post("/v1/completions", {"prompt": "x" * 1000})
            assert status == 413 and "1000 bytes" in answer["error"]["message"]

            async def chunked() -> AsyncIterator[bytes]:  # no Content-Length
                yield json.dumps({"prompt": "x" * 1000}).encode()
            async with s.client.post(s.url + "/v1/completions", data=chunked()) as r:
                assert r.status == 413

            # An upload that never ends is answered once past the limit (reading it all would hang)...
            never = asyncio.Event()

            async def endless() -> AsyncIterator[bytes]:
                yield b'{"prompt": "' + b"x" * 2000
                await never.wait()
                yield b'"}'
            async with s.client.post(s.url + "/v1/completions", data=endless()) as r:
                assert r.status == 413

            never.set()

            # ...and a declared Content-Length over it before any of the body arrives (raw HTTP: aiohttp's
            # client holds the headers back until the body's first bytes).
            host, port = s.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 5000\r\n\r\n")
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 413 ")
            writer.close()
            assert len(s.p.bodies) == 1
    run(go())


def test_hop_timeouts_are_504_naming_the_hop():
    async def go() -> None:
        async with stack(prefill_timeout=0.2, decode_timeout=0.3) as s:
            status, answer, _ = await s.post("/v1/completions", {"prompt": "slow"})
            message = answer["error"]["message"]
            assert status == 504 and message.startswith(f"prefill upstream {s.p.url} timed out")
            assert "--prefill-timeout 0.2 s" in message and s.d.bodies == []
            assert s.app[ROUTER].prefill.errors[s.p.url] == 1

            status, answer, _ = await s.post("/v1/completions", {"prompt": "hold"})
            message = answer["error"]["message"]
            assert status == 504 and message.startswith(f"decode upstream {s.d.url} timed out")
            assert "--decode-timeout 0.3 s" in message

            async with s.client.post(s.url + "/v1/completions", json={"prompt": "gate", "stream": True}) as r:
                assert r.status == 200
                events = [e async for e in read_events(r)]
            assert json.loads(events[0])["choices"][0]["text"] == WORDS[0]
            error = json.loads(events[-1])["error"]
            assert error["code"] == 504 and error["message"].startswith(f"decode upstream {s.d.url} timed out")
            assert s.app[ROUTER].decode.errors[s.d.url] == 2
    run(go())


def test_stats_need_the_key_and_urls_never_show_credentials():
    async def go() -> None:
        d = await FakeVllm("decode").start()
        dead = f"127.0.0.1:{closed_port()}"
        key = {"Authorization": "Bearer k"}
        try:
            async with stack(n_decode=0, extra_decode=(d.url.replace("http://", "http://eng:s3cret@"),),
                             extra_prefill=(f"http://eng:s3cret@{dead}",), api_key="k") as s:
                assert (await s.get("/proxy/stats"))[0] == 401
                status, _, _ = await s.post("/v1/completions", {"prompt": "hi"}, **key)  # live prefill first
                assert status == 200  # the URL's credentials are still used upstream
                assert d.headers[0]["Authorization"] == "Basic " + base64.b64encode(b"eng:s3cret").decode()
                status, answer, _ = await s.post("/v1/completions", {"prompt": "hi"}, **key)
                assert status == 502 and f"http://{dead}" in answer["error"]["message"]
                assert "s3cret" not in json.dumps(answer)
                status, stats, _ = await s.get("/proxy/stats", **key)
                assert status == 200 and "s3cret" not in json.dumps(stats)
                assert stats["prefill"][f"http://{dead}"]["errors"] == 1 and stats["decode"][d.url]["requests"] == 1
                status, doc, _ = await s.get("/health", **key)
                assert list(doc["decode"]) == [d.url] and "s3cret" not in json.dumps(doc)
        finally:
            await d.stop()
    run(go())


# ---- the command ------------------------------------------------------------------------------------------

def test_cli_without_aiohttp_says_what_to_install(monkeypatch):
    from typer.testing import CliRunner

    from kvxferd.cli import app

    monkeypatch.setitem(sys.modules, "aiohttp", None)
    result = CliRunner().invoke(app, ["proxy", "--prefill", "h:1", "--decode", "h:2"])
    assert result.exit_code == 2
    assert "pip install 'kvxferd[proxy]'" in result.output


def test_cli_serves():
    async def go() -> None:
        p, d = await FakeVllm("prefill").start(), await FakeVllm("decode").start()
        port = closed_port()
        # Keys from the environment, so they need not show in `ps`
        env = {**os.environ, "NO_COLOR": "1", "KVXFERD_PROXY_API_KEY": "client-secret",
               "KVXFERD_PROXY_UPSTREAM_API_KEY": "engine-secret"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvxferd", "proxy", "--prefill", p.url, "--decode", d.url.removeprefix("http://"),
            "--port", str(port), "--log-level", "debug", "--max-concurrency", "8", "--max-body-mib", "0.5",
            "--prefill-timeout", "30", "--decode-timeout", "0", stderr=subprocess.PIPE, env=env)
        base, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer client-secret"}
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(200):
                    with contextlib.suppress(aiohttp.ClientConnectionError):
                        async with client.get(base + "/health") as r:  # probes need no key
                            assert r.status == 200
                            break
                    await asyncio.sleep(0.025)
                async with client.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
                    assert r.status == 401
                async with client.post(base + "/v1/completions", json={"prompt": "x" * 2**19}, headers=key) as r:
                    assert r.status == 413
                async with client.post(base + "/v1/completions", json={"prompt": "hi"}, headers=key) as r:
                    assert r.status == 200 and (await r.json())["id"] == "cmpl-d"
                async with client.get(base + "/proxy/stats", headers=key) as r:
                    assert (await r.json())["proxy"]["max_concurrency"] == 8
        finally:
            proc.terminate()
            _, err = await proc.communicate()
            await p.stop()
            await d.stop()
        log = err.decode()
        assert f"listening on http://127.0.0.1:{port}" in log
        rid = p.headers[0]["X-Request-Id"]
        assert f"request {rid}: prefill {p.url}" in log and f"decode {d.url}, first byte after" in log
        assert p.headers[0]["Authorization"] == "Bearer engine-secret" and "client-secret" not in log
    run(go())


def test_cli_refuses_an_empty_key():
    from typer.testing import CliRunner

    from kvxferd.cli import app

    result = CliRunner().invoke(app, ["proxy", "--prefill", "h:1", "--decode", "h:2", "--api-key", ""])
    assert result.exit_code == 2 and "--api-key is empty" in result.output
