"""Posting lanes: a large read split across extra NIXL agents, each posted from its own thread.

    read of B bytes, B >= 2 x split_bytes -> k = min(lanes, B // split_bytes) slices of its
        descriptor pairs (contiguous, equal counts)
    slice i -> lane i's thread: explicit descriptor rows -> READ on lane i's agent (no notification)
    every slice DONE -> the daemon's own agent sends the consumers' notifications -> "received"

Why: with UCX's shared-memory transports (CMA) a READ's copy runs inside the call that posts
it, so one agent moves one stream at a time, and the event loop that posts it stalls for the
whole copy. Each lane is its own NIXL agent (its own UCX worker) driven by its own thread;
NIXL releases the GIL in its calls, so slices copy in parallel and the loop stays free.

A lane's agent is created in NIXL's strict thread mode: the lane thread loads peers and posts,
the loop thread registers memory, checks states and releases handles, and NIXL serializes them.
Lanes read into memory the daemon's agent registered too: they register every engine rank.
They load a peer's metadata on first use, from the handshake the daemon's agent made.
Notifications always come from the daemon's agent, after the data is in place, so a prefill
engine never frees blocks a slice still reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .memory import MemType
from .nixl_driver import DONE, NixlDriver, Registration, TransferError
from .postings import Posted, SliceRead

log = logging.getLogger("kvxferd")

LaneRegistrations = list[list[Registration]]  # per lane, one registration per buffer


class Lane:
    """One extra NIXL agent and the one thread that posts on it.

    Peers are loaded on the lane's thread before its first slice for them (a handshake does
    not wait for the lanes), and forgotten there too: `_known` is the thread's alone. A peer
    daemon serving several engines answers each engine's handshake with metadata naming that
    engine's memory alone, under the same agent name: a slice carrying metadata the lane has not
    loaded yet loads it, and NIXL adds that memory to what the lane had loaded for the agent.
    """

    def __init__(self, index: int, driver: NixlDriver) -> None:
        self.index = index
        self.nixl = driver
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"kvxferd-lane{index}")
        self._known: dict[str, set[bytes]] = {}  # peer agent -> the metadata this lane's agent loaded

    def post(self, local: np.ndarray, local_mem: MemType, remote: np.ndarray, remote_mem: MemType,
             peer: str, metadata: tuple[bytes, ...], on_posted: Callable[[], None]) -> SliceRead:
        """Post on this lane's thread; `on_posted` then runs on the calling event loop (with CMA
        the slice is DONE by then, so the loop need not spin for it)."""
        loop = asyncio.get_running_loop()
        posting = self._thread.submit(self._post, local, local_mem, remote, remote_mem, peer, metadata)
        posting.add_done_callback(lambda _: loop.call_soon_threadsafe(on_posted))
        return SliceRead(self, posting)

    def _post(self, local: np.ndarray, local_mem: MemType, remote: np.ndarray, remote_mem: MemType,
              peer: str, metadata: tuple[bytes, ...]) -> Posted:
        loaded = self._known.setdefault(peer, set())
        for blob in metadata:
            if blob not in loaded:
                try:
                    self.nixl.add_peer(blob)
                except Exception as exc:
                    raise TransferError(f"lane {self.index}: loading peer {peer}: {exc}") from exc
                loaded.add(blob)
        handle = self.nixl.read_rows(local, local_mem, remote, remote_mem, peer)
        try:  # DONE already (the copy ran inside the post): the slice's end is now
            return Posted(handle, time.monotonic() if self.nixl.state(handle) == DONE else 0.0)
        except TransferError:
            return Posted(handle, 0.0)  # the loop's check reports it

    def forget(self, peer: str) -> None:
        self._thread.submit(self._forget, peer)

    def _forget(self, peer: str) -> None:
        if self._known.pop(peer, None) is not None:
            try:
                self.nixl.remove_peer(peer)
            except Exception as exc:  # gone already: nothing to undo
                log.debug("lane %d: removing peer %s: %s", self.index, peer, exc)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


class Lanes:
    """The daemon's posting lanes; empty when `count` is 0 (every read on the daemon's agent)."""

    def __init__(self, count: int, split_bytes: int, name: str, backends: tuple[str, ...]) -> None:
        self.split_bytes = split_bytes
        self.lanes = [Lane(i, NixlDriver(f"{name}-lane{i}", backends, telemetry=False, progress_thread=False,
                                         shared=True)) for i in range(count)]

    def slices(self, nbytes: int) -> int:
        """How many lanes a read of `nbytes` is split across; 0: post it whole on the daemon's agent."""
        k = min(len(self.lanes), nbytes // self.split_bytes) if self.split_bytes > 0 else 0
        return k if k >= 2 else 0

    # --- what every lane must know ----------------------------------------------
    def register(self, buffers: list[tuple[int, int, MemType, int]]) -> LaneRegistrations:
        """Register buffers (addr, nbytes, mem type, device) with every lane; the caller keeps
        what this returns for `deregister`."""
        done: LaneRegistrations = []
        try:
            for lane in self.lanes:
                regs: list[Registration] = []
                done.append(regs)
                for addr, nbytes, mem, device in buffers:
                    regs.append(lane.nixl.register(addr, nbytes, mem, device))
        except Exception:
            self.deregister(done)
            raise
        return done

    def deregister(self, per_lane: LaneRegistrations) -> None:
        for lane, regs in zip(self.lanes, per_lane):
            for reg in regs:
                lane.nixl.deregister(reg)

    def remove_peer(self, agent: str) -> None:
        """The daemon's agent dropped a peer: each lane drops it too, after what it has queued."""
        for lane in self.lanes:
            lane.forget(agent)

    def remote_agents(self) -> int:
        """Remote agents loaded on the lanes' agents, all lanes together (status: a leak shows)."""
        return sum(len(lane.nixl.remote_agents) for lane in self.lanes)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()


__all__ = ["Lane", "Lanes"]
