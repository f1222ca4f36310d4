"""`kvxferd demo`: two daemons and two synthetic engines on this machine, every byte verified.

    driver --pipe--> prefill engine (TP ranks) --unix socket--> daemon P
           --pipe--> decode engine  (TP ranks) --unix socket--> daemon D --ZMQ/NIXL--> daemon P
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from ... import protocol as P
from ...client import RemoteRef, new_read_token
from ...plan.models import ModelShape


class DemoError(RuntimeError):
    pass


def _engine_main(conn: Connection[tuple[str, Any], tuple[str, tuple[Any, ...]]], socket_path: str, engine_id: str,
                 shape: bytes, tp: int, device: str) -> None:
    from .engine import SyntheticEngine

    try:
        eng = SyntheticEngine(socket_path, engine_id, msgspec.msgpack.decode(shape, type=ModelShape), tp, device)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", eng.side_channel))
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "decode":
                args = (*args[:6], msgspec.msgpack.decode(args[6], type=ModelShape), *args[7:])
            elif cmd == "finish_read":
                args = (*args[:2], msgspec.msgpack.decode(args[2], type=ModelShape), *args[3:])
            result = getattr(eng, cmd)(*args)
            if cmd == "verify_all":
                result = [str(m) for m in result]
            conn.send(("ok", result))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        if cmd == "close":
            return


class EngineProcess:
    """A synthetic engine in its own process, driven over a pipe."""

    def __init__(self, socket_path: str, engine_id: str, shape: ModelShape, tp: int, device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child, socket_path, engine_id,
                                                           msgspec.msgpack.encode(shape), tp, device), daemon=True)
        self.proc.start()
        self.engine_id = engine_id
        self.side_channel = self._result(120)

    def _result(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise DemoError(f"engine {self.engine_id} did not answer within {timeout:g} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise DemoError(f"engine {self.engine_id}: {value}")
        return value

    def _call(self, cmd: str, *args: Any, timeout: float = 120) -> Any:
        self.conn.send((cmd, args))
        return self._result(timeout)

    # The engine's methods (kvxferd.lab.synthetic.engine.SyntheticEngine), run in its process.
    def prefill(self, seq: int, num_tokens: int, lease_s: float, digest: bool | None = None,
                read_token: str = "", hold: bool = True) -> tuple[tuple[int, ...], ...]:
        return tuple(self._call("prefill", seq, num_tokens, lease_s, digest, read_token, hold))

    def hold(self, seq: int, blocks: Sequence[Sequence[int]], lease_s: float, digest: bool | None = None,
             read_token: str = "") -> None:
        self._call("hold", seq, blocks, lease_s, digest, read_token)

    def wait_released(self, seq: int, timeout_s: float) -> list[str]:
        return list(self._call("wait_released", seq, timeout_s, timeout=timeout_s + 60))

    def free(self, blocks: Sequence[Sequence[int]]) -> None:
        self._call("free", blocks)

    def reuse(self, blocks: Sequence[Sequence[int]], seq: int) -> None:
        self._call("reuse", blocks, seq)

    def decode(self, seq: int, num_tokens: int, remote: RemoteRef, remote_blocks: Sequence[Sequence[int]],
               hit_tokens: int, deadline_s: float, remote_shape: ModelShape, audit: bool | None = None,
               ) -> dict[str, Any]:
        """Read a prompt and verify every byte that arrived; the outcome as a dict."""
        shape = msgspec.msgpack.encode(remote_shape)
        return dict(self._call("decode", seq, num_tokens, remote, remote_blocks, hit_tokens, deadline_s, shape, audit,
                               timeout=deadline_s + 60))

    def finish_read(self, seq: int, timeout_s: float, remote_shape: ModelShape, remote_tp: int) -> dict[str, Any]:
        """A posted read's outcome (`post_read`), its bytes verified as `decode` does."""
        shape = msgspec.msgpack.encode(remote_shape)
        return dict(self._call("finish_read", seq, timeout_s, shape, remote_tp, timeout=timeout_s + 60))

    def expect(self, seq: int, remote: RemoteRef) -> None:
        self._call("expect", seq, remote)

    def post_read(self, seq: int, num_tokens: int, remote: RemoteRef, remote_blocks: Sequence[Sequence[int]],
                  hit_tokens: int, deadline_s: float, audit: bool | None = None) -> list[list[int]]:
        return list(self._call("post_read", seq, num_tokens, remote, remote_blocks, hit_tokens, deadline_s, audit))

    def wait_read(self, seq: int, timeout_s: float) -> list[tuple[str, list[list[int]], str, int]]:
        return list(self._call("wait_read", seq, timeout_s, timeout=timeout_s + 60))

    def drop(self, seq: int) -> tuple[tuple[int, ...], ...]:
        return tuple(self._call("drop", seq))

    def tokens(self) -> list[str]:
        return list(self._call("tokens"))

    def pending(self) -> list[int]:
        return list(self._call("pending"))

    def verify_all(self) -> list[str]:
        return list(self._call("verify_all"))

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._call("close", timeout=10)
            except (DemoError, OSError, EOFError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def thread_states(pid: int) -> str:
    """Each thread's state and kernel wait channel, from /proc (for a process that will not exit)."""
    states = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda p: int(p.name)):
        try:
            state = next(line for line in (task / "status").read_text().splitlines() if line.startswith("State:"))
            states.append(f"{task.name} {state.split(None, 1)[1]} {(task / 'wchan').read_text()}")
        except (OSError, StopIteration):
            continue
    return "; ".join(states) or "none readable"


