"""`kvxferd bench vllm`: real vLLM P/D through kvxferd side by side with vLLM's NixlConnector,
and the same vLLM alone with no connector.

The setups run the same tiny model on the same machine, its two cores split as if between two
nodes: each vLLM instance has every one of its processes (API server, engine core, worker) on
one core, and each daemon sits on its engine's core. Prefill node: core 0 (prefill vLLM and, for
kvxferd, its daemon). Decode node: core 1 (decode vLLM and its daemon). The plain instance is
a decode node alone: core 1, no connector, and its prompts already in its prefix cache (each
prompt is sent once, untimed, before the case), so its requests do what a P/D decode does:
a little compute for the first token (the prompt's last block: vLLM recomputes that much of
a fully cached prompt, where a P/D decode computes one token), then decode steps. Requests go
in waves of the concurrency (a wave's prefills, then its decodes together), so every setup's
decode batches are alike (and every setup gets the same prompts). Rounds alternate between the
setups so the machine's noise weighs on all alike; the setups not being measured are frozen
(SIGSTOP), so their idle pollers take no CPU from the one that is.

The plain instance has one core for everything, as the decode has: its ITL is higher than
with vLLM's processes spread over both cores (~10 against ~7 ms at concurrency 1 here), and so
is the P/D decode's; the ratio compares like with like.

Why whole instances are pinned: vLLM's worker busy-polls its step queue for a second after
each step, and its engine core spins on `sched_yield` waiting for the worker. With only the
workers' compute threads bound, a prefill's post-step spin on core 0 takes CPU from the
decode's API server and engine core wherever they run, which a plain instance alone never
pays: that, not the connector, was most of a P/D decode's inter-token latency over plain.

Per prompt length and concurrency:

    TTFT         prefill request + decode request until its first token (what the router does;
                 the wait for the wave's other prefills is not counted)
    decode TTFT  the decode request alone: KV ready (handshake, pull) + one decode step
    ITL          inter-token latency of the decode: every gap between two streamed tokens
                 (counted by token ids), pooled over the case's requests (p50, p99, mean)
    requests/s   requests finished / wall time
    idle CPU     each instance's and daemon's CPU over an idle window, % of one core

the ratio kvxferd / NixlConnector for each, and each P/D decode's ITL over the plain
instance's (what a connector costs a decode step). And, from the kvxferd decode's own /metrics
(`vllm:kvxferd_step_seconds`): what the connector cost each step that scheduled tokens while
transfers were pending, measured inside vLLM. Waves leave few such steps (a wave's reads end
before its decodes start), so after the rounds the kvxferd setup also serves requests that
arrive 40 ms apart, each read landing while the ones before it decode (`staggered`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .synthetic.demo import DaemonProcess
from .vllm_servers import DEFAULT_VENV, LaunchError, VllmServer, free_port, get_text, make_model, stream

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


@dataclass
class Setup:
    """One P/D pair (and its daemons, for kvxferd), or one plain instance (no prefill)."""

    name: str
    prefill: VllmServer | None
    decode: VllmServer
    daemons: list[DaemonProcess] = field(default_factory=list)

    def processes(self) -> dict[str, list[int]]:
        procs = {"decode vLLM": descendants(self.decode.proc.pid)}
        if self.prefill is not None:
            procs["prefill vLLM"] = descendants(self.prefill.proc.pid)
        for d in self.daemons:
            procs[d.name] = [d.proc.pid]
        return procs

    def signal(self, sig: int) -> None:
        for pids in self.processes().values():
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """% of one core each part uses while no request is in flight."""
        procs = self.processes()
        before = {k: cpu_seconds(v) for k, v in procs.items()}
        time.sleep(seconds)
        return {k: 100.0 * (cpu_seconds(v) - before[k]) / seconds for k, v in procs.items()}


@dataclass
class Sample:
    ttft_s: float
    decode_ttft_s: float
    gaps_s: list[float]  # between the decode's successive tokens


def prefill(setup: Setup, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    """(seconds, kv_transfer_params) of a P/D prefill; the plain instance's prompts are cached."""
    if setup.prefill is None:
        return 0.0, {}
    t0 = time.perf_counter()
    p = setup.prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    return time.perf_counter() - t0, {"kv_transfer_params": p["kv_transfer_params"]}


