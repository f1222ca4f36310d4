"""Real vLLM servers, kvxferd daemons and the router as processes on this machine.

Used by `kvxferd demo --engine vllm`, `kvxferd bench vllm` and the real-engine tests. Imports
neither vLLM nor torch: vLLM runs in its own environment (`vllm_python()`), started as
`python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .synthetic.demo import stop_process

VLLM_PYTHON_ENV = "KVXFERD_VLLM_PYTHON"
DEFAULT_VENV = Path.home() / ".cache" / "kvxferd" / "vllm-venv"


class LaunchError(RuntimeError):
    pass


def vllm_python() -> str:
    """The interpreter of the environment vLLM is installed in (scripts/vllm-env.sh makes it)."""
    path = os.environ.get(VLLM_PYTHON_ENV) or str(DEFAULT_VENV / "bin" / "python")
    if not Path(path).exists():
        raise LaunchError(f"no vLLM environment at {path}: run scripts/vllm-env.sh "
                          f"or set {VLLM_PYTHON_ENV} to a python with vllm and kvxferd installed")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(directory: Path, seed: int, family: str = "dense") -> Path:
    """A tiny random-weight model of `family` (made once per directory, in vLLM's environment)."""
    subprocess.run([vllm_python(), "-m", "kvxferd.lab.tiny_models", str(directory), "--seed", str(seed),
                    "--family", family], check=True, capture_output=True)
    return directory


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise LaunchError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def complete(url: str, prompt: str | list[int], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    """A greedy completion from the tiny model (vLLM or the router at `url`)."""
    return post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0.0, "ignore_eos": True, **extra})


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