def stop_process(proc: subprocess.Popen[bytes], log: IO[str]) -> None:
    """SIGTERM, then SIGKILL after 10 s; close its log."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


class DaemonProcess:
    """`kvxferd serve` in its own process."""

    def __init__(self, workdir: Path, name: str, metrics_port: int = -1, extra: Sequence[str] = (),
                 side_channel_port: int = 0, socket: str | None = None, prefix: Sequence[str] = ()) -> None:
        """`prefix` runs the daemon through another command (`ip netns exec NS`), which must exec it."""
        self.socket = socket or str(workdir / f"{name}.sock")
        self.log = open(workdir / f"{name}.log", "a")  # noqa: SIM115  (the daemon's stdout; closed in stop())
        cmd = [*prefix, sys.executable, "-m", "kvxferd", "serve", "--socket", self.socket,
               "--side-channel-port", str(side_channel_port),
               "--metrics-port", str(metrics_port), "--name", name, *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.name = name
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        from ...client import Client, DaemonError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DemoError(f"daemon {self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                Client(self.socket, 5).close()
                return
            except DaemonError:  # it answered (and refused us): it is up
                return
            except (ConnectionError, OSError):
                time.sleep(0.05)
        raise DemoError(f"daemon {self.name} not ready within {timeout:g} s; see {self.log.name}")

    @property
    def metrics_address(self) -> str:
        """host:port its metrics server bound (ask for port 0 and read it here: a port picked
        beforehand may be taken by another process before the daemon binds it)."""
        from ...client import Client

        with Client(self.socket, 10) as c:
            address = c.status().metrics
        if address is None:
            raise DemoError(f"daemon {self.name} serves no metrics")
        return address

    def metric(self, sample: str) -> float:
        """One sample of its Prometheus exposition, named as written there (`name{label="v"}`);
        0 when absent (a labelled counter appears once counted)."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            for row in r.read().decode().splitlines():
                if row.startswith(sample + " "):
                    return float(row.rsplit(" ", 1)[1])
        return 0.0

    def kill(self) -> None:
        """SIGKILL: no goodbye to peers or engines. The process is gone once every thread has left
        the kernel. A CI run once saw that take over 10 s (cause not established), so this waits
        60 s, writes where the threads were at 10 s into the daemon's log, and says so if it fails."""
        self.proc.kill()
        try:
            self.proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            states = thread_states(self.proc.pid)
            self.log.write(f"[test harness] still running 10 s after SIGKILL; threads: {states}\n")
            self.log.flush()
        try:
            self.proc.wait(50)
        except subprocess.TimeoutExpired:
            raise DemoError(f"daemon {self.name} (pid {self.proc.pid}) still running 60 s after SIGKILL; "
                            f"its threads: {thread_states(self.proc.pid)}") from None

    def stop(self) -> None:
        stop_process(self.proc, self.log)


@dataclass
class DemoResult:
    requests: int
    received: int
    failed: int
    bytes: int
    seconds: float
    latencies: list[float]
    prefix_hits: int
    released: dict[str, int]  # prefill release status -> requests
    sizes: list[int] = field(default_factory=list)  # bytes of each received request
    split_reads: int = 0  # decode ranks' reads split across posting lanes

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies or [0.0]) * 1000
        warm_s, warm_b = sum(self.latencies[1:]), sum(self.sizes[1:])  # the first one pays the handshake
        return {"requests": self.requests, "received": self.received, "failed": self.failed,
                "prefix_hits": self.prefix_hits, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "first_request_ms": round(float(lat[0]), 3),
                "throughput_gb_s": round(warm_b / warm_s / 1e9, 3) if warm_s else 0.0,
                "p50_ms": round(float(np.percentile(lat, 50)), 3), "p99_ms": round(float(np.percentile(lat, 99)), 3),
                "prefill_released": self.released}


