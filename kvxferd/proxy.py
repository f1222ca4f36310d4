"""`kvxferd proxy`: an OpenAI-compatible router that runs vLLM's prefill/decode hand-off.

Disaggregated serving needs something in front of the engines: the prompt goes to a prefill engine
with max_tokens 1 and `do_remote_decode`, which answers with `kv_transfer_params` saying where the
KV cache waits; the client's original request then goes to a decode engine carrying those params, so
it reads the cache instead of recomputing it. vLLM ships toy proxies for this in its examples; this is
the same protocol as a command, so trying P/D needs no code. It is deliberately small: no retries, no
health-based ejection (a dead upstream answers 502 until it is removed from the command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

log = logging.getLogger("kvxferd.proxy")

REQUEST_ID = "X-Request-Id"

# What vLLM's connectors expect on the prefill hop: keep the blocks for a remote decoder, nothing remote yet.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets (the client's body is left untouched).

    One token, because the prefill engine's only job is to fill the KV cache; the token it samples is
    thrown away. No streaming, because its answer is read whole for `kv_transfer_params`.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:  # chat's newer name for the same limit; vLLM takes the smaller
        out["max_completion_tokens"] = 1
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 1:
        out["min_tokens"] = 1  # vLLM refuses min_tokens > max_tokens with a 400
    out["stream"] = False
    out.pop("stream_options", None)  # vLLM rejects stream_options without stream
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's own request plus where its KV cache waits: the prefill answer's params, verbatim."""
    return {**body, "kv_transfer_params": kv_transfer_params}


def normalize_url(url: str) -> str:
    """An upstream's base URL: `http://` added when missing (`host:8100` works), no trailing slash.

    A path is kept (an ingress may route by prefix) except `/v1`, which would double the API prefix.
    """
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream {url!r}: expected http://HOST:PORT")
    if parts.path.endswith("/v1"):
        raise ValueError(f"upstream {url!r}: give the server's base URL, without /v1")
    return url


def error_response(message: str, status: int, kind: str) -> web.Response:
    """An OpenAI-shaped error, so OpenAI client libraries show the message."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def relay_error(status: int, raw: bytes, url: str) -> web.Response:
    """An upstream's error as the client's answer: vLLM's own JSON when it sent JSON, else wrapped."""
    try:
        json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()[:2000]
        return error_response(f"{url} answered HTTP {status}: {text}", status, "upstream_error")
    return web.Response(body=raw, status=status, content_type="application/json")


@dataclass
class Pool:
    """One role's upstreams, with the requests in flight on each (for picking) and what each has served."""

    role: str
    urls: list[str]
    inflight: dict[str, int] = field(init=False)
    requests: dict[str, int] = field(init=False)
    errors: dict[str, int] = field(init=False)
    _next: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.urls = list(dict.fromkeys(normalize_url(u) for u in self.urls))
        if not self.urls:
            raise ValueError(f"at least one {self.role} upstream is needed")
        self.inflight = dict.fromkeys(self.urls, 0)
        self.requests = dict.fromkeys(self.urls, 0)
        self.errors = dict.fromkeys(self.urls, 0)

    def pick(self) -> str:
        """Least requests in flight; among equals the one after the last pick, so idle upstreams take turns."""
        n = len(self.urls)
        order = [(self._next + k) % n for k in range(n)]
        i = min(order, key=lambda j: self.inflight[self.urls[j]])  # min keeps the first of equals
        self._next = (i + 1) % n
        return self.urls[i]

    @contextlib.contextmanager
    def lease(self) -> Iterator[str]:
        """Pick an upstream and count the request in flight on it until the block ends, however it ends."""
        url = self.pick()
        self.inflight[url] += 1
        self.requests[url] += 1
        try:
            yield url
        finally:
            self.inflight[url] -= 1

    def stats(self) -> dict[str, dict[str, int]]:
        return {u: {"inflight": self.inflight[u], "requests": self.requests[u], "errors": self.errors[u]}
                for u in self.urls}


