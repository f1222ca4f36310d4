"""The daemon <-> daemon protocol: the ZMQ side channel and the READ notification.

The decode daemon asks the prefill daemon for an engine's ranks; the answer carries the
NIXL agent metadata and, per rank, the compatibility hash, the geometry and the buffer
addresses. Every READ then carries a `Notification` telling the prefill daemon which held
request a consumer has finished. An audited read asks, before it is reported, for the
digests of the rows it read (`AuditRequest`, integrity.py). Payloads are msgspec msgpack
(never pickle); every wait has a deadline.

Side-channel version 2 tags requests (`"kind": "handshake" | "audit"`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import zmq
import zmq.asyncio
from msgspec import Meta

from .plan.geometry import Geometry, Segment
from .protocol import DECODE_ERRORS, Name, Rank, TpSize

HANDSHAKE_VERSION = 2
MAX_MESSAGE = 256 << 20
MAX_AUDIT_ROWS = 4 << 20


HandshakeFailure = Literal["timeout", "unreachable", "malformed", "refused", "invalid"]


class HandshakeError(RuntimeError):
    """A handshake that failed; `reason` is a short label for metrics."""

    def __init__(self, reason: HandshakeFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HandshakeRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="handshake"):
    version: int
    engine_id: Name
    requester: str = ""


class AuditRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="audit"):
    """Digests of the rows a consumer read from one held request of one prefill rank.

    `rows`: little-endian int64 pairs (address, length) in the prefill daemon's mapping,
    as the consumer's READ named them."""

    version: int
    engine_id: Name
    tp_rank: Rank
    request_id: Name
    rows: Annotated[bytes, Meta(max_length=MAX_AUDIT_ROWS * 16)]


class AuditReply(msgspec.Struct):
    ok: bool
    reason: str = ""
    digests: bytes = b""  # little-endian uint64, one per row asked about
    reused: list[list[int]] = []  # per cache group: held blocks whose bytes changed since the hold
    # Not held yet (the read overtook the prefill engine's hold): ask again before the deadline.
    retry: bool = False


class RankInfo(msgspec.Struct):
    tp_rank: Rank
    tp_size: TpSize
    compat_hash: str
    geometry: Geometry
    buffer_addrs: list[Annotated[int, Meta(ge=0)]]
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device: Annotated[int, Meta(ge=0, le=1023)] = 0


class HandshakeReply(msgspec.Struct):
    ok: bool
    reason: str = ""
    agent: str = ""
    metadata: bytes = b""
    ranks: list[RankInfo] = []


class Notification(msgspec.Struct, array_like=True, tag="KVX1"):
    """Sent with each READ (or alone, to a rank nothing is read from): one consumer of the
    prefill engine's held request is done. On the wire:
    `["KVX1", engine, prefill rank, prefill request id, expected consumers]`."""

    engine_id: Name
    tp_rank: Rank
    request_id: Name
    expected: Annotated[int, Meta(ge=1, le=4096)]  # consumers the hold waits for


_notification_decoder = msgspec.msgpack.Decoder(Notification)


def decode_notification(data: bytes) -> Notification | None:
    """A peer's notification, or None when the bytes are not one (counted, never raised)."""
    try:
        return _notification_decoder.decode(data)
    except DECODE_ERRORS:
        return None


