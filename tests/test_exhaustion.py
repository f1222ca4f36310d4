"""Resource exhaustion on the engine socket: a daemon out of fds keeps accepting once they free
up, fds a client sends and no frame uses are closed, a client that does not read its replies is
pushed back on, and connections per uid are capped. Real daemons in their own processes, real
Unix sockets, fds counted in /proc."""

from __future__ import annotations

import array
import asyncio
import os
import resource
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvxferd import protocol as P
from kvxferd import rpc
from kvxferd.client import Client, DaemonError, EngineClient
from kvxferd.holds import MEMORY_LOOK_S
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)
STATUS_FRAME = rpc.frame(P.encoder.encode(P.StatusQuery()))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settle(pid: int, target: int, timeout: float = 20.0) -> int:
    """The daemon's open fds once they drop to `target` (or whatever they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while (n := open_fds(pid)) > target and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def register_one(socket_path: str, engine_id: str) -> None:
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(socket_path, engine_id, 0, 1, timeout=15.0) as c:
            c.register(geo, shm_fds=[fd])
            c.hold("r", 5.0, [[1]])
    finally:
        os.close(fd)
        mm.close()


def test_a_daemon_out_of_fds_serves_again_once_they_free_up(tmp_path):
    """A flood on the metrics port (0.0.0.0 in the deployments) uses up the daemon's fds; the
    engine socket's accepts fail with EMFILE meanwhile. Once the flood goes, an engine registers
    and /metrics answers, with the failures counted."""
    probe = DaemonProcess(tmp_path, "probe", metrics_port=0)
    baseline = open_fds(probe.proc.pid)
    probe.stop()
    limit = baseline + 24
    daemon = DaemonProcess(tmp_path, "daemon", metrics_port=0, prefix=["prlimit", f"--nofile={limit}:{limit}"])
    try:
        metrics = Client(daemon.socket, 10).status().metrics
        host, port = metrics.rsplit(":", 1)
        flood = []
        for _ in range(64):  # more than the daemon has fds left: its accepts start failing
            s = socket.create_connection((host, int(port)), timeout=5)
            flood.append(s)
        # The metrics server closes a connection that sent no head within 10 s: both waits fit in that.
        deadline = time.monotonic() + 8
        while open_fds(daemon.proc.pid) < limit - 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_fds(daemon.proc.pid) >= limit - 2, "the flood did not exhaust the daemon's fds"
        # Engines connect only now: connected before the daemon took the flood in, they could be
        # accepted while fds were left (the daemon's loop picks either listening socket first).
        waiting = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
        for w in waiting:  # queued by the kernel; the daemon's accepts of them fail
            w.connect(daemon.socket)
        log = Path(daemon.log.name)
        deadline = time.monotonic() + 5
        while "engine socket: accept failed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine socket's accept loop has met EMFILE before the flood goes
        assert "engine socket: accept failed" in log.read_text(), "the engine socket never ran out of fds"
        for s in flood + waiting:
            s.close()
        register_one(daemon.socket, "after-flood")  # accepted again, and served
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        [line] = [x for x in body.splitlines() if x.startswith('kvxferd_accept_errors_total{errno="EMFILE"}')]
        assert float(line.split()[-1]) >= 1
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def _send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])


def test_fds_sent_with_frames_that_do_not_use_them_are_closed(tmp_path):
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        with Client(daemon.socket, 10) as c:
            c.status()
            before = open_fds(daemon.proc.pid)
            for _ in range(40):  # each status request carries 3 fds it does not name
                fds = [os.memfd_create("junk") for _ in range(3)]
                _send_with_fds(c.sock, STATUS_FRAME, fds)
                for fd in fds:
                    os.close(fd)
                c.sock.settimeout(10)
                reader = rpc.FrameReader()
                got: list[bytes] = []
                while not got:
                    got = reader.feed(c.sock.recv(1 << 16))
                assert isinstance(P.reply_decoder.decode(got[0]), P.StatusReply)
            # the connection is still open: the daemon holds none of the 120 fds
            assert settle(daemon.proc.pid, before) <= before
            c.status()  # and still serves it
    finally:
        daemon.stop()


def test_too_many_unused_fds_close_the_connection_and_every_fd(tmp_path):
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        with Client(daemon.socket, 10) as c:
            c.status()
            before = open_fds(daemon.proc.pid)
            fds = [os.memfd_create("junk") for _ in range(200)]
            header_only = rpc.frame(b"x" * 32)[:2]  # a frame that never completes keeps its fds
            try:
                for i in range(0, 200, 50):
                    _send_with_fds(c.sock, header_only if i == 0 else b"\0", fds[i:i + 50])
                big = [os.memfd_create("junk") for _ in range(rpc.MAX_FDS_QUEUED - 199)]
                for i in range(0, len(big), 200):
                    _send_with_fds(c.sock, b"\0", big[i:i + 200])
            finally:
                for fd in fds + big:
                    os.close(fd)
            assert c.sock.recv(1 << 16) is not None  # the error reply (or EOF): the daemon closed it
        assert settle(daemon.proc.pid, before) <= before
        Client(daemon.socket, 10).status()
    finally:
        daemon.stop()


def test_fds_of_a_truncated_message_are_closed():
    """MSG_CTRUNC: the fds that fit the ancillary buffer were received and must be closed. The
    kernel truncates only when they do not fit: the buffer is made small for this one test."""

    async def scenario() -> tuple[int, int, bool]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        failed: list[object] = []

        def on_frame(conn: rpc.ServerConnection, data: bytes | Exception) -> bytes:
            failed.append(data)
            return b""

        before = len(os.listdir("/proc/self/fd"))
        conn = rpc.ServerConnection(b, 1 << 20, on_frame, lambda _c: None)
        fds = [os.memfd_create("junk") for _ in range(4)]
        _send_with_fds(a, STATUS_FRAME, fds)
        for fd in fds:
            os.close(fd)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if conn.closed:
                break
        a.close()
        after = len(os.listdir("/proc/self/fd"))
        return before, after, any(isinstance(f, rpc.FrameError) for f in failed)

    saved = rpc._ANC
    rpc._ANC = socket.CMSG_SPACE(2 * 4)
    try:
        before, after, failed = asyncio.run(scenario())
    finally:
        rpc._ANC = saved
    assert failed
    assert after <= before - 1  # b closed, a closed, and none of the received fds left open


def test_a_client_that_does_not_read_its_replies_is_pushed_back(tmp_path):
    """Pipelined requests whose replies are never read: the daemon stops reading that client
    (its socket buffers fill and its sends block) instead of queueing replies without bound, and
    serves everyone else meanwhile."""
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        reply = len(P.encoder.encode(P.StatusReply(Client(daemon.socket, 10).status())))
        rss = rss_bytes(daemon.proc.pid)
        hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hog.connect(daemon.socket)
        hog.settimeout(5.0)
        frames = (256 << 20) // reply  # 256 MiB of replies if the daemon answered them all
        batch = STATUS_FRAME * 1000
        sent = 0
        try:
            while sent < frames:
                hog.sendall(batch)
                sent += 1000
        except TimeoutError:
            pass
        assert sent < frames, "every request was read: nothing pushed back"
        with Client(daemon.socket, 10) as other:  # the loop is not stuck on the hog
            other.status()
        assert rss_bytes(daemon.proc.pid) - rss < 64 << 20
        hog.close()
        Client(daemon.socket, 10).status()
    finally:
        daemon.stop()


def test_connections_per_uid_are_capped(tmp_path):
    os.environ["KVXFERD_MAX_CONNECTIONS_PER_UID"] = "4"
    try:
        daemon = DaemonProcess(tmp_path, "daemon", metrics_port=0)
    finally:
        del os.environ["KVXFERD_MAX_CONNECTIONS_PER_UID"]
    try:
        first = Client(daemon.socket, 10)
        clients = [first] + [Client(daemon.socket, 10) for _ in range(3)]
        for c in clients:
            c.status()
        with pytest.raises((DaemonError, ConnectionError, OSError)) as refused, \
                Client(daemon.socket, 10) as fifth:
            fifth.status()
        if isinstance(refused.value, DaemonError):
            assert refused.value.code == "forbidden" and "max_connections_per_uid" in str(refused.value)
        clients.pop().close()
        time.sleep(0.2)
        with Client(daemon.socket, 10) as again:
            metrics = again.status().metrics
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        assert 'kvxferd_rejected_connections_total{reason="connections"} 1.0' in body
        for c in clients:
            c.close()
    finally:
        daemon.stop()


def _answer_as(gid: int, uid: int, ask: Callable[[], str | None]) -> str:
    """What the daemon answers `ask` run in a forked child as uid:gid (the interpreter's files
    need not be readable by that user): what `ask` returns, else "served"; the refusal's code, or
    the OS error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                answer = ask() or "served"
            except DaemonError as exc:
                answer = exc.code
            except OSError as exc:
                answer = f"{type(exc).__name__}: {exc}"
            os.write(w, answer.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        answer = f.read()
    os.waitpid(pid, 0)
    return answer


def as_user(socket_path: str, gid: int, uid: int) -> str:
    """What the daemon answers a client running as uid:gid."""
    def ask() -> None:
        Client(socket_path, 10).status()
    return _answer_as(gid, uid, ask)


def as_user_register(socket_path: str, gid: int, uid: int, engine: str, rank: int, tp_size: int) -> str:
    """What the daemon answers a registration from a client running as uid:gid."""
    geo = build(SHAPE, tp_size, rank)

    def register() -> None:
        fd, _mapping = create_shm(geo.buffers[0])
        with EngineClient(socket_path, engine, rank, tp_size) as c:
            c.register(geo, shm_fds=[fd])
    return _answer_as(gid, uid, register)


def test_socket_group_members_connect_without_allowed_uids():
    """`socket_group` makes the socket 0660 for that group; its members are served (primary group,
    what SO_PEERCRED tells), a uid outside it is refused although the file mode would let it in."""
    if os.getuid() != 0:
        pytest.skip("needs root to run clients as other users")
    import grp
    import pwd

    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    root_dir = tempfile.mkdtemp(prefix="kvx-group-")
    os.chmod(root_dir, 0o755)
    os.environ["KVXFERD_SOCKET_GROUP"] = group
    try:
        daemon = DaemonProcess(Path(root_dir), "daemon", socket=f"{root_dir}/run/kvxferd.sock")
    finally:
        del os.environ["KVXFERD_SOCKET_GROUP"]
    try:
        os.chmod(f"{root_dir}/run", 0o750)
        os.chown(f"{root_dir}/run", 0, nobody.pw_gid)
        assert as_user(daemon.socket, nobody.pw_gid, nobody.pw_uid) == "served"
        os.chmod(daemon.socket, 0o666)  # the file mode is not the check: the daemon's is
        os.chmod(f"{root_dir}/run", 0o755)
        assert as_user(daemon.socket, 12345, 12345) == "forbidden"
    finally:
        daemon.stop()
        subprocess.run(["rm", "-rf", root_dir], check=False)


def test_engine_memory_must_be_sealed_against_shrinking(tmp_path):
    """An engine that shrinks its memfd after registering would kill the daemon with SIGBUS on
    the next read of the cut pages: an unsealed memfd is refused by name, a sealed one cannot
    shrink."""
    daemon = DaemonProcess(tmp_path, "daemon")
    geo = build(SHAPE, 1, 0)
    try:
        plain = os.memfd_create("unsealed")
        os.ftruncate(plain, geo.buffers[0])
        with EngineClient(daemon.socket, "unsealed", 0, 1) as c, pytest.raises(DaemonError) as refused:
            c.register(geo, shm_fds=[plain])
        os.close(plain)
        assert refused.value.code == "bad_request" and "F_SEAL_SHRINK" in str(refused.value)
        fd, mm = create_shm(geo.buffers[0])
        with EngineClient(daemon.socket, "sealed", 0, 1) as c:
            c.register(geo, shm_fds=[fd])
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
            c.hold("r", 5.0, [[3]])
        os.close(fd)
        mm.close()
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def test_sparse_engine_memory_is_refused_at_registration_and_at_each_hold(tmp_path):
    """The engine pays for its memory: a memfd with unallocated pages is refused at registration
    by name (the daemon would fault them in on its own account: a digest, a peer's READ); one
    whose engine punched a hole after registering gets no hold kept, by name, until it is
    whole again."""
    import ctypes
    import fcntl

    daemon = DaemonProcess(tmp_path, "daemon")
    geo = build(SHAPE, 1, 0)
    try:
        sparse = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
        os.ftruncate(sparse, geo.buffers[0])
        fcntl.fcntl(sparse, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with EngineClient(daemon.socket, "sparse", 0, 1) as c, pytest.raises(DaemonError) as refused:
            c.register(geo, shm_fds=[sparse])
        os.close(sparse)
        assert refused.value.code == "bad_request" and "sparse: 0 of its" in str(refused.value)

        libc = ctypes.CDLL(None, use_errno=True)
        # a hole made up for by as many pages kept past the end (KEEP_SIZE): the count would match
        fd, mm = create_shm(geo.buffers[0])
        half = geo.buffers[0] // 2
        assert libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(half)) == 0  # KEEP_SIZE | PUNCH_HOLE
        assert libc.fallocate(fd, 1, ctypes.c_long(geo.buffers[0]), ctypes.c_long(half)) == 0
        assert os.fstat(fd).st_blocks * 512 == geo.buffers[0]
        with EngineClient(daemon.socket, "made-up", 0, 1) as c, pytest.raises(DaemonError, match="sparse"):
            c.register(geo, shm_fds=[fd])
        os.close(fd)
        mm.close()

        fd, mm = create_shm(geo.buffers[0])
        with EngineClient(daemon.socket, "filled", 0, 1) as c:
            c.register(geo, shm_fds=[fd])
            c.hold("r", 5.0, [[3]], digest=True)
            assert libc.fallocate(fd, 1, ctypes.c_long(geo.buffers[0]), ctypes.c_long(1 << 20)) == -1  # sealed
            assert libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(1 << 20)) == 0  # KEEP_SIZE | PUNCH_HOLE
            time.sleep(2 * MEMORY_LOOK_S)  # the daemon looks at a rank's memory at most this often
            with pytest.raises(DaemonError, match="memory lost pages since it registered"):
                c.hold("s", 5.0, [[4]], digest=True)
            os.posix_fallocate(fd, 0, geo.buffers[0])  # whole again (no bigger: sealed against growing): held
            c.hold("s", 5.0, [[4]], digest=True)
        os.close(fd)
        mm.close()
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def test_a_registration_refused_after_mapping_keeps_no_fd(tmp_path):
    """A registration whose later buffer is refused (a malformed CUDA IPC handle) closes what its
    earlier ones mapped: sent again and again, the same memfd costs the daemon no fd."""
    daemon = DaemonProcess(tmp_path, "daemon")
    one = build(SHAPE, 1, 0)
    geo = msgspec.structs.replace(one, buffers=(one.buffers[0], 4096))  # a second buffer, unused
    fd, mm = create_shm(geo.buffers[0])
    try:
        with EngineClient(daemon.socket, "e", 0, 1) as c:
            before = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
            for _ in range(50):
                msg, _ = c.requests.register(geo, shm_fds=[fd])
                msg = msgspec.structs.replace(msg, memory=[P.MemoryHandle("shm", geo.buffers[0]),
                                                           P.MemoryHandle("cuda_ipc", 4096, 0, b"x!")])
                with pytest.raises(DaemonError, match="bad_request"):
                    c.rpc.call(msg, P.Registered, [fd])
            assert len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) <= before + 2
            c.register(one, shm_fds=[fd])  # and it registers still
    finally:
        os.close(fd)
        mm.close()
        daemon.stop()


