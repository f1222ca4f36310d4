"""Two network namespaces joined by an impaired link, for network-fault tests.

    netns <lab>-p                                        netns <lab>-d
    prefill daemon                                       decode daemon
    10.<n>.0.1 (and .3 once it moves)                    10.<n>.0.2
        |                                                    |
      tun kvxp ==== forwarder process (root netns) ==== tun kvxd
                    per IP packet: drop (loss, partition), or
                    deliver after delay +- jitter (reordering allowed)

The forwarder is a userspace netem: the kernels on both sides see real IP packets delayed,
reordered and lost, and their TCP stacks retransmit for real. It is used because `tc netem`
needs the `sch_netem` kernel module, which the machines this suite runs on do not have
(`tc qdisc add ... netem` fails "Specified qdisc kind is unknown").

Only addresses inside the namespaces this module creates are touched; `Netlab.close`
deletes them (and with them the TUN devices).
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import multiprocessing as mp
import os
import random
import selectors
import shutil
import struct
import subprocess
import time
from multiprocessing.sharedctypes import Synchronized

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 9000  # fewer packets per byte: the forwarder is Python


def unavailable() -> str | None:
    """Why network namespaces with TUN links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    probe = f"kvxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _setns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def _open_tun(netns: str, ifname: str) -> int:
    _setns(netns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Impairment:
    """What the link does to packets now (shared with the forwarder process)."""

    def __init__(self, ctx: mp.context.SpawnContext) -> None:
        self.delay_ms: Synchronized[float] = ctx.Value("d", 0.0)
        self.jitter_ms: Synchronized[float] = ctx.Value("d", 0.0)
        self.loss: Synchronized[float] = ctx.Value("d", 0.0)
        self.partitioned: Synchronized[bool] = ctx.Value("b", False)
        self.forwarded: Synchronized[int] = ctx.Value("q", 0)
        self.dropped: Synchronized[int] = ctx.Value("q", 0)


def _forward(ns_p: str, ns_d: str, imp: Impairment, ready: mp.synchronize.Event, seed: int) -> None:
    fds = [_open_tun(ns_p, "kvxp"), _open_tun(ns_d, "kvxd")]
    ready.set()
    rng = random.Random(seed)
    sel = selectors.DefaultSelector()
    for i, fd in enumerate(fds):
        sel.register(fd, selectors.EVENT_READ, i)
    due: list[tuple[float, int, int, bytes]] = []  # (deliver at, order, destination fd, packet)
    order = forwarded = dropped = 0
    while True:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else 0.2
        for key, _ in sel.select(timeout):
            src = key.data
            for _ in range(64):  # drain what is queued, bounded so both directions progress
                try:
                    pkt = os.read(fds[src], 65536)
                except BlockingIOError:
                    break
                if imp.partitioned.value or rng.random() < imp.loss.value:
                    dropped += 1
                    continue
                delay = imp.delay_ms.value + rng.uniform(-1, 1) * imp.jitter_ms.value
                order += 1
                heapq.heappush(due, (time.monotonic() + max(0.0, delay) / 1000, order, fds[1 - src], pkt))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(due)
            try:
                os.write(dst, pkt)
                forwarded += 1
            except OSError:  # the receiving device's queue is full, or it is down: a real link drops too
                dropped += 1
        imp.forwarded.value, imp.dropped.value = forwarded, dropped


class Netlab:
    """The two namespaces, their addresses and the link between them."""

    def __init__(self, seed: int = 7) -> None:
        n = os.getpid() % 200 + 20
        self.name = f"kvx{os.getpid()}"
        self.ns_p, self.ns_d = f"{self.name}-p", f"{self.name}-d"
        self.subnet = f"10.{n}.0"
        self.prefill_ip, self.decode_ip = f"{self.subnet}.1", f"{self.subnet}.2"
        ctx = mp.get_context("spawn")
        self.impairment = Impairment(ctx)
        self._forwarder: mp.process.BaseProcess | None = None
        try:
            for ns in (self.ns_p, self.ns_d):
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            ready = ctx.Event()
            self._forwarder = ctx.Process(target=_forward, args=(self.ns_p, self.ns_d, self.impairment, ready, seed),
                                          daemon=True)
            self._forwarder.start()
            if not ready.wait(30):
                raise RuntimeError("the link forwarder did not open its TUN devices")
            for ns, dev, ip in ((self.ns_p, "kvxp", self.prefill_ip), (self.ns_d, "kvxd", self.decode_ip)):
                self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def impair(self, delay_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0) -> None:
        """Each packet, each way: lost with probability `loss`, else delayed delay_ms +- jitter_ms."""
        self.impairment.delay_ms.value = delay_ms
        self.impairment.jitter_ms.value = jitter_ms
        self.impairment.loss.value = loss

    def partition(self, on: bool = True) -> None:
        self.impairment.partitioned.value = on

    def move_prefill(self, new_host: int) -> str:
        """The prefill host's address changes: the old one is gone, a new one answers."""
        new_ip = f"{self.subnet}.{new_host}"
        self._ip("-n", self.ns_p, "addr", "del", f"{self.prefill_ip}/24", "dev", "kvxp")
        self._ip("-n", self.ns_p, "addr", "add", f"{new_ip}/24", "dev", "kvxp")
        self.prefill_ip = new_ip
        return new_ip

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        if self._forwarder is not None and self._forwarder.is_alive():
            self._forwarder.kill()
            self._forwarder.join(5)
        for ns in (self.ns_p, self.ns_d):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
