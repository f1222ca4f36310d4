"""Engine <-> daemon protocol (`PROTOCOL_VERSION`, history below): msgspec msgpack messages. See docs/protocol.md.

Every request is one frame; the daemon answers each with exactly one frame, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta

from .plan.geometry import Geometry

# 2 added `batch`, 3 the completion doorbell, 4 segment `lanes` and `stride` (a daemon that did not
# know them would drop them and misread the memory: it refuses version 4), 5 the daemon's own
# doorbell pipe (`register.doorbell_pipe`), 6 `expect` (a read announced before its blocks are
# allocated: the prefill's holds are kept alive meanwhile), 7 completions written into the doorbell
# pipe (`register.doorbell_records`, see doorbell.py), 8 packed block lists (`Blocks`), 9 the
# doorbell's counter page, 10 its completion ring (`register.doorbell_ring`), 11 read tokens
# (`hold.read_token`, `remote.read_token`: a hold is a capability, see docs/security.md); older
# clients are served (their holds carry no token: any reader may read the blocks they name), 12
# daemon keys (`registered.side_channel_key`, `remote.daemon_key`: a read dials the prefill
# daemon's own CurveZMQ key, see identity.py)
PROTOCOL_VERSION = 12
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
MAX_FRAME = 64 << 20  # bytes; a frame announcing more is refused

# Static bounds, checked while decoding (the daemon's configuration narrows lease and deadline).
Rank = Annotated[int, Meta(ge=0, le=4095)]
TpSize = Annotated[int, Meta(ge=1, le=4096)]
MAX_BATCH = 4096  # orders in one batch frame
Seconds = Annotated[float, Meta(gt=0, le=86400)]
WaitSeconds = Annotated[float, Meta(ge=0, le=3600)]
Tokens = Annotated[int, Meta(ge=0, le=1 << 31)]
Bytes = Annotated[int, Meta(ge=0, le=1 << 50)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
# A hold's capability (protocol 11): "" (an open hold, readable by whoever names it) or at least
# MIN_READ_TOKEN characters, e.g. 32 hex digits of 128 random bits (client.new_read_token).
ReadToken = Annotated[str, Meta(max_length=128)]
MIN_READ_TOKEN = 32
# A daemon's CurveZMQ public key in Z85 (protocol 12); "": the decode daemon's default server key.
Z85_KEY = r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}"  # a 32-byte key in Z85
DaemonKey = Annotated[str, Meta(pattern=rf"^(?:{Z85_KEY})?\Z")]
MAX_BLOCK_ID = (1 << 31) - 1
# One cache group's block ids: a msgpack array of ints, or (protocol 8) packed, little-endian
# int32 in a bin: 4 bytes an id, decoded without a Python int each (`block_array`).
BlockList = list[Annotated[int, Meta(ge=0, le=MAX_BLOCK_ID)]] | bytes
Blocks = list[BlockList]

ErrorCode = Literal["bad_request", "unknown_engine", "unsupported", "internal", "version", "forbidden"]


class RequestError(Exception):
    """A request the daemon refuses; answered as an `Error` with this code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


def block_array(ids: BlockList) -> np.ndarray:
    """One cache group's block ids as int64. A list was range-checked while decoding; packed ids
    are checked here (RequestError: not whole 4-byte ids, or negative)."""
    if isinstance(ids, bytes):
        return _unpacked(ids).astype(np.int64)
    return np.array(ids, dtype=np.int64)


def block_arrays(blocks: Blocks) -> tuple[np.ndarray, ...]:
    return tuple(block_array(ids) for ids in blocks)


def check_blocks(blocks: Blocks) -> None:
    """What `block_arrays` would refuse (RequestError), without converting."""
    for ids in blocks:
        if isinstance(ids, bytes):
            _unpacked(ids)


def _unpacked(ids: bytes) -> np.ndarray:
    if len(ids) % 4:
        raise RequestError("bad_request", f"packed block ids of {len(ids)} bytes: not a whole number of "
                                          "4-byte ids")
    packed = np.frombuffer(ids, dtype="<i4")
    if len(packed) and packed.min() < 0:  # int32: negative is the only way out of 0..MAX_BLOCK_ID
        raise RequestError("bad_request", f"packed block ids {packed[packed < 0][:8].tolist()} out of range "
                                          f"0..{MAX_BLOCK_ID}")
    return packed