def test_hugetlb_memory_is_refused_whatever_its_seals(tmp_path):
    """A hugetlb memfd sealed against shrinking still loses a page to fallocate(PUNCH_HOLE), and
    with the huge page pool used up the daemon's next read of it is a SIGBUS: only tmpfs memfds."""
    geo = build(ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16), 1, 0)
    try:
        fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 2 << 20)
    except OSError as exc:
        pytest.skip(f"no hugetlb memfds here: {exc}")
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        with EngineClient(daemon.socket, "huge", 0, 1) as c, pytest.raises(DaemonError) as refused:
            c.register(geo, memory=[P.MemoryHandle("shm", geo.buffers[0])], fds=[fd])
        assert refused.value.code == "bad_request" and "tmpfs" in str(refused.value)
    finally:
        os.close(fd)
        daemon.stop()


def test_fds_parked_across_many_connections_are_bounded_per_uid(tmp_path):
    """Unfinished frames keep the fds sent with them; one uid spreading them over connections
    is held to MAX_FDS_PER_UID between them all, and an engine still registers."""
    daemon = DaemonProcess(tmp_path, "daemon", prefix=["prlimit", "--nofile=16384:16384"])
    hoarders: list[socket.socket] = []
    try:
        Client(daemon.socket, 10).status()
        before = open_fds(daemon.proc.pid)
        junk = [os.memfd_create("junk") for _ in range(200)]
        try:
            for _ in range(8):  # 8 x 1,000 fds would be 8,000 parked
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(daemon.socket)
                s.settimeout(5)
                try:
                    _send_with_fds(s, rpc.frame(b"x" * 64)[:2], junk)  # a frame that never completes
                    for _ in range(4):
                        _send_with_fds(s, b"\0", junk)
                except OSError:
                    pass  # refused part-way: the daemon closed this one
                hoarders.append(s)
        finally:
            for fd in junk:
                os.close(fd)
        time.sleep(0.5)
        assert open_fds(daemon.proc.pid) - before <= rpc.MAX_FDS_PER_UID + 64
        register_one(daemon.socket, "victim")
    finally:
        for s in hoarders:
            s.close()
        daemon.stop()