def run_case(setup: Setup, length: int, concurrency: int, requests: int, rng: random.Random,
             max_tokens: int) -> tuple[list[Sample], float]:
    """Requests in waves of `concurrency`: a wave's prefills together, then its decodes together,
    so each setup's decode batches hold the same requests, the plain instance's too (a sliding
    window would make a P/D decode's batches as ragged as its prefills' finishing times)."""
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(requests)]  # never a prefix hit
    if setup.prefill is None:  # computed once, untimed: its requests then decode, as a P/D decode does
        for prompt in prompts:
            setup.decode.complete(prompt, 1)
    samples: list[Sample] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(0, requests, concurrency):
            wave = prompts[i:i + concurrency]
            prefilled = list(pool.map(lambda p: prefill(setup, p), wave))
            decoded = list(pool.map(lambda p, extra: stream(setup.decode.url, p, max_tokens, **extra[1]),
                                    wave, prefilled))
            samples += [Sample(pre_s + d.ttft_s, d.ttft_s, d.gaps_s) for (pre_s, _), d in zip(prefilled, decoded)]
    return samples, requests / (time.perf_counter() - t0)


STAGGERED = 16  # requests of the staggered phase (the step cost's samples)
STAGGER_S = 0.04  # between their arrivals: each read lands while the ones before decode


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Result:
    cases: dict[tuple[int, int], dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    idle: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    step: dict[str, Any] = field(default_factory=dict)  # the kvxferd decode's step cost, from its /metrics

    def add(self, setup: str, length: int, concurrency: int, samples: list[Sample], rps: float) -> None:
        c = self.cases.setdefault((length, concurrency), {}).setdefault(
            setup, {"ttft": [], "decode_ttft": [], "gaps": [], "rps": []})
        c["ttft"] += [s.ttft_s for s in samples]
        c["decode_ttft"] += [s.decode_ttft_s for s in samples]
        c["gaps"] += [g for s in samples for g in s.gaps_s]
        c["rps"].append(rps)

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for (length, conc), by in sorted(self.cases.items()):
            row: dict[str, Any] = {"prompt_tokens": length, "concurrency": conc}
            for name, c in by.items():
                row[name] = {"ttft_ms_p50": 1e3 * statistics.median(c["ttft"]),
                             "ttft_ms_p99": 1e3 * pct(c["ttft"], .99),
                             "decode_ttft_ms_p50": 1e3 * statistics.median(c["decode_ttft"]),
                             "itl_ms_p50": 1e3 * statistics.median(c["gaps"]),
                             "itl_ms_p99": 1e3 * pct(c["gaps"], .99),
                             "itl_ms_mean": 1e3 * statistics.fmean(c["gaps"]),
                             "requests_per_s": statistics.median(c["rps"]), "samples": len(c["ttft"])}
            if "kvxferd" in by and "nixl" in by:
                k, n = row["kvxferd"], row["nixl"]
                row["ratio"] = {m: k[m] / n[m] for m in ("ttft_ms_p50", "ttft_ms_p99", "decode_ttft_ms_p50",
                                                         "itl_ms_p50", "requests_per_s")}
            if "plain" in by:
                row["itl_over_plain"] = {name: row[name]["itl_ms_p50"] / row["plain"]["itl_ms_p50"]
                                         for name in by if name != "plain"}
                row["itl_p99_over_plain"] = {name: row[name]["itl_ms_p99"] / row["plain"]["itl_ms_p99"]
                                             for name in by if name != "plain"}
                row["itl_mean_over_plain"] = {name: row[name]["itl_ms_mean"] / row["plain"]["itl_ms_mean"]
                                              for name in by if name != "plain"}
            rows.append(row)
        return rows

    def idle_table(self) -> dict[str, dict[str, float]]:
        return {setup: {part: statistics.median(v) for part, v in parts.items()} for setup, parts in self.idle.items()}


def start_setups(wd: Path, model: Path, stack: ExitStack) -> dict[str, Setup]:
    if shutil.which("taskset") is None:
        raise LaunchError("kvxferd bench vllm pins each instance and daemon to a core with `taskset` "
                          "(util-linux), which is not on PATH")
    p_daemon = DaemonProcess(wd, "kvxferd-prefill-daemon", prefix=["taskset", "-c", "0"])
    d_daemon = DaemonProcess(wd, "kvxferd-decode-daemon", prefix=["taskset", "-c", "1"])
    for d in (p_daemon, d_daemon):
        stack.callback(d.stop)

    def nixl_env() -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}

    setups = {
        "kvxferd": Setup("kvxferd",
                         VllmServer(wd, "kvxferd-prefill", model, "kv_producer", "kvxferd", p_daemon.socket, cores="0",
                                    pin=True),
                         VllmServer(wd, "kvxferd-decode", model, "kv_consumer", "kvxferd", d_daemon.socket, cores="1",
                                    pin=True),
                         [p_daemon, d_daemon]),
        "nixl": Setup("nixl",
                      VllmServer(wd, "nixl-prefill", model, "kv_producer", "nixl", cores="0", env=nixl_env(), pin=True),
                      VllmServer(wd, "nixl-decode", model, "kv_consumer", "nixl", cores="1", env=nixl_env(), pin=True)),
        "plain": Setup("plain", None, VllmServer(wd, "plain", model, cores="1", pin=True)),
    }
    servers = [s for setup in setups.values() for s in (setup.prefill, setup.decode) if s is not None]
    for s in servers:
        stack.callback(s.stop)
    for s in servers:
        s.wait_ready()
    return setups


