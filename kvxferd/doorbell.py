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

Protocol 10 moves the records out of the pipe into a ring in a larger shared page, so a step
that finds completions reads them from memory as well, with no system call at all (on this
project's VM a `read(2)` right after a forward pass costs 40-70 us; the same records from the
ring 25):

    the ring page: a memfd of RING_PAGE bytes, sealed against shrinking, growing and more seals
    0        8        16       24        64       72              4096                    65536
    +--------+--------+--------+--  --+--------+-----  -----+------------------------------+
    | writes | head   | closed |      | tail   |            | records, as in the pipe: a ring |
    +--------+--------+--------+--  --+--------+-----  -----+------------------------------+
    u64 LE: writes (the counter, as protocol 9), head (record bytes the daemon wrote, ever),
    closed (1 once the daemon closed its end of the pipe), tail (record bytes the engine took,
    ever: the engine writes it, on its own cache line)

The daemon writes a record at `head % RING_BYTES` (wrapping at the end), then `head`, then the
counter, then a byte into the pipe (its wake-up: an engine waiting on the pipe in poll(2), and the
end-of-file when the daemon goes, still come through the pipe; the bytes mean nothing else). The
engine copies `tail..head` out, then stores `tail`. The daemon reads `tail` only to learn how much
room the ring has, bounded by what it wrote: an engine that lies about it loses its own records,
nothing else. Every field is stored and loaded whole, one 8-byte move (`SharedWords`), and the
stores land in program order only where the CPU keeps them so (x86's total store order; Python
has no fences), so the daemon offers a ring on x86 hosts only, a counter page elsewhere. The
poll marker goes into the ring too, in room every record leaves for it.

A completion goes to the queue instead (and the marker into the pipe or the ring, once, until
the engine polls) when its record is larger than PIPE_BUF, when the pipe already holds a quarter
of its capacity (an engine that stopped reading), or when the ring has no room for it. Once one
is queued, later ones queue behind it until a poll has taken them all, so the engine sees every
rank's completions in order. The quarter keeps room for the marker: a record takes at most one of
the pipe's page slots, and two neighbouring slots hold more than a page between them, so a
quarter's worth of bytes fills at most half the slots plus two. A marker that does not fit anyway
closes the pipe: the engine reads end-of-file and polls every step from then on.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import platform
import select
import stat
import struct
import sys
import termios

import msgspec

from . import protocol as P

log = logging.getLogger("kvxferd")

HEADER = struct.Struct("<I")
MAX_RECORD = select.PIPE_BUF  # header included: a larger write to a pipe may be split
POLL_MARKER = HEADER.pack(0)
RING = b"\x01"
COUNTER_PAGE = mmap.PAGESIZE
# The pages' u64 fields, as indices of 8-byte words (byte offsets in the module's diagram): loaded
# and stored only through `SharedWords`, whole.
WRITES, HEAD, CLOSED, TAIL = 0, 1, 2, 8
RING_HEAD, RING_CLOSED, RING_TAIL = 8 * HEAD, 8 * CLOSED, 8 * TAIL
RING_DATA, RING_PAGE = 4096, 1 << 16  # fixed, whatever the host's page size: the layout is the protocol's
RING_BYTES = RING_PAGE - RING_DATA
# The fields are stored in the host's order, which the protocol says is little-endian: other hosts
# get no page (their engines read the pipe every step).
PAGES = sys.byteorder == "little"
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux 5.1: no new writable mapping

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(P.Completion)


class DoorbellError(ConnectionError):
    """The pipe carried something that is not a record: what the daemon says can no longer be
    trusted, as if its connection were lost."""