def test_an_unfinished_frame_times_out():
    """A frame begun and never completed would keep its bytes and fds: the connection ends."""

    async def scenario() -> list[object]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        seen: list[object] = []

        def on_frame(conn: rpc.ServerConnection, data: bytes | Exception) -> bytes:
            seen.append(data)
            return b""

        conn = rpc.ServerConnection(b, 1 << 20, on_frame, lambda _c: None)
        a.sendall(rpc.frame(b"x" * 100)[:10])
        for _ in range(200):
            await asyncio.sleep(0.01)
            if conn.closed:
                break
        a.close()
        return seen

    saved = rpc.FRAME_TIMEOUT_S
    rpc.FRAME_TIMEOUT_S = 0.2
    try:
        seen = asyncio.run(scenario())
    finally:
        rpc.FRAME_TIMEOUT_S = saved
    assert [str(e) for e in seen if isinstance(e, rpc.FrameError)] == ["a frame begun 0.2 s ago did not complete"]


def test_a_client_that_half_closes_gets_every_reply(tmp_path):
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.settimeout(20)
        s.sendall(STATUS_FRAME * 300)
        s.shutdown(socket.SHUT_WR)
        reader = rpc.FrameReader()
        replies: list[bytes] = []
        while data := s.recv(1 << 16):
            replies += reader.feed(data)
        s.close()
        assert len(replies) == 300
    finally:
        daemon.stop()


