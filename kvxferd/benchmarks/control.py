"""`kvxferd bench control`: requests/s and latency of the control path at 1, 16 and 256
concurrent reads of 16 blocks (TP 1 -> 1, small pages so that the data plane is not the limit).
Each level twice: the engine learning of completions by long polls (the baseline), then from
its doorbell's records (protocol 7).

Client latency: read call -> completion delivered to the engine. The ceiling, per level: raw
NIXL posting the same reads from a process of its own (control_raw.py). Daemon latency, measured
inside the decode daemon: read RPC received -> READs posted, and -> completion queued. The
prefill engine holds each request before it is read (untimed), as a prefill does.

`run_leases`: what fail-closed reads cost (leases.py), one read in flight: today's read with
confirmation off, against confirmation on for a read the engine did not announce (its claim
goes out with the READ) and for one it announced (`expect`, as vLLM's connector does).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Iterable

from .. import protocol as P
from ..client import AsyncEngineClient, Completion, EngineClient, RemoteRef, new_read_token
from ..plan.geometry import Geometry
from ..plan.models import ModelShape, build
from . import control_raw
from .harness import BenchEngine, cpu_seconds, daemons, environment, median, pct

SHAPE = ModelShape(layers=2, kv_heads=1, head_dim=64, block_size=16, num_blocks=8192)
BLOCKS = 16


async def _drive(socket: str, token: str, geo: Geometry, remote_host: str, remote_port: int, concurrency: int,
                 requests: int, batch: int = 1, prefill: tuple[str, str] = ("", ""),
                 announce: bool = False, pause_s: float = 0.0,
                 bell: EngineClient | None = None) -> tuple[float, list[float]]:
    """`requests` reads, `concurrency` in flight; one connection posts, another streams completions
    (long polls), or with `bell` (the registering client) they come in the decode engine's doorbell
    (its records: in the pipe, or its ring).

    `batch` > 1: reads go `batch` to a frame (protocol 2), posted whenever that many slots are free.
    `prefill`: the prefill engine's socket and token; it holds each request first (untimed).
    `announce`: the decode engine expects each request before reading it (untimed).
    `pause_s`: between the hold (and expect) and the read, as a request waits to be scheduled.
    """
    poster = await AsyncEngineClient.connect(socket, "d", 0, 1)
    poller = await AsyncEngineClient.connect(socket, "d", 0, 1)
    holder = await AsyncEngineClient.connect(prefill[0], "p", 0, 1)
    await poster.attach(token)  # the rank was registered on another connection (BenchEngine's)
    await poller.attach(token)
    await holder.attach(prefill[1])
    waiting: dict[str, asyncio.Future[Completion]] = {}
    latencies: list[float] = []

    def deliver(completions: list[Completion]) -> None:
        for c in completions:
            fut = waiting.pop(c.request_id, None)
            if fut is not None:
                fut.set_result(c)

    async def pump() -> None:
        while True:
            deliver(await poller.poll(wait_s=1.0))

    async def pump_doorbell(client: EngineClient) -> None:
        """Records as the pipe becomes readable; a poll only when it asks for one."""
        assert client.doorbell is not None
        fd, readable = os.dup(client.doorbell), asyncio.Event()  # the loop's own: the client may close its fd
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, readable.set)
        try:
            while client.doorbell is not None:  # None: the daemon closed its end: long polls from now on
                await readable.wait()
                readable.clear()
                items, poll = client.pushed(force=True)  # force: empty the pipe, whose bytes woke the loop
                deliver(items)
                if poll:
                    deliver(await poller.poll(0.0))
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        await pump()

    async def one(i: int, slot: int) -> None:
        rid = f"c{concurrency}-{i}"
        blocks = [list(range(slot * BLOCKS, (slot + 1) * BLOCKS))]
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        waiting[rid] = fut
        token = new_read_token()
        remote = RemoteRef("p", remote_host, remote_port, 1, rid, token)
        await holder.hold(rid, 60.0, blocks, read_token=token)
        if announce:
            await poster.expect(rid, remote)
        if pause_s:
            await asyncio.sleep(pause_s)
        t0 = time.perf_counter()
        await poster.read(rid, remote, BLOCKS * 16, blocks, blocks)
        c = await fut
        latencies.append(time.perf_counter() - t0)
        assert c.status == "received", c

    pump_task = asyncio.create_task(pump() if bell is None else pump_doorbell(bell))
    await one(-1, 0)  # handshake and plan outside the measurement
    latencies.clear()
    if batch > 1:
        t0 = time.perf_counter()
        await _batched(poster, holder, waiting, latencies, remote_host, remote_port, concurrency, requests, batch)
        elapsed = time.perf_counter() - t0
        pump_task.cancel()
        for c in (poster, poller, holder):
            c.close()
        return elapsed, latencies
    sem = asyncio.Semaphore(concurrency)
    slots = list(range(concurrency))

    async def guarded(i: int) -> None:
        async with sem:
            slot = slots.pop()
            try:
                await one(i, slot)
            finally:
                slots.append(slot)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(requests)))
    elapsed = time.perf_counter() - t0
    pump_task.cancel()
    for c in (poster, poller, holder):
        c.close()
    return elapsed, latencies


async def _batched(poster: AsyncEngineClient, holder: AsyncEngineClient, waiting: dict[str, asyncio.Future[Completion]],
                   latencies: list[float], host: str, port: int, concurrency: int, requests: int,
                   batch: int) -> None:
    free = list(range(concurrency))
    room = asyncio.Condition()

    async def finish(rid: str, slot: int, t0: float, fut: asyncio.Future[Completion]) -> None:
        c = await fut
        latencies.append(time.perf_counter() - t0)
        assert c.status == "received", c
        async with room:
            free.append(slot)
            room.notify()

    def room_for(k: int) -> Callable[[], bool]:
        return lambda: len(free) >= k

    tasks = []
    sent = 0
    tokens: dict[str, str] = {}  # request id -> its hold's read token
    while sent < requests:
        n = min(batch, requests - sent)
        async with room:
            await room.wait_for(room_for(n))
            slots = [free.pop() for _ in range(n)]
        msgs: list[P.Hold | P.Read | P.Expect] = []
        holds: list[P.Hold | P.Read | P.Expect] = []
        for k, slot in enumerate(slots):
            blocks = [list(range(slot * BLOCKS, (slot + 1) * BLOCKS))]
            rid = f"b{concurrency}-{sent + k}"
            holds.append(holder.requests.hold(rid, 60.0, blocks, read_token=tokens.setdefault(rid, new_read_token())))
        assert all(e is None for e in await holder.batch(holds))
        t0 = time.perf_counter()
        for slot in slots:
            rid = f"b{concurrency}-{sent}"
            sent += 1
            blocks = [list(range(slot * BLOCKS, (slot + 1) * BLOCKS))]
            fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
            waiting[rid] = fut
            msgs.append(poster.requests.read(rid, RemoteRef("p", host, port, 1, rid, tokens.pop(rid)), BLOCKS * 16,
                                             blocks, blocks, 30.0))
            tasks.append(asyncio.create_task(finish(rid, slot, t0, fut)))
        assert all(e is None for e in await poster.batch(msgs))
    await asyncio.gather(*tasks)


COMPLETIONS = ("poll", "doorbell")  # how the engine learns of them: long polls, or records in its doorbell


def run(levels: Iterable[int] = (1, 16, 256), requests: int = 2000,
        batched: Iterable[int] = (256,), batch: int = 16, pause_s: float = 0.0) -> list[dict[str, float | str]]:
    """Per level, then per `batched` level with the reads `batch` to a frame: one row for each
    way the engine learns of completions (long polls, the baseline; its doorbell's records),
    one after the other on fresh daemons. `pause_s`: between each unbatched read's hold and the
    read (untimed)."""
    rows: list[dict[str, float | str]] = []
    runs = [(c, 1) for c in levels] + [(c, batch) for c in batched]
    ceilings: dict[int, dict[str, float]] = {}  # raw NIXL's, per level (control_raw)
    for (concurrency, per_frame), completions in itertools.product(runs, COMPLETIONS):
        n = requests if concurrency > 1 else max(200, requests // 4)
        if concurrency not in ceilings:
            ceilings[concurrency] = control_raw.run(concurrency, n)
        raw = ceilings[concurrency]
        with daemons(2) as (pd, dd):
            geo = build(SHAPE, 1, 0)
            p = BenchEngine(pd.socket, "p", geo)
            d = BenchEngine(dd.socket, "d", geo, doorbell="records" if completions == "doorbell" else "")
            host, port = p.side_channel.rsplit(":", 1)
            pids = (pd.proc.pid, dd.proc.pid, os.getpid())  # the daemons, and this process: the engines
            cpu = [cpu_seconds(pid) for pid in pids]
            elapsed, lat = asyncio.run(_drive(dd.socket, d.client.token, geo, host, int(port), concurrency, n,
                                              per_frame, (pd.socket, p.client.token), pause_s=pause_s,
                                              bell=d.client if d.client.doorbell is not None else None))
            cpu = [(cpu_seconds(pid) - c) / elapsed * 100 for pid, c in zip(pids, cpu)]
            daemon = d.client.status().latency_us
            rows.append({"concurrency": concurrency, "batch": per_frame, "completions": completions,
                         "pause_ms": pause_s * 1e3, "requests": n, "req_per_s": n / elapsed,
                         "client_p50_us": pct(lat, 50) * 1e6, "client_p99_us": pct(lat, 99) * 1e6,
                         "rpc_to_post_p50_us": _us(daemon.rpc_to_post.p50),
                         "rpc_to_post_p99_us": _us(daemon.rpc_to_post.p99),
                         "rpc_to_completion_p50_us": _us(daemon.rpc_to_completion.p50),
                         "rpc_to_completion_p99_us": _us(daemon.rpc_to_completion.p99),
                         # each process's CPU over the timed reads, in % of one core
                         "prefill_daemon_cpu_pct": cpu[0], "decode_daemon_cpu_pct": cpu[1],
                         "engines_cpu_pct": cpu[2],
                         # all three's CPU per read: what bounds reads/s on this machine's cores
                         "cpu_us_per_read": sum(cpu) / 100 * elapsed / n * 1e6,
                         "raw_req_per_s": raw["req_per_s"], "raw_post_p50_us": raw["post_p50_us"],
                         "raw_done_p50_us": raw["done_p50_us"]})
            d.close()
            p.close()
    return rows


LEASE_MODES: tuple[tuple[str, list[str], bool], ...] = (
    ("off", ["--no-confirm-leases"], False), ("unannounced", [], False), ("announced", [], True))
PAUSE_S = 0.002  # hold -> read: the expect's claim is answered meanwhile (the same pause in every mode)
# Small-page READs complete with the prefill daemon's progress: after the pause its idle pacing
# (pace.py) would decide the READ's time, differently in each mode (a claim wakes it). A spin
# window longer than the pause keeps both daemons progressing, so the modes differ by leases only.
SPIN = {"KVXFERD_SPIN_S": "0.01"}


def run_leases(requests: int = 1000, rounds: int = 3) -> list[dict[str, float | str]]:
    """Per mode, medians over alternating rounds of a 16-block read's latency, one in flight."""
    samples: dict[str, dict[str, list[float]]] = {m: {"client": [], "daemon": []} for m, _, _ in LEASE_MODES}
    for _ in range(rounds):
        for mode, extra, announce in LEASE_MODES:
            with environment(SPIN), daemons(2, extra) as (pd, dd):
                geo = build(SHAPE, 1, 0)
                p = BenchEngine(pd.socket, "p", geo)
                d = BenchEngine(dd.socket, "d", geo)
                host, port = p.side_channel.rsplit(":", 1)
                _, lat = asyncio.run(_drive(dd.socket, d.client.token, geo, host, int(port), 1, requests, 1,
                                            (pd.socket, p.client.token), announce, PAUSE_S))
                samples[mode]["client"].append(pct(lat, 50) * 1e6)
                samples[mode]["daemon"].append(_us(d.client.status().latency_us.rpc_to_completion.p50))
                d.close()
                p.close()
    base = samples["off"]
    rows: list[dict[str, float | str]] = []
    for mode, _, _ in LEASE_MODES:
        client, daemon = median(samples[mode]["client"]), median(samples[mode]["daemon"])
        rows.append({"mode": mode, "requests": requests, "rounds": rounds, "client_p50_us": client,
                     "rpc_to_completion_p50_us": daemon, "client_ratio": client / median(base["client"]),
                     "daemon_ratio": daemon / median(base["daemon"])})
    return rows


def render_leases(rows: list[dict[str, float | str]]) -> str:
    lines = [f"{'confirmation':>13} {'client p50 us':>14} {'x off':>6} {'rpc->done p50 us':>17} {'x off':>6}"]
    for r in rows:
        lines.append(f"{r['mode']:>13} {r['client_p50_us']:>14.0f} {r['client_ratio']:>6.3f} "
                     f"{r['rpc_to_completion_p50_us']:>17.0f} {r['daemon_ratio']:>6.3f}")
    return "\n".join(lines)


def render(rows: list[dict[str, float | str]]) -> str:
    cores = os.cpu_count() or 1
    lines = [f"{'conc':>5} {'batch':>5} {'completions':>11} {'reqs':>6} {'req/s':>8} {'client p50/p99 us':>19} "
             f"{'rpc->post p50/p99 us':>22} {'rpc->done p50/p99 us':>22} {'CPU% prefill/decode/engines':>28} "
             f"{'CPU us/read (bound)':>19}"]
    for r in rows:
        lines.append(f"{r['concurrency']:>5} {r['batch']:>5} {r['completions']:>11} {r['requests']:>6} "
                     f"{r['req_per_s']:>8.0f} "
                     f"{r['client_p50_us']:>9.0f}/{r['client_p99_us']:<9.0f} "
                     f"{r['rpc_to_post_p50_us']:>11.0f}/{r['rpc_to_post_p99_us']:<10.0f} "
                     f"{r['rpc_to_completion_p50_us']:>11.0f}/{r['rpc_to_completion_p99_us']:<10.0f} "
                     f"{r['prefill_daemon_cpu_pct']:>12.0f}/{r['decode_daemon_cpu_pct']:.0f}/"
                     f"{r['engines_cpu_pct']:<10.0f} {r['cpu_us_per_read']:>9.0f} "
                     f"{'(%.0f/s)' % (cores * 1e6 / float(r['cpu_us_per_read'])):<9}")
    for poll, bell in zip(rows[::2], rows[1::2]):
        lines.append(f"conc {poll['concurrency']} batch {poll['batch']}: doorbell / poll req/s "
                     f"{float(bell['req_per_s']) / float(poll['req_per_s']):.3f}")
    lines.append(f"CPU us/read: the daemons' and the engines' CPU per read, all three; bound: the reads/s "
                 f"that leaves this machine's {cores} cores")
    lines.append("")
    lines.append("raw NIXL, the same reads posted by a process of its own (the ceiling; control_raw.py):")
    lines.append(f"{'conc':>5} {'req/s':>8} {'post call p50 us':>17} {'post->done p50 us':>18}")
    ceilings = {r["concurrency"]: r for r in rows}  # one per level, shared by its rows
    for conc, r in ceilings.items():
        lines.append(f"{conc:>5} {float(r['raw_req_per_s']):>8.0f} {float(r['raw_post_p50_us']):>17.0f} "
                     f"{float(r['raw_done_p50_us']):>18.0f}")
    for poll, bell in zip(rows[::2], rows[1::2]):
        raw = float(poll["raw_req_per_s"])
        lines.append(f"conc {poll['concurrency']} batch {poll['batch']}: kvxferd / raw NIXL req/s "
                     f"{float(poll['req_per_s']) / raw:.3f} (poll), {float(bell['req_per_s']) / raw:.3f} (doorbell)")
    return "\n".join(lines)


def _us(value: float | None) -> float:
    """A daemon percentile; NaN when the daemon had no samples."""
    return float("nan") if value is None else value
