"""Prometheus metrics and the HTTP exporter (/metrics, /healthz, /readyz)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import __version__

log = logging.getLogger(__name__)

disable_created_metrics()  # *_created series only add noise to every dashboard query

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DESCS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.build_info = Info("kvxferd_build", "kvxferd build information", registry=r)
        self.build_info.info({"version": __version__})
        # lane: who moved the bytes (peers.py): nixl (a peer daemon's agent), copy or loop (an
        # engine of this daemon: its memcpy, NIXL's loopback); none: failed before a route
        self.transfers = Counter("kvxferd_transfers", "Read requests finished, by peer engine, lane and outcome",
                                 ["peer", "lane", "outcome"], registry=r)
        self.transfer_failures = Counter("kvxferd_transfer_failures", "Failed reads by peer and reason",
                                         ["peer", "reason"], registry=r)
        self.transfer_bytes = Counter("kvxferd_transfer_bytes", "Bytes read from peers, by peer and lane",
                                      ["peer", "lane"], registry=r)
        self.transfer_seconds = Histogram("kvxferd_transfer_duration_seconds",
                                          "Read call to completion, by peer, lane and outcome",
                                          ["peer", "lane", "outcome"],
                                          buckets=_LATENCY, registry=r)
        self.read_post = Histogram("kvxferd_read_post_seconds", "Read RPC received to READs posted",
                                   buckets=_LATENCY, registry=r)
        self.forbidden = Counter("kvxferd_forbidden_requests", "Requests naming an engine rank the connection "
                                 "may not act for, by method", ["method"], registry=r)
        self.digested_bytes = Counter("kvxferd_digested_bytes", "Bytes digested for the integrity audit, by where "
                                      "(hold, audit answered, read checked)", ["where"], registry=r)
        self.digest_seconds = Histogram("kvxferd_digest_seconds", "Time digesting per hold, audit answered or read "
                                        "checked", ["where"], buckets=_LATENCY, registry=r)
        self.audits = Counter("kvxferd_audits", "Reads checked against the prefill's digests, by outcome "
                              "(ok, corrupt, unanswered)", ["outcome"], registry=r)
        self.corrupt_blocks = Counter("kvxferd_corrupt_blocks", "Local blocks an audit found corrupt", registry=r)
        self.split_reads = Counter("kvxferd_split_reads", "Reads split across posting lanes", registry=r)
        self.read_slices = Counter("kvxferd_read_slices", "Slices of split reads posted on lanes", registry=r)
        self.descriptors = Histogram("kvxferd_transfer_descriptors", "Descriptors per read request", ["peer"],
                                     buckets=_DESCS, registry=r)
        self.handshakes = Counter("kvxferd_handshakes", "Handshakes with peer daemons, by outcome",
                                  ["peer", "outcome"], registry=r)
        self.handshake_failures = Counter("kvxferd_handshake_failures", "Failed handshakes by reason",
                                          ["reason"], registry=r)
        self.handshake_seconds = Histogram("kvxferd_handshake_duration_seconds", "Handshake round trip",
                                           buckets=_LATENCY, registry=r)
        self.handshakes_served = Counter("kvxferd_handshakes_served", "Handshake requests answered, by outcome",
                                         ["outcome"], registry=r)
        self.inflight = Gauge("kvxferd_transfers_in_flight", "Read requests in flight", registry=r)
        self.quarantined = Gauge("kvxferd_quarantined_transfers",
                                 "Transfers past their deadline whose outcome is unknown", registry=r)
        self.quarantines = Counter("kvxferd_quarantines", "Reads that failed while NIXL still ran them", registry=r)
        self.held = Gauge("kvxferd_held_requests", "Prefill requests held for consumers", registry=r)
        self.held_oldest = Gauge("kvxferd_held_oldest_age_seconds", "Age of the oldest held request", registry=r)
        self.holds_finished = Counter("kvxferd_holds", "Held requests finished, by outcome (sent, expired, dropped)",
                                      ["outcome"], registry=r)
        self.notifs_sent = Counter("kvxferd_notifications_sent", "Notifications sent to peers", registry=r)
        self.notifs_lost = Counter("kvxferd_notifications_lost", "Notifications that could not be sent on the "
                                   "side channel (their holds end with their leases)", registry=r)
        self.serving_unasked = Gauge("kvxferd_serving_unasked", "1 while this daemon progresses NIXL unasked for "
                                     "a reader from before side-channel version 5", registry=r)
        self.serve_requests = Counter("kvxferd_serve_requests", "Requests for a peer daemon's NIXL progress "
                                      "while a READ of its memory runs, by way (sent, received)", ["way"], registry=r)
        self.notifs_received = Counter("kvxferd_notifications_received", "Notifications received, by kind",
                                       ["kind"], registry=r)
        self.rpc = Counter("kvxferd_rpc_requests", "Engine RPC requests by method and outcome",
                           ["method", "outcome"], registry=r)
        self.rpc_seconds = Histogram("kvxferd_rpc_duration_seconds", "Engine RPC handling time", ["method"],
                                     buckets=_LATENCY, registry=r)
        self.engines = Gauge("kvxferd_registered_engines", "Engines with at least one registered rank", registry=r)
        self.ranks = Gauge("kvxferd_registered_ranks", "Registered engine ranks", registry=r)
        self.registered_bytes = Gauge("kvxferd_registered_memory_bytes", "Bytes of engine memory registered",
                                      registry=r)
        self.nixl_post = Histogram("kvxferd_nixl_post_seconds", "NIXL post time per transfer", buckets=_LATENCY,
                                   registry=r)
        self.nixl_xfer = Histogram("kvxferd_nixl_transfer_seconds", "NIXL transfer time per transfer",
                                   buckets=_LATENCY, registry=r)
        self.peers = Gauge("kvxferd_peers", "Remote engines known, by state (handshaking, ready, retired: "
                           "lists kept while reads use them)", ["state"], registry=r)
        self.peers_retired = Counter("kvxferd_peers_retired", "Peers retired, by reason (posting_failed, silent, "
                                     "engine_gone, restarted, idle)", ["reason"], registry=r)
        self.peer_rate = Gauge("kvxferd_peer_read_rate_bytes_per_second", "Moving average of reads of 1 MiB and "
                               "more from each peer, by the memory moved (VRAM, DRAM): rates.py",
                               ["peer", "memory"], registry=r)
        self.peer_probes = Counter("kvxferd_peer_probes", "Liveness probes of peers, by outcome (alive, "
                                   "epoch_unknown, engine_gone, restarted, no_answer)", ["outcome"], registry=r)
        self.remote_agents = Gauge("kvxferd_nixl_remote_agents", "NIXL remote agents the daemon's agent has "
                                   "loaded (one per peer daemon in use)", registry=r)
        self.rejected = Counter("kvxferd_rejected_connections", "Engine connections refused, by reason",
                                ["reason"], registry=r)
        self.accept_errors = Counter("kvxferd_accept_errors", "Failed accepts on the engine socket, by errno "
                                     "(EMFILE: out of fds; the socket keeps serving once fds free up)",
                                     ["errno"], registry=r)
        self.lease_claims = Counter("kvxferd_lease_claims", "Claims on prefill holds: asked by this daemon as "
                                    "decode (answered, unanswered), answered as prefill", ["side", "outcome"],
                                    registry=r)
        self.claims_open = Gauge("kvxferd_lease_claims_open", "Prefill holds this daemon claims (its reads and "
                                 "engines' expectations need them)", registry=r)
        self.reads_expected = Counter("kvxferd_reads_expected", "Reads engines announced before their blocks "
                                      "were allocated (their prefill holds kept alive meanwhile)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Caps on a request's head: a client is a scraper or a probe, never one that needs more.
_LINE_MAX = 8192  # bytes in the request line or one header line
_HEADERS_MAX = 100  # header lines
_HEAD_MAX = 32768  # bytes of headers in all
_HEAD_S = 10.0  # to send the whole head (one header every few seconds cannot hold a connection forever)


class _Refused(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The request line, once the headers after it are read (and dropped); _Refused past a cap."""
    async with asyncio.timeout(_HEAD_S):
        try:
            request = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise _Refused("400 Bad Request") from None  # request line over _LINE_MAX
        count = size = 0
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _Refused("431 Request Header Fields Too Large") from None
            except asyncio.IncompleteReadError:
                return request  # the client half-closed after its head: answered, as before
            if line in (b"\r\n", b"\n"):
                return request
            count, size = count + 1, size + len(line)
            if count > _HEADERS_MAX or size > _HEAD_MAX:
                raise _Refused("431 Request Header Fields Too Large")


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: str) -> None:
    writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(status) + 1}\r\n"
                 f"Connection: close\r\n\r\n{status}\n".encode())
    await writer.drain()
    writer.write_eof()
    # Read and drop what the client still sends, for a moment: closing with unread bytes sends an RST,
    # which can destroy the answer before the client reads it.
    try:
        async with asyncio.timeout(2):
            budget = 1 << 20
            while budget > 0 and (chunk := await reader.read(65536)):
                budget -= len(chunk)
    except TimeoutError:
        pass


async def serve_http(metrics: Metrics, host: str, port: int, ready: Callable[[], bool]) -> asyncio.Server:
    """A minimal HTTP/1.0 exporter on the daemon's loop (no thread touches daemon state)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                line = await _read_head(reader)
            except _Refused as exc:
                await _refuse(reader, writer, exc.status)
                return
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else ""
            if path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, metrics.render()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/readyz":
                ok = ready()
                status, ctype, body = ("200 OK" if ok else "503 Service Unavailable"), "text/plain", \
                    (b"ready\n" if ok else b"not ready\n")
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the client stalled or left: nobody to answer
        except Exception:  # a bug here must not end the exporter nor surface as an unretrieved task error
            log.warning("metrics HTTP request failed", exc_info=True)
        finally:
            writer.close()

    # limit: a line longer than _LINE_MAX raises LimitOverrunError in readuntil (answered, not raised)
    return await asyncio.start_server(handle, host, port, limit=_LINE_MAX)