class Router:
    """The prefill and decode upstreams; all state lives on the event loop's thread, so no locks."""

    def __init__(self, prefill_urls: Iterable[str], decode_urls: Iterable[str]) -> None:
        self.prefill = Pool("prefill", list(prefill_urls))
        self.decode = Pool("decode", list(decode_urls))

    def stats(self) -> dict[str, Any]:
        return {"prefill": self.prefill.stats(), "decode": self.decode.stats()}


ROUTER = web.AppKey("router", Router)


class _Proxy:
    """The request handlers, sharing one client session (connection reuse to the upstreams)."""

    def __init__(self, router: Router, api_key: str | None, timeout: aiohttp.ClientTimeout,
                 health_timeout: float) -> None:
        self.router = router
        self.api_key = api_key
        self.timeout = timeout
        self.health_timeout = health_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy app has not started"
        return self._session

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        # limit=0: aiohttp's default pool of 100 connections would queue the 101st concurrent stream.
        self._session = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))
        yield
        await self._session.close()

    def _headers(self, request: web.Request, request_id: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif auth := request.headers.get("Authorization"):
            headers["Authorization"] = auth
        if request_id:
            headers[REQUEST_ID] = request_id
        return headers

    def _failed(self, pool: Pool, url: str, exc: BaseException, request_id: str) -> web.Response:
        """502 when the upstream could not be reached, 504 when it went silent past the read timeout."""
        pool.errors[url] += 1
        timed_out = isinstance(exc, asyncio.TimeoutError)
        detail = "timed out" if timed_out and not str(exc) else f"{type(exc).__name__}: {exc}"
        message = f"{pool.role} upstream {url} failed: {detail}"
        log.warning("request %s: %s", request_id, message)
        return error_response(message, 504 if timed_out else 502, "upstream_unavailable")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions: prefill hop, then decode hop."""
        t0 = time.perf_counter()
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        try:
            body = json.loads(await request.read())
        except ValueError:
            return error_response("request body is not valid JSON", 400, "invalid_request_error")
        if not isinstance(body, dict):
            return error_response("request body must be a JSON object", 400, "invalid_request_error")
        headers = self._headers(request, request_id)
        prefill, decode = self.router.prefill, self.router.decode

        with prefill.lease() as p_url:
            try:
                async with self.session.post(p_url + request.path, json=prefill_body(body), headers=headers) as up:
                    status, raw = up.status, await up.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(prefill, p_url, exc, request_id)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        if status != 200:
            prefill.errors[p_url] += 1
            log.warning("request %s: prefill %s answered HTTP %d", request_id, p_url, status)
            return relay_error(status, raw, p_url)
        try:
            kv = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not isinstance(kv, dict):
            prefill.errors[p_url] += 1
            message = (f"prefill upstream {p_url} answered without kv_transfer_params: is it a vLLM server "
                       f"started with --kv-transfer-config (kv_role kv_producer or kv_both)?")
            log.warning("request %s: %s", request_id, message)
            return error_response(message, 502, "upstream_error")

        with decode.lease() as d_url:
            try:
                async with self.session.post(d_url + request.path, json=decode_body(body, kv),
                                             headers=headers) as up:
                    if up.status != 200:
                        raw = await up.read()
                        decode.errors[d_url] += 1
                        log.warning("request %s: decode %s answered HTTP %d", request_id, d_url, up.status)
                        return relay_error(up.status, raw, d_url)
                    if body.get("stream"):
                        return await self._stream(request, up, request_id, t0, p_url, prefill_ms, d_url)
                    raw = await up.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(decode, d_url, exc, request_id)
        self._log_first_byte(request_id, t0, p_url, prefill_ms, d_url)
        return web.Response(body=raw, status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/json"), REQUEST_ID: request_id})

    async def _stream(self, request: web.Request, up: aiohttp.ClientResponse, request_id: str, t0: float,
                      p_url: str, prefill_ms: float, d_url: str) -> web.StreamResponse:
        """Pass decode's SSE bytes through as they arrive; once headers are out, errors end the stream instead."""
        resp = web.StreamResponse(status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", REQUEST_ID: request_id})
        first = True
        try:
            await resp.prepare(request)
            while True:
                try:
                    chunk = await up.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self._failed(self.router.decode, d_url, exc, request_id)
                    event = {"error": {"message": f"decode upstream {d_url} failed mid-stream: "
                                                  f"{type(exc).__name__}: {exc}", "type": "upstream_unavailable",
                                       "code": 502}}
                    await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                    break
                if not chunk:
                    break
                await resp.write(chunk)
                if first:
                    first = False
                    self._log_first_byte(request_id, t0, p_url, prefill_ms, d_url)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away: drop the upstream so vLLM aborts the request
            log.debug("request %s: client disconnected mid-stream", request_id)
            up.close()
        return resp

    def _log_first_byte(self, request_id: str, t0: float, p_url: str, prefill_ms: float, d_url: str) -> None:
        ttfb_ms = (time.perf_counter() - t0) * 1e3
        log.debug("request %s: prefill %s (%.1f ms), decode %s, first byte after %.1f ms",
                  request_id, p_url, prefill_ms, d_url, ttfb_ms,
                  extra={"fields": {"request_id": request_id, "prefill": p_url, "decode": d_url,
                                    "prefill_ms": round(prefill_ms, 3), "ttfb_ms": round(ttfb_ms, 3)}})

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models from a decode server: it serves the same model the client will talk to."""
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        with self.router.decode.lease() as url:
            try:
                async with self.session.get(url + "/v1/models", headers=self._headers(request)) as up:
                    raw = await up.read()
                    return web.Response(body=raw, status=up.status, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json")})
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(self.router.decode, url, exc, request_id)

    async def _probe(self, url: str) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with self.session.get(url + "/health", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=self.health_timeout)) as up:
                return "ok" if up.status == 200 else f"HTTP {up.status}"
        except TimeoutError:
            return f"no answer within {self.health_timeout:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while at least one prefill and one decode upstream answer their own /health."""
        pools = (self.router.prefill, self.router.decode)
        results = await asyncio.gather(*(self._probe(u) for pool in pools for u in pool.urls))
        doc: dict[str, dict[str, str]] = {}
        it = iter(results)
        for pool in pools:
            doc[pool.role] = {u: next(it) for u in pool.urls}
        healthy = all("ok" in doc[pool.role].values() for pool in pools)
        return web.json_response(doc, status=200 if healthy else 503)

    async def stats(self, request: web.Request) -> web.Response:
        """GET /proxy/stats: in flight, served and failed requests per upstream."""
        return web.json_response(self.router.stats())


def make_app(prefill_urls: Iterable[str], decode_urls: Iterable[str], *, api_key: str | None = None,
             connect_timeout: float = 5.0, read_timeout: float = 600.0, health_timeout: float = 2.0,
             max_body_mib: int = 64) -> web.Application:
    """The proxy as an aiohttp application; `app[ROUTER]` holds the upstreams and their counters.

    read_timeout bounds an upstream's silence, not a whole request, so long generations stream on;
    it must cover a long prompt's prefill under load. The body limit is raised from aiohttp's 1 MiB,
    which long prompts and base64 images exceed.
    """
    router = Router(prefill_urls, decode_urls)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
    proxy = _Proxy(router, api_key, timeout, health_timeout)
    app = web.Application(client_max_size=max_body_mib * 2**20)
    app[ROUTER] = router
    app.cleanup_ctx.append(proxy.session_ctx)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/proxy/stats", proxy.stats)
    return app


def run(host: str, port: int, prefill_urls: Iterable[str], decode_urls: Iterable[str], **options: Any) -> None:
    """Serve until interrupted. Handlers are cancelled when their client disconnects, which closes the
    upstream connection and makes vLLM abort the request instead of generating for nobody."""
    app = make_app(prefill_urls, decode_urls, **options)
    router = app[ROUTER]

    def announce(*_: Any) -> None:  # run_app calls this once the socket is bound
        log.info("kvxferd proxy listening on http://%s:%d: prefill %s, decode %s", host, port,
                 ", ".join(router.prefill.urls), ", ".join(router.decode.urls))

    loop: asyncio.AbstractEventLoop | None = None
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(app, host=host, port=port, print=announce, access_log=None, handler_cancellation=True, loop=loop)
