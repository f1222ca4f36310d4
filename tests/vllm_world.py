"""Shared pieces of the real-vLLM tests: tiny models, daemons, servers started side by side."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kvxferd import protocol as P
from kvxferd.client import Client
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.vllm_servers import VllmServer, make_model

MODELS = Path(os.environ.get("KVXFERD_TEST_MODELS", Path.home() / ".cache" / "kvxferd" / "models"))


def model(seed: int) -> Path:
    return make_model(MODELS / f"tiny-llama-seed{seed}", seed)


def start(*servers: VllmServer) -> None:
    """Servers start in parallel (they were spawned by their constructors); wait for all."""
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        for s in servers:
            s.stop()
        raise


class World:
    """The processes a real-vLLM test world runs: each one `own`ed is stopped by `close()`,
    newest first, also when `start` fails part-way (nothing is left running for the suite)."""

    def __init__(self, workdir) -> None:
        self.workdir = workdir
        self.running: list = []
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        raise NotImplementedError

    def own(self, process):
        self.running.append(process)
        return process

    def close(self) -> None:
        while self.running:
            self.running.pop().stop()


def daemon_status(d: DaemonProcess) -> P.Status:
    with contextlib.closing(Client(d.socket, 10)) as c:
        return c.status()


MAX_STOPS_S = 300.0  # VM stops `wait_until` does not count, in all


def daemon_warnings(d: DaemonProcess, lines: int = 12) -> list[str]:
    """The last warnings in a daemon's log (its stall watch's among them): what a failure needs."""
    with open(d.log.name, errors="replace") as f:
        return [line.rstrip() for line in f if " WARNING " in line or " ERROR " in line][-lines:]


def wait_until(what: str, check, timeout: float, interval: float = 0.5):
    """`check()` once it is true; AssertionError after `timeout` seconds. A sleep that overran
    by over a second is not counted (up to MAX_STOPS_S in all): this VM has stopped every
    process at once for 24-110 s, the daemons and engines waited on included."""
    deadline = time.monotonic() + timeout
    last, excused = None, 0.0
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        slept = time.monotonic()
        time.sleep(interval)
        overran = time.monotonic() - slept - interval
        if overran > 1.0 and excused < MAX_STOPS_S:
            excused += overran
            deadline += overran
    raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})")


def text(response: dict) -> str:
    return response["choices"][0]["text"]