@dataclass
class VllmServer:
    """One vLLM OpenAI server. `connector`: None (plain), "kvxferd" or "nixl" (vLLM's own, the baseline)."""

    workdir: Path
    name: str
    model: Path
    role: str | None = None  # kv_producer / kv_consumer / kv_both
    connector: str | None = None
    socket: str = ""  # kvxferd daemon socket
    tp: int = 1
    dtype: str = "bfloat16"
    # VLLM_CPU_OMP_THREADS_BIND: "0", "1", "0|1" for TP 2; "nobind": one unpinned thread (the only
    # choice with worker_in_engine: vLLM binds threads only for workers it starts as processes)
    cores: str = "0"
    block_size: int = 32
    prefix_caching: bool = True
    args: list[str] = field(default_factory=list)  # more `vllm serve` flags
    extra_config: dict[str, Any] = field(default_factory=dict)
    failure_policy: str = "recompute"
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    # TP 1 only: the model worker runs inside the engine core's process (the `uni` executor), two
    # processes where vLLM's default is three, each importing torch and vLLM (~15 s of CPU here).
    # The connector's scheduler and worker halves then share a process.
    worker_in_engine: bool = False
    # every process of the server (API server, engine core, workers) on `cores`, not only the
    # workers' compute threads: a machine's cores split as if between nodes (benchmarks)
    pin: bool = False

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.log_path = self.workdir / f"{self.name}.log"
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", "4096", "--tensor-parallel-size", str(self.tp),
               "--block-size", str(self.block_size),
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching", "-O0",
               "--disable-uvicorn-access-log", *self.args]
        if self.pin:
            if not all(c.isdigit() for c in self.cores.split("|")):
                raise LaunchError(f"vLLM {self.name}: pinning needs core numbers (cores={self.cores!r})")
            if shutil.which("taskset") is None:
                raise LaunchError(f"vLLM {self.name}: pinning needs `taskset` (util-linux), not on PATH")
            cmd = ["taskset", "-c", self.cores.replace("|", ","), *cmd]
        if self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.transfer_config())]
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=self.cores, PYTHONUNBUFFERED="1", **self.env)
        if self.worker_in_engine:
            if self.tp != 1 or self.cores != "nobind":
                raise LaunchError(f"vLLM {self.name}: a worker inside the engine core serves TP 1 on one "
                                  f"unpinned thread only (tp={self.tp}, cores={self.cores!r})")
            cmd += ["--distributed-executor-backend", "uni"]
            # vLLM's CPU platform turns `uni` into `mp` unless this is off; the API server still
            # runs its engine core in a process of its own
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.cores == "nobind":
            env.setdefault("OMP_NUM_THREADS", "1")
        self.log = open(self.log_path, "a")  # noqa: SIM115  (the server's stdout for its lifetime; closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()

    def transfer_config(self) -> dict[str, Any]:
        if self.connector == "kvxferd":
            return {"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.vllm",
                    "kv_role": self.role, "kv_load_failure_policy": self.failure_policy,
                    "kv_connector_extra_config": {"socket": self.socket, **self.extra_config}}
        return {"kv_connector": "NixlConnector", "kv_role": self.role, "kv_buffer_device": "cpu",
                "kv_load_failure_policy": self.failure_policy, "kv_connector_extra_config": self.extra_config}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600.0) -> VllmServer:
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"vLLM {self.name} exited with {self.proc.returncode}; "
                                  f"last lines of {self.log_path}:\n{self.tail()}")
            try:
                get_text(self.url + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(1.0)
        raise LaunchError(f"vLLM {self.name} not ready within {timeout:g} s; see {self.log_path}")

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text if "Attempted to load weight" not in line)[-lines * 200:]

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        return complete(self.url, prompt, max_tokens, **extra)

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric over its label sets (vLLM's /metrics)."""
        total = 0.0
        for line in get_text(self.url + "/metrics").splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self.log.close()


@dataclass
class ProxyProcess:
    workdir: Path
    prefill: list[str]
    decode: list[str]
    port: int = 0

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.log = open(self.workdir / "proxy.log", "a")  # noqa: SIM115  (the proxy's stdout; closed in stop())
        cmd = [sys.executable, "-m", "kvxferd", "proxy", "--port", str(self.port)]
        for u in self.prefill:
            cmd += ["--prefill", u]
        for u in self.decode:
            cmd += ["--decode", u]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise LaunchError(f"proxy did not start; see {self.log.name}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        return complete(self.url, prompt, max_tokens, **extra)

    def stop(self) -> None:
        stop_process(self.proc, self.log)


@dataclass
class Timed:
    text: str
    ttft_s: float  # until the first generated text arrived
    total_s: float
    gaps_s: list[float] = field(default_factory=list)  # between successive tokens (see stream): inter-token latencies


def stream(url: str, prompt: str | list[int], max_tokens: int = 16, timeout: float = 300.0, **extra: Any) -> Timed:
    """A streamed completion, timed on the client: TTFT is what a user waits for the first token.

    Tokens are counted by their ids, not their text (a token may decode to no text yet, and the
    server merges tokens into one chunk when it falls behind): a chunk of k tokens after a
    delay d counts as k gaps of d / k. Tokens in the first chunk beyond the first have no gap."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, **extra}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (when, how many tokens)
    parts = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise LaunchError(f"{url}: {chunk['error']}")
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            piece = choice.get("text") or ""
            tokens = len(choice.get("token_ids") or []) or (1 if piece else 0)
            if tokens:
                arrivals.append((time.perf_counter(), tokens))
            parts.append(piece)
    first = arrivals[0][0] - t0 if arrivals else 0.0
    gaps = [(t - before) / n for (before, _), (t, n) in itertools.pairwise(arrivals) for _ in range(n)]
    return Timed("".join(parts), first, time.perf_counter() - t0, gaps)


def handoff(prefill: VllmServer, decode: VllmServer, prompt: str | list[int], max_tokens: int = 16,
            **extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's two steps done by hand: (prefill response, decode response)."""
    p = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, **extra)
    if not p.get("kv_transfer_params"):
        raise LaunchError(f"prefill {prefill.name} answered without kv_transfer_params: {p}")
    return p, decode.complete(prompt, max_tokens, kv_transfer_params=p["kv_transfer_params"], **extra)


def prompts(count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of an exact length (block boundaries are then known), distinct per seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(count)]
