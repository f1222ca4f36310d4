"""`kvxferd proxy`: an OpenAI-compatible router that runs vLLM's prefill/decode hand-off.

Disaggregated serving needs something in front of the engines: the prompt goes to a prefill engine
with max_tokens 1 and `do_remote_decode`, which answers with `kv_transfer_params` saying where the
KV cache waits; the client's original request then goes to a decode engine carrying those params, so
it reads the cache instead of recomputing it. vLLM ships toy proxies for this in its examples; this is
the same protocol as a command, so trying P/D needs no code. It is deliberately small: no retries, no
health-based ejection (a dead upstream answers 502 until it is removed from the command line).

As a front door it checks clients' API key (`Settings.api_key`, as vLLM's own server does) and sends
the engines a key of its own (`upstream_api_key`), never the client's; names each request for the
engines itself; answers 503 past `max_concurrency` requests in flight instead of queueing; refuses
bodies over `max_body_bytes` without reading them whole; and bounds each hop's time (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web

log = logging.getLogger("kvxferd.proxy")

REQUEST_ID = "X-Request-Id"
# Probes (kubelets, load balancers) carry no key; every other route, /v1 and /proxy, needs it.
AUTH_EXEMPT = frozenset({"/health"})
RETRY_AFTER_S = 1  # what a 503 over the concurrency cap tells the client; OpenAI's clients honour it

# What vLLM's connectors expect on the prefill hop: keep the blocks for a remote decoder, nothing remote yet.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Settings:
    """What `kvxferd proxy`'s options set; docs/deploy.md explains each."""

    # Secrets stay out of repr(), so logging the settings shows no key.
    api_key: str | None = field(default=None, repr=False)           # clients send `Authorization: Bearer <it>`
    upstream_api_key: str | None = field(default=None, repr=False)  # sent to the engines (and their /health)
    max_concurrency: int = 1024          # /v1 requests in flight; past it, 503 at once
    max_body_bytes: int = 4 * 2**20
    connect_timeout: float = 5.0         # seconds to connect to an upstream, either hop
    prefill_timeout: float = 300.0       # the whole prefill hop: request sent, answer read
    decode_timeout: float = 1800.0       # the whole decode hop, streaming included; 0: no limit
    read_timeout: float = 600.0          # longest silence from an upstream
    health_timeout: float = 2.0          # each upstream's /health probe

    def __post_init__(self) -> None:
        # Messages name the command's options, which these mirror.
        for name in ("api_key", "upstream_api_key"):
            if getattr(self, name) == "":  # an empty key must not quietly turn authentication off
                raise ValueError(f"--{name.replace('_', '-')} is empty: give a key or leave the option out")
        if self.max_concurrency < 1 or self.max_body_bytes < 1:
            raise ValueError("--max-concurrency and the body limit must be at least 1")
        if min(self.connect_timeout, self.prefill_timeout, self.read_timeout, self.health_timeout) <= 0:
            raise ValueError("timeouts must be positive (--decode-timeout may be 0: no limit)")
        if self.decode_timeout < 0:
            raise ValueError("--decode-timeout must be positive, or 0 for no limit")


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
        raise ValueError(f"upstream {redact(url)!r}: expected http://HOST:PORT")
    if parts.path.endswith("/v1"):
        raise ValueError(f"upstream {redact(url)!r}: give the server's base URL, without /v1")
    return url


