"""The daemon's own copy between two engine ranks it maps: a same-node read of host memory.

Both engines' KV memory is mapped in this process (engines.py), so a read between two engines
of this daemon needs no transport: the plan's rows are copied from one mapping into the other.

    rows: dst (local rank) [addr, len], src (the prefill rank) [addr, len], one per descriptor
      -> every row checked inside its rank's mappings (NIXL checks its descriptors against the
         registrations; a memmove checks nothing, so this does)
      -> runs merged where both sides go on contiguously
      -> small (bytes and runs): copied on the loop's thread at once (a thread's wake-up costs more)
         large: split into `threads` parts of about equal bytes (a long run cut inside), one per
         pool thread; the last part's end wakes the loop
      -> each part: process_vm_readv on this process itself, IOV_MAX runs a call (the kernel's
         loop, without the GIL: threads scale, where a memmove a row from Python spends ~1 us of
         GIL per row; measured in docs/benchmarks.md, "Same node"); a memmove a run where the
         call is refused (a seccomp profile without it)

A read that ends while its copy runs stops it at the copy's next batch (at most CALL_BYTES
later): until then it keeps its posting (quarantined, its memory mapped), as for a NIXL READ.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from .nixl_driver import TransferError

IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)
# bytes per call: under Linux's MAX_RW_COUNT (2 GiB - 4 KiB) a call, and small enough that a read
# that ended stops within one batch (`CopyRead.cancel`)
CALL_BYTES = 64 << 20
INLINE_BYTES = 256 << 10  # at most this much is copied on the loop's thread, in the post ...
INLINE_RUNS = 64  # ... in at most this many memmove calls
Spans = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]  # sorted mapping starts, and their ends


def spans(buffers: Sequence[tuple[int, int]]) -> Spans:
    """`(address, bytes)` of a rank's mappings, as `outside` takes them."""
    ordered = sorted(buffers)
    starts = np.array([a for a, _ in ordered], dtype=np.int64)
    return starts, starts + np.array([n for _, n in ordered], dtype=np.int64)


def outside(addr: npt.NDArray[np.int64], length: npt.NDArray[np.int64], within: Spans) -> int:
    """How many rows `[addr, addr + length)` do not lie inside one of the spans."""
    starts, ends = within
    if not len(starts):
        return len(addr)
    i = np.searchsorted(starts, addr, side="right") - 1
    # length <= end - addr, not addr + length <= end: no sum that could wrap
    inside = (i >= 0) & (length >= 0) & (length <= ends[np.maximum(i, 0)] - addr)
    return int(len(addr) - np.count_nonzero(inside))


