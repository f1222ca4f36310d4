"""Unix-socket transport for the engine protocol: framing, fd passing, and the daemon's server.

    frame = | length: u32 big-endian | msgpack body (protocol.Request / protocol.Reply) |

File descriptors (shared-memory buffers) travel as SCM_RIGHTS ancillary data with the
frame that names them (`Register.memory`); the receiver queues them in arrival order.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import stat
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import protocol as P

_HEADER = struct.Struct(">I")
_ANC = socket.CMSG_SPACE(256 * array.array("i").itemsize)


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
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self.fds.extend(fds)
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

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise FrameError(f"request names {n} file descriptors, {len(self.fds)} arrived")
        return [self.fds.popleft() for _ in range(n)]

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", data)


OnFrame = Callable[["ServerConnection", "bytes | Exception"], "bytes | Awaitable[bytes]"]
OnConnection = Callable[["ServerConnection"], None]


class ServerConnection:
    """One engine connection on the daemon side, served from the event loop's read callback.

    Each complete frame goes to `on_frame(conn, frame)`, which returns the reply body, or a
    coroutine producing it for the rare request that must wait (a long poll); frames that
    arrive meanwhile wait their turn, so replies keep the order of requests. No task and no
    queue stand between a request and its answer on the common path.
    """

    def __init__(self, sock: socket.socket, max_frame: int, on_frame: OnFrame, on_close: OnConnection) -> None:
        self.sock = sock
        self.reader = FrameReader(max_frame)
        self.credentials = peer_credentials(sock)
        self.loop = asyncio.get_running_loop()
        self.on_frame, self.on_close = on_frame, on_close
        self.backlog: deque[bytes] = deque()
        self.busy = False  # an async reply is pending
        self.out = b""  # reply bytes the socket did not take yet
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
            if flags & socket.MSG_CTRUNC:
                raise FrameError("file descriptors were truncated (too many in one frame)")
            self.backlog.extend(self.reader.feed(data, anc))
        except FrameError as exc:
            self.backlog.clear()
            self.fail(exc)
            return
        self._drain()
        if not data:
            self.close()

    def _drain(self) -> None:
        while self.backlog and not self.busy and not self.closed:
            reply = self.on_frame(self, self.backlog.popleft())
            if isinstance(reply, bytes):
                self.write(reply)
            else:
                self.busy = True
                asyncio.ensure_future(reply).add_done_callback(self._replied)

    def _replied(self, task: asyncio.Future[bytes]) -> None:
        self.busy = False
        if not task.cancelled() and task.exception() is None and not self.closed:
            self.write(task.result())
        self._drain()
        if self._closing:
            self.close()

    def write(self, body: bytes) -> None:
        """Queue one reply; the socket takes it now or when it becomes writable."""
        if self.closed:
            return
        data = frame(body)
        if self.out:
            self.out += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.out = data[sent:]
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        self.out = self.out[sent:]
        if not self.out:
            self.loop.remove_writer(self.sock.fileno())

    def fail(self, exc: Exception) -> None:
        """A transport error: answer it (the caller encodes it) and close."""
        reply = self.on_frame(self, exc)
        if isinstance(reply, bytes):  # an error is always answered at once
            self.write(reply)
        self.close()

    def close(self) -> None:
        """The peer is gone (or must go): stop reading; close once no reply is pending."""
        self._closing = True
        if self.busy or self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.sock.fileno())
        if self.out:
            self.loop.remove_writer(self.sock.fileno())
        self.on_close(self)
        self.reader.close()
        self.sock.close()


async def serve_unix(path: str, on_connect: OnConnection, on_frame: OnFrame, on_close: OnConnection,
                     mode: int = 0o600, max_frame: int = P.MAX_FRAME,
                     group: int | None = None) -> tuple[socket.socket, asyncio.Task[None]]:
    """Listen on `path` (its directory made 0700 if we create it); see ServerConnection."""
    p = Path(path)
    if not p.parent.exists():
        p.parent.mkdir(parents=True, mode=0o700)
    parent_mode = p.parent.stat().st_mode
    if parent_mode & stat.S_IWOTH and not parent_mode & stat.S_ISVTX:
        raise PermissionError(f"socket directory {p.parent} is world-writable: anyone could replace the socket")
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, -1, group)
    sock.listen(512)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept_loop() -> None:
        while True:
            conn, _ = await loop.sock_accept(sock)
            on_connect(ServerConnection(conn, max_frame, on_frame, on_close))

    return sock, asyncio.create_task(accept_loop())