def queued_bytes(fd: int) -> int:
    """Bytes written to a pipe and not yet read (FIONREAD works on either end)."""
    return int(HEADER.unpack(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


class SharedWords:
    """A shared page's u64 fields and the mapping under them. Each field is loaded and stored with
    one aligned 8-byte move (a native memoryview item), so a process reading it meanwhile sees
    the old value or the new one: `struct.pack_into` zeroes a field's bytes before it writes them
    and `unpack_from` reads a byte at a time, either of which another process could catch half
    done (a ring's `head` read as 0 is no daemon's)."""

    def __init__(self, page: mmap.mmap, nbytes: int) -> None:
        self.page = page
        self.w = memoryview(page)[:nbytes].cast("Q")  # w[WRITES], w[HEAD], ...: one load or store each

    def close(self) -> None:
        self.w.release()  # first: a mapping with views on it cannot close
        self.page.close()


def counter_page() -> tuple[int, mmap.mmap]:
    """A counter page (protocol 9): its memfd for the engine (send it, then close it) and the
    daemon's writable mapping. Sealed against shrinking and growing (a page cut from under the
    mapping would kill the daemon with SIGBUS at its next bump) and, where the kernel can, against
    any new writable mapping: the engine's can only read."""
    return _sealed_page(COUNTER_PAGE, engine_writes=False)


def ring_page() -> tuple[int, mmap.mmap]:
    """A ring page (protocol 10), as `counter_page` but one the engine maps writable: it stores
    its `tail` there."""
    return _sealed_page(RING_PAGE, engine_writes=True)


def ring_supported() -> bool:
    """Whether this host keeps plain stores in order (x86's total store order): the ring's
    records, `head` and the counter are stored one after another with no fence between."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _sealed_page(size: int, engine_writes: bool) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("kvxferd-doorbell", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        page = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | (0 if engine_writes else F_SEAL_FUTURE_WRITE))
        except OSError:  # before Linux 5.1: the engine may map it writable, and only fools itself
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd, page


class Doorbell:
    """The daemon's end of one rank's doorbell. Owns the write end, the counter page's mapping
    and count (protocol 9) or the ring page's with its `head` (protocol 10), and whether the
    engine has been told that completions wait in the queue (`told`, until its next poll)."""

    def __init__(self, write_end: int, records: bool, owner: str = "", counter: mmap.mmap | None = None,
                 ring: bool = False) -> None:
        self.fd, self.records, self.owner = write_end, records, owner  # owner: whose, for the logs
        self.budget = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) // 4
        self.told = False
        self.counter = None if counter is None else SharedWords(counter, RING_DATA if ring else COUNTER_PAGE)
        self.writes = 0  # what the counter says: the daemon's own count, never read back from the page
        self.ring = ring and records and counter is not None and len(counter) >= RING_PAGE
        self.head = self.tail = 0  # the ring's: bytes written, and taken as far as the daemon knows

    @classmethod
    def make(cls, records: bool, owner: str = "", counter: bool = False,
             ring: bool = False) -> tuple[Doorbell, list[int]]:
        """A new pipe: the daemon's end, and the fds for the engine (send them, then close them):
        the pipe's read end, then with `counter` the counter page's memfd, a ring page's with
        `ring` too. A page that cannot be made (no fd left) is left out: the engine reads the
        pipe every step."""
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        page = None
        fds = [read_end]
        if counter and PAGES:
            try:
                page_fd, page = ring_page() if ring else counter_page()
                fds.append(page_fd)
            except OSError as exc:
                log.warning("%s: no doorbell page (%s): the engine reads the pipe every step", owner, exc)
        return cls(write_end, records, owner, page, ring), fds

    def _bump(self) -> None:
        """After each write to the pipe or the ring, and at its close: the engine's next check reads it."""
        if self.counter is not None:
            self.writes += 1
            self.counter.w[WRITES] = self.writes

    def push(self, c: P.Completion) -> bool:
        """Records mode: write `c` into the ring or the pipe. False: it goes to the queue (see the module)."""
        if not self.records or self.told or self.fd < 0:
            return False
        if sum(map(len, c.block_ids)) >= MAX_RECORD:  # a byte per id at least: not worth encoding
            return False
        body = _encoder.encode(c)
        record = HEADER.pack(len(body)) + body
        if len(record) > MAX_RECORD:
            return False
        if self.ring:
            return self._into_ring(record, room_after=len(POLL_MARKER))
        if queued_bytes(self.fd) + len(record) > self.budget:
            return False
        return self._write(record)

    def tell(self) -> None:
        """A completion was queued: say so once until the engine polls (a byte, or the marker)."""
        if self.told or self.fd < 0:
            return
        self.told = True
        if self.ring:
            written = self._into_ring(POLL_MARKER, room_after=0)
        else:
            written = self._write(POLL_MARKER if self.records else RING)
        if not written and self.records and self.fd >= 0:
            log.warning("%s: doorbell full past its budget; closed: the engine polls every step", self.owner)
            self.close()

    def polled(self, left: bool) -> None:
        """The engine polled; `left`: completions remain queued (more than one poll's worth)."""
        self.told = False
        if left:
            self.tell()

    def _into_ring(self, record: bytes, room_after: int) -> bool:
        """Protocol 10: `record` into the ring if it fits with `room_after` bytes to spare (a
        record leaves room for the marker), then its wake-up byte into the pipe."""
        assert self.counter is not None
        page, w = self.counter.page, self.counter.w
        taken = w[TAIL]  # the engine's word: believed within what was written
        if self.tail <= taken <= self.head:
            self.tail = taken
        if self.head - self.tail + len(record) + room_after > RING_BYTES:
            return False
        at = self.head % RING_BYTES
        first = min(len(record), RING_BYTES - at)
        page[RING_DATA + at:RING_DATA + at + first] = record[:first]
        if first < len(record):  # wraps: the rest at the ring's start
            page[RING_DATA:RING_DATA + len(record) - first] = record[first:]
        self.head += len(record)
        w[HEAD] = self.head
        self._bump()
        try:
            os.write(self.fd, RING)
        except BlockingIOError:
            pass  # a full pipe wakes a waiting engine already
        except OSError as exc:  # EPIPE: the engine closed its end, and with it the ring (the client does both)
            # Queued as well: an engine that never mapped the ring finds it by poll. One that closed
            # its pipe and kept reading its ring would see it twice; losing it would be worse.
            log.info("%s: doorbell closed by the engine (%s); it polls without it", self.owner, exc)
            self.close()
            return False
        return True

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
        if self.ring and self.counter is not None:  # a step that finds records behind the bump reads the pipe too
            self.counter.w[CLOSED] = 1
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


def map_counter(fd: int) -> SharedWords | None:
    """The engine's read-only mapping of a counter page, its memfd closed; None (the engine reads
    the pipe every step) when `fd` is not a page sealed against shrinking: one that could shrink
    would let whoever holds it kill the engine with SIGBUS at its next check."""
    page = _map_page(fd, 8, mmap.PROT_READ)
    return None if page is None else SharedWords(page, 8)


def map_ring(fd: int) -> RingReader | None:
    """The engine's side of a ring page (protocol 10), its memfd closed; None when `fd` is not a
    ring page sealed against shrinking (as `map_counter`)."""
    page = _map_page(fd, RING_PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
    return None if page is None else RingReader(page)


def _map_page(fd: int, size: int, prot: int) -> mmap.mmap | None:
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:  # first: then its size can only grow
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            return None
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    except (OSError, ValueError):  # not a memfd (EINVAL from F_GET_SEALS), or mmap refused
        return None
    finally:
        os.close(fd)


class RingReader:
    """The engine's side of a ring page: takes the records the daemon wrote since the last take.
    Keeps its own `tail` (the page's copy is for the daemon), and checks the daemon's `head`
    against it: a head that ran backwards or more than a ring ahead is not the daemon's."""

    def __init__(self, page: mmap.mmap) -> None:
        self.fields = SharedWords(page, RING_DATA)
        self.page, self.w = page, self.fields.w  # w[WRITES] is the counter
        self.tail = 0

    def take(self) -> bytes:
        """The bytes of whole records between the engine's tail and the daemon's head (b"": none)."""
        page = self.page
        head = self.w[HEAD]
        n = head - self.tail
        if n == 0:
            return b""
        if not 0 < n <= RING_BYTES:
            raise DoorbellError(f"ring head {head} against the engine's tail {self.tail}")
        at = RING_DATA + self.tail % RING_BYTES
        if at + n <= RING_PAGE:
            data = page[at:at + n]
        else:  # wrapped: the rest at the ring's start
            data = page[at:] + page[RING_DATA:RING_DATA + n - (RING_PAGE - at)]
        self.tail = head
        self.w[TAIL] = head  # after the copy: the daemon may write over them now
        return data

    def closed(self) -> bool:
        """The daemon says it closed its end: the pipe's end of file is there to read."""
        return self.w[CLOSED] != 0

    def close(self) -> None:
        self.fields.close()


def _parse(buf: memoryview) -> tuple[list[P.Completion], bool, int]:
    """The records at the start of `buf`, whether the marker was among them, and where the first
    record not yet whole in `buf` starts."""
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
            except P.DECODE_ERRORS as exc:  # UnicodeDecodeError too: a string that is not UTF-8
                raise DoorbellError(f"undecodable record: {exc}") from None
        at = start + n
    return out, poll, at


def parse_whole(data: bytes) -> tuple[list[P.Completion], bool]:
    """Records the ring gave (whole ones only: a record cut short is not the daemon's)."""
    out, poll, at = _parse(memoryview(data))
    if at != len(data):
        raise DoorbellError(f"{len(data) - at} B of the ring are no whole record")
    return out, poll


class Records:
    """The engine's side of a records doorbell: parses what `read(2)` returned into
    completions, and whether the marker asked for a poll. Bounded: a length over PIPE_BUF
    is not a record (`DoorbellError`)."""

    def __init__(self) -> None:
        self.pending = bytearray()  # the start of a record a read cut (at most MAX_RECORD)

    def feed(self, data: bytes) -> tuple[list[P.Completion], bool]:
        buf = memoryview(self.pending + data if self.pending else data)
        out, poll, at = _parse(buf)
        self.pending = bytearray(buf[at:]) if at < len(buf) else bytearray()
        return out, poll
