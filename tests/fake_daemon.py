"""A daemon's registration reply, faked: what an engine keeps of the fds a reply brings."""

from __future__ import annotations

import os
import socket
import struct
import threading
from pathlib import Path

from kvxferd import protocol as P
from kvxferd import rpc
from kvxferd.client import EngineClient
from kvxferd.memory import create_shm
from kvxferd.plan.models import ModelShape, build


def _open_fds() -> set[tuple[int, str]]:
    """This process's open fds and what each is (the listing's own fd left out)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except FileNotFoundError:  # the listing's own directory, closed since
            pass
    return out


def register_with(tmp_path: Path, reply: P.Registered, fds: list[int]) -> tuple[
        bool, bool, tuple[list[P.Completion], bool]]:
    """Register with a fake daemon that answers `reply` with `fds`: (doorbell kept, its page (a
    counter or a ring) mapped, what a step's `pushed()` then finds). Asserts that no fd the reply
    brought is left open once the client is closed."""
    path = str(tmp_path / "fake.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        reader = rpc.FrameReader()
        answered = 0
        while answered < 2:
            for _ in reader.feed(conn.recv(1 << 16)):
                body = rpc.frame(P.encoder.encode(P.Welcome(P.PROTOCOL_VERSION, "fake") if answered == 0 else reply))
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if answered else []
                conn.sendmsg([body], anc)
                answered += 1
        conn.recv(1)  # until the client closes
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    geo = build(ModelShape(layers=1, kv_heads=1, head_dim=8, block_size=4, num_blocks=8), 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        before = _open_fds()
        with EngineClient(path, "e", 0, 1) as c:
            c.register(geo, [fd], doorbell=True, records=True)
            kept = c.doorbell is not None, c._counter is not None or c._ring is not None, c.pushed()
        thread.join(5)
        assert _open_fds() <= before  # nothing the reply brought is left open
        return kept
    finally:
        os.close(fd)
        mm.close()
        server.close()
