"""Shared pieces: daemons in their own processes, engines in this one (no verification in
the timed path), and small statistics."""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..client import Completion, EngineClient
from ..lab.synthetic.demo import DaemonProcess
from ..memory import create_shm
from ..plan.geometry import Geometry

if TYPE_CHECKING:
    from ..memory import VmmBuffer


def median(xs: Iterable[float]) -> float:
    return statistics.median(xs)


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(pids: Sequence[int], seconds: float) -> list[float]:
    """Each process's CPU use over `seconds`, in percent of one core."""
    before = [cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    return [(cpu_seconds(p) - b) / seconds * 100 for p, b in zip(pids, before)]


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set for what starts inside (daemons read KVXFERD_* at start)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def daemons(n: int = 2, extra: Sequence[str] = ()) -> Iterator[list[DaemonProcess]]:
    with tempfile.TemporaryDirectory(prefix="kvxferd-bench-") as work:
        procs: list[DaemonProcess] = []
        try:
            for i in range(n):
                procs.append(DaemonProcess(Path(work), f"daemon-{i}", extra=list(extra)))
            yield procs
        finally:
            for p in procs:
                p.stop()


class BenchEngine:
    """One engine rank registered with a daemon, its memory in this process."""

    def __init__(self, socket: str, engine_id: str, geo: Geometry, touch: bool = True, device: str = "cpu",
                 doorbell: str = "", keep_fds: bool = False) -> None:
        """`doorbell`: "" none (the engine polls), "ring" a byte per batch, "records" the completions.
        `keep_fds`: keep the memfds open for other processes to map (`memfds`)."""
        self.geo = geo
        fds: list[int] = []
        self.mmaps: list[mmap.mmap | VmmBuffer] = []
        self.views: list[np.ndarray] = []
        self.client = EngineClient(socket, engine_id, geo.tp_rank, geo.tp_size)
        if device == "cuda-vmm":  # device memory shared as CUDA VMM fds
            from ..client import MemoryHandle
            from ..memory import VmmBuffer
            vmm_bufs = [VmmBuffer(size) for size in geo.buffers]
            self.mmaps = [*vmm_bufs]
            fds = [b.export() for b in vmm_bufs]
            self.side_channel = self.client.register(
                geo, memory=[MemoryHandle("cuda_vmm", b.nbytes) for b in vmm_bufs], fds=fds)
        else:
            for size in geo.buffers:
                fd, mm = create_shm(size, engine_id)
                fds.append(fd)
                self.mmaps.append(mm)
                view = np.frombuffer(mm, dtype=np.uint8)
                if touch:
                    view[:] = 0x5A  # fault the pages in: measure copies, not page faults
                self.views.append(view)
            self.side_channel = self.client.register(geo, shm_fds=fds, doorbell=bool(doorbell),
                                                     records=doorbell == "records")
        if device == "cuda-vmm" or not keep_fds:
            for fd in fds:
                os.close(fd)
            fds = []
        self.fds = fds  # the memfds kept open while the engine lives: `memfds`
        self.pending: dict[str, Completion] = {}
        self.records = doorbell == "records"  # `wait` checks the pipe is still open each time

    def wait(self, request_id: str, timeout: float = 60.0) -> Completion:
        """`request_id`'s completion: from the doorbell's records when the engine took them (as
        the vLLM worker does; a poll only when the pipe asks for one), else by long polls (also
        once the daemon closed the doorbell). TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while request_id not in self.pending:
            wait_s = min(max(deadline - time.monotonic(), 0.0), 1.0)
            if self.records and self.client.doorbell is not None:
                items, more = self.client.pushed(wait_s=wait_s)
                if more:
                    items += self.client.poll()
            else:
                items = self.client.poll(wait_s=wait_s)
            for c in items:
                self.pending[c.request_id] = c
            if request_id not in self.pending and time.monotonic() >= deadline:
                raise TimeoutError(f"no completion for {request_id!r} within {timeout:g} s")
        return self.pending.pop(request_id)

    def memfds(self) -> list[tuple[str, int]]:
        """This engine's host memory as paths another process may open and map: the same pages."""
        if len(self.fds) != len(self.geo.buffers):
            raise ValueError("memfds(): the engine was made without keep_fds, or its memory is on a device")
        return [(f"/proc/{os.getpid()}/fd/{fd}", size) for fd, size in zip(self.fds, self.geo.buffers, strict=True)]

    def close(self) -> None:
        try:
            self.client.unregister()
        finally:
            self.client.close()
            self.views.clear()
            for mm in self.mmaps:
                mm.close()
            for fd in self.fds:
                os.close(fd)
            self.fds = []