def test_pipelined_requests_are_answered_in_order(tmp_path):
    """Requests that arrive together are answered together (one send for a burst of replies),
    each reply in its request's place."""
    daemon = DaemonProcess(tmp_path, "daemon")
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.settimeout(20)
        s.sendall(rpc.frame(P.encoder.encode(P.Hello(P.PROTOCOL_VERSION, "pipelined"))))
        reader = rpc.FrameReader()
        while not reader.feed(s.recv(1 << 16)):
            pass
        unknown = [rpc.frame(P.encoder.encode(P.Poll(f"engine-{i}", 0, 0.0, 16))) for i in range(200)]
        s.sendall(b"".join(unknown[:100]) + STATUS_FRAME + b"".join(unknown[100:]))
        replies: list[bytes] = []
        while len(replies) < 201:
            replies += reader.feed(s.recv(1 << 16))
        s.close()
        errors = [P.reply_decoder.decode(r) for r in replies]
        assert isinstance(errors[100], P.StatusReply)
        named = [e.message for i, e in enumerate(errors) if i != 100]
        assert all(f"'engine-{i}'" in m for i, m in enumerate(named)), "a reply out of its request's place"
    finally:
        daemon.stop()


def test_replies_past_the_unsent_bound_that_the_socket_takes_do_not_stall_the_connection(monkeypatch):
    """A burst of replies stops at UNSENT_HIGH; when the socket takes it whole, nothing waits to
    be written and nothing is read: the requests still waiting must be answered all the same."""
    monkeypatch.setattr(rpc, "UNSENT_HIGH", 4096)

    async def scenario() -> int:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.setblocking(False)
        conn = rpc.ServerConnection(b, 1 << 20, lambda _c, data: b"r" * 1000, lambda _c: None)
        a.sendall(rpc.frame(b"q") * 40)  # 40 replies of ~1 KB: ten bursts' worth
        reader, replies = rpc.FrameReader(), 0
        for _ in range(300):
            await asyncio.sleep(0.01)
            try:
                replies += len(reader.feed(a.recv(1 << 20)))
            except BlockingIOError:
                pass
            if replies == 40:
                break
        conn.close(force=True)
        a.close()
        return replies

    assert asyncio.run(scenario()) == 40


