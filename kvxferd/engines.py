"""Engine ranks: registration (map the memory, register it with NIXL), lookup, and release.

    register -> serving -> unregister / disconnect -> closing -> (idle, lease over) -> released

A closing rank answers no request, but its memory stays mapped and registered while a read
may still write it (in flight or quarantined) or a peer may still read it (a hold's lease).

An engine's registration has an epoch, a random token made when its first rank registers and
shared by the ranks that join it: peers learn it at handshake and ask for it in probes, so an
engine that restarted under the same id (its ranks all gone, then back) is told apart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from . import handshake as hs
from . import protocol as P
from .doorbell import Doorbell
from .lanes import LaneRegistrations, Lanes
from .memory import Mapping, MappingError, MemType, map_cuda, map_cuda_vmm, map_shm
from .nixl_driver import NixlDriver, Registration
from .plan.descriptors import region_addresses
from .plan.geometry import Geometry, GeometryError, validate
from .protocol import RequestError
from .recorder import Recorder
from .rpc import ServerConnection

log = logging.getLogger("kvxferd")

EngineKey = tuple[str, int]  # (engine id, tp rank)


@dataclass(eq=False)
class EngineRank:
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    mappings: list[Mapping]
    registrations: list[Registration]
    region_addr: np.ndarray  # absolute address of each geometry region in this process
    compat_hash: str
    conn: ServerConnection | None
    completions: deque[P.Completion] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False
    release_after: float = 0.0  # prefill memory: the latest lease a reader may still be using
    lane_registrations: LaneRegistrations = field(default_factory=list)  # the same memory, on each lane
    token: str = field(default_factory=lambda: secrets.token_hex(16))  # lets another process `attach`
    attached: weakref.WeakSet[ServerConnection] = field(default_factory=weakref.WeakSet)
    doorbell: Doorbell | None = None  # the pipe that tells the engine of completions (protocol 5)
    digesting: int = 0  # integrity digests reading this memory on the digest thread (integrity.Digester)
    epoch: str = ""  # the engine's registration this rank belongs to (see the module's docstring)
    uid: int | None = None  # the registering connection's (SO_PEERCRED); None: registered in-process

    @property
    def key(self) -> EngineKey:
        return self.engine_id, self.tp_rank

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mappings)

    @property
    def mem_type(self) -> MemType:
        return self.mappings[0].kind if self.mappings else "DRAM"

    @property
    def device(self) -> int:
        return self.mappings[0].device if self.mappings else 0

    def may_act(self, conn: ServerConnection | None) -> bool:
        """Whether a request on `conn` may name this rank: the connection that registered it and
        those attached with the rank's token (None: the daemon itself). Never a pid: a client in
        another PID namespace (a pod beside the daemon's) is pid 0 to the daemon, as are all others."""
        return conn is None or conn is self.conn or conn in self.attached

    def complete(self, c: P.Completion) -> None:
        """Hand a completion to the engine: into its doorbell (protocol 7) or the queue its next
        poll takes (dropped once the rank is closing)."""
        if self.closing:
            return
        if self.doorbell is not None and self.doorbell.push(c):
            return
        self.completions.append(c)
        self.wakeup.set()
        if self.doorbell is not None:
            self.doorbell.tell()

    def take_completions(self, max_items: int) -> P.Completions:
        items: list[P.Completion] = []
        while self.completions and len(items) < max_items:
            items.append(self.completions.popleft())
        if self.doorbell is not None:
            self.doorbell.polled(left=bool(self.completions))
        return P.Completions(items)

    def open_doorbell(self, records: bool, counter: bool = False, ring: bool = False) -> list[int]:
        """Make the rank's doorbell; returns the fds for the engine, the pipe's read end and the
        counter (or ring) page's memfd when asked for and made (the caller sends and closes them)."""
        self.close_doorbell()
        self.doorbell, fds = Doorbell.make(records, f"engine {self.engine_id} rank {self.tp_rank}", counter, ring)
        return fds

    def close_doorbell(self) -> None:
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    def rank_info(self) -> hs.RankInfo:
        """What a peer's handshake learns about this rank."""
        return hs.RankInfo(self.tp_rank, self.tp_size, self.compat_hash, [m.address for m in self.mappings],
                           self.mem_type, self.device, geometry=self.geometry)


class Engines:
    """Owns every registered rank: its mappings and NIXL registrations from register to release."""

    def __init__(self, nixl: NixlDriver, recorder: Recorder, lanes: Lanes | None = None,
                 max_ranks_per_uid: int = 1024, max_buffers_per_uid: int = 16384) -> None:
        self._nixl = nixl
        self._max_ranks_per_uid = max_ranks_per_uid
        self._max_buffers_per_uid = max_buffers_per_uid
        self._lanes = lanes
        self._recorder = recorder
        self._ranks: dict[EngineKey, EngineRank] = {}  # serving, by key
        # Closed ranks whose memory stays until nothing uses it: apart from the keys, so that a
        # restarted engine registers again at once (its old memory may be pinned for a lease).
        self._closing: list[EngineRank] = []
        self.ranks = MappingProxyType(self._ranks)  # read only: the dispatch's lookup

    def serving(self, engine_id: str) -> list[EngineRank]:
        """The serving ranks of one engine, by rank."""
        return sorted((e for e in self._ranks.values() if e.engine_id == engine_id),
                      key=lambda e: e.tp_rank)

    def all(self) -> list[EngineRank]:
        return [*self._ranks.values(), *self._closing]

    def knows(self, key: EngineKey) -> bool:
        return key in self._ranks

    # --- register -------------------------------------------------------------
    def register(self, msg: P.Register, fds: list[int], conn: ServerConnection | None = None) -> EngineRank:
        """Map and register the rank's memory; every fd in `fds` (one per shm/cuda_vmm handle, in
        order) is consumed. `conn`: the connection whose closing unregisters the rank."""
        pending = deque(fds)
        mappings: list[Mapping] = []
        try:
            geo = self._check(msg, conn)
            for m in msg.memory:  # each mapper owns (and closes) the fd it is given
                if m.kind == "shm":
                    mappings.append(map_shm(pending.popleft(), m.nbytes))
                elif m.kind == "cuda_vmm":
                    mappings.append(map_cuda_vmm(pending.popleft(), m.nbytes, m.device))
                else:
                    mappings.append(map_cuda(m.cuda_handle, m.nbytes))
        except BaseException as exc:  # whatever failed (a bad CUDA handle too), nothing made is kept
            for mp in mappings:
                mp.close()
            if isinstance(exc, MappingError | RequestError):
                raise RequestError("bad_request", str(exc)) if isinstance(exc, MappingError) else exc from None
            if isinstance(exc, Exception):
                raise RequestError("bad_request", f"engine memory could not be mapped: {type(exc).__name__}: "
                                                  f"{str(exc)[:200]}") from None
            raise
        finally:
            for fd in pending:
                os.close(fd)
        regs: list[Registration] = []
        try:
            for mp in mappings:
                regs.append(self._nixl.register(mp.address, mp.nbytes, mp.kind, mp.device))
            lane_regs = self._lanes.register([(mp.address, mp.nbytes, mp.kind, mp.device) for mp in mappings]) \
                if self._lanes is not None else []
        except Exception as exc:
            for reg in regs:
                self._nixl.deregister(reg)
            for mp in mappings:
                mp.close()
            raise RequestError("unsupported", f"NIXL cannot register this engine's {mappings[0].kind} memory "
                                              f"({msg.memory[0].kind}): {exc}") from None
        siblings = self.serving(msg.engine_id)
        er = EngineRank(msg.engine_id, msg.tp_rank, msg.tp_size, geo, mappings, regs,
                        region_addresses(geo, [mp.address for mp in mappings]), hs.compat_hash(geo), conn,
                        lane_registrations=lane_regs,
                        epoch=siblings[0].epoch if siblings else secrets.token_hex(8),
                        uid=None if conn is None else conn.credentials[1])
        self._ranks[er.key] = er
        self._changed()
        log.info("registered engine %s rank %d/%d: %s, %d B", er.engine_id, er.tp_rank, er.tp_size,
                 geo.model, er.nbytes)
        return er

    def _check(self, msg: P.Register, conn: ServerConnection | None) -> Geometry:
        if (msg.engine_id, msg.tp_rank) in self._ranks:
            raise RequestError("bad_request", f"engine {msg.engine_id!r} rank {msg.tp_rank} already registered")
        if conn is not None:  # each rank maps memory: one user's ranks are bounded, whatever their engine ids
            uid = conn.credentials[1]
            mine = [r for r in (*self._ranks.values(), *self._closing) if r.uid == uid]
            if len(mine) >= self._max_ranks_per_uid:
                raise RequestError("bad_request", f"uid {uid} has {len(mine)} engine ranks registered or still mapped "
                                                  f"(max_ranks_per_uid {self._max_ranks_per_uid})")
            buffers = sum(len(r.mappings) for r in mine) + len(msg.memory)  # each a mapping, a host one an fd too
            if buffers > self._max_buffers_per_uid:
                raise RequestError("bad_request", f"uid {uid} would have {buffers} engine buffers mapped "
                                                  f"(max_buffers_per_uid {self._max_buffers_per_uid})")
        for other in self.serving(msg.engine_id):  # an engine's ranks: one user's, one TP size
            if other.uid is not None and conn is not None and other.uid != conn.credentials[1]:
                raise RequestError("forbidden", f"engine {msg.engine_id!r} is registered by another user "
                                                f"(uid {other.uid})")
            if other.tp_size != msg.tp_size:
                raise RequestError("bad_request", f"engine {msg.engine_id!r} has ranks of TP size {other.tp_size}, "
                                                  f"not {msg.tp_size}")
        try:
            geo = validate(msg.geometry)
        except GeometryError as exc:
            raise RequestError("bad_request", f"invalid geometry: {exc}") from None
        if (geo.tp_rank, geo.tp_size) != (msg.tp_rank, msg.tp_size):
            raise RequestError("bad_request", f"geometry is for rank {geo.tp_rank}/{geo.tp_size}, "
                                              f"registration for {msg.tp_rank}/{msg.tp_size}")
        if len(msg.memory) != len(geo.buffers):
            raise RequestError("bad_request", f"{len(msg.memory)} memory handles for {len(geo.buffers)} buffers")
        for i, (m, size) in enumerate(zip(msg.memory, geo.buffers)):
            if m.nbytes < size:
                raise RequestError("bad_request", f"buffer {i}: handle of {m.nbytes} B, geometry needs {size} B")
        return geo

    def answer_probe(self, req: hs.ProbeRequest) -> hs.ProbeReply:
        """A peer daemon asks whether an engine is still registered here, and under which epoch."""
        ranks = self.serving(req.engine_id)
        if not ranks:
            return hs.ProbeReply(False, f"engine {req.engine_id!r} is not registered with this daemon", gone=True)
        return hs.ProbeReply(True, epoch=ranks[0].epoch)

    # --- close and release ----------------------------------------------------
    def close(self, er: EngineRank, why: str) -> bool:
        """Stop serving a rank (its memory stays until `release`); False if it was closing already."""
        if er.closing:
            return False
        er.closing = True
        er.close_doorbell()  # a closing rank queues no completion
        if self._ranks.get(er.key) is er:
            del self._ranks[er.key]
            self._closing.append(er)
        self._changed()
        log.info("engine %s rank %d: %s; memory released when idle", er.engine_id, er.tp_rank, why)
        return True

    def idle(self, in_use: Callable[[EngineRank], bool], now: float) -> list[EngineRank]:
        """Closing ranks nothing touches any more: no read uses them and every lease has ended."""
        return [er for er in self._closing
                if er.closing and now >= er.release_after and not er.digesting and not in_use(er)]

    def release(self, er: EngineRank) -> None:
        """Deregister and unmap a closed rank's memory (the caller made sure nothing uses it)."""
        if self._ranks.get(er.key) is er:
            del self._ranks[er.key]
        if er in self._closing:
            self._closing.remove(er)
        for reg in er.registrations:
            self._nixl.deregister(reg)
        if self._lanes is not None:
            self._lanes.deregister(er.lane_registrations)
        for mp in er.mappings:
            mp.close()
        er.registrations, er.mappings, er.lane_registrations = [], [], []
        self._changed()

    def _changed(self) -> None:
        live = list(self._ranks.values())
        self._recorder.engines_changed(len(live), len({e.engine_id for e in live}),
                                       sum(e.nbytes for e in self.all()))

    def status(self, pinned: Callable[[EngineRank], int]) -> list[P.EngineStatus]:
        return [P.EngineStatus(e.engine_id, e.tp_rank, e.tp_size, e.geometry.model, e.nbytes,
                               e.mappings[0].kind if e.mappings else "-", "closing" if e.closing else "serving",
                               pinned(e), len(e.completions), _rdma(e.mappings)) for e in self.all()]


def _rdma(mappings: list[Mapping]) -> bool | None:
    """All of a rank's buffers readable by a NIC directly (False: one is not); None: not asked."""
    answers = [m.rdma_capable for m in mappings]
    return None if not answers or None in answers else all(answers)
