"""The completion doorbell: a pipe from the daemon to one engine rank (protocol 5 and later).

The daemon makes the pipe and keeps its write end (non-blocking); the engine gets the read end
with its `registered` reply. Nothing the engine does to its end can make the daemon wait.

Protocol 5-6 ("ring"): the daemon writes one byte when completions wait for a poll; the engine
polls only after a byte. Protocol 7 ("records"): the completions themselves travel in the pipe,
so a step learns what finished with one `read(2)` and no round trip:

    one write(2) per record, at most PIPE_BUF (4096) bytes: atomic, never split or interleaved
    +-------------+------------------------------------+
    | u32 LE  n   | n bytes: a msgpack `Completion`     |
    +-------------+------------------------------------+
    n == 0: the poll marker: completions wait in the daemon's queue, poll for them

Protocol 9 adds the doorbell's counter: a page of shared memory (a sealed memfd the daemon
makes and maps, sent with the pipe) whose first 8 bytes count the daemon's writes to the pipe,
little-endian, bumped after each write and once more when the daemon closes its end. A step
whose counter has not moved since its last read skips the read: one load from memory instead of
a system call, which on a cache the forward pass just evicted costs tens of microseconds. The
engine maps the page read-only; the daemon never reads it (its count is its own), and the seals
keep an engine from shrinking it under the daemon's mapping.

A completion goes to the queue instead (and the marker into the pipe, once, until the engine
polls) when its record is larger than PIPE_BUF, or when the pipe already holds a quarter of its
capacity (an engine that stopped reading). Once one is queued, later ones queue behind it until
a poll has taken them all, so the engine sees every rank's completions in order. The quarter
keeps room for the marker: a record takes at most one of the pipe's page slots, and two
neighbouring slots hold more than a page between them, so a quarter's worth of bytes fills at
most half the slots plus two. A marker that does not fit anyway closes the pipe: the engine
reads end-of-file and polls every step from then on.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import select
import stat
import struct
import termios

import msgspec

from . import protocol as P

log = logging.getLogger("kvxferd")

HEADER = struct.Struct("<I")
MAX_RECORD = select.PIPE_BUF  # header included: a larger write to a pipe may be split
POLL_MARKER = HEADER.pack(0)
RING = b"\x01"
COUNTER = struct.Struct("<Q")  # the counter page's first bytes (protocol 9)
COUNTER_PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1: no new writable mapping

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(P.Completion)


class DoorbellError(ConnectionError):
    """The pipe carried something that is not a record: what the daemon says can no longer be
    trusted, as if its connection were lost."""


def queued_bytes(fd: int) -> int:
    """Bytes written to a pipe and not yet read (FIONREAD works on either end)."""
    return int(HEADER.unpack(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


def counter_page() -> tuple[int, mmap.mmap]:
    """A counter page (protocol 9): its memfd for the engine (send it, then close it) and the
    daemon's writable mapping. Sealed against shrinking and growing (a page cut from under the
    mapping would kill the daemon with SIGBUS at its next bump) and, where the kernel can, against
    any new writable mapping: the engine's can only read."""
    fd = os.memfd_create("kvxferd-doorbell", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, COUNTER_PAGE)
        page = mmap.mmap(fd, COUNTER_PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE)
        except OSError:  # before Linux 5.1: the engine may map it writable, and only fools itself
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd, page


class Doorbell:
    """The daemon's end of one rank's doorbell. Owns the write end, the counter page's mapping
    and count (protocol 9), and whether the engine has been told that completions wait in the
    queue (`told`, until its next poll)."""

    def __init__(self, write_end: int, records: bool, owner: str = "", counter: mmap.mmap | None = None) -> None:
        self.fd, self.records, self.owner = write_end, records, owner  # owner: whose, for the logs
        self.budget = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) // 4
        self.told = False
        self.counter = counter
        self.writes = 0  # what the counter says: the daemon's own count, never read back from the page

    @classmethod
    def make(cls, records: bool, owner: str = "", counter: bool = False) -> tuple[Doorbell, list[int]]:
        """A new pipe: the daemon's end, and the fds for the engine (send them, then close them):
        the pipe's read end, then with `counter` the counter page's memfd. A counter page that
        cannot be made (no fd left) is left out: the engine reads the pipe every step."""
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        page = None
        fds = [read_end]
        if counter:
            try:
                page_fd, page = counter_page()
                fds.append(page_fd)
            except OSError as exc:
                log.warning("%s: no doorbell counter page (%s): the engine reads the pipe every step", owner, exc)
        return cls(write_end, records, owner, page), fds

    def _bump(self) -> None:
        """After each write to the pipe, and at its close: the engine's next check reads it."""
        if self.counter is not None:
            self.writes += 1
            COUNTER.pack_into(self.counter, 0, self.writes)

    def push(self, c: P.Completion) -> bool:
        """Records mode: write `c` into the pipe. False: it goes to the queue (see the module)."""
        if not self.records or self.told or self.fd < 0:
            return False
        if sum(map(len, c.block_ids)) >= MAX_RECORD:  # a byte per id at least: not worth encoding
            return False
        body = _encoder.encode(c)
        record = HEADER.pack(len(body)) + body
        if len(record) > MAX_RECORD or queued_bytes(self.fd) + len(record) > self.budget:
            return False
        return self._write(record)

    def tell(self) -> None:
        """A completion was queued: say so once until the engine polls (a byte, or the marker)."""
        if self.told or self.fd < 0:
            return
        self.told = True
        if not self._write(POLL_MARKER if self.records else RING) and self.records and self.fd >= 0:
            log.warning("%s: doorbell full past its budget; closed: the engine polls every step", self.owner)
            self.close()

    def polled(self, left: bool) -> None:
        """The engine polled; `left`: completions remain queued (more than one poll's worth)."""
        self.told = False
        if left:
            self.tell()

    def _write(self, data: bytes) -> bool:
        try:
            os.write(self.fd, data)
            self._bump()
            return True
        except BlockingIOError:
            return False  # ring mode: a full pipe is rung already
        except OSError as exc:  # EPIPE: the engine closed its end
            log.info("%s: doorbell closed by the engine (%s); it polls without it", self.owner, exc)
            self.close()
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.counter is not None:
            self._bump()  # the engine reads end-of-file, and polls from then on
            self.counter.close()
            self.counter = None


