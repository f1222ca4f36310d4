"""Unix-socket transport for the engine protocol: length-prefixed frames, fd passing.

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
from pathlib import Path
from typing import Awaitable, Callable

import msgspec

from . import protocol as P

_HEADER = struct.Struct(">I")
_ANC = socket.CMSG_SPACE(256 * array.array("i").itemsize)


class FrameError(ValueError):
    """A frame that violates the transport (too large, truncated ancillary data)."""


class DaemonError(RuntimeError):
    """The daemon answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Incremental parser: feed bytes and fds, take complete frames."""

    def __init__(self, max_frame: int = P.MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self.fds: deque[int] = deque()

    def feed(self, data: bytes, ancdata=()) -> list[bytes]:
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


class ServerConnection:
    """One engine connection on the daemon side (non-blocking socket on the event loop)."""

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        self.sock = sock
        self.reader = FrameReader(max_frame)
        self.frames: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self.credentials = peer_credentials(sock)
        self.loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._readable)
        self.closed = False

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
            for f in self.reader.feed(data, anc):
                self.frames.put_nowait(f)
        except FrameError as exc:
            self.frames.put_nowait(exc)
            data = b""
        if not data:
            self._stop_reading()
            self.frames.put_nowait(None)

    def _stop_reading(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())

    async def send(self, body: bytes) -> None:
        data = frame(body)
        try:  # replies are small: the socket buffer almost always takes them at once
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            await self.loop.sock_sendall(self.sock, data[sent:])

    def close(self) -> None:
        self._stop_reading()
        self.reader.close()
        self.sock.close()


Handler = Callable[[ServerConnection], Awaitable[None]]


async def serve_unix(path: str, handler: Handler, mode: int = 0o600, max_frame: int = P.MAX_FRAME,
                     group: int | None = None) -> tuple[socket.socket, asyncio.Task]:
    """Listen on `path` (its directory made 0700 if we create it); run `handler` per connection."""
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
        tasks: set[asyncio.Task] = set()
        while True:
            conn, _ = await loop.sock_accept(sock)
            task = asyncio.create_task(handler(ServerConnection(conn, max_frame)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    return sock, asyncio.create_task(accept_loop())


class Client:
    """Synchronous engine-side client; the reference implementation of the protocol."""

    def __init__(self, path: str, timeout: float = 30.0, client: str = "") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ConnectionError(f"no kvxferd daemon at {path}: {exc.strerror or exc}") from None
        self.reader = FrameReader()
        reply = self.call(P.Hello(P.PROTOCOL_VERSION, client or f"pid {os.getpid()}"))
        self.daemon = reply.daemon

    def call(self, msg: P.Msg, fds: list[int] = (), timeout: float | None = None) -> P.Msg:
        body = frame(P.encoder.encode(msg))
        if fds:
            sent = self.sock.sendmsg([body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(body):
                self.sock.sendall(body[sent:])
        else:
            self.sock.sendall(body)
        if timeout is not None:
            self.sock.settimeout(timeout)
        reply = self._recv()
        if isinstance(reply, P.Error):
            raise DaemonError(reply.code, reply.message)
        return reply

    def _recv(self) -> P.Msg:
        while True:
            frames = self.reader.feed(b"")
            if frames:
                return P.reply_decoder.decode(frames[0])
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("daemon closed the connection")
            frames = self.reader.feed(data)
            if frames:
                if len(frames) > 1:
                    raise FrameError("daemon sent more than one reply")
                return P.reply_decoder.decode(frames[0])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio engine-side client (same protocol, same replies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.daemon = ""

    @classmethod
    async def connect(cls, path: str, client: str = "") -> "AsyncClient":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"no kvxferd daemon at {path}: {exc.strerror or exc}") from None
        self = cls(sock)
        self.daemon = (await self.call(P.Hello(P.PROTOCOL_VERSION, client or f"pid {os.getpid()}"))).daemon
        return self

    async def call(self, msg: P.Msg, fds: list[int] = ()) -> P.Msg:
        body = frame(P.encoder.encode(msg))
        async with self._lock:
            if fds:
                sent = self.sock.sendmsg([body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                body = body[sent:]
            if body:
                await self.loop.sock_sendall(self.sock, body)
            while True:
                data = await self.loop.sock_recv(self.sock, 1 << 16)
                if not data:
                    raise ConnectionError("daemon closed the connection")
                frames = self.reader.feed(data)
                if frames:
                    reply = P.reply_decoder.decode(frames[0])
                    break
        if isinstance(reply, P.Error):
            raise DaemonError(reply.code, reply.message)
        return reply

    def close(self) -> None:
        self.sock.close()


def decode_request(data: bytes) -> P.Msg:
    """Decode one request frame; raises msgspec errors with a readable message."""
    return P.request_decoder.decode(data)


__all__ = ["Client", "AsyncClient", "DaemonError", "FrameError", "FrameReader", "serve_unix", "decode_request",
           "msgspec"]
