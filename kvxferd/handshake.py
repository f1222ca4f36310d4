"""The daemon <-> daemon protocol: the ZMQ side channel and the READ notification.

The decode daemon asks the prefill daemon for an engine's ranks; the answer carries the
NIXL agent metadata and, per rank, the compatibility hash, the geometry and the buffer
addresses. Each read then tells the prefill daemon, with a `Notification`, which held request
a consumer has finished: on the side channel once the read is done (`NoticeRequest`), or, to a
daemon from before notices, carried by the READ itself. An audited read asks, before it is
reported, for the digests of the rows it read (`AuditRequest`, integrity.py). Payloads are
msgspec msgpack (never pickle); every wait has a deadline.

Side-channel version 2 tags requests (`"kind": "handshake" | "audit" | "probe"`). A probe
(`ProbeRequest`) asks whether an engine is still registered, and under which epoch (a token the
prefill daemon makes when an engine's first rank registers): the decode daemon's way to notice
a peer that went away or restarted (liveness.py). A daemon from before probes answers one as a
malformed request: alive, epoch unknown. Version 3 adds `"lease"`, a decode daemon's claims on
the holds it reads (leases.py), sent over one DEALER connection per peer daemon (sidelink.py).
Version 4 adds `"notice"`: the notifications of reads that are done, on that same connection
instead of on the READs (notices.py), to a daemon whose handshake reply says it takes them.
Version 5 adds `"serve"`: a reader asks for the serving daemon's NIXL progress when a READ of
its needs it, instead of that daemon progressing for every hold (serving.py). Version 6 makes a
hold a capability: a claim carries the read token the reader was given (`Claimed.token`) and
asks for the blocks the hold grants (`Claimed.grant`); the answer lists them (`ClaimAnswer.blocks`)
or says `denied`. A reader posts a READ only for blocks a grant lists; a notification counts
only with the hold's token (docs/security.md).

What a handshake grants is scoped to the engine it names: the reply's metadata covers that
engine's registered memory only, and the requester (the asking daemon's NIXL agent) is the
only agent whose notifications for that engine the answering daemon accepts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import msgspec
import zmq
import zmq.asyncio
from msgspec import Meta

from . import protocol as P
from .identity import CurveKeys, PeerKeys, fingerprinted, speaks_for
from .plan.geometry import Geometry, Segment
from .protocol import DECODE_ERRORS, Name, Rank, TpSize

HANDSHAKE_VERSION = 2  # of handshakes and audits; leases are version 3 (LeaseRequest)
LEASE_VERSION = 3
NOTICE_VERSION = 4
SERVE_VERSION = 5  # also the version of notices from a reader that asks for progress
GRANT_VERSION = 6  # of lease requests that carry read tokens and ask for the blocks a hold grants
MAX_MESSAGE = 64 << 20  # a handshake reply: metadata and geometries (~50 KiB a rank of a 128-layer model)
# What a peer sends is bounded by kind before it is kept, logged or relayed (docs/security.md):
# a reason or an agent name longer than these makes the whole reply malformed.
MAX_REASON = 1024
PeerText = Annotated[str, Meta(max_length=MAX_REASON)]
AgentName = Annotated[str, Meta(max_length=256)]


def printable(text: str) -> str:
    """A peer's text as it may be logged or relayed: control characters (a forged log line's
    newline, a terminal escape) shown as `?`."""
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)
MAX_AUDIT_ROWS = 4 << 20


HandshakeFailure = Literal["timeout", "unreachable", "malformed", "refused", "invalid"]


class HandshakeError(RuntimeError):
    """A handshake that failed; `reason` is a short label for metrics."""

    def __init__(self, reason: HandshakeFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HandshakeRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="handshake"):
    """`requester`: the asking daemon's NIXL agent name (every kvxferd has sent it since
    side-channel version 1). The answering daemon accepts notifications for `engine_id` from that
    agent only; a request without it is answered, but no notification of its sender counts."""

    version: int
    engine_id: Name
    requester: Annotated[str, Meta(max_length=1024)] = ""


class AuditRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="audit"):
    """Digests of the rows a consumer read from one held request of one prefill rank.

    `rows`: little-endian int64 pairs (address, length) in the prefill daemon's mapping,
    as the consumer's READ named them. `token`: the hold's read token, as a claim carries it
    (digests of small rows give their bytes back: an audit is a read, and needs the capability).
    A daemon before it refuses the field (upgrade prefill daemons first)."""

    version: int
    engine_id: Name
    tp_rank: Rank
    request_id: Name
    rows: Annotated[bytes, Meta(max_length=MAX_AUDIT_ROWS * 16)]
    token: P.ReadToken = ""


class AuditReply(msgspec.Struct):
    ok: bool
    reason: PeerText = ""
    digests: bytes = b""  # little-endian uint64, one per row asked about
    reused: list[list[int]] = []  # per cache group: held blocks whose bytes changed since the hold
    # Not held yet (the read overtook the prefill engine's hold): ask again before the deadline.
    retry: bool = False


Epoch = Annotated[str, Meta(max_length=64)]  # an engine registration's token (engines.py makes 16 hex digits)


class ProbeRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="probe"):
    """Is `engine_id` still registered, and under which epoch? Cheap: no metadata, no geometry."""

    version: int
    engine_id: Name


class ProbeReply(msgspec.Struct):
    """`ok`: registered, as `epoch`. `gone`: not registered (any more). Neither: the daemon could
    not say (one from before probes answers a malformed request): it is alive, its epoch unknown."""

    ok: bool
    reason: PeerText = ""
    epoch: Epoch = ""
    gone: bool = False


class _RankFields(msgspec.Struct):
    tp_rank: Rank
    tp_size: TpSize
    compat_hash: str
    buffer_addrs: list[Annotated[int, Meta(ge=0)]]
    mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    device: Annotated[int, Meta(ge=0, le=1023)] = 0


class RankInfo(_RankFields, kw_only=True):
    geometry: Geometry


# One rank's geometry as it arrives, at most MAX_GEOMETRY_BYTES encoded (a 128-layer model's is
# ~50 KiB): decoded on its own, one rank a loop turn, so that a peer's reply of many ranks or a
# bloated geometry never holds the daemon's loop (a 55 MiB geometry took 0.7 s in one decode).
MAX_GEOMETRY_BYTES = 1 << 20


class _ArrivingRank(_RankFields, kw_only=True):
    geometry: msgspec.Raw


class HandshakeReply(msgspec.Struct):
    """`metadata`: the answering agent's connection info and its registrations of the engine's
    memory, nothing else (one blob per memory type: `metadata` the first, `more_metadata` the
    rest, empty unless an engine's ranks mix host and device memory). A daemon before this
    change sent metadata for all its memory; loading either is the same call."""

    ok: bool
    reason: PeerText = ""
    agent: AgentName = ""
    metadata: bytes = b""
    ranks: list[RankInfo] = []
    more_metadata: list[bytes] = []
    # the `NoticeRequest` version the answering daemon takes (side-channel version 4); 0 from a
    # daemon before notices: READs to it carry their notifications
    notices: int = 0
    # the `ServeRequest` version the answering daemon takes (5): it progresses NIXL for readers
    # that ask; 0 from a daemon before: it progresses while it holds anything
    serve: int = 0
    epoch: Epoch = ""  # the engine's registration (see ProbeRequest); "" from a daemon before epochs

    @property
    def all_metadata(self) -> tuple[bytes, ...]:
        return (self.metadata, *self.more_metadata) if self.metadata else tuple(self.more_metadata)


class _ArrivingReply(HandshakeReply):
    ranks: list[_ArrivingRank] = []  # type: ignore[assignment]


class Notification(msgspec.Struct, array_like=True, tag="KVX1", gc=False):
    """One consumer of the prefill engine's held request is done (also sent for a rank nothing
    is read from). In a `NoticeRequest`, or as a NIXL notification carried by a READ. On the wire:
    `["KVX1", engine, prefill rank, prefill request id, expected consumers, read token]`; a
    daemon before read tokens sends no token (counted only for a hold that has none)."""

    engine_id: Name
    tp_rank: Rank
    request_id: Name
    expected: Annotated[int, Meta(ge=1, le=4096)]  # consumers the hold waits for
    token: P.ReadToken = ""  # the hold's read token (side-channel version 6)


class Claimed(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One held request a decode daemon reads (or will): `[engine, prefill rank, request id]`,
    and from version 6 `token` (the read token its reader presents) and `grant` (send the block
    lists the hold grants: the claimer has none yet)."""

    engine_id: Name
    tp_rank: Rank
    request_id: Name
    token: P.ReadToken = ""
    grant: bool = False


