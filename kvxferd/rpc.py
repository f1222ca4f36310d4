"""Unix-socket transport for the engine protocol: framing, fd passing, and the daemon's server.

    frame = | length: u32 big-endian | msgpack body (protocol.Request / protocol.Reply) |

File descriptors (shared-memory buffers) travel as SCM_RIGHTS ancillary data with the
frame that names them (`Register.memory`); the receiver queues them in arrival order.
"""

from __future__ import annotations

import array
import asyncio
import errno
import logging
import os
import socket
import stat
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import protocol as P
from . import sockdir

log = logging.getLogger("kvxferd")

_HEADER = struct.Struct(">I")
_ANC = socket.CMSG_SPACE(256 * array.array("i").itemsize)
MAX_FDS_QUEUED = 1024  # fds a connection may have sent and not yet used (one per memory buffer)
# A client that does not read its replies: stop answering (and reading) it above this many unsent
# reply bytes, so the kernel's socket buffers push back on it instead of our memory growing.
UNSENT_HIGH = 4 << 20
FRAME_TIMEOUT_S = 30.0  # a frame begun must complete within this (a 64 MiB one takes milliseconds)
LINGER_S = 10.0  # a client that closed its end gets this long to take the replies still unsent
MAX_FDS_PER_UID = 4096  # fds sent and not yet used, across all connections of one uid
MAX_PARTIAL_BYTES_PER_UID = 256 << 20  # bytes of frames not yet complete, across connections of one uid
ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest wait after accept fails for want of fds or memory
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class FrameError(ValueError):
    """A frame that violates the transport (too large, truncated ancillary data)."""


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Incremental parser: feed bytes and fds, take complete frames."""

    def __init__(self, max_frame: int = P.MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self.fds: deque[int] = deque()

    def feed(self, data: bytes, ancdata: list[tuple[int, int, bytes]] | tuple[()] = ()) -> list[bytes]:
        self.fds.extend(received_fds(ancdata))
        if len(self.fds) > MAX_FDS_QUEUED:
            raise FrameError(f"{len(self.fds)} file descriptors sent and not used (at most {MAX_FDS_QUEUED})")
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameError(f"frame of {n} B exceeds the {self.max_frame} B limit")
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(bytes(self._buf[_HEADER.size:_HEADER.size + n]))
            del self._buf[:_HEADER.size + n]
        return out

    @property
    def buffered(self) -> int:
        """Bytes of a frame begun and not complete."""
        return len(self._buf)

    @property
    def partial(self) -> bool:
        """Part of a frame has arrived (the fds sent with it may be its own)."""
        return bool(self._buf)

    def close_unclaimed(self) -> None:
        """Close fds no frame used: every frame they could belong to has been answered."""
        if not self._buf:
            self.close()

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise FrameError(f"request names {n} file descriptors, {len(self.fds)} arrived")
        return [self.fds.popleft() for _ in range(n)]

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def received_fds(ancdata: list[tuple[int, int, bytes]] | tuple[()]) -> list[int]:
    """The fds an SCM_RIGHTS message carried (now open in this process: the caller owns them)."""
    out: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
            out.extend(fds)
    return out


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", data)


OnFrame = Callable[["ServerConnection", "bytes | Exception"], "bytes | Awaitable[bytes]"]
OnConnection = Callable[["ServerConnection"], None]


class UidBudget:
    """What the connections of one uid hold between them: fds sent and not yet used, bytes of
    frames not yet complete. One engine process cannot exhaust the daemon's fds or memory by
    spreading them over many connections (max_connections_per_uid of them)."""

    def __init__(self, max_fds: int = MAX_FDS_PER_UID, max_bytes: int = MAX_PARTIAL_BYTES_PER_UID) -> None:
        self.max_fds, self.max_bytes = max_fds, max_bytes
        self._held: dict[int, list[int]] = {}  # uid -> [fds, bytes]
        self._by_conn: dict[int, tuple[int, int]] = {}  # id(conn) -> (fds, bytes) it reported last

    def report(self, conn: object, uid: int, fds: int, nbytes: int) -> str:
        """Record what `conn` holds now; the reason its uid is over budget, or ""."""
        old_fds, old_bytes = self._by_conn.pop(id(conn), (0, 0))
        held = self._held.setdefault(uid, [0, 0])
        held[0] += fds - old_fds
        held[1] += nbytes - old_bytes
        if fds or nbytes:
            self._by_conn[id(conn)] = (fds, nbytes)
        if held == [0, 0]:
            del self._held[uid]
            return ""
        if held[0] > self.max_fds:
            return f"uid {uid} has {held[0]} fds sent and not used on its connections (at most {self.max_fds})"
        if held[1] > self.max_bytes:
            return f"uid {uid} has {held[1]} B of unfinished frames on its connections (at most {self.max_bytes})"
        return ""


class ServerConnection:
    """One engine connection on the daemon side, served from the event loop's read callback.

    Each complete frame goes to `on_frame(conn, frame)`, which returns the reply body, or a
    coroutine producing it for the rare request that must wait (a long poll); frames that
    arrive meanwhile wait their turn, so replies keep the order of requests. No task and no
    queue stand between a request and its answer on the common path.
    """

    def __init__(self, sock: socket.socket, max_frame: int, on_frame: OnFrame, on_close: OnConnection,
                 budget: UidBudget | None = None) -> None:
        self.sock = sock
        self.reader = FrameReader(max_frame)
        self.credentials = peer_credentials(sock)
        self.budget = budget or UidBudget()
        self.protocol = 0  # the version its hello named (0: none yet): what its replies may carry
        self._pending: asyncio.Future[bytes] | None = None  # the async reply being computed
        self._frame_timer: asyncio.TimerHandle | None = None  # a frame begun must complete in time
        self._linger: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self.on_frame, self.on_close = on_frame, on_close
        self.backlog: deque[bytes] = deque()
        self.busy = False  # an async reply is pending
        self.out: deque[tuple[memoryview, list[int]]] = deque()  # replies not sent yet, with their fds
        self._fds_out: list[int] = []  # fds that go with the next reply (ours: closed once sent)
        self.unsent = 0  # their total
        self.reading = True  # False while the client leaves too many replies unread
        self.eof = False
        self.counted = False  # in the daemon's connections per uid
        self.closed = False
        self._closing = False
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, anc, flags, _ = self.sock.recvmsg(1 << 16, _ANC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, anc, flags = b"", [], 0
        try:
            if flags & socket.MSG_CTRUNC:  # the fds that did fit are ours now: close them
                for fd in received_fds(anc):
                    os.close(fd)
                raise FrameError("file descriptors were truncated (too many in one frame)")
            self.backlog.extend(self.reader.feed(data, anc))
            self._account()
        except FrameError as exc:
            self.backlog.clear()
            self.fail(exc)
            return
        self.eof = not data
        if self.eof and self._pending is not None:
            self._pending.cancel()  # nobody waits for that long poll: the rank goes at once
        self._drain()
        if self.eof:
            self.close()  # once the replies queued are sent (LINGER_S at most)

    def _account(self) -> None:
        """Report fds and unfinished bytes to the uid's budget; time an unfinished frame."""
        over = self.budget.report(self, self.credentials[1], len(self.reader.fds), self.reader.buffered)
        if over:
            raise FrameError(over)
        if self.reader.partial and self._frame_timer is None:
            self._frame_timer = self.loop.call_later(FRAME_TIMEOUT_S, self._frame_timed_out)
        elif not self.reader.partial and self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _frame_timed_out(self) -> None:
        self._frame_timer = None
        if not self.closed:
            self.fail(FrameError(f"a frame begun {FRAME_TIMEOUT_S:g} s ago did not complete"))

    def _drain(self) -> None:
        while self._answer_burst():  # a burst that reached UNSENT_HIGH went out whole: go on
            pass
        if not self.backlog and not self.busy:
            self.reader.close_unclaimed()
            if not self.closed:
                self.budget.report(self, self.credentials[1], len(self.reader.fds), self.reader.buffered)
        self._pace_reading()

    def _answer_burst(self) -> bool:
        """Answer the requests waiting, their replies sent together (one send(2) for a burst of
        requests), in order: a reply that carries fds or is computed later sends the ones
        before it first. (A reply waits for the requests after it in its burst: behind a large
        READ, whose copy holds the loop, by that copy.) True when requests still wait and may
        be answered now (the burst stopped at UNSENT_HIGH and the socket took it)."""
        burst: list[bytes] = []  # framed replies not handed to the socket yet
        held = 0  # their bytes, counted against UNSENT_HIGH as if unsent
        try:
            while self.backlog and not self.busy and not self.closed and self.unsent + held < UNSENT_HIGH:
                reply = self.on_frame(self, self.backlog.popleft())
                if isinstance(reply, bytes) and not self._fds_out:
                    burst.append(frame(reply))
                    held += len(burst[-1])
                    continue
                if burst:
                    self._put(memoryview(b"".join(burst)), [])
                    burst, held = [], 0
                if isinstance(reply, bytes):
                    self.write(reply)
                else:
                    self.busy = True
                    self._pending = asyncio.ensure_future(reply)
                    self._pending.add_done_callback(self._replied)
        finally:  # a handler that raised loses its own reply, not the ones before it
            if burst:
                self._put(memoryview(b"".join(burst)), [])  # one reply: join returns it, no copy
        return bool(self.backlog) and not self.busy and not self.closed and self.unsent < UNSENT_HIGH

    def _pace_reading(self) -> None:
        """Read requests only while their replies are taken: unanswered frames or unsent replies
        beyond UNSENT_HIGH stop reading until the client catches up."""
        want = not self.closed and not self.eof and self.unsent < UNSENT_HIGH and not self.backlog
        if want != self.reading:
            self.reading = want
            if want:
                self.loop.add_reader(self.sock.fileno(), self._readable)
            else:
                self.loop.remove_reader(self.sock.fileno())

    def _replied(self, task: asyncio.Future[bytes]) -> None:
        self.busy, self._pending = False, None
        if not task.cancelled() and task.exception() is None and not self.closed:
            self.write(task.result())
        self._drain()
        if self._closing:
            self.close()

    def send_with_next_reply(self, fd: int) -> None:
        """Pass `fd` to the client with the next reply (SCM_RIGHTS); ours is closed once sent."""
        self._fds_out.append(fd)

    def write(self, body: bytes) -> None:
        """Queue one reply; the socket takes it now or when it becomes writable."""
        fds, self._fds_out = self._fds_out, []
        self._put(memoryview(frame(body)), fds)

    def _put(self, data: memoryview, fds: list[int]) -> None:
        """Framed replies, `fds` going with their first byte."""
        if self.closed:
            _close_all(fds)
            return
        if self.out:
            self.out.append((data, fds))
            self.unsent += len(data)
            return
        try:
            sent = self._send(data, fds)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            _close_all(fds)
            self.close(force=True)
            return
        if sent < len(data):
            self.out.append((data[sent:], fds if not sent else []))
            self.unsent += len(data) - sent
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _send(self, data: memoryview, fds: list[int]) -> int:
        """Send what the socket takes; fds go with the first byte and are closed once sent."""
        if not fds:
            return self.sock.send(data)
        sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        _close_all(fds)
        return sent

    def _writable(self) -> None:
        while self.out:
            data, fds = self.out[0]
            try:
                sent = self._send(data, fds)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close(force=True)
                return
            self.unsent -= sent
            if sent < len(data):
                self.out[0] = (data[sent:], [] if sent else fds)
                return
            self.out.popleft()
        self.loop.remove_writer(self.sock.fileno())
        self._drain()  # requests held back while replies waited
        if self._closing and not self.closed:
            self.close()

    def fail(self, exc: Exception) -> None:
        """A transport error: answer it (the caller encodes it) and close."""
        reply = self.on_frame(self, exc)
        if isinstance(reply, bytes):  # an error is always answered at once
            self.write(reply)
        self.backlog.clear()
        self.close()

    def close(self, force: bool = False) -> None:
        """The peer is gone (or must go): stop reading; close once no reply is pending and the
        replies queued are sent (at most LINGER_S later; at once with `force`: the socket failed)."""
        self._closing = True
        self.eof = True
        if self.closed:
            return
        self._pace_reading()
        if not force and (self.busy or self.out or self.backlog):
            if self._linger is None:
                self._linger = self.loop.call_later(LINGER_S, self.close, True)
            return
        self.closed = True
        for timer in (self._linger, self._frame_timer):
            if timer is not None:
                timer.cancel()
        if self._pending is not None:
            self._pending.cancel()
        self.budget.report(self, self.credentials[1], 0, 0)
        if self.reading:
            self.reading = False
            self.loop.remove_reader(self.sock.fileno())
        if self.out:
            self.loop.remove_writer(self.sock.fileno())
        self.on_close(self)
        self.reader.close()
        for _, fds in self.out:
            _close_all(fds)
        _close_all(self._fds_out)
        self.out.clear()
        self.sock.close()