def block_lists(blocks: Blocks) -> list[list[int]]:
    """The lists a completion reports, whichever way the request carried them."""
    return [ids if isinstance(ids, list) else block_array(ids).tolist() for ids in blocks]


def pack_blocks(ids: Iterable[int] | np.ndarray) -> bytes:
    """One cache group's block ids, packed (protocol 8). ValueError: not integers in
    0..MAX_BLOCK_ID (packing must not wrap an id into another block)."""
    if not isinstance(ids, np.ndarray):
        ids = list(ids)  # any iterable, as the unpacked form took
    try:
        arr = np.asarray(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    except OverflowError:
        raise ValueError(f"block ids out of range 0..{MAX_BLOCK_ID}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"block ids must be a flat list of integers, got {arr.dtype} of shape {arr.shape}")
    if len(arr) and (arr.min() < 0 or arr.max() > MAX_BLOCK_ID):
        raise ValueError(f"block ids out of range 0..{MAX_BLOCK_ID}: {arr.min()} .. {arr.max()}")
    return arr.astype("<i4").tobytes()


class Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    """A request on the engine socket. Those made once per request (hold, read, expect, their
    completion) are `gc=False`: they hold only strings, numbers and lists of them, never a cycle,
    so the garbage collector need not track them (thousands a second)."""


class MemoryHandle(msgspec.Struct, forbid_unknown_fields=True):
    """One engine buffer. shm and cuda_vmm: its fd travels as SCM_RIGHTS with the frame."""
    kind: Literal["shm", "cuda_vmm", "cuda_ipc"]
    nbytes: Bytes  # size of the allocation (>= the geometry's buffer size)
    device: Annotated[int, Meta(ge=0, le=1023)] = 0  # CUDA device ordinal (cuda_*)
    cuda_handle: bytes = b""  # cuda_ipc: from memory.export_cuda

    @property
    def has_fd(self) -> bool:
        return self.kind in ("shm", "cuda_vmm")


class Hello(Msg, tag="hello"):
    version: int
    client: str = ""


class Register(Msg, tag="register", omit_defaults=True):  # fields at their default not sent (Registered)
    engine_id: Name
    tp_rank: Rank
    tp_size: TpSize
    geometry: Geometry
    memory: list[MemoryHandle]  # one per geometry buffer, shm fds in the same order
    # protocol 3-4: one more fd, last, an eventfd to ring. Not rung any more: its open file is the
    # engine's too, which can make a write to it block (the fd is closed, `registered.doorbell` false).
    doorbell: bool = False
    doorbell_pipe: bool = False  # protocol 5: the daemon makes the doorbell, sends its read end back
    doorbell_records: bool = False  # protocol 7: the doorbell carries the completions (doorbell.py)
    doorbell_counter: bool = False  # protocol 9: with records, a counter page too (doorbell.py)
    doorbell_ring: bool = False  # protocol 10: with a counter, the records in a ring on its page


class Unregister(Msg, tag="unregister"):
    engine_id: Name
    tp_rank: Rank


class Hold(Msg, tag="hold", omit_defaults=True, gc=False):  # a daemon before 11 refuses a read_token it is sent
    """Prefill: keep request's blocks until its consumers have read them or the lease ends."""
    engine_id: Name
    tp_rank: Rank
    request_id: Name
    lease_s: Seconds = 30.0
    block_ids: Blocks = []
    digest: bool | None = None  # digest the blocks for audits; None: the daemon's integrity_audit
    # protocol 11: what a reader must present (RemoteRef.read_token) to read these blocks; only
    # the blocks named here are ever read of this request. "": any reader that names the request
    read_token: ReadToken = ""


class RemoteRef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    engine_id: Name
    host: Name
    port: Port
    tp_size: TpSize
    request_id: Name
    read_token: ReadToken = ""  # protocol 11: the prefill hold's token (Hold.read_token)
    # protocol 12: the prefill daemon's public key (its Registered.side_channel_key), which the
    # decode daemon must have authorized; "": its default server key
    daemon_key: DaemonKey = ""


class Read(Msg, tag="read", gc=False):
    """Decode: pull `remote.request_id` from the remote engine into these local blocks."""
    engine_id: Name
    tp_rank: Rank
    request_id: Name
    remote: RemoteRef
    num_tokens: Tokens
    local_blocks: Blocks  # per cache group: the missing tail (attention) / state blocks
    remote_blocks: Blocks
    deadline_s: Seconds = 30.0
    audit: bool | None = None  # check the bytes against the prefill's digests; None: integrity_audit


class Expect(Msg, tag="expect", gc=False):
    """Protocol 6, decode: this request will read `remote` (a `read` with the same request id
    follows, or a release). The daemon keeps the prefill's holds alive from now until that read
    ends, at most max_lease_s: a decode busy before it allocates blocks still finds the KV."""
    engine_id: Name
    tp_rank: Rank
    request_id: Name
    remote: RemoteRef


class Batch(Msg, tag="batch"):
    """Protocol 2: several holds and reads in one frame, carried out in order, one result each
    (an engine step's orders in one round trip). Protocol 6 adds expects."""
    items: Annotated[list[Hold | Read | Expect], Meta(max_length=MAX_BATCH)]


class Poll(Msg, tag="poll"):
    engine_id: Name
    tp_rank: Rank
    wait_s: WaitSeconds = 0.0  # long-poll: wait up to this long (at most 60 s) for the first completion
    max_items: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024


class StatusQuery(Msg, tag="status"):
    pass


class Attach(Msg, tag="attach"):
    """Protocol 3: let this connection act for a rank registered by another process, with the
    token its `registered` reply handed out."""
    engine_id: Name
    tp_rank: Rank
    token: Annotated[str, Meta(min_length=1, max_length=128)]


Request = Hello | Register | Unregister | Hold | Read | Batch | Poll | StatusQuery | Attach | Expect


class Completion(msgspec.Struct, gc=False):
    request_id: str
    status: Literal["sent", "expired", "received", "failed"]
    block_ids: list[list[int]] = []
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class Welcome(Msg, tag="welcome"):
    version: int
    daemon: str


class Registered(Msg, tag="registered", omit_defaults=True):
    """Fields at their default are not sent: a client older than a field (clients refuse
    unknown fields) is still answered."""

    side_channel: str  # host:port that peers handshake with
    agent: str
    doorbell: bool = False  # protocol 5: a doorbell pipe's read end came with this reply (SCM_RIGHTS)
    token: str = ""  # protocol 3: what another process presents (`attach`) to act for this rank
    # protocol 6: how long after a hold began a decode's claims may keep it. An engine that loses
    # its daemon's connection keeps the blocks it held until then: the daemon may have vouched
    # for them to a decode reading them.
    max_lease_s: float = 0.0
    doorbell_records: bool = False  # protocol 7: the doorbell carries completion records (doorbell.py)
    doorbell_counter: bool = False  # protocol 9: the counter page's memfd came after the pipe's read end
    doorbell_ring: bool = False  # protocol 10: that page is a ring page, and the records are in it
    # protocol 12: this daemon's CurveZMQ public key (Z85; "" without Curve): what a prefill puts
    # in kv_transfer_params (remote_daemon_key) for the decode daemon to dial
    side_channel_key: str = ""

    def for_version(self, version: int) -> Registered:
        """This reply as a client of `version` can decode it: fields it predates left at their
        default (and so not sent)."""
        since = {"doorbell": (3, False), "token": (3, ""), "max_lease_s": (6, 0.0), "doorbell_records": (7, False),
                 "doorbell_counter": (9, False), "doorbell_ring": (10, False), "side_channel_key": (12, "")}
        older = {name: default for name, (v, default) in since.items() if version < v}
        return msgspec.structs.replace(self, **older) if older else self


class Ok(Msg, tag="ok"):
    pass


class Completions(Msg, tag="completions"):
    items: list[Completion]


# --- status: what `kvxferd status` shows; its --json is this Struct as JSON ----------------


class EngineStatus(msgspec.Struct):
    engine: str
    rank: int
    tp_size: int
    model: str
    bytes: int
    memory: str  # NIXL memory type, "-" once released
    state: Literal["serving", "closing"]
    pinned: int  # reads (in flight or quarantined) that may still touch this memory
    pending_completions: int
    # GPU memory: whether the driver says a NIC may read every buffer directly (GPUDirect RDMA,
    # READs from other hosts); None: host memory, or the driver did not say (memory.py)
    rdma: bool | None = None


class PeerStatus(msgspec.Struct):
    engine: str
    address: str
    agent: str
    handshake_age_s: float | None
    handshake_s: float
    plans: int
    ranks: list[int]
    active: int  # reads using this peer's prepared lists
    # handshaking; ready; retired: gone (`retired` says why), its lists kept while reads use them
    state: Literal["handshaking", "ready", "retired"] = "ready"
    retired: str = ""  # posting_failed, silent, engine_gone, restarted, idle
    epoch: str = ""  # the remote engine's registration ("": a daemon before epochs)
    heard_s: float | None = None  # since its side channel last answered (handshake or probe)
    idle_s: float | None = None  # since a read was last posted to it
    # who moves its routes' bytes (peers.py): "nixl" (its daemon's agent, over UCX); for an
    # engine of this daemon itself, "copy" (this daemon's memcpy) or "loop" (NIXL's loopback)
    lanes: list[str] = []
    # moving average of its reads of 1 MiB and more (None: none yet); slow: GPU memory moved far
    # below a device transport (rates.py, slow_route_gbps)
    read_gbps: float | None = None
    slow: bool = False


class ReadStatus(msgspec.Struct):
    engine: str
    rank: int
    request: str
    peer: str
    age_s: float


class HoldStatus(msgspec.Struct):
    engine: str
    rank: int
    request: str
    consumers: str  # "notified/expected"; "?" until the first consumer says how many
    age_s: float
    expires_in_s: float


class Recent(msgspec.Struct):
    window_s: int
    reads: int
    bytes: int
    bytes_per_s: float


class Counters(msgspec.Struct):
    received: int = 0
    failed: int = 0
    split_reads: int = 0  # reads split across posting lanes
    sent: int = 0
    expired: int = 0
    unknown_notifs: int = 0
    unauthorized_notifs: int = 0  # from an agent that never handshook for the engine named: dropped
    handshakes: int = 0
    handshake_failures: int = 0
    unauthenticated_peers: int = 0
    misattributed: int = 0  # side-channel requests in another daemon's name than their key's: refused
    forbidden: int = 0  # requests naming a rank from a connection that may not act for it
    integrity_failures: int = 0  # audited reads whose bytes did not match the prefill's digests
    quarantined: int = 0  # reads that failed while NIXL still ran them (their memory stayed pinned)
    peers_retired: int = 0  # peers retired (why: kvxferd_peers_retired_total{reason})


class Percentiles(msgspec.Struct, omit_defaults=True):
    n: int
    p50: float | None = None  # microseconds
    p99: float | None = None


class Latency(msgspec.Struct):
    rpc_to_post: Percentiles
    rpc_to_completion: Percentiles
    # NIXL's post call per READ posted whole (its telemetry); over CMA the copy runs inside it
    nixl_post: Percentiles = msgspec.field(default_factory=lambda: Percentiles(0))


class FailureRecord(msgspec.Struct):
    time: float
    engine: str
    rank: int
    request: str
    peer: str
    reason: str


class Totals(msgspec.Struct):
    """How many there are: the status lists show at most STATUS_ROWS of each (the oldest)."""

    engines: int
    peers: int
    in_flight: int
    held: int
    remote_agents: int = 0  # NIXL remote agents the daemon's agent has loaded (one per peer daemon in use)
    lane_remote_agents: int = 0  # the same, summed over the posting lanes' agents


STATUS_ROWS = 100  # rows per status list: a daemon with 10,000 holds answers `status` quickly


class Status(msgspec.Struct):
    version: str
    agent: str
    uptime_s: float
    socket: str
    side_channel: str
    side_channel_auth: Literal["curve", "none"]
    metrics: str | None
    engines: list[EngineStatus]
    peers: list[PeerStatus]
    in_flight: list[ReadStatus]
    quarantined: int
    held: list[HoldStatus]
    recent: Recent
    counters: Counters
    latency_us: Latency
    failures: list[FailureRecord]
    totals: Totals
    side_channel_key: str = ""  # the daemon's CurveZMQ public key (Z85; "" without Curve)


class StatusReply(Msg, tag="status_reply"):
    status: Status


class Error(Msg, tag="error"):
    code: ErrorCode
    message: str


class Results(Msg, tag="results"):
    """The answer to a `batch`: per item, `ok` or the `error` it alone got."""
    items: list[Ok | Error]


Reply = Welcome | Registered | Ok | Completions | StatusReply | Error | Results

# What decoding untrusted bytes may raise (msgspec reports bad UTF-8 as UnicodeDecodeError).
NOT_APPLIED = "not applied: "  # starts the error of a batch item held back because another was refused

# What decoding untrusted bytes raises: msgspec's own errors, UnicodeDecodeError for a string that
# is not UTF-8, and RecursionError for containers nested deeper than the interpreter's limit (an
# unknown field is skipped recursively: 3 KB of brackets is enough).
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