MAX_CLAIMS = 4096  # claims in one lease request (a decode daemon batches per peer daemon)


class LeaseRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="lease"):
    """Side-channel version 3: a decode daemon claims held requests it reads or will read.

    Each claim asks the prefill daemon to keep the hold alive for `extend_s` more seconds (0:
    only say how long it is alive) and not to end it before then, even once its consumers have
    all notified, unless `requester` notified it too. The reply says, per claim, whether the
    hold is alive and for how long: a decode daemon reports a read `received` only when such a
    reply covers the moment it saw the READ done (leases.py)."""

    version: int
    seq: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]  # echoed: replies on one link may come out of order
    requester: Annotated[str, Meta(max_length=1024)]
    extend_s: Annotated[float, Meta(ge=0, le=3600)]
    claims: Annotated[list[Claimed], Meta(max_length=MAX_CLAIMS)]
    release: bool = False  # the requester is done with these holds without reading them: unpin


class NoticeRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="notice"):
    """Side-channel version 4: a decode daemon's notifications of reads that are done, sent on
    its link once the READs ended (none rides on the READ: a READ carrying a NIXL notification
    completes only once the serving daemon progresses, notices.py). Counted as NIXL notifications
    are, from `requester` (the agent that handshook). Not answered: a reply per batch would queue
    the lease answers on the same link behind it."""

    version: int  # NOTICE_VERSION; SERVE_VERSION from a reader that asks for progress (serving.py)
    requester: Annotated[str, Meta(max_length=1024)]
    notices: Annotated[list[Notification], Meta(max_length=MAX_CLAIMS)]