def merge_runs(dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64],
               length: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], ...]:
    """Rows that continue the row before on both sides joined into one: (dst, src, length)."""
    if len(dst) <= 1:
        return dst, src, length
    continues = (dst[1:] == dst[:-1] + length[:-1]) & (src[1:] == src[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return dst[starts], src[starts], np.add.reduceat(length, starts)


def cut(dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], length: npt.NDArray[np.int64],
        most: int) -> tuple[npt.NDArray[np.int64], ...]:
    """Runs longer than `most` bytes cut into pieces of at most `most` (so threads share one long run)."""
    pieces = -(-length // most)
    if not len(length) or int(pieces.max()) <= 1:
        return dst, src, length
    run = np.repeat(np.arange(len(length)), pieces)
    within = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index inside its run
    offset = within * most
    return dst[run] + offset, src[run] + offset, np.minimum(length[run] - offset, most)


def _process_vm_readv() -> Callable[..., int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
    return call


_readv = _process_vm_readv()
_readv_refused = False  # set once the kernel said no (EPERM under a seccomp profile, ENOSYS): memmove from then on


def _iovecs(addr: npt.NDArray[np.int64], length: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    out = np.empty((len(addr), 2), dtype=np.uint64)
    out[:, 0], out[:, 1] = addr, length
    return out


def _batches(length: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """[start, end) of consecutive runs, at most IOV_MAX runs and CALL_BYTES bytes each (every run
    at most CALL_BYTES itself: `post` cuts longer ones)."""
    ends = np.cumsum(length)
    out, at = [], 0
    while at < len(length):
        before = int(ends[at - 1]) if at else 0
        end = min(at + IOV_MAX, int(np.searchsorted(ends, before + CALL_BYTES, side="right")))
        end = max(end, at + 1)
        out.append((at, end))
        at = end
    return out


def _readv_batch(pid: int, local: npt.NDArray[np.uint64], remote: npt.NDArray[np.uint64], want: int) -> bool:
    """One process_vm_readv call; False when the kernel refuses it (EPERM under a seccomp
    profile, ENOSYS), OSError for a short count (the runs were checked inside our mappings)."""
    assert _readv is not None
    got = _readv(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
    if got == want:
        return True
    err = ctypes.get_errno()
    if got == -1 and err in (errno.EPERM, errno.ENOSYS):
        return False
    raise OSError(err, f"process_vm_readv copied {got} of {want} bytes: {os.strerror(err)}")


def copy_runs(dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64], length: npt.NDArray[np.int64],
              stop: threading.Event | None = None) -> float:
    """Copy each run src -> dst, a batch of runs a call; returns when it ended (monotonic). Every
    run lies inside memory this process maps (checked by the caller): a short count is a defect,
    raised. `stop` set (its read ended): no further batch starts (CopyStopped)."""
    global _readv_refused
    local, remote, pid = _iovecs(dst, length), _iovecs(src, length), os.getpid()
    for at, end in _batches(length):
        if stop is not None and stop.is_set():
            raise CopyStopped("the read ended: the rest of its copy was not made")
        if _readv is not None and not _readv_refused:
            if _readv_batch(pid, local[at:end], remote[at:end], int(length[at:end].sum())):
                continue
            _readv_refused = True  # refused (seccomp): memmove this batch and from now on
        for d, s, n in zip(dst[at:end].tolist(), src[at:end].tolist(), length[at:end].tolist()):
            ctypes.memmove(d, s, n)
    return time.monotonic()


class CopyStopped(Exception):
    """A copy's read ended while it ran: the rest was not copied."""


def _done(at: float) -> Future[float]:
    f: Future[float] = Future()
    f.set_result(at)
    return f


def _failed(exc: Exception) -> Future[float]:
    f: Future[float] = Future()
    f.set_exception(exc)
    return f


class CopyRead:
    """One remote rank's rows of a read, copied by this daemon (a `postings.Posting`)."""

    wakes_loop = True
    __slots__ = ("_stop", "parts", "posted")

    def __init__(self, parts: list[Future[float]], posted: float, stop: threading.Event | None = None) -> None:
        self.parts, self.posted, self._stop = parts, posted, stop

    def ended(self) -> bool:
        if not all(p.done() for p in self.parts):
            return False
        for p in self.parts:
            if p.cancelled():
                raise TransferError("copy cancelled before it ran")
            if (exc := p.exception()) is not None:
                raise TransferError(f"copy failed: {exc}")
        return True

    def release_if_ended(self) -> bool:
        return all(p.done() for p in self.parts)

    def release(self) -> bool:
        return True

    def timing(self) -> tuple[float, float] | None:
        return None

    def ended_at(self) -> float:
        if not self.parts or not all(p.done() and not p.cancelled() and p.exception() is None for p in self.parts):
            return 0.0
        return max(p.result() for p in self.parts)

    def cancel(self) -> bool:
        """Its read ended: parts not started are dropped, running ones stop at their next batch
        (none writes blocks the engine may have reused for long); True when none runs now."""
        if self._stop is not None:
            self._stop.set()
        for p in self.parts:
            p.cancel()
        return all(p.done() for p in self.parts)


class Copier:
    """The pool that copies same-node reads of host memory (owned by the daemon; one)."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvxferd-copy")
        self._lock = threading.Lock()

    def post(self, dst_rows: npt.NDArray[np.int64], dst_spans: Spans, src_rows: npt.NDArray[np.int64],
             src_spans: Spans, wake: Callable[[], None]) -> CopyRead:
        """Copy `src_rows` into `dst_rows` (both (N, 3) [addr, len, dev], pairwise of one length);
        `wake` runs on the loop once a copy on the pool ended. TransferError, before a byte
        moves, for rows outside the mappings."""
        if len(dst_rows) != len(src_rows) or not np.array_equal(dst_rows[:, 1], src_rows[:, 1]):
            raise TransferError("copy: local and remote rows differ in count or length")
        length = dst_rows[:, 1]
        for side, rows, within in (("local", dst_rows, dst_spans), ("remote", src_rows, src_spans)):
            if bad := outside(rows[:, 0], length, within):
                raise TransferError(f"copy: {bad} {side} rows lie outside the engine's memory")
        dst, src, length = merge_runs(dst_rows[:, 0], src_rows[:, 0], length)
        posted = time.monotonic()
        total = int(length.sum())
        if (total <= INLINE_BYTES and len(length) <= INLINE_RUNS) or (self.threads == 1 and total <= 4 * INLINE_BYTES):
            try:
                return CopyRead([_done(copy_runs(dst, src, length))], posted)
            except OSError as exc:
                raise TransferError(f"copy failed: {exc}") from exc
        loop = asyncio.get_running_loop()  # before anything is submitted: nothing runs unowned
        share = -(-total // self.threads)
        dst, src, length = cut(dst, src, length, min(share, CALL_BYTES))
        edges = np.searchsorted(np.cumsum(length), np.arange(1, self.threads) * share)
        parts = [(d, s, n) for d, s, n in zip(np.split(dst, edges), np.split(src, edges), np.split(length, edges))
                 if len(d)]
        left = [len(parts)]

        def part_done(_f: Future[float]) -> None:  # on a pool thread
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last and not loop.is_closed():
                loop.call_soon_threadsafe(wake)

        futures: list[Future[float]] = []
        stop = threading.Event()
        try:
            for d, s, n in parts:
                futures.append(self._pool.submit(copy_runs, d, s, n, stop))
        except RuntimeError as exc:  # the pool is shut down (the daemon stops): what runs is its read's
            stop.set()
            for f in futures:
                f.cancel()
            return CopyRead([*futures, _failed(exc)], posted, stop)
        for f in futures:
            f.add_done_callback(part_done)
        return CopyRead(futures, posted, stop)

    def close(self) -> None:
        """Wait for the copies running (they write engine memory that is unmapped next)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