class Cluster:
    """Two daemons and two synthetic engines (prefill, decode), each in its own process; with
    `same_node`, one daemon that both engines register with (`daemons[0] is daemons[1]`)."""

    def __init__(self, shape: ModelShape, p_tp: int, d_tp: int, p_shape: ModelShape | None = None,
                 workdir: str | None = None, metrics: bool = False, device: str = "cpu",
                 daemon_args: Sequence[str] = (), daemons: Sequence[DaemonProcess] = (),
                 same_node: bool = False) -> None:
        """`daemons`: a prefill and a decode daemon already started (the cluster stops them)."""
        self.shape, self.p_shape, self.p_tp, self.d_tp = shape, p_shape or shape, p_tp, d_tp
        self._read_tokens: dict[int, str] = {}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvxferd-")
            self.work = Path(self._tmp.name)
        else:
            self.work = Path(workdir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.daemons: list[DaemonProcess] = []
        self.engines: list[EngineProcess] = []
        port = 0 if metrics else -1
        try:
            if daemons:
                self.daemons = list(daemons)
            elif same_node:
                node = DaemonProcess(self.work, "node-daemon", port, daemon_args)
                self.daemons = [node, node]
            else:
                self.daemons = [DaemonProcess(self.work, "prefill-daemon", port, daemon_args),
                                DaemonProcess(self.work, "decode-daemon", port, daemon_args)]
            self.prefill = EngineProcess(self.daemons[0].socket, "prefill", self.p_shape, p_tp, device)
            self.engines.append(self.prefill)
            self.decode = EngineProcess(self.daemons[1].socket, "decode", shape, d_tp, device)
            self.engines.append(self.decode)
        except BaseException:
            self.close()
            raise
        host, port_s = self.prefill.side_channel.rsplit(":", 1)
        self.host, self.port = host, int(port_s)
        self.daemon_key = self.status(0).side_channel_key  # the prefill daemon's: what its reads dial

    def read_token(self, seq: int) -> str:
        """Prompt `seq`'s read token (made on first use): what its hold is given and its read presents."""
        token = self._read_tokens.get(seq)
        if token is None:
            token = self._read_tokens[seq] = new_read_token()
        return token

    def remote(self, seq: int) -> RemoteRef:
        return RemoteRef("prefill", self.host, self.port, self.p_tp, f"req-{seq}", self.read_token(seq),
                         self.daemon_key)

    def transfer(self, seq: int, num_tokens: int, hit_tokens: int = 0, lease_s: float = 30.0,
                 deadline_s: float = 30.0) -> dict[str, Any]:
        """Prefill a prompt, read it on the decode side (verified there), wait for its release."""
        blocks = self.prefill.prefill(seq, num_tokens, lease_s, read_token=self.read_token(seq))
        try:
            out = self.decode.decode(seq, num_tokens, self.remote(seq), blocks, hit_tokens, deadline_s, self.p_shape)
            out["released"] = self.prefill.wait_released(seq, lease_s + 5)
        finally:
            self.prefill.free(blocks)
        return out

    def status(self, which: int) -> P.Status:
        from ...client import Client

        with Client(self.daemons[which].socket) as c:
            return c.status()

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for d in dict.fromkeys(self.daemons):  # one daemon for both sides is stopped once
            d.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_demo(shape: ModelShape, p_tp: int, d_tp: int, requests: int, max_tokens: int, hit_ratio: float,
             seed: int, workdir: str | None = None, progress: Callable[[int], object] | None = None,
             p_shape: ModelShape | None = None,
             lease_s: float = 30.0, deadline_s: float = 30.0, same_node: bool = False) -> DemoResult:
    """Start everything, run `requests` prompts P -> D, verify every byte; raise DemoError on mismatch."""
    rng = np.random.default_rng(seed)
    result = DemoResult(requests, 0, 0, 0, 0.0, [], 0, {})
    with Cluster(shape, p_tp, d_tp, p_shape, workdir, same_node=same_node) as cluster:
        for i in range(requests):
            num_tokens = int(rng.integers(1, max_tokens + 1))
            hit = 0
            if shape.kind not in ("mamba2", "gdn") and rng.random() < hit_ratio and num_tokens > shape.block_size:
                hit = int(rng.integers(1, num_tokens // shape.block_size + 1)) * shape.block_size
                result.prefix_hits += 1
            out = cluster.transfer(i, num_tokens, hit, lease_s, deadline_s)
            if out["status"] == "received":
                result.received += 1
                result.bytes += out["bytes"]
                result.seconds += out["latency_s"]
                result.latencies.append(out["latency_s"])
                result.sizes.append(out["bytes"])
            else:
                result.failed += 1
            for status in out["released"]:
                result.released[status] = result.released.get(status, 0) + 1
            if progress:
                progress(1)
        stray = cluster.decode.verify_all()
        if stray:
            raise DemoError(f"bytes outside any request changed on the decode engine: {stray}")
        result.split_reads = cluster.status(1).counters.split_reads
    return result
