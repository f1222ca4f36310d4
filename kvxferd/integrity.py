"""KV integrity audit: digests of byte rows, computed where the memory is.

    prefill daemon                                   decode daemon
    hold(R)  -> digest every row of R's blocks       READ ... DONE
                (kept with the hold)                 digest the local rows that arrived
                                     <-- audit(R, the remote rows read) --
    re-digest R's blocks: rows changed since the
    hold = blocks reused; digest the rows read  -->  compare row by row: a differing row, or a
                                                     row from a reused block, makes its local
                                                     block corrupt -> failed "integrity"

The digest of a row of n bytes (zero-padded to whole 8-byte words w_0 .. w_m-1, little endian):

    digest = sum_j  w_j * K_j   (mod 2**64),   K_j = (2j + 1) * 0x9E3779B97F4A7C15  (odd)

Every K_j is odd, so any change to one word changes the digest, and the position weights catch
words moved within a row. It is a multiply and a sum: numpy on host memory, the same int64
arithmetic in torch on a GPU's memory (two's-complement wrap gives the same bits), so a CUDA
engine's blocks are digested on their device and only 8 bytes per row cross to the host.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from .memory import Mapping
from .plan.geometry import ATTENTION, Geometry

log = logging.getLogger("kvxferd")

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
BATCH_WORDS = 1 << 20  # gather at most this many words at once (8 MiB of index)
SLOW_JOB_S = 5.0  # a digest job running longer is logged
LONG_ROW_WORDS = 512  # rows this long (4 KiB) are digested in place one by one; shorter ones gathered
CHUNK_WORDS = 1 << 20  # a row longer than this (8 MiB) is digested a chunk at a time: bounded temporaries


class AuditError(ValueError):
    """Rows that do not lie inside the memory they name."""


T = TypeVar("T")


class Digester:
    """Runs digests on a thread of their own. They read engine memory for as long as its bytes
    take (seconds for a long prompt's blocks), so never on the daemon's loop; one at a time,
    since memory bandwidth is what they spend (numpy releases the GIL for the arithmetic).

    Each job names the engine rank whose memory it reads; the rank counts it (`digesting`) until
    the thread is done with it, even if whoever awaited it stopped waiting, so its memory is not
    unmapped under the thread. The daemon keeps two: one for its engines' work (holds, reads
    checked) and one for peers' audits, so that neither side can starve the other."""

    def __init__(self, name: str = "digest") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvxferd-{name}")
        self._name = name
        self.pending = 0  # jobs queued or running

    async def run(self, rank: Any, job: Callable[[], T]) -> tuple[T, float]:
        """`job()`'s result and the seconds it ran (not counting the wait for the thread)."""
        def timed() -> tuple[T, float]:
            t0 = time.perf_counter()
            try:
                result = job()
            finally:
                seconds = time.perf_counter() - t0
                if seconds > SLOW_JOB_S:  # memory that took this long to read: the host is short of it, or stalled
                    log.warning("a %s job read engine memory for %.1f s", self._name, seconds)
            return result, seconds

        def done(_: object) -> None:
            self.pending -= 1
            rank.digesting -= 1

        self.pending += 1
        rank.digesting += 1
        running = asyncio.get_running_loop().run_in_executor(self._pool, timed)
        running.add_done_callback(done)
        return await asyncio.shield(running)  # a waiter that gives up leaves the job to finish

    def close(self) -> None:
        """Wait for the job running (it reads engine memory); drop the ones queued behind it."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def weights(words: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (np.arange(words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * GOLDEN


def _chunk_shift(first: int) -> int:
    """A chunk starting at word `first` of a row: its weights are the first chunk's plus this,
    (2 (first + j) + 1) G = (2 j + 1) G + 2 first G (mod 2^64), as a signed 64-bit int."""
    shift = 2 * first * int(GOLDEN) % (1 << 64)
    return shift - (1 << 64) if shift >= 1 << 63 else shift


def digest_bytes(data: bytes | np.ndarray) -> int:
    """The digest of one row given as bytes (the definition the vectorized paths implement)."""
    words = _padded_words(data)
    with np.errstate(over="ignore"):
        return int((words * weights(len(words))).sum(dtype=np.uint64))


def _padded_words(data: bytes | np.ndarray) -> np.ndarray:
    """Bytes as little-endian uint64 words, the last one padded with zeros."""
    raw = np.frombuffer(bytes(data), dtype=np.uint8)
    padded = np.zeros(-(-len(raw) // 8) * 8, dtype=np.uint8)
    padded[:len(raw)] = raw
    return padded.view("<u8")


def _locate(mappings: Sequence[Mapping], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the index of the mapping holding it and its offset there; AuditError if none does."""
    bases = np.array([m.address for m in mappings], dtype=np.int64)
    ends = bases + np.array([m.nbytes for m in mappings], dtype=np.int64)
    order = np.argsort(bases)
    pos = np.searchsorted(bases[order], rows[:, 0], side="right") - 1
    which = order[np.clip(pos, 0, None)]
    # Rows come off the wire: no sum that can wrap (a row (2**63 - 2, 3) must not pass as short).
    # With pos >= 0 the address is at least a base, so end - address cannot wrap either.
    with np.errstate(over="ignore"):
        bad = (pos < 0) | (rows[:, 1] < 0) | (rows[:, 1] > ends[which] - rows[:, 0])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AuditError(f"row {i} (address {int(rows[i, 0]):#x}, {int(rows[i, 1])} B) is outside the "
                         f"engine's registered memory")
    return which, rows[:, 0] - bases[which]


