"""Where a P/D decode's first token waits: real vLLM prefill and decode (CPU build) through two
kvxferd daemons, rounds of 8 prompts at concurrency 1 and 8.

Per round it prints the decode TTFT, how long the decode daemon's reads took against NIXL's own
post and transfer time, how many lease claims those reads asked, and how long after vLLM answered
each prefill request its daemon held it (a read is confirmed only once the hold is there,
docs/reliability.md). docs/benchmarks.md has its results.

    KVXFERD_VLLM_PYTHON=~/.cache/kvxferd/vllm-venv/bin/python python bench/pd_hold_latency.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvxferd.client import Client
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.lab.vllm_servers import DEFAULT_VENV, VllmServer, make_model, stream

SUMS = ("kvxferd_transfer_duration_seconds_sum", "kvxferd_nixl_post_seconds_sum",
        "kvxferd_nixl_transfer_seconds_sum", "kvxferd_lease_claims_total")


def scrape(address: str) -> dict[str, float]:
    """The decode daemon's sums over label sets, for the names in SUMS."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    totals = dict.fromkeys(SUMS, 0.0)
    for line in body.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SUMS[:3] or (name == SUMS[3] and 'side="asked"' in line):
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class HoldWatch:
    """When each request first shows among the prefill daemon's holds (polled every 3 ms)."""

    def __init__(self, socket: str) -> None:
        self.socket, self.seen = socket, {}
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with Client(self.socket, 10) as c:
            while not self._stop.is_set():
                for h in c.status().held:
                    self.seen.setdefault(h.request, time.perf_counter() - self.t0)
                time.sleep(0.003)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 1, 8])
    args = ap.parse_args()
    wd = Path(tempfile.mkdtemp(prefix="kvxferd-holdlat-"))
    model = make_model(DEFAULT_VENV.parent / "models" / "tiny-llama-seed0", 0)
    pd, dd = DaemonProcess(wd, "p-daemon", metrics_port=0), DaemonProcess(wd, "d-daemon", metrics_port=0)
    prefill = VllmServer(wd, "prefill", model, "kv_producer", "kvxferd", pd.socket, cores="0")
    decode = VllmServer(wd, "decode", model, "kv_consumer", "kvxferd", dd.socket, cores="1")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(0)
        for conc in args.concurrency:
            watch, before = HoldWatch(pd.socket), scrape(dd.metrics_address)
            answered: dict[str, float] = {}

            def one(prompt: list[int], watch: HoldWatch = watch, answered: dict[str, float] = answered) -> float:
                kv = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
                answered[kv["remote_request_id"]] = time.perf_counter() - watch.t0
                return stream(decode.url, prompt, 16, kv_transfer_params=kv).ttft_s

            prompts = [[rng.randrange(3, 1000) for _ in range(args.tokens)] for _ in range(8)]
            with concurrent.futures.ThreadPoolExecutor(conc) as pool:
                ttfts = list(pool.map(one, prompts))
            held = watch.stop()
            d = {k: v - before[k] for k, v in scrape(dd.metrics_address).items()}
            delays = [held[r] - t for r, t in answered.items() if r in held]
            print(f"concurrency {conc}: decode TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms "
                  f"(max {max(ttfts) * 1e3:.0f}); reads {d[SUMS[0]] * 1e3:.0f} ms in all, NIXL post "
                  f"{d[SUMS[1]] * 1e3:.0f} ms + transfer {d[SUMS[2]] * 1e3:.0f} ms; claims asked {d[SUMS[3]]:.0f}; "
                  f"held after the answer: {', '.join(f'{x * 1e3:.0f}' for x in sorted(delays))} ms "
                  f"({len(answered) - len(delays)} never seen held)", flush=True)
    finally:
        for s in (prefill, decode):
            s.stop()
        for daemon in (pd, dd):
            daemon.stop()


if __name__ == "__main__":
    main()
