"""The daemon's records: engine ranks, peers, reads and held requests; the notification format."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from . import handshake as hs
from . import protocol as P
from .memory import Mapping
from .plan.geometry import Geometry
from .plan.planner import RankPlan
from .rpc import ServerConnection

NOTIF_PREFIX = b"KVX1"


def encode_notif(engine_id: str, rank: int, request_id: str, expected: int) -> bytes:
    return msgspec.msgpack.encode([NOTIF_PREFIX, engine_id, rank, request_id, expected])


def decode_notif(data: bytes) -> tuple[str, int, str, int] | None:
    try:
        prefix, engine_id, rank, request_id, expected = msgspec.msgpack.decode(data)
        if prefix != NOTIF_PREFIX:
            return None
        return str(engine_id), int(rank), str(request_id), int(expected)
    except (*P.DECODE_ERRORS, ValueError, TypeError):
        return None


class RequestError(Exception):
    """A request the daemon refuses; becomes a protocol Error with this code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class EngineRank:
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    mappings: list[Mapping]
    registrations: list
    region_addr: np.ndarray
    compat_hash: str
    conn: ServerConnection | None
    completions: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    pinned: int = 0  # transfers (in flight or quarantined) that may still touch this memory
    closing: bool = False
    release_after: float = 0.0  # prefill memory: the latest lease a reader may still be using

    @property
    def key(self) -> tuple[str, int]:
        return self.engine_id, self.tp_rank

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mappings)

    def complete(self, c: P.Completion) -> None:
        if not self.closing:
            self.completions.append(c)
            self.wakeup.set()


@dataclass
class PeerLink:
    """Prepared descriptor lists for one local rank reading one peer's rank."""

    local: object
    remote: object


@dataclass
class Peer:
    engine_id: str
    host: str
    port: int
    ready: asyncio.Future
    agent: str = ""
    ranks: dict[int, hs.RankInfo] = field(default_factory=dict)
    since: float = 0.0
    handshake_s: float = 0.0
    plans: dict[tuple[str, int], RankPlan] = field(default_factory=dict)
    links: dict[tuple[str, int, int], PeerLink] = field(default_factory=dict)
    active: int = 0  # transfers using this peer's lists
    broken: bool = False

    @property
    def label(self) -> str:
        return self.engine_id

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Transfer:
    engine: EngineRank
    request_id: str
    remote: str  # the remote engine id: the peer label in metrics and logs
    peer: Peer | None
    local_blocks: list[list[int]]
    started: float
    deadline: float
    received_at: float = 0.0  # perf_counter when the read RPC arrived
    posted_at: float = 0.0  # monotonic time the READs were posted
    handles: list = field(default_factory=list)  # (remote rank, nixl handle)
    nbytes: int = 0
    descriptors: int = 0
    done: bool = False


@dataclass
class Held:
    engine: EngineRank
    request_id: str
    deadline: float
    since: float
    block_ids: list[list[int]]
    count: int = 0
    expected: int = 0
