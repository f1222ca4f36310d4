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
import os
import select
import struct
import termios

import msgspec

from . import protocol as P

log = logging.getLogger("kvxferd")

HEADER = struct.Struct("<I")
MAX_RECORD = select.PIPE_BUF  # header included: a larger write to a pipe may be split
POLL_MARKER = HEADER.pack(0)
RING = b"\x01"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(P.Completion)


class DoorbellError(ConnectionError):
    """The pipe carried something that is not a record: what the daemon says can no longer be
    trusted, as if its connection were lost."""


def queued_bytes(fd: int) -> int:
    """Bytes written to a pipe and not yet read (FIONREAD works on either end)."""
    return int(HEADER.unpack(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


class Doorbell:
    """The daemon's end of one rank's doorbell. Owns the write end and whether the engine has
    been told that completions wait in the queue (`told`, until its next poll)."""

    def __init__(self, write_end: int, records: bool, owner: str = "") -> None:
        self.fd, self.records, self.owner = write_end, records, owner  # owner: whose, for the logs
        self.budget = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) // 4
        self.told = False

    @classmethod
    def make(cls, records: bool, owner: str = "") -> tuple[Doorbell, int]:
        """A new pipe: the daemon's end, and the read end for the engine (send it, then close it)."""
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        return cls(write_end, records, owner), read_end

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