MAX_SERVE_S = 10.0


class ServeRequest(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag="serve"):
    """Side-channel version 5: a reader's READ of the answering daemon's memory is under way and
    not done once posted (UCX over TCP, a new endpoint's wire-up, a READ that carried a NIXL
    notification): progress NIXL often for `serve_s`. Sent on the reader's link, at most every
    half `serve_s` per peer while such READs run; never answered, as a notice is not."""

    version: int
    requester: Annotated[str, Meta(max_length=1024)]
    serve_s: Annotated[float, Meta(gt=0, le=MAX_SERVE_S)]


ClaimState = Literal["held", "consumed", "pending", "ended", "denied"]
# held: alive, for granted_s at least;  consumed: ended "sent" after a notification of the requester;
# pending: not held yet (an engine step behind its request);  ended: expired, dropped, or unknown;
# denied (version 6): held, but the claim's read token is not the hold's
MAX_GRANT_BLOCKS = 1 << 20  # block ids one grant lists per cache group (handoff.MAX_BLOCKS_PER_GROUP)
MAX_GRANT_GROUPS = 64


MAX_GRANT_S = 1e7  # a claim's grant, at most: far past any max_lease_s


class ClaimAnswer(msgspec.Struct, array_like=True):
    state: ClaimState
    # held: not ended before this long after the request arrived (bounded: NaN or a negative
    # would stop the decode's renewal heap)
    granted_s: Annotated[float, Meta(ge=0, le=MAX_GRANT_S)] = 0.0
    # held, consumed: the registration of the engine holding it (ProbeRequest). A read planned
    # against another one read memory of an engine that has restarted under the same id.
    epoch: Epoch = ""
    # held, consumed, asked with `grant` (version 6): per cache group, the block ids the hold
    # names (packed little-endian int32): the only blocks a READ of this request may touch
    blocks: Annotated[list[Annotated[bytes, Meta(max_length=MAX_GRANT_BLOCKS * 4)]],
                      Meta(max_length=MAX_GRANT_GROUPS)] = []


class LeaseReply(msgspec.Struct):
    """`answers`: one per claim, in order. A daemon before side-channel version 3 answers a lease
    request with a refusal without `seq` (0): a link takes that for its oldest request."""

    ok: bool
    reason: PeerText = ""
    seq: int = 0
    answers: Annotated[list[ClaimAnswer], Meta(max_length=MAX_CLAIMS)] = []
    agent: AgentName = ""  # the answering daemon's NIXL agent: a grant holds for that daemon instance only


_notification_decoder = msgspec.msgpack.Decoder(Notification)


def decode_notification(data: bytes) -> Notification | None:
    """A peer's notification, or None when the bytes are not one (counted, never raised)."""
    try:
        return _notification_decoder.decode(data)
    except DECODE_ERRORS:
        return None