def test_a_handler_that_raises_loses_its_own_reply_only():
    """Replies wait in a burst until the burst ends: a request whose handler raises must not take
    the replies before it down with it."""

    async def scenario() -> list[bytes]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.setblocking(False)
        asyncio.get_running_loop().set_exception_handler(lambda _loop, _ctx: None)  # the raise, logged elsewhere

        def on_frame(_c: rpc.ServerConnection, data: bytes | Exception) -> bytes:
            if data == b"boom":
                raise RuntimeError("a handler fault")
            return b"re:" + data if isinstance(data, bytes) else b""

        conn = rpc.ServerConnection(b, 1 << 20, on_frame, lambda _c: None)
        a.sendall(rpc.frame(b"one") + rpc.frame(b"two") + rpc.frame(b"boom"))
        reader, replies = rpc.FrameReader(), []
        for _ in range(100):
            await asyncio.sleep(0.01)
            try:
                replies += reader.feed(a.recv(1 << 16))
            except BlockingIOError:
                pass
            if len(replies) >= 2:
                break
        conn.close(force=True)
        a.close()
        return [bytes(r) for r in replies]

    assert asyncio.run(scenario()) == [b"re:one", b"re:two"]


def test_a_registration_whose_doorbell_cannot_be_made_leaves_nothing_registered(tmp_path):
    """The daemon out of fds as it makes a rank's doorbell: the engine hears why, and nothing
    stays registered, so its retry registers (not "already registered" for good)."""
    daemon = DaemonProcess(tmp_path, "daemon")
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    pid = daemon.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    failures: list[str] = []
    try:
        for spare in range(12):  # fds left to the daemon as the registration arrives
            with EngineClient(daemon.socket, "e", 0, 1, timeout=15.0) as c:
                resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + spare, hard))
                try:
                    c.register(geo, shm_fds=[fd], doorbell=True, records=True)
                    c.unregister()
                    continue
                except (DaemonError, OSError) as exc:
                    failures.append(str(exc))
                finally:
                    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            with EngineClient(daemon.socket, "e", 0, 1, timeout=15.0) as c:  # the engine's retry
                c.register(geo, shm_fds=[fd], doorbell=True, records=True)
                c.unregister()
        assert any("doorbell could not be made" in f for f in failures), failures
        assert daemon.proc.poll() is None
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        daemon.stop()
        os.close(fd)
        mm.close()