_req_decoder = msgspec.msgpack.Decoder(HandshakeRequest | AuditRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_audit_reply_decoder = msgspec.msgpack.Decoder(AuditReply)
_encoder = msgspec.msgpack.Encoder()


def compat_fields(geo: Geometry) -> dict[str, str]:
    """What must agree between two engines for their caches to be exchangeable."""
    segments = sorted(f"{g.name}/{v.name}.{s.name}:{g.kind}:{s.total_units}x{s.token_bytes}:{s.layout}"
                      + _spacing(s) for g in geo.groups for v in g.views for s in v.segments)
    return {"protocol": str(HANDSHAKE_VERSION), "model": geo.model, "dtype": geo.dtype,
            "segments": ",".join(segments)}


def _spacing(s: Segment) -> str:
    """Lanes, and whether units are spaced apart: nothing for plain segments, so their hash is
    what daemons before protocol 4 compute; a daemon that drops the fields never matches. The
    stride's value depends on the page (block size), which may differ: only its presence counts."""
    if (s.lanes, s.stride) == (1, 0):
        return ""
    return f":{s.lanes}l" + (":strided" if s.stride else "")


def compat_hash(geo: Geometry) -> str:
    return hashlib.sha256(_encoder.encode(compat_fields(geo))).hexdigest()[:16]


def weights_mismatch(local: Geometry, remote: Geometry) -> str:
    """Why two engines' weights may not exchange caches; "" when they may."""
    if local.weights and remote.weights and local.weights != remote.weights:
        return (f"model weights differ: local {local.weights[:120]!r} vs remote {remote.weights[:120]!r} "
                "(an engine started with enforce_handshake_compat=false accepts other weights)")
    return ""


def explain_mismatch(local: Geometry, remote: Geometry) -> str:
    """The compatibility fields that differ, for the error a read ends with."""
    a, b = compat_fields(local), compat_fields(remote)
    diffs = [f"{k}: local {a[k][:80]!r} vs remote {b[k][:80]!r}" for k in a if a[k] != b[k] and k != "segments"]
    if a["segments"] != b["segments"]:  # name the segments that differ, not a common prefix
        mine, theirs = a["segments"].split(","), b["segments"].split(",")
        only_local = [x for x in mine if x not in theirs][:3]
        only_remote = [x for x in theirs if x not in mine][:3]
        diffs.append(f"segments: local {only_local} vs remote {only_remote}")
    return "compatibility hash mismatch; " + "; ".join(diffs)


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ identity of this daemon and the server key it expects from peers.

    The simplest deployment shares one keypair across the cluster: every daemon presents it
    and trusts it (`authorized_dir` holds its public half). Per-node keypairs work too: put
    every node's public key in `authorized_dir` and give the servers' key as `server_public`.
    """

    public: bytes
    secret: bytes
    server_public: bytes
    authorized_dir: str


def load_curve(secret_file: str, authorized_dir: str, server_key_file: str = "") -> CurveKeys:
    import zmq.auth

    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key")
    if not Path(authorized_dir).is_dir():
        raise ValueError(f"curve authorized keys directory {authorized_dir} does not exist")
    server = zmq.auth.load_certificate(server_key_file)[0] if server_key_file else public
    return CurveKeys(public, secret, server, authorized_dir)


def generate_keys(directory: str, name: str = "kvxferd") -> tuple[str, str]:
    """Write a keypair (`name.key` public, `name.key_secret`); returns both paths."""
    import zmq.auth

    Path(directory).mkdir(parents=True, exist_ok=True, mode=0o700)
    return zmq.auth.create_certificates(directory, name)


SideRequest = HandshakeRequest | AuditRequest
SideReply = HandshakeReply | AuditReply
Answer = Callable[[SideRequest], SideReply]


class HandshakeServer:
    """ROUTER socket answering handshake and audit requests with `answer(request) -> reply`."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, answer: Answer,
                 curve: CurveKeys | None = None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_AUDIT_ROWS * 16 + 4096)  # audits name their rows
        self.auth = None
        if curve is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self.auth = AsyncioAuthenticator(ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=curve.authorized_dir)
            self.sock.curve_secretkey = curve.secret
            self.sock.curve_publickey = curve.public
            self.sock.curve_server = True
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.answer = answer

    async def watch_auth(self, on_refused: Callable[[int], None]) -> None:
        """Report peers refused at the ZMTP handshake (no or wrong CurveZMQ key)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            on_refused(int(event["event"]))

    async def run(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != 3 or parts[1] != b"":
                continue  # not a REQ socket's envelope: nothing to answer
            reply: SideReply
            try:
                reply = self.answer(_req_decoder.decode(parts[2]))
            except DECODE_ERRORS as exc:
                reply = HandshakeReply(False, f"malformed side-channel request: {exc}")
            except Exception as exc:  # the side channel must outlive any one request
                reply = HandshakeReply(False, f"internal error: {type(exc).__name__}: {exc}")
            await self.sock.send_multipart([parts[0], b"", _encoder.encode(reply)])

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(0)


async def request(ctx: zmq.asyncio.Context, host: str, port: int, engine_id: str, timeout_s: float,
                  requester: str = "", curve: CurveKeys | None = None) -> HandshakeReply:
    """Ask the daemon at host:port for engine_id's ranks; raise HandshakeError on any failure."""
    reply = await _ask(ctx, host, port, HandshakeRequest(HANDSHAKE_VERSION, engine_id, requester), timeout_s,
                       _reply_decoder, curve)
    if not reply.ok:
        raise HandshakeError("refused", f"{host}:{port} refused the handshake: {reply.reason}")
    return reply


async def audit(ctx: zmq.asyncio.Context, host: str, port: int, req: AuditRequest, timeout_s: float,
                curve: CurveKeys | None = None) -> AuditReply:
    """Ask the daemon at host:port for an audit; HandshakeError when no answer comes."""
    return await _ask(ctx, host, port, req, timeout_s, _audit_reply_decoder, curve)


async def _ask(ctx: zmq.asyncio.Context, host: str, port: int, req: SideRequest, timeout_s: float,
               decoder: msgspec.msgpack.Decoder[Any], curve: CurveKeys | None) -> Any:
    """One request, one reply, within `timeout_s`."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
    if curve is not None:
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_serverkey = curve.server_public
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(_encoder.encode(req))
        if not await sock.poll(timeout=int(timeout_s * 1000)):
            raise HandshakeError("timeout", f"no {req.__struct_config__.tag} answer from {host}:{port} within "
                                            f"{timeout_s:g} s (peer down, unreachable, or refusing our CurveZMQ key)")
        try:
            return decoder.decode(await sock.recv())
        except DECODE_ERRORS as exc:
            raise HandshakeError("malformed", f"malformed answer from {host}:{port}: {exc}") from None
    except zmq.ZMQError as exc:
        raise HandshakeError("unreachable", f"side channel to {host}:{port} failed: {exc}") from None
    finally:
        sock.close(0)
