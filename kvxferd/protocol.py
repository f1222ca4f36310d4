"""Engine <-> daemon protocol (version 1): msgspec msgpack messages. See docs/protocol.md.

Every request is one frame; the daemon answers each with exactly one frame, in order.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from .plan.geometry import Geometry

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20  # bytes; a frame announcing more is refused


class Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    pass


class MemoryHandle(msgspec.Struct, forbid_unknown_fields=True):
    """One engine buffer. shm and cuda_vmm: its fd travels as SCM_RIGHTS with the frame."""
    kind: Literal["shm", "cuda_vmm", "cuda_ipc"]
    nbytes: int  # size of the allocation (>= the geometry's buffer size)
    device: int = 0  # CUDA device ordinal (cuda_*)
    cuda_handle: bytes = b""  # cuda_ipc: from memory.export_cuda

    @property
    def has_fd(self) -> bool:
        return self.kind in ("shm", "cuda_vmm")


class Hello(Msg, tag="hello"):
    version: int
    client: str = ""


class Register(Msg, tag="register"):
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    memory: list[MemoryHandle]  # one per geometry buffer, shm fds in the same order


class Unregister(Msg, tag="unregister"):
    engine_id: str
    tp_rank: int


class Hold(Msg, tag="hold"):
    """Prefill: keep request's blocks until its consumers have read them or the lease ends."""
    engine_id: str
    tp_rank: int
    request_id: str
    lease_s: float = 30.0
    block_ids: list[list[int]] = []


class RemoteRef(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str
    host: str
    port: int
    tp_size: int
    request_id: str


class Read(Msg, tag="read"):
    """Decode: pull `remote.request_id` from the remote engine into these local blocks."""
    engine_id: str
    tp_rank: int
    request_id: str
    remote: RemoteRef
    num_tokens: int
    local_blocks: list[list[int]]  # per cache group: the missing tail (attention) / state blocks
    remote_blocks: list[list[int]]
    deadline_s: float = 30.0


class Poll(Msg, tag="poll"):
    engine_id: str
    tp_rank: int
    wait_s: float = 0.0  # long-poll: wait up to this long for the first completion
    max_items: int = 1024


class StatusQuery(Msg, tag="status"):
    pass


Request = Union[Hello, Register, Unregister, Hold, Read, Poll, StatusQuery]


class Completion(msgspec.Struct):
    request_id: str
    status: Literal["sent", "expired", "received", "failed"]
    block_ids: list[list[int]] = []
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class Welcome(Msg, tag="welcome"):
    version: int
    daemon: str


class Registered(Msg, tag="registered"):
    side_channel: str  # host:port that peers handshake with
    agent: str


class Ok(Msg, tag="ok"):
    pass


class Completions(Msg, tag="completions"):
    items: list[Completion]


class StatusReply(Msg, tag="status_reply"):
    status: dict


class Error(Msg, tag="error"):
    code: str  # bad_request, unknown_engine, unsupported, internal, version
    message: str


Reply = Union[Welcome, Registered, Ok, Completions, StatusReply, Error]

# What decoding untrusted bytes may raise (msgspec reports bad UTF-8 as UnicodeDecodeError).
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
