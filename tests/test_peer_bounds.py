"""What a hostile peer daemon sends is bounded before it is kept, logged or relayed
(docs/security.md): a handshake refusal with a 16 MiB reason, answered to every read that names
the peer, fails each read with a short reason; the decode daemon's memory, its engine's
completions and `status` stay small."""

from __future__ import annotations

import threading

import msgspec
import zmq

from kvxferd import handshake as hs
from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.plan.models import PRESETS

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=2)
TOKENS = 40
HUGE = "x\n" * (8 << 20)  # 16 MiB, newlines in it (a forged log line each)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class HostilePeer:
    """A side channel that answers every request with a refusal carrying `reason` (or `reply`)."""

    def __init__(self, reason: str = "", reply: hs.HandshakeReply | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.reply = msgspec.msgpack.encode(reply or hs.HandshakeReply(False, reason))
        self.answered = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                parts = self.sock.recv_multipart()
                self.sock.send_multipart([*parts[:-1], self.reply])
                self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def test_a_peers_huge_refusal_is_cut_before_it_is_kept_or_relayed():
    peer = HostilePeer(HUGE)
    try:
        with Cluster(SHAPE, 1, 1) as c:
            c.transfer(0, TOKENS)
            daemon = c.daemons[1].proc.pid
            before = _rss_kib(daemon)
            blocks = c.prefill.prefill(1, TOKENS, 30.0)
            for seq in range(1, 5):
                ref = RemoteRef("hostile", "127.0.0.1", peer.port, 1, f"req-{seq}")
                out = c.decode.decode(seq, TOKENS, ref, blocks, 0, 5.0, c.p_shape)
                assert out["status"] == "failed" and "handshake" in out["reason"], out["reason"][:300]
                assert len(out["reason"]) < 4096 and "\n" not in out["reason"]
            assert peer.answered >= 4
            st = c.status(1)  # answers, and small
            assert all(len(f.reason) < 4096 for f in st.failures)
            assert _rss_kib(daemon) - before < 64 << 10, "the peer's reasons were kept"
            assert c.transfer(2, TOKENS)["status"] == "received"  # honest reads go on
    finally:
        peer.close()


def test_a_peers_bloated_geometry_is_refused_by_its_size_without_holding_the_loop():
    """A handshake answer whose geometry is 55 MiB (a real rank's is ~50 KiB) took 0.7 s to decode
    in one piece on the decode daemon's loop. Each rank's geometry is now bounded by its encoded
    size before it is decoded (and each is decoded in a loop turn of its own): the read fails,
    naming the size, without decoding it, and honest reads go on."""
    from kvxferd.plan.geometry import Region
    from kvxferd.plan.models import build

    geo = build(SHAPE, 1, 0)
    bloated = msgspec.structs.replace(geo, regions=tuple(Region(0, i, 1) for i in range(2_000_000)))
    peer = HostilePeer(reply=hs.HandshakeReply(True, agent="hostile", metadata=b"m",
                                               ranks=[hs.RankInfo(0, 1, "h", [4096], geometry=bloated)]))
    try:
        with Cluster(SHAPE, 1, 1) as c:
            blocks = c.prefill.prefill(1, TOKENS, 30.0)
            ref = RemoteRef("hostile", "127.0.0.1", peer.port, 1, "req-1")
            out = c.decode.decode(1, TOKENS, ref, blocks, 0, 10.0, c.p_shape)
            assert out["status"] == "failed" and "geometry is" in out["reason"] and "encoded, more than" in \
                out["reason"], out["reason"][:300]
            assert peer.answered >= 1
            assert c.transfer(2, TOKENS)["status"] == "received"
    finally:
        peer.close()