# The engine reads its end keeping the GIL. A step checks the doorbell between vLLM's own
# threads (its output thread serializes the last step's tokens meanwhile); a read that let go of
# the GIL waited for them to give it back: 9-19 us p50 and 54-143 us p99 against 3 and 13 us
# with a thread busy 0.3 ms of every 1 ms (`kvxferd bench step`). So the call must never wait:
# preadv2(RWF_NOWAIT) does not, whatever the pipe's O_NONBLOCK (a flag of the open file, which
# whoever else holds it could clear). Pipes take RWF_NOWAIT from Linux 6.4; before, and where the
# C library has no preadv2, a plain read(2) of the pipe the engine set non-blocking.
_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_preadv2 = getattr(_libc, "preadv2", None)
if _preadv2 is not None:
    _preadv2.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_int, ctypes.c_long, ctypes.c_int]
    _preadv2.restype = ctypes.c_ssize_t
_read = _libc.read
_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_read.restype = ctypes.c_ssize_t
_NO_NOWAIT = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)  # this kernel cannot read a pipe RWF_NOWAIT
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 8)


class PipeReader:
    """Reads of one doorbell's read end, the GIL held throughout and never waiting. Not for two
    threads at once (one buffer): the vLLM worker reads under its lock."""

    def __init__(self, size: int) -> None:
        self._buf = ctypes.create_string_buffer(size)
        self._iov = _Iovec(ctypes.addressof(self._buf), size)
        self.size = size
        self.nowait = _preadv2 is not None  # False: plain read(2) on the non-blocking pipe

    def read(self, fd: int) -> bytes | None:
        """What the pipe holds, up to `size` bytes (b"" at end of file); None when it is empty."""
        if self.nowait and _preadv2 is not None:
            n = _preadv2(fd, ctypes.byref(self._iov), 1, -1, _RWF_NOWAIT)  # -1: the pipe's own position
            if n < 0 and ctypes.get_errno() in _NO_NOWAIT:
                self.nowait = False
                return self.read(fd)
        else:
            n = _read(fd, self._buf, self.size)
        if n >= 0:
            return ctypes.string_at(self._buf, n)
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):  # EINTR: Python's signal handlers run first
            return None
        raise OSError(err, os.strerror(err))


def map_counter(fd: int) -> mmap.mmap | None:
    """The engine's read-only mapping of a counter page, its memfd closed; None (the engine reads
    the pipe every step) when `fd` is not a page sealed against shrinking: one that could shrink
    would let whoever holds it kill the engine with SIGBUS at its next check."""
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:  # first: then its size can only grow
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < COUNTER.size:
            return None
        return mmap.mmap(fd, COUNTER.size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):  # not a memfd (EINVAL from F_GET_SEALS), or mmap refused
        return None
    finally:
        os.close(fd)


class Records:
    """The engine's side of a records doorbell: parses what `read(2)` returned into
    completions, and whether the marker asked for a poll. Bounded: a length over PIPE_BUF
    is not a record (`DoorbellError`)."""

    def __init__(self) -> None:
        self.pending = bytearray()  # the start of a record a read cut (at most MAX_RECORD)

    def feed(self, data: bytes) -> tuple[list[P.Completion], bool]:
        buf = memoryview(self.pending + data if self.pending else data)
        out: list[P.Completion] = []
        poll = False
        at = 0
        while len(buf) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, at)
            if n > MAX_RECORD - HEADER.size:
                raise DoorbellError(f"record of {n} B announced; at most {MAX_RECORD - HEADER.size}")
            start = at + HEADER.size
            if len(buf) - start < n:
                break
            if n == 0:
                poll = True
            else:
                try:
                    out.append(_decoder.decode(buf[start:start + n]))
                except msgspec.DecodeError as exc:
                    raise DoorbellError(f"undecodable record: {exc}") from None
            at = start + n
        self.pending = bytearray(buf[at:]) if at < len(buf) else bytearray()
        return out, poll