def redact(url: str) -> str:
    """An upstream URL as stats, errors and logs show it: credentials in it (`user:pass@`) left out."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def correlation_id(value: str | None) -> str | None:
    """A client's X-Request-Id, fit for our logs only: the characters of ordinary ids, at most 64.

    It is never the engines' request id: ids are per engine, and a client must not be able to pick (or
    collide with) another client's.
    """
    if not value:
        return None
    return re.sub(r"[^A-Za-z0-9._:-]", "", value)[:64] or None


def bearer_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `key`. Digests are compared, in constant time, so
    neither the key's bytes nor its length show in how long a wrong guess takes."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                               hashlib.sha256(key.encode()).digest())


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None when it is longer than `limit`: at most limit + 1 bytes are read, so a
    huge or endless upload costs no more memory than an allowed one (aiohttp's own read() keeps going
    a chunk past its limit). A declared Content-Length over the limit is refused before reading."""
    if request.content_length is not None and request.content_length > limit:
        return None
    body = bytearray()
    while chunk := await request.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def error_response(message: str, status: int, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-shaped error, so OpenAI client libraries show the message."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


def relay_error(status: int, raw: bytes, url: str) -> web.Response:
    """An upstream's error as the client's answer: vLLM's own JSON when it sent JSON, else wrapped."""
    try:
        json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace").strip()[:2000]
        return error_response(f"{redact(url)} answered HTTP {status}: {text}", status, "upstream_error")
    return web.Response(body=raw, status=status, content_type="application/json")


def hop_failure(role: str, url: str, exc: BaseException, total: float | None) -> tuple[int, str]:
    """The status and message for a hop that failed: 504 naming the hop and the limit when it timed
    out, 502 when the upstream could not be reached or broke off."""
    where = f"{role} upstream {redact(url)}"
    detail = re.sub(r"//[^/\s@]+@", "//", str(exc))  # in case the exception quotes a URL with credentials
    if isinstance(exc, aiohttp.ServerTimeoutError):  # connect or silence; aiohttp's message says which
        return 504, f"{where} timed out: {detail}"
    if isinstance(exc, TimeoutError):
        return 504, f"{where} timed out: no complete answer within --{role}-timeout {total:g} s"
    return 502, f"{where} failed: {type(exc).__name__}: {detail}"


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
        """Per upstream, by its redacted URL (credentials in a URL are used upstream, never shown)."""
        return {redact(u): {"inflight": self.inflight[u], "requests": self.requests[u], "errors": self.errors[u]}
                for u in self.urls}


class Router:
    """The prefill and decode upstreams; all state lives on the event loop's thread, so no locks."""

    def __init__(self, prefill_urls: Iterable[str], decode_urls: Iterable[str]) -> None:
        self.prefill = Pool("prefill", list(prefill_urls))
        self.decode = Pool("decode", list(decode_urls))

    def stats(self) -> dict[str, Any]:
        return {"prefill": self.prefill.stats(), "decode": self.decode.stats()}


ROUTER = web.AppKey("router", Router)
SETTINGS = web.AppKey("settings", Settings)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Proxy:
    """The request handlers, sharing one client session (connection reuse to the upstreams)."""

    def __init__(self, router: Router, settings: Settings) -> None:
        self.router = router
        self.settings = settings
        s = settings
        self.prefill_timeout = aiohttp.ClientTimeout(total=s.prefill_timeout, sock_connect=s.connect_timeout,
                                                     sock_read=s.read_timeout)
        self.decode_timeout = aiohttp.ClientTimeout(total=s.decode_timeout or None, sock_connect=s.connect_timeout,
                                                    sock_read=s.read_timeout)
        self.inflight = 0  # /v1 requests being served
        self.rejected = 0  # turned away over max_concurrency
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy app has not started"
        return self._session

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        # limit=0: aiohttp's pool would queue past its 100 connections; max_concurrency bounds them instead.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await self._session.close()

    def authorized(self, request: web.Request) -> bool:
        key = self.settings.api_key
        return key is None or bearer_matches(request.headers.get("Authorization"), key)

    @web.middleware
    async def gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Authentication first (a stranger takes no slot), then the cap on /v1 requests in flight.

        Over the cap the answer is an immediate 503 with Retry-After, not a queue: a queue in the proxy
        would hide the overload from clients and load balancers, and the engines queue anyway.
        """
        if request.path not in AUTH_EXEMPT and not self.authorized(request):
            return error_response("missing or wrong API key: send `Authorization: Bearer <key>`", 401,
                                  "authentication_error", {"WWW-Authenticate": "Bearer"})
        if not request.path.startswith("/v1/"):
            return await handler(request)
        if self.inflight >= self.settings.max_concurrency:
            self.rejected += 1
            return error_response(f"the proxy has {self.inflight} requests in flight, its limit; retry shortly",
                                  503, "overloaded", {"Retry-After": str(RETRY_AFTER_S)})
        self.inflight += 1
        try:
            return await handler(request)
        finally:
            self.inflight -= 1

    def _headers(self, request_id: str | None = None) -> dict[str, str]:
        # Never the client's Authorization: the client key is the proxy's to check, not the engines'.
        headers: dict[str, str] = {}
        if self.settings.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.settings.upstream_api_key}"
        if request_id:
            headers[REQUEST_ID] = request_id
        return headers

    def _failed(self, pool: Pool, url: str, exc: BaseException, tag: str, total: float | None) -> web.Response:
        pool.errors[url] += 1
        status, message = hop_failure(pool.role, url, exc, total)
        log.warning("request %s: %s", tag, message)
        return error_response(message, status, "upstream_timeout" if status == 504 else "upstream_unavailable")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions: prefill hop, then decode hop."""
        t0 = time.perf_counter()
        request_id = uuid.uuid4().hex  # the engines' id for it: ours, unique, whatever the client sent
        client_id = correlation_id(request.headers.get(REQUEST_ID))
        tag = f"{request_id} (client's id {client_id})" if client_id else request_id  # for our logs
        raw_body = await read_body(request, self.settings.max_body_bytes)
        if raw_body is None:
            return error_response(f"request body is over the proxy's limit of {self.settings.max_body_bytes} "
                                  f"bytes", 413, "invalid_request_error")
        try:
            body = json.loads(raw_body)
        except ValueError:
            return error_response("request body is not valid JSON", 400, "invalid_request_error")
        if not isinstance(body, dict):
            return error_response("request body must be a JSON object", 400, "invalid_request_error")
        headers = self._headers(request_id)
        prefill, decode = self.router.prefill, self.router.decode

        with prefill.lease() as p_url:
            try:
                async with self.session.post(p_url + request.path, json=prefill_body(body), headers=headers,
                                             timeout=self.prefill_timeout) as up:
                    status, raw = up.status, await up.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(prefill, p_url, exc, tag, self.prefill_timeout.total)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        if status != 200:
            prefill.errors[p_url] += 1
            log.warning("request %s: prefill %s answered HTTP %d", tag, redact(p_url), status)
            return relay_error(status, raw, p_url)
        try:
            kv = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not isinstance(kv, dict):
            prefill.errors[p_url] += 1
            message = (f"prefill upstream {redact(p_url)} answered without kv_transfer_params: is it a vLLM "
                       f"server started with --kv-transfer-config (kv_role kv_producer or kv_both)?")
            log.warning("request %s: %s", tag, message)
            return error_response(message, 502, "upstream_error")

        with decode.lease() as d_url:
            try:
                async with self.session.post(d_url + request.path, json=decode_body(body, kv), headers=headers,
                                             timeout=self.decode_timeout) as up:
                    if up.status != 200:
                        raw = await up.read()
                        decode.errors[d_url] += 1
                        log.warning("request %s: decode %s answered HTTP %d", tag, redact(d_url), up.status)
                        return relay_error(up.status, raw, d_url)
                    if body.get("stream"):
                        return await self._stream(request, up, request_id, tag, t0, p_url, prefill_ms, d_url)
                    raw = await up.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(decode, d_url, exc, tag, self.decode_timeout.total)
        self._log_first_byte(request_id, tag, t0, p_url, prefill_ms, d_url)
        return web.Response(body=raw, status=up.status, headers={
            "Content-Type": up.headers.get("Content-Type", "application/json"), REQUEST_ID: request_id})

    async def _stream(self, request: web.Request, up: aiohttp.ClientResponse, request_id: str, tag: str,
                      t0: float, p_url: str, prefill_ms: float, d_url: str) -> web.StreamResponse:
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
                    self.router.decode.errors[d_url] += 1
                    status, message = hop_failure("decode", d_url, exc, self.decode_timeout.total)
                    log.warning("request %s: %s mid-stream", tag, message)
                    event = {"error": {"message": f"{message} (mid-stream)", "code": status,
                                       "type": "upstream_timeout" if status == 504 else "upstream_unavailable"}}
                    await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                    break
                if not chunk:
                    break
                await resp.write(chunk)
                if first:
                    first = False
                    self._log_first_byte(request_id, tag, t0, p_url, prefill_ms, d_url)
            await resp.write_eof()
        except ConnectionResetError:  # the client went away: drop the upstream so vLLM aborts the request
            log.debug("request %s: client disconnected mid-stream", tag)
            up.close()
        return resp

    def _log_first_byte(self, request_id: str, tag: str, t0: float, p_url: str, prefill_ms: float,
                        d_url: str) -> None:
        ttfb_ms = (time.perf_counter() - t0) * 1e3
        p_name, d_name = redact(p_url), redact(d_url)
        log.debug("request %s: prefill %s (%.1f ms), decode %s, first byte after %.1f ms",
                  tag, p_name, prefill_ms, d_name, ttfb_ms,
                  extra={"fields": {"request_id": request_id, "prefill": p_name, "decode": d_name,
                                    "prefill_ms": round(prefill_ms, 3), "ttfb_ms": round(ttfb_ms, 3)}})

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models from a decode server: it serves the same model the client will talk to."""
        with self.router.decode.lease() as url:
            try:
                async with self.session.get(url + "/v1/models", headers=self._headers(),
                                            timeout=self.decode_timeout) as up:
                    raw = await up.read()
                    return web.Response(body=raw, status=up.status, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json")})
            except (TimeoutError, aiohttp.ClientError) as exc:
                return self._failed(self.router.decode, url, exc, "/v1/models", self.decode_timeout.total)

    async def _probe(self, url: str) -> str:
        try:
            async with self.session.get(url + "/health", headers=self._headers(),
                                        timeout=aiohttp.ClientTimeout(total=self.settings.health_timeout)) as up:
                return "ok" if up.status == 200 else f"HTTP {up.status}"
        except TimeoutError:
            return f"no answer within {self.settings.health_timeout:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while at least one prefill and one decode upstream answer their own /health.

        Open to probes, so with an API key set only a client that sends it sees which upstream is which.
        """
        pools = (self.router.prefill, self.router.decode)
        results = await asyncio.gather(*(self._probe(u) for pool in pools for u in pool.urls))
        doc: dict[str, dict[str, str]] = {}
        it = iter(results)
        for pool in pools:
            doc[pool.role] = {redact(u): next(it) for u in pool.urls}
        healthy = all("ok" in doc[pool.role].values() for pool in pools)
        shown: dict[str, Any] = doc if self.authorized(request) else {"status": "ok" if healthy else "unhealthy"}
        return web.json_response(shown, status=200 if healthy else 503)

    async def stats(self, request: web.Request) -> web.Response:
        """GET /proxy/stats: in flight, served and failed requests per upstream, and the proxy's own."""
        return web.json_response({**self.router.stats(), "proxy": {
            "inflight": self.inflight, "max_concurrency": self.settings.max_concurrency,
            "rejected": self.rejected}})


def make_app(prefill_urls: Iterable[str], decode_urls: Iterable[str], **settings: Any) -> web.Application:
    """The proxy as an aiohttp application; `app[ROUTER]` holds the upstreams and their counters,
    `app[SETTINGS]` the `Settings` made from the keyword arguments (a ValueError names a bad one)."""
    router = Router(prefill_urls, decode_urls)
    s = Settings(**settings)
    if s.upstream_api_key and any("@" in urlsplit(u).netloc for u in router.prefill.urls + router.decode.urls):
        # Both would be the Authorization header; aiohttp refuses the pair on every request.
        raise ValueError("an upstream URL carries credentials (user:pass@) and an upstream API key is set: "
                         "use one or the other")
    proxy = _Proxy(router, s)
    # client_max_size only backs up read_body(), which enforces the limit without reading past it.
    app = web.Application(client_max_size=s.max_body_bytes, middlewares=[proxy.gate])
    app[ROUTER] = router
    app[SETTINGS] = s
    app.cleanup_ctx.append(proxy.session_ctx)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/proxy/stats", proxy.stats)
    return app


def run(app: web.Application, host: str, port: int) -> None:
    """Serve until interrupted. Handlers are cancelled when their client disconnects, which closes the
    upstream connection and makes vLLM abort the request instead of generating for nobody."""
    router, s = app[ROUTER], app[SETTINGS]

    def announce(*_: Any) -> None:  # run_app calls this once the socket is bound
        log.info("kvxferd proxy listening on http://%s:%d: prefill %s, decode %s", host, port,
                 ", ".join(map(redact, router.prefill.urls)), ", ".join(map(redact, router.decode.urls)))
        if s.api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("no --api-key: any client that reaches %s:%d uses the engines%s", host, port,
                        " with the upstream API key" if s.upstream_api_key else "")

    loop: asyncio.AbstractEventLoop | None = None
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(app, host=host, port=port, print=announce, access_log=None, handler_cancellation=True, loop=loop)