_req_decoder = msgspec.msgpack.Decoder(HandshakeRequest | AuditRequest | ProbeRequest | LeaseRequest | NoticeRequest
                                       | ServeRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_arriving_decoder = msgspec.msgpack.Decoder(_ArrivingReply)
_geometry_decoder = msgspec.msgpack.Decoder(Geometry)
_audit_reply_decoder = msgspec.msgpack.Decoder(AuditReply)
_probe_reply_decoder = msgspec.msgpack.Decoder(ProbeReply)
lease_reply_decoder = msgspec.msgpack.Decoder(LeaseReply)
encode = msgspec.msgpack.Encoder().encode
_encoder = msgspec.msgpack.Encoder()


class _Kind(msgspec.Struct):
    kind: str = ""


_kind_decoder = msgspec.msgpack.Decoder(_Kind)


def _unanswered(data: bytes) -> bool:
    """Whether a request that could not be read or answered says it is of a kind never answered."""
    try:
        return _kind_decoder.decode(data).kind in ("notice", "serve")
    except DECODE_ERRORS:
        return False


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


SideRequest = HandshakeRequest | AuditRequest | ProbeRequest | LeaseRequest | NoticeRequest | ServeRequest
SideReply = HandshakeReply | AuditReply | ProbeReply | LeaseReply
Answer = Callable[[SideRequest], "SideReply | Awaitable[SideReply] | None"]  # None: nothing to answer
MAX_ANSWERS_PENDING = 256  # answers still being computed (audits digesting); more wait their turn


class HandshakeServer:
    """ROUTER socket answering handshake and audit requests with `answer(request) -> reply`."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, answer: Answer,
                 keys: PeerKeys | None = None,
                 on_misattributed: Callable[[SideRequest, str], None] | None = None,
                 unattributed: bool = False) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_AUDIT_ROWS * 16 + 4096)  # audits name their rows
        self.auth = None
        if keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self.auth = AsyncioAuthenticator(ctx)
            self.auth.start()
            self.auth.configure_curve_callback(domain="*", credentials_provider=keys.authorized)
            self.sock.curve_secretkey = keys.curve.secret
            self.sock.curve_publickey = keys.curve.public
            self.sock.curve_server = True
        self._on_misattributed = on_misattributed or (lambda req, sender: None)
        self._unattributed = unattributed  # requester names without a key's fingerprint are answered
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
        self._pending: set[asyncio.Task[None]] = set()  # answers still being computed (audits)

    async def watch_auth(self, on_refused: Callable[[int], None]) -> None:
        """Report peers refused at the ZMTP handshake (no or wrong CurveZMQ key)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            on_refused(int(event["event"]))

    async def run(self) -> None:
        """Answer requests in turn; an answer that must wait (an audit's digests) is sent when
        ready, while later requests are answered meanwhile."""
        pending = self._pending
        while True:
            if len(pending) >= MAX_ANSWERS_PENDING:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            frames = await self.sock.recv_multipart(copy=False)
            if len(frames) != 3 or frames[1].bytes != b"":
                continue  # not a REQ socket's envelope: nothing to answer
            parts = [f.bytes for f in frames]
            try:
                req = _req_decoder.decode(parts[2])
                sender = str(frames[2].get("User-Id")) if self.auth is not None else None
                reply = self.answer(req) if sender is None else self._attributed(req, sender)
            except DECODE_ERRORS as exc:
                # A notice (or serve request) is never answered, not even its refusal: on a link (sidelink.py) a
                # reply without seq would be taken for the refusal of the oldest lease claim.
                reply = None if _unanswered(parts[2]) else HandshakeReply(
                    False, f"malformed side-channel request: {exc}")
            except Exception as exc:  # the side channel must outlive any one request
                reply = None if _unanswered(parts[2]) else HandshakeReply(
                    False, f"internal error: {type(exc).__name__}: {exc}")
            if reply is None:  # a notice or a serve request: answered by nothing
                await asyncio.sleep(0)
            elif isinstance(reply, HandshakeReply | AuditReply | ProbeReply | LeaseReply):
                await self.sock.send_multipart([parts[0], b"", _encoder.encode(reply)])
                # a ready message is received without yielding: a flood would keep the loop here
                await asyncio.sleep(0)
            else:
                task = asyncio.ensure_future(self._answer_later(parts[0], reply))
                pending.add(task)
                task.add_done_callback(pending.discard)

    def _attributed(self, req: SideRequest, sender: str) -> SideReply | Awaitable[SideReply] | None:
        """`req` answered if its requester is the sender's (identity.py), else refused: a claim or
        a handshake in another daemon's name, or in a name without a key's fingerprint, is told
        so; a notice is dropped (and reported). Probes and audits name nobody: answered."""
        requester = getattr(req, "requester", None)
        if requester is None or speaks_for(requester, sender, self._unattributed):
            return self.answer(req)
        self._on_misattributed(req, sender)
        reason = (f"requester {printable(requester[:80])} is not the agent of the key this request came with "
                  f"({sender}): a daemon speaks only for itself" if fingerprinted(requester) else
                  f"requester {printable(requester[:80])} names no daemon key's fingerprint (a daemon before "
                  "protocol 12): this daemon answers only requests it can attribute to their key "
                  "(unattributed_peers = false)")
        if isinstance(req, LeaseRequest):
            return LeaseReply(False, reason, req.seq)
        if isinstance(req, HandshakeRequest):
            return HandshakeReply(False, reason)
        return None

    async def _answer_later(self, identity: bytes, reply: Awaitable[SideReply]) -> None:
        try:
            answer = await reply
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the server closes
            answer = AuditReply(False, "internal error: the answer was cancelled")  # never silence
        except Exception as exc:
            answer = AuditReply(False, f"internal error: {type(exc).__name__}: {exc}")
        with contextlib.suppress(zmq.ZMQError):  # the socket closed meanwhile: nobody to answer
            await self.sock.send_multipart([identity, b"", _encoder.encode(answer)])

    def close(self) -> None:
        for task in self._pending:
            task.cancel()
        self.sock.disable_monitor()
        self.monitor.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.sock.close(0)


async def request(ctx: zmq.asyncio.Context, host: str, port: int, engine_id: str, timeout_s: float,
                  requester: str = "", curve: CurveKeys | None = None) -> HandshakeReply:
    """Ask the daemon at host:port for engine_id's ranks; raise HandshakeError on any failure."""
    arriving: _ArrivingReply = await _ask(ctx, host, port, HandshakeRequest(HANDSHAKE_VERSION, engine_id, requester),
                                          timeout_s, _arriving_decoder, curve)
    if not arriving.ok:
        raise HandshakeError("refused", f"{host}:{port} refused the handshake: {printable(arriving.reason)}")
    return await _decoded(arriving, f"{host}:{port}")


async def _decoded(arriving: _ArrivingReply, where: str) -> HandshakeReply:
    """The reply with each rank's geometry decoded, one a loop turn, each bounded first."""
    for r in arriving.ranks:
        if len(r.geometry) > MAX_GEOMETRY_BYTES:
            raise HandshakeError("malformed", f"malformed answer from {where}: rank {r.tp_rank}'s geometry is "
                                              f"{len(r.geometry)} B encoded, more than {MAX_GEOMETRY_BYTES} B")
    ranks = []
    for r in arriving.ranks:
        try:
            geometry = _geometry_decoder.decode(r.geometry)
        except DECODE_ERRORS as exc:
            raise HandshakeError("malformed", f"malformed answer from {where}: rank {r.tp_rank}'s geometry: "
                                              f"{exc}") from None
        ranks.append(RankInfo(**{**msgspec.structs.asdict(r), "geometry": geometry}))
        await asyncio.sleep(0)
    return HandshakeReply(**{**msgspec.structs.asdict(arriving), "ranks": ranks})


async def audit(ctx: zmq.asyncio.Context, host: str, port: int, req: AuditRequest, timeout_s: float,
                curve: CurveKeys | None = None) -> AuditReply:
    """Ask the daemon at host:port for an audit; HandshakeError when no answer comes."""
    return await _ask(ctx, host, port, req, timeout_s, _audit_reply_decoder, curve)


async def probe(ctx: zmq.asyncio.Context, host: str, port: int, engine_id: str, timeout_s: float,
                curve: CurveKeys | None = None) -> ProbeReply:
    """Ask the daemon at host:port whether engine_id is registered; HandshakeError when no answer
    comes. An older daemon's answer (a HandshakeReply refusing the unknown kind) decodes as a
    ProbeReply neither ok nor gone."""
    return await _ask(ctx, host, port, ProbeRequest(HANDSHAKE_VERSION, engine_id), timeout_s,
                      _probe_reply_decoder, curve)


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
        # A REQ socket's send waits for a connection: one the peer refuses at the ZMTP handshake
        # (a key it does not admit) may never come, and the send must not wait for ever.
        try:
            await asyncio.wait_for(sock.send(_encoder.encode(req)), timeout_s)
        except TimeoutError:
            raise HandshakeError("timeout", f"no connection to {host}:{port} within {timeout_s:g} s (peer down, "
                                            "unreachable, or refusing our CurveZMQ key)") from None
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