async def serve_unix(path: str, on_connect: OnConnection, on_frame: OnFrame, on_close: OnConnection,
                     mode: int = 0o600, max_frame: int = P.MAX_FRAME, group: int | None = None,
                     on_accept_error: Callable[[OSError], None] | None = None,
                     ) -> tuple[socket.socket, asyncio.Task[None]]:
    """Listen on `path` (its directory checked, or created, by the rule in sockdir.py); see
    ServerConnection. `on_accept_error`: told of each failed accept (the loop goes on, see `accept_forever`)."""
    p = Path(path)
    sockdir.prepare(p.parent, mode, group)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sockdir.bind(sock, path)  # remembers the file, so that stopping removes only this one
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, -1, group)
    sock.listen(512)
    sock.setblocking(False)

    budget = UidBudget()  # shared by every connection of this socket

    def connected(conn: socket.socket) -> None:
        on_connect(ServerConnection(conn, max_frame, on_frame, on_close, budget))

    return sock, asyncio.create_task(accept_forever(sock, connected, on_accept_error))


async def accept_forever(sock: socket.socket, connected: Callable[[socket.socket], None],
                         on_error: Callable[[OSError], None] | None = None) -> None:
    """Accept connections until cancelled. Out of fds or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
    the pending connection stays queued and accept would fail at once again: wait, doubling from
    10 ms to 1 s, and go on, so that engines can connect again as soon as fds free up. A
    connection that failed on its own (ECONNABORTED) is skipped."""
    loop = asyncio.get_running_loop()
    backoff = ACCEPT_BACKOFF_S[0]
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except OSError as exc:
            if on_error is not None:
                on_error(exc)
            if exc.errno in _OUT_OF_RESOURCES:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, ACCEPT_BACKOFF_S[1])
            continue
        backoff = ACCEPT_BACKOFF_S[0]
        try:
            connected(conn)
        except OSError as exc:  # SO_PEERCRED or the loop's registration failed: drop this one only
            conn.close()
            if on_error is not None:
                on_error(exc)