def histogram_quantile(text: str, name: str, q: float) -> tuple[float, float, float, int]:
    """Quantile `q` of a Prometheus histogram (its label sets summed), as Prometheus estimates it
    (linearly within the bucket that holds it): (estimate, the bucket's lower and upper bounds,
    the count of observations); all 0 when it has none."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line[line.index('le="') + 4:].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return 0.0, 0.0, 0.0, 0
    lower, below = 0.0, 0.0
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            if bound == float("inf"):
                return lower, lower, bound, int(total)
            inside = buckets[bound] - below
            return lower + (bound - lower) * (q * total - below) / inside, lower, bound, int(total)
        lower, below = bound, buckets[bound]
    raise AssertionError("unreachable: the +Inf bucket holds every observation")


def staggered(setup: Setup, length: int, requests: int, gap_s: float, max_tokens: int,
              rng: random.Random) -> None:
    """Requests that arrive `gap_s` apart instead of in waves: each one's KV is pulled while the
    ones before it decode, so the decode runs steps that schedule tokens with a read pending
    (what `vllm:kvxferd_step_seconds` times; waves have few such steps)."""
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(requests)]

    def one(prompt: list[int]) -> None:
        _, extra = prefill(setup, prompt)
        stream(setup.decode.url, prompt, max_tokens, **extra)

    with ThreadPoolExecutor(requests) as pool:
        pending = []
        for prompt in prompts:
            pending.append(pool.submit(one, prompt))
            time.sleep(gap_s)
        for f in pending:
            f.result()


def run(rounds: int, lengths: list[int], concurrencies: list[int], requests: int, max_tokens: int,
        idle_s: float, workdir: Path, say: Callable[[str], None]) -> Result:
    model = make_model(DEFAULT_VENV.parent / "models" / "tiny-llama-seed0", 0)
    result = Result()
    rng = random.Random(0)
    with ExitStack() as stack:
        say("starting 4 vLLM instances and 2 daemons (a few minutes on 2 cores)")
        setups = start_setups(workdir, model, stack)

        def resume_all() -> None:  # stoppable again
            for s in setups.values():
                s.signal(signal.SIGCONT)

        stack.callback(resume_all)
        for s in setups.values():  # connect once, outside the measurement
            s.signal(signal.SIGCONT)
            run_case(s, 64, 1, 2, rng, 4)
            s.signal(signal.SIGSTOP)
        for r in range(rounds):
            order = ["kvxferd", "nixl", "plain"] if r % 2 == 0 else ["plain", "nixl", "kvxferd"]
            for name in order:
                setup = setups[name]
                setup.signal(signal.SIGCONT)
                try:
                    for length in lengths:
                        for conc in concurrencies:
                            # the same prompts for every setup in a round (none seen before by any)
                            prompts = random.Random(f"{r}/{length}/{conc}")
                            samples, rps = run_case(setup, length, conc, max(requests, conc), prompts, max_tokens)
                            result.add(name, length, conc, samples, rps)
                            say(f"round {r + 1}/{rounds} {name:8s} {length:5d} tokens x{conc}: TTFT p50 "
                                f"{1e3 * statistics.median(s.ttft_s for s in samples):7.1f} ms, {rps:5.2f} req/s")
                    time.sleep(1.0)  # let the last completions settle before the idle window
                    for part, cpu in setup.idle_cpu(idle_s).items():
                        result.idle.setdefault(name, {}).setdefault(part, []).append(cpu)
                finally:
                    setup.signal(signal.SIGSTOP)
        kvxferd = setups["kvxferd"]
        kvxferd.signal(signal.SIGCONT)
        say(f"kvxferd: {STAGGERED} requests of {lengths[0]} tokens arriving {1e3 * STAGGER_S:g} ms apart")
        staggered(kvxferd, lengths[0], STAGGERED, STAGGER_S, max_tokens, rng)
        text = get_text(kvxferd.decode.url + "/metrics")
        for q in (0.5, 0.99):
            estimate, lower, upper, count = histogram_quantile(text, "vllm:kvxferd_step_seconds", q)
            key = f"p{round(q * 100)}"
            result.step[f"{key}_us"] = estimate * 1e6
            result.step[f"{key}_bucket_us"] = [lower * 1e6, upper * 1e6]
            result.step["steps"] = count
    return result


def render(out: dict[str, Any]) -> str:
    lines = ["prompt  conc | TTFT p50 ms        | TTFT p99 ms        | decode TTFT p50 ms | requests/s        "
             "| decode ITL p50 ms   | ITL over plain: p50   p99    mean",
             "             | kvxferd  nixl ratio| kvxferd  nixl ratio| kvxferd  nixl ratio| kvxferd nixl ratio"
             "| kvxferd  nixl plain | kvxferd        nixl | kvxferd nixl | kvxferd nixl"]
    for row in out["cases"]:
        k, n, r, p = row["kvxferd"], row["nixl"], row["ratio"], row["plain"]
        cells = [f"{k[m]:7.1f} {n[m]:6.1f} {r[m]:4.2f}" for m in ("ttft_ms_p50", "ttft_ms_p99", "decode_ttft_ms_p50")]
        cells.append(f"{k['requests_per_s']:6.2f} {n['requests_per_s']:5.2f} {r['requests_per_s']:4.2f}")
        cells.append(f"{k['itl_ms_p50']:7.2f} {n['itl_ms_p50']:5.2f} {p['itl_ms_p50']:5.2f} | "
                     + " | ".join(f"{row[key]['kvxferd']:7.3f} {row[key]['nixl']:5.3f}"
                                  for key in ("itl_over_plain", "itl_p99_over_plain", "itl_mean_over_plain")))
        lines.append(f"{row['prompt_tokens']:6d} {row['concurrency']:4d} | " + "| ".join(cells))
    step = out.get("step_cost", {})
    if step.get("steps"):
        lines.append("")
        lines.append(f"kvxferd's cost per decode step with transfers pending, inside vLLM ({step['steps']} steps): "
                     + ", ".join(f"{q} ~{step[q + '_us']:.1f} us (in ({step[q + '_bucket_us'][0]:g}, "
                                 f"{step[q + '_bucket_us'][1]:g}])" for q in ("p50", "p99"))
                     + ", estimated within the histogram's bucket as Prometheus does")
    lines.append("")
    lines.append("idle CPU, % of one core:")
    for setup, parts in out["idle_cpu_percent"].items():
        lines.append(f"  {setup:8s} " + ", ".join(f"{part} {cpu:.1f}%" for part, cpu in parts.items()))
    return "\n".join(lines)
