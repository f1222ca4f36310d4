"""Engine-side library: the reference implementation of the engine half of the protocol.

    with EngineClient("/run/kvxferd/kvxferd.sock", "prefill-0", rank=0, tp_size=2) as c:
        c.register(geometry, shm_fds=[fd])          # or memory=[...cuda_vmm...], fds=[fd]
        c.hold("req-1", lease_s=30)                 # prefill
        c.read("req-1", remote, num_tokens, local_blocks, remote_blocks)   # decode
        for done in c.poll(wait_s=1.0): ...

`Client` and `AsyncClient` carry frames; `Requests` builds every message one engine rank
sends, so the sync and the asyncio engine clients cannot drift apart.
"""

from __future__ import annotations

import array
import asyncio
import os
import secrets
import select
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TypeVar

import msgspec
import numpy as np

from . import protocol as P
from .doorbell import (
    WRITES,
    DoorbellError,
    PipeReader,
    Records,
    RingReader,
    SharedWords,
    map_counter,
    map_ring,
    parse_whole,
)
from .plan.geometry import Geometry
from .rpc import FrameError, FrameReader, frame

__all__ = ["AsyncClient", "AsyncEngineClient", "Client", "Completion", "DaemonError", "EngineClient",
           "MemoryHandle", "RemoteRef", "Requests", "new_read_token"]

RemoteRef = P.RemoteRef
Completion = P.Completion
MemoryHandle = P.MemoryHandle
BlockLists = Iterable[Iterable[int]]
R = TypeVar("R", bound=P.Msg)
MAX_READS = 16  # per pushed() call, of READ_BYTES each: a daemon that keeps the pipe full cannot hold a step
READ_BYTES = 1 << 16
# With a counter page, a step reads the pipe at least this often whatever the count says: a
# daemon that died without a last bump is found by the end-of-file (and a bump whose store the
# engine saw before the bytes, on a CPU that orders loads and stores more loosely than x86, waits
# no longer than this).
FORCED_READ_S = 0.1
_clock = time.monotonic  # what FORCED_READ_S is measured with (tests set their own)


class DaemonError(RuntimeError):
    """The daemon answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def new_read_token() -> str:
    """A hold's read token: 128 random bits as 32 hex digits. Whoever is given it may read the
    hold's blocks, so it travels only with the request (vLLM: in its kv_transfer_params)."""
    return secrets.token_hex(16)


def _hello(client: str) -> P.Hello:
    return P.Hello(P.PROTOCOL_VERSION, client or f"pid {os.getpid()}")