def outside_spans(spans: np.ndarray, rows: np.ndarray) -> int:
    """The index of the first row not inside one of the (address, length) `spans` (joined where
    they touch or overlap), or -1. Pure integer arithmetic that cannot wrap."""
    if not len(rows):
        return -1
    order = np.argsort(spans[:, 0], kind="stable")
    starts, ends = spans[order, 0], spans[order, 0] + spans[order, 1]  # spans are our own: no wrap
    run_end = np.maximum.accumulate(ends)
    new_run = np.concatenate(([True], starts[1:] > run_end[:-1]))
    run_start, run_stop = starts[new_run], np.maximum.reduceat(ends, np.flatnonzero(new_run))
    at = np.searchsorted(run_start, rows[:, 0], side="right") - 1
    with np.errstate(over="ignore"):
        bad = (at < 0) | (rows[:, 1] < 0) | (rows[:, 1] > run_stop[np.clip(at, 0, None)] - rows[:, 0])
    return int(np.flatnonzero(bad)[0]) if bad.any() else -1


def _host_words(m: Mapping) -> np.ndarray:
    """A mapping's bytes as uint64 words (the tail that is not a whole word dropped)."""
    return np.ctypeslib.as_array((ctypes.c_uint64 * (m.nbytes // 8)).from_address(m.address))


def digest_rows(mappings: Sequence[Mapping], rows: np.ndarray) -> np.ndarray:
    """uint64 digest of each (address, length) row of `rows` (N, >=2 int64), read in place."""
    rows = np.asarray(rows, dtype=np.int64)[:, :2]
    out = np.zeros(len(rows), dtype=np.uint64)
    if not len(rows):
        return out
    which, offset = _locate(mappings, rows)
    aligned = (offset % 8 == 0) & (rows[:, 1] % 8 == 0)
    odd = ~aligned & (rows[:, 1] > 0)  # rare: rows of odd lengths or offsets (an empty row's digest is 0)
    for mi, m in enumerate(mappings):
        mine = which == mi
        sel = np.flatnonzero(odd & mine)
        if len(sel):
            out[sel] = _odd_row_digests(m, offset[sel], rows[sel, 1])
        for length in np.unique(rows[aligned & mine, 1]):
            sel = np.flatnonzero(aligned & mine & (rows[:, 1] == length))
            out[sel] = _digest_uniform(m, offset[sel] // 8, int(length) // 8)
    return out


def _odd_row_digests(m: Mapping, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Digests of rows not in whole words, one at a time by the definition, a chunk of a row at a
    time (a row may be as long as a hold). Device memory is copied off the device chunk by chunk,
    through one view of the mapping: never read through a host pointer (a VRAM row dereferenced
    so would fault the daemon)."""
    read: Callable[[int, int], bytes]
    if m.kind == "VRAM":
        import torch

        mem = torch.as_tensor(_CudaBytes(m.address, m.nbytes, "|u1"), device=f"cuda:{m.device}")

        def read(offset: int, nbytes: int) -> bytes:
            return mem[offset:offset + nbytes].cpu().numpy().tobytes()
    else:
        def read(offset: int, nbytes: int) -> bytes:
            return ctypes.string_at(m.address + offset, nbytes)
    k = weights(min(CHUNK_WORDS, -(-int(lengths.max()) // 8)))

    def digest(offset: int, nbytes: int) -> np.uint64:
        return _chunked_digest(-(-nbytes // 8), k, lambda a, count: _padded_words(
            read(offset + 8 * a, min(8 * count, nbytes - 8 * a))))

    return np.array([digest(o, n) for o, n in zip(offsets.tolist(), lengths.tolist())], dtype=np.uint64)


def _slices(words: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """`_chunked_digest`'s chunks of a row in memory: views, no copies."""
    return lambda first, count: words[first:first + count]


def _chunked_digest(words: int, k: np.ndarray, chunk: Callable[[int, int], np.ndarray]) -> np.uint64:
    """One row's digest from its `words` words, CHUNK_WORDS at a time (`chunk(first, count)`: those
    words as uint64), each chunk's weights the first chunk's `k` shifted to its place: bounded
    temporaries however long the row."""
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for a in range(0, words, CHUNK_WORDS):
            x = chunk(a, min(CHUNK_WORDS, words - a))
            total += np.dot(x, k[:len(x)])
            if a:
                total += np.int64(_chunk_shift(a)).view(np.uint64) * x.sum(dtype=np.uint64)
    return total


def _digest_uniform(m: Mapping, first_word: np.ndarray, words: int) -> np.ndarray:
    """Digests of rows of `words` words each, starting at the given word indices of `m`."""
    if words == 0:
        return np.zeros(len(first_word), dtype=np.uint64)
    if m.kind == "VRAM":
        return _digest_uniform_torch(m, first_word, words)
    mem = _host_words(m)
    k = weights(min(words, CHUNK_WORDS))
    out = np.empty(len(first_word), dtype=np.uint64)
    step = max(1, BATCH_WORDS // words)
    with np.errstate(over="ignore"):
        if words >= LONG_ROW_WORDS:  # dot products in place: no copy, ~6 GB/s against ~1 for a gather
            for i, s in enumerate(first_word.tolist()):
                out[i] = _chunked_digest(words, k, _slices(mem[s:s + words]))
            return out
        for s in range(0, len(first_word), step):
            idx = first_word[s:s + step, None] + np.arange(words, dtype=np.int64)
            out[s:s + step] = (mem[idx] * k).sum(axis=1, dtype=np.uint64)
    return out


class _CudaBytes:
    """A device pointer as a CUDA array torch can wrap without a copy."""

    def __init__(self, address: int, nbytes: int, typestr: str = "<i8") -> None:
        size = int(typestr[2:])
        self.__cuda_array_interface__ = {"shape": (nbytes // size,), "typestr": typestr, "data": (address, False),
                                         "version": 3}


def _digest_uniform_torch(m: Mapping, first_word: np.ndarray, words: int, device: Any = None) -> np.ndarray:
    """The same digests computed by torch where the memory is (a CUDA device; or host memory in
    tests, with `device="cpu"`). int64 multiply and sum wrap like uint64 ones, bit for bit."""
    import torch

    if device == "cpu":
        mem = torch.from_numpy(_host_words(m).view(np.int64))
    else:
        mem = torch.as_tensor(_CudaBytes(m.address, m.nbytes), device=f"cuda:{m.device}")
    k = torch.from_numpy(weights(min(words, CHUNK_WORDS)).view(np.int64)).to(mem.device)
    out = np.empty(len(first_word), dtype=np.uint64)
    if words > CHUNK_WORDS:  # slices a chunk at a time: no index as long as the row on the engine's device
        for i, s in enumerate(first_word.tolist()):
            total = torch.zeros((), dtype=torch.int64, device=mem.device)
            for a in range(0, words, CHUNK_WORDS):
                x = mem[s + a:s + min(words, a + CHUNK_WORDS)]
                total += (x * k[:len(x)]).sum()
                if a:
                    total += _chunk_shift(a) * x.sum()
            out[i] = np.int64(total.item()).view(np.uint64)
        return out
    step = max(1, BATCH_WORDS // words)
    for s in range(0, len(first_word), step):
        idx = torch.from_numpy(first_word[s:s + step]).to(mem.device)[:, None] + torch.arange(words,
                                                                                              device=mem.device)
        out[s:s + step] = (mem[idx] * k).sum(dim=1).cpu().numpy().view(np.uint64)
    return out


def block_rows(geo: Geometry, region_addr: np.ndarray, block_ids: Sequence[Sequence[int] | np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every byte row of the listed blocks: (rows (N, 2) [address, length], cache group, block id).

    A block's bytes in group g are, for each view of g and each kernel page of the block, the
    span of the view's segments: from `region_addr[view.region] + page * view.page_stride` plus
    the first segment's offset to the end of the last (segments may interleave: CPU attention's
    K and V; state groups: one page per block).
    """
    rows: list[np.ndarray] = []
    groups: list[np.ndarray] = []
    blocks: list[np.ndarray] = []
    for g, (group, listed) in enumerate(zip(geo.groups, block_ids)):
        ids = np.asarray(listed, dtype=np.int64)
        if not len(ids):
            continue
        ppb = group.pages_per_block if group.kind == ATTENTION else 1
        pages = (ids[:, None] * ppb + np.arange(ppb)).ravel()
        owner = np.repeat(ids, ppb)
        for view in [v for v in group.views if v.segments]:
            first = min(s.offset for s in view.segments)
            span = max(s.offset + s.extent for s in view.segments) - first
            addr = region_addr[view.region] + pages * view.page_stride + first
            rows.append(np.stack([addr, np.full_like(addr, span)], axis=1))
            groups.append(np.full(len(addr), g, dtype=np.int64))
            blocks.append(owner)
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros((0, 2), dtype=np.int64), empty, empty
    return np.concatenate(rows), np.concatenate(groups), np.concatenate(blocks)