def _fds_message(fds: Sequence[int]) -> list[tuple[int, int, array.array[int]]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def _reply(body: bytes, expect: type[R]) -> R:
    try:
        reply = P.reply_decoder.decode(body)
    except P.DECODE_ERRORS as exc:  # not only msgspec's own: a string that is not UTF-8 raises UnicodeDecodeError
        raise FrameError(f"undecodable reply: {exc}") from None
    if isinstance(reply, P.Error):
        raise DaemonError(reply.code, reply.message)
    if not isinstance(reply, expect):
        raise FrameError(f"daemon answered {type(reply).__name__}, expected {expect.__name__}")
    return reply


class Client:
    """Synchronous transport: one request, one reply."""

    def __init__(self, path: str, timeout: float = 30.0, client: str = "") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ConnectionError(f"no kvxferd daemon at {path}: {exc.strerror or exc}") from None
        self.reader = FrameReader()
        welcome = self.call(_hello(client), P.Welcome)
        self.daemon, self.version = welcome.daemon, welcome.version

    def call(self, msg: P.Msg, expect: type[R], fds: Sequence[int] = (), timeout: float | None = None) -> R:
        body = frame(P.encoder.encode(msg))
        try:
            if fds:
                sent = self.sock.sendmsg([body], _fds_message(fds))
                if sent < len(body):
                    self.sock.sendall(body[sent:])
            else:
                self.sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed first; a refusal it sent before closing is still readable
        if timeout is not None:
            self.sock.settimeout(timeout)
        reply = _reply(self._recv(), expect)
        if expect is not P.Registered:
            self.reader.close()  # fds only come with a registration (its doorbell)
        return reply

    def _recv(self) -> bytes:
        frames = self.reader.feed(b"")
        while not frames:  # recvmsg: a reply may bring fds (a doorbell), kept in self.reader.fds
            data, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize))
            if not data:
                raise ConnectionError("daemon closed the connection")
            frames = self.reader.feed(data, anc)
        if len(frames) > 1:
            raise FrameError("daemon sent more than one reply")
        return frames[0]

    def status(self) -> P.Status:
        return self.call(P.StatusQuery(), P.StatusReply).status

    def close(self) -> None:
        self.sock.close()
        self.reader.close()  # fds a reply brought that nobody took

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio transport (same protocol, same replies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.daemon = ""
        self.version = P.PROTOCOL_VERSION

    @classmethod
    async def connect(cls, path: str, client: str = "") -> AsyncClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"no kvxferd daemon at {path}: {exc.strerror or exc}") from None
        self = cls(sock)
        welcome = await self.call(_hello(client), P.Welcome)
        self.daemon, self.version = welcome.daemon, welcome.version
        return self

    async def call(self, msg: P.Msg, expect: type[R], fds: Sequence[int] = ()) -> R:
        body = frame(P.encoder.encode(msg))
        async with self._lock:
            try:
                if fds:
                    body = body[self.sock.sendmsg([body], _fds_message(fds)):]
                if body:
                    await self.loop.sock_sendall(self.sock, body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon closed first; a refusal it sent before closing is still readable
            frames = self.reader.feed(b"")
            while not frames:
                data = await self.loop.sock_recv(self.sock, 1 << 16)
                if not data:
                    raise ConnectionError("daemon closed the connection")
                frames = self.reader.feed(data)
        return _reply(frames[0], expect)

    def close(self) -> None:
        self.sock.close()


class Requests:
    """The messages one engine rank sends (the same for the sync and the asyncio client)."""

    def __init__(self, engine_id: str, rank: int, tp_size: int, version: int = P.PROTOCOL_VERSION) -> None:
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        # Protocol 8 block lists travel packed: the daemon decodes 4 bytes an id, not a Python int
        self._blocks = _packed if version >= 8 else _listed
        self._keys = version >= 12  # a daemon before 12 refuses a remote naming its daemon's key

    def register(self, geometry: Geometry, shm_fds: Sequence[int] = (), memory: Sequence[P.MemoryHandle] = (),
                 fds: Sequence[int] = (), doorbell: int | None = None) -> tuple[P.Register, list[int]]:
        """The registration and the fds that travel with it.

        Host memory: `shm_fds`, one memfd per geometry buffer (sizes from the geometry). GPU
        memory: `memory` handles (cuda_vmm with their fds in `fds`, in order; or cuda_ipc).
        `doorbell` (protocol 3-4): an eventfd sent last; daemons since protocol 5 close it unrung
        (its open file would be shared with the engine) and make their own (`doorbell_pipe`).
        """
        if shm_fds:
            handles, sent = [P.MemoryHandle("shm", size) for size in geometry.buffers], list(shm_fds)
        else:
            handles, sent = list(memory), list(fds)
        if doorbell is not None:
            sent.append(doorbell)
        return P.Register(self.engine_id, self.rank, self.tp_size, geometry, handles, doorbell is not None), sent

    def unregister(self) -> P.Unregister:
        return P.Unregister(self.engine_id, self.rank)

    def attach(self, token: str) -> P.Attach:
        return P.Attach(self.engine_id, self.rank, token)

    def hold(self, request_id: str, lease_s: float, block_ids: BlockLists, digest: bool | None = None,
             read_token: str = "") -> P.Hold:
        return P.Hold(self.engine_id, self.rank, request_id, lease_s, self._blocks(block_ids), digest, read_token)

    def read(self, request_id: str, remote: P.RemoteRef, num_tokens: int, local_blocks: BlockLists,
             remote_blocks: BlockLists, deadline_s: float, audit: bool | None = None) -> P.Read:
        return P.Read(self.engine_id, self.rank, request_id, self._remote(remote), num_tokens,
                      self._blocks(local_blocks), self._blocks(remote_blocks), deadline_s, audit)

    def expect(self, request_id: str, remote: P.RemoteRef) -> P.Expect:
        return P.Expect(self.engine_id, self.rank, request_id, self._remote(remote))

    def _remote(self, remote: P.RemoteRef) -> P.RemoteRef:
        # the daemon dials its default server key instead (the shared-key deployment)
        return remote if self._keys or not remote.daemon_key else msgspec.structs.replace(remote, daemon_key="")

    def poll(self, wait_s: float, max_items: int) -> P.Poll:
        return P.Poll(self.engine_id, self.rank, wait_s, max_items)


Order = P.Hold | P.Read | P.Expect


def _settle(todo: list[int], results: P.Results, out: list[DaemonError | None]) -> list[int]:
    """Record the outcomes of the orders `todo` named; return those a refused batch left
    unapplied (a daemon applies a batch all or nothing: P.NOT_APPLIED marks the innocent). An
    answer that is not one result per order, or that holds every order back and refuses none,
    is no daemon's: FrameError (an order it left unanswered must not pass for accepted)."""
    if len(results.items) != len(todo):
        raise FrameError(f"daemon answered {len(results.items)} results to a batch of {len(todo)}")
    again = []
    for i, r in zip(todo, results.items, strict=True):
        if isinstance(r, P.Error) and r.message.startswith(P.NOT_APPLIED):
            again.append(i)
        else:
            out[i] = DaemonError(r.code, r.message) if isinstance(r, P.Error) else None
    if len(again) == len(todo):
        raise FrameError(f"daemon held back all {len(todo)} orders of a batch and refused none")
    return again  # each round settles one refusal at least


def _each_applied(orders: Sequence[Order], send: Callable[[list[Order]], P.Results]) -> list[DaemonError | None]:
    """Per order, None or the error it was refused with. The daemon applies a batch all or
    nothing; the orders a refusal held back go again without it (one more round trip per
    refused batch), so each order gets its own outcome, as one call each would give."""
    out: list[DaemonError | None] = [None] * len(orders)
    todo = list(range(len(orders)))
    while todo:
        todo = _settle(todo, send([orders[i] for i in todo]), out)
    return out


def _listed(lists: BlockLists) -> P.Blocks:
    return [[int(b) for b in blocks] for blocks in lists]


# Lists this long and longer travel packed; shorter ones cost both ends less as msgpack ints than
# numpy's calls do (`kvxferd bench framing`, docs/benchmarks.md).
PACK_MIN_IDS = 256


def _packed(lists: BlockLists) -> P.Blocks:
    out: P.Blocks = []
    for blocks in lists:
        ids = blocks if isinstance(blocks, list | np.ndarray) else list(blocks)
        packed = None
        if len(ids) >= PACK_MIN_IDS:
            try:
                packed = P.pack_blocks(ids)
            except ValueError:  # ids packing would wrap: sent as ints, which the daemon refuses by name
                pass
        out.append(packed if packed is not None else [int(b) for b in ids])
    return out


class EngineClient:
    """One engine rank's synchronous connection to its daemon."""

    def __init__(self, socket_path: str, engine_id: str, rank: int, tp_size: int, timeout: float = 30.0) -> None:
        self.rpc = Client(socket_path, timeout, client=f"{engine_id}/{rank}")
        self.requests = Requests(engine_id, rank, tp_size, self.rpc.version)
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        self.side_channel = ""
        self.doorbell: int | None = None  # doorbell pipe's read end (see doorbell.py)
        self._bell: select.poll | None = None  # watches `doorbell`
        self._pipe = PipeReader(READ_BYTES)  # reads the doorbell
        self._counter: SharedWords | None = None  # the doorbell's counter page (protocol 9), read-only
        self._ring: RingReader | None = None  # or its ring page (protocol 10), whose first bytes count
        self._seen = 0  # the counter when the pipe was last read
        self._more = False  # the last read stopped at MAX_READS: the pipe may hold more
        self._read_at = 0.0  # monotonic: the pipe's last read
        self._records: Records | None = None  # parses it when it carries completions (protocol 7)
        self.token = ""  # from `register`: what another process passes to `attach`
        self.agent = ""  # from `register`: the daemon's NIXL agent (a new one: the daemon restarted)
        self.max_lease_s = 0.0  # from `register` (protocol 6): how long claims may keep a hold
        # from `register` (protocol 12): the daemon's public key, what readers name (RemoteRef.daemon_key)
        self.daemon_key = ""

    def register(self, geometry: Geometry, shm_fds: Sequence[int] = (), memory: Sequence[P.MemoryHandle] = (),
                 fds: Sequence[int] = (), doorbell: bool = False, records: bool = False, ring: bool = True) -> str:
        """Hand the daemon this rank's KV memory; returns the side channel peers should dial.

        `doorbell`: ask the daemon (protocol 5 and later) for a doorbell pipe, so that `pushed()`
        learns without a round trip what finished: a byte saying a poll would find some, or with
        `records` (protocol 7) the completions themselves, which then no longer come by `poll`
        unless the pipe asks for one. The daemon keeps the write end: nothing the engine does
        can block it. With `ring` (protocol 10, x86 hosts) the records come in a ring of shared
        memory instead, so that a step reads them without a system call (doorbell.py).
        """
        msg, sent = self.requests.register(geometry, shm_fds, memory, fds)
        if doorbell and self.rpc.version >= 5:
            v = self.rpc.version
            msg = msgspec.structs.replace(msg, doorbell_pipe=True, doorbell_records=records and v >= 7,
                                          doorbell_counter=records and v >= 9,
                                          doorbell_ring=records and ring and v >= 10)
        reply = self.rpc.call(msg, P.Registered, sent)
        bell = counter = in_ring = None
        if reply.doorbell and self.rpc.reader.fds:  # the pipe's read end came with the reply
            bell = self.rpc.reader.take_fds(1)[0]
            if not stat.S_ISFIFO(os.fstat(bell).st_mode):  # not a doorbell: poll every step instead
                os.close(bell)
                bell = None
            elif reply.doorbell_records and reply.doorbell_ring:  # the records are in the ring alone
                in_ring = map_ring(self.rpc.reader.take_fds(1)[0]) if self.rpc.reader.fds else None
                if in_ring is None:  # no ring to read them in: without the doorbell, every step polls
                    os.close(bell)
                    bell = None
            elif reply.doorbell_records and reply.doorbell_counter and self.rpc.reader.fds:
                counter = map_counter(self.rpc.reader.take_fds(1)[0])  # the page's memfd came after it
        if bell is not None:
            os.set_blocking(bell, False)
            os.set_inheritable(bell, False)  # a child holding it would keep the daemon writing to no one
        self.rpc.reader.close()  # anything else a reply carried is not ours to keep
        self._close_doorbell()
        self.doorbell, self.side_channel, self.token = bell, reply.side_channel, reply.token
        self._records = Records() if bell is not None and reply.doorbell_records else None
        self._counter, self._ring = counter, in_ring
        self.agent, self.max_lease_s, self.daemon_key = reply.agent, reply.max_lease_s, reply.side_channel_key
        return self.side_channel

    @classmethod
    def of_doorbell(cls, fd: int, page_fd: int | None = None, ring: bool = False) -> EngineClient:
        """A records doorbell's read end (and its counter page's memfd, or with `ring` its ring
        page's, closed here) alone, no daemon connection: `pushed()` and nothing else (benchmarks
        and tests of the doorbell)."""
        c = cls.__new__(cls)
        c.doorbell = c._counter = c._ring = None
        c._close_doorbell()  # the doorbell's fields, as before a registration
        c.doorbell, c._records, c._pipe = fd, Records(), PipeReader(READ_BYTES)
        if page_fd is not None:
            if ring:
                c._ring = map_ring(page_fd)
            else:
                c._counter = map_counter(page_fd)
            if c._ring is None and c._counter is None:
                c._close_doorbell()
                raise ValueError(f"fd {page_fd} is not a sealed doorbell page")
        return c

    def attach(self, token: str) -> None:
        """Act for a rank another connection registered (protocol 3), with the token its
        registration returned; requests naming it from this connection are then served. A
        second connection of the registering process attaches too: a pid is no identity."""
        self.rpc.call(self.requests.attach(token), P.Ok)

    def pushed(self, wait_s: float = 0.0, force: bool = False) -> tuple[list[P.Completion], bool]:
        """What the doorbell brought since the last call, without a round trip: the completions
        it carried (protocol 7), and whether a poll may find more (a ring, the poll marker, or no
        doorbell: then every poll may). With `wait_s`, waits that long for the pipe first (the
        engine's process sleeps meanwhile). A pipe that carries what is not a record raises
        `DoorbellError`, a `ConnectionError`: treat it as the daemon's connection lost. One
        thread at a time (the reads share a buffer).

        With a counter page (protocol 9) a call reads the pipe only when the counter moved, and at
        least every FORCED_READ_S, or with `force` (a last drain): a daemon killed before it could
        bump the count closed its end all the same, and the read's end-of-file says so."""
        if self.doorbell is None:
            return [], True
        try:
            if self._ring is not None:
                completions, poll, ended = self._from_ring(self._ring, wait_s, force)
            else:
                completions, poll, ended = self._from_pipe(wait_s, force)
        except DoorbellError:  # what it carries can no longer be trusted
            self._close_doorbell()
            raise
        if ended:  # the daemon closed its end: poll from now on
            self._close_doorbell()
        return completions, poll or ended

    def _from_pipe(self, wait_s: float, force: bool) -> tuple[list[P.Completion], bool, bool]:
        """`pushed()` reading the pipe (protocols 5-9): (completions, poll, the end of file)."""
        assert self.doorbell is not None
        if self._counter is not None:  # protocol 9: nothing written since the last read, nothing to read
            count = self._counter.w[WRITES]
            now = _clock()
            if count == self._seen and not (self._more or force or wait_s > 0) and now < self._read_at + FORCED_READ_S:
                return [], False, False
            self._seen = count  # read before the pipe: a write after it moves it again
            self._read_at = now
        if wait_s > 0 and not self._wait(wait_s):
            return [], False, False
        chunks, ended, self._more = [], False, True
        for _ in range(MAX_READS):  # one read, unless the pipe held more than one read's worth
            chunk = self._pipe.read(self.doorbell)
            if chunk is None:  # empty (no exception raised: the common case)
                self._more = False
                break
            if not chunk:  # the daemon closed its end
                ended = True
                break
            chunks.append(chunk)
            if len(chunk) < READ_BYTES:
                self._more = False
                break
        if self._records is None or not chunks:
            return [], bool(chunks), ended  # protocol 5-6: a byte says a poll would find some
        return *self._records.feed(chunks[0] if len(chunks) == 1 else b"".join(chunks)), ended

    def _from_ring(self, ring: RingReader, wait_s: float, force: bool) -> tuple[list[P.Completion], bool, bool]:
        """`pushed()` with a ring (protocol 10): the records come from memory. The pipe, whose
        bytes only wake a waiting engine, is read once the daemon says it closed it, when the count
        moved and the ring held nothing, before a wait, with `force`, and at least every
        FORCED_READ_S (a daemon killed before it could say so); the ring is taken again after it.
        (completions, poll, the end of file)"""
        count = ring.w[WRITES]
        now = _clock()
        forced = force or now >= self._read_at + FORCED_READ_S
        if count == self._seen and not forced and wait_s <= 0:
            return [], False, False
        self._seen = count  # read before the ring: a record after it moves it again
        data = ring.take()
        ended = False
        if forced or not data or ring.closed():
            # The pipe first, the ring after: a record comes before its wake-up byte and before the
            # end of file, so what the drain ate a byte or the end of file for is taken here.
            self._read_at = now
            ended = self._drain()
            data += ring.take()
            if not (data or ended) and wait_s > 0 and self._wait(wait_s):
                self._seen = ring.w[WRITES]
                ended = self._drain()
                data = ring.take()
        return (*parse_whole(data), ended) if data else ([], False, ended)

    def _drain(self) -> bool:
        """Empty the pipe of wake-up bytes; True at its end of file (the daemon closed it)."""
        assert self.doorbell is not None
        for _ in range(MAX_READS):  # until empty: the end of file may follow the last bytes
            chunk = self._pipe.read(self.doorbell)
            if chunk is None:
                return False
            if not chunk:
                return True
        return False

    def _wait(self, wait_s: float) -> bool:
        """Sleep in poll(2), the GIL let go, until the pipe has something or `wait_s` passed."""
        assert self.doorbell is not None
        if self._bell is None:
            self._bell = select.poll()
            self._bell.register(self.doorbell, select.POLLIN)
        return bool(self._bell.poll(wait_s * 1000))

    def rung(self, wait_s: float = 0.0) -> bool:
        """Protocol 5-6's question, for a doorbell without records: whether a poll may find
        completions (the bytes the daemon wrote are consumed)."""
        if self._records is not None:
            raise RuntimeError("this doorbell carries the completions: read them with pushed()")
        return self.pushed(wait_s)[1]

    def unregister(self) -> None:
        self.rpc.call(self.requests.unregister(), P.Ok)

    def hold(self, request_id: str, lease_s: float = 30.0, block_ids: BlockLists = (),
             digest: bool | None = None, read_token: str = "") -> None:
        """Prefill: hold these blocks for their readers. `read_token` (protocol 11, `new_read_token`)
        is what a reader must present; "" lets whoever names the request read them."""
        self.rpc.call(self.requests.hold(request_id, lease_s, block_ids, digest, read_token), P.Ok)

    def read(self, request_id: str, remote: P.RemoteRef, num_tokens: int, local_blocks: BlockLists,
             remote_blocks: BlockLists, deadline_s: float = 30.0, audit: bool | None = None) -> None:
        self.rpc.call(self.requests.read(request_id, remote, num_tokens, local_blocks, remote_blocks, deadline_s,
                                         audit), P.Ok)

    def expect(self, request_id: str, remote: P.RemoteRef) -> None:
        """Decode: `request_id` will read `remote` (protocol 6; before, nothing is sent)."""
        if self.rpc.version >= 6:
            self.rpc.call(self.requests.expect(request_id, remote), P.Ok)

    def poll(self, wait_s: float = 0.0, max_items: int = 1024) -> list[P.Completion]:
        return self.rpc.call(self.requests.poll(wait_s, max_items), P.Completions, timeout=wait_s + 30).items

    def batch(self, orders: Sequence[Order]) -> list[DaemonError | None]:
        """Holds, reads and expects (built with `self.requests`) in one round trip, one call each
        to a protocol-1 daemon; per order, None or the error the daemon refused it with (an
        expect a daemon before protocol 6 does not know: None, not sent)."""
        if self.rpc.version < 6:
            kept = [i for i, o in enumerate(orders) if not isinstance(o, P.Expect)]
            if len(kept) < len(orders):
                out_all: list[DaemonError | None] = [None] * len(orders)
                for i, r in zip(kept, self.batch([orders[i] for i in kept])):
                    out_all[i] = r
                return out_all
        if not orders:
            return []
        if self.rpc.version < 2:
            out: list[DaemonError | None] = []
            for order in orders:
                try:
                    self.rpc.call(order, P.Ok)
                    out.append(None)
                except DaemonError as exc:
                    out.append(exc)
            return out
        return _each_applied(orders, lambda todo: self.rpc.call(P.Batch(todo), P.Results))

    def status(self) -> P.Status:
        return self.rpc.status()

    def close(self) -> None:
        self.rpc.close()
        self._close_doorbell()

    def _close_doorbell(self) -> None:
        if self.doorbell is not None:
            os.close(self.doorbell)
        if self._counter is not None:
            self._counter.close()
        if self._ring is not None:
            self._ring.close()
        self.doorbell = self._bell = self._records = self._counter = self._ring = None
        self._seen, self._more, self._read_at = 0, False, 0.0

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient:
    """The same calls for engines that run an asyncio loop."""

    def __init__(self, rpc: AsyncClient, engine_id: str, rank: int, tp_size: int) -> None:
        self.rpc = rpc
        self.requests = Requests(engine_id, rank, tp_size, rpc.version)
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        self.token = ""  # from `register`: what another connection passes to `attach`
        self.daemon_key = ""  # from `register` (protocol 12): the daemon's public key

    @classmethod
    async def connect(cls, socket_path: str, engine_id: str, rank: int, tp_size: int) -> AsyncEngineClient:
        return cls(await AsyncClient.connect(socket_path, f"{engine_id}/{rank}"), engine_id, rank, tp_size)

    async def register(self, geometry: Geometry, shm_fds: Sequence[int] = (),
                       memory: Sequence[P.MemoryHandle] = (), fds: Sequence[int] = ()) -> str:
        msg, sent = self.requests.register(geometry, shm_fds, memory, fds)
        reply = await self.rpc.call(msg, P.Registered, sent)
        self.token, self.daemon_key = reply.token, reply.side_channel_key
        return reply.side_channel

    async def attach(self, token: str) -> None:
        """Act for a rank another connection registered, with the token its registration returned."""
        await self.rpc.call(self.requests.attach(token), P.Ok)

    async def unregister(self) -> None:
        await self.rpc.call(self.requests.unregister(), P.Ok)

    async def hold(self, request_id: str, lease_s: float = 30.0, block_ids: BlockLists = (),
                   digest: bool | None = None, read_token: str = "") -> None:
        await self.rpc.call(self.requests.hold(request_id, lease_s, block_ids, digest, read_token), P.Ok)

    async def read(self, request_id: str, remote: P.RemoteRef, num_tokens: int, local_blocks: BlockLists,
                   remote_blocks: BlockLists, deadline_s: float = 30.0, audit: bool | None = None) -> None:
        await self.rpc.call(self.requests.read(request_id, remote, num_tokens, local_blocks, remote_blocks,
                                               deadline_s, audit), P.Ok)

    async def expect(self, request_id: str, remote: P.RemoteRef) -> None:
        """Decode: `request_id` will read `remote` (protocol 6; before, nothing is sent)."""
        if self.rpc.version >= 6:
            await self.rpc.call(self.requests.expect(request_id, remote), P.Ok)

    async def poll(self, wait_s: float = 0.0, max_items: int = 1024) -> list[P.Completion]:
        return (await self.rpc.call(self.requests.poll(wait_s, max_items), P.Completions)).items

    async def batch(self, orders: Sequence[Order]) -> list[DaemonError | None]:
        """Holds, reads and expects (built with `self.requests`) in one round trip; per order, None
        or its error (an expect a daemon before protocol 6 does not know: None, not sent)."""
        if self.rpc.version < 6 and any(isinstance(o, P.Expect) for o in orders):
            kept = [i for i, o in enumerate(orders) if not isinstance(o, P.Expect)]
            out_all: list[DaemonError | None] = [None] * len(orders)
            for i, r in zip(kept, await self.batch([orders[i] for i in kept])):
                out_all[i] = r
            return out_all
        if not orders:
            return []
        out: list[DaemonError | None] = [None] * len(orders)
        todo = list(range(len(orders)))
        while todo:  # as `_each_applied`, awaiting each round
            results = await self.rpc.call(P.Batch([orders[i] for i in todo]), P.Results)
            todo = _settle(todo, results, out)
        return out

    async def stream(self, wait_s: float = 1.0) -> AsyncIterator[P.Completion]:
        """Completions as they come (long-polls under the hood)."""
        while True:
            for item in await self.poll(wait_s):
                yield item
            await asyncio.sleep(0)

    def close(self) -> None:
        self.rpc.close()


