"""Soak: thousands of requests through two daemons with faults mixed in; afterwards no lost
and no duplicated completion, no held request left, bounded daemon memory growth.

Short form in CI. The long form, with both daemons' RSS and open fds sampled to a CSV that
bench/soak_plot.py draws (docs/soak.png):

    KVXFERD_SOAK_REQUESTS=20000 KVXFERD_SOAK_SAMPLES=soak.csv python -m pytest -s tests/test_soak.py
"""

import os
import random
import time
from collections import Counter

import msgspec

from kvxferd.benchmarks.harness import rss_mb
from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess
from kvxferd.plan.models import PRESETS

REQUESTS = int(os.environ.get("KVXFERD_SOAK_REQUESTS", "1000"))
SAMPLES = os.environ.get("KVXFERD_SOAK_SAMPLES")
SAMPLE_EVERY = 100  # requests
RSS_BOUND_MB, FD_BOUND = 64, 16  # growth allowed from the first sample after warm-up to the end
SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=512, layers=2)

# kind -> (decode outcome, prefill outcome) each must end in
EXPECT = {
    "normal": ({"received"}, {"sent"}),
    "missing_engine": ({"failed"}, None),
    "bad_blocks": ({"failed"}, {"expired"}),
    "lost_notification": ({"received"}, {"expired"}),
    "full_hit": ({"received"}, {"sent"}),
    "tiny_deadline": ({"received", "failed"}, {"sent", "expired"}),
}
MIX = ["normal"] * 70 + ["missing_engine"] * 8 + ["bad_blocks"] * 6 + ["lost_notification"] * 6 + \
    ["full_hit"] * 6 + ["tiny_deadline"] * 4


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """RSS and open fds of both daemons, every SAMPLE_EVERY requests."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, float, int, float, int]] = []
        self.t0 = time.monotonic()

    def sample(self, c: Cluster, seq: int, generation: int) -> None:
        p, d = c.daemons[0].proc.pid, c.daemons[1].proc.pid
        self.rows.append((round(time.monotonic() - self.t0, 2), seq, generation, rss_mb(p), open_fds(p),
                          rss_mb(d), open_fds(d)))

    def growth(self, column: int) -> float:
        """Last sample minus the first after warm-up: the second of the daemon's life (the first is
        taken before it served anything); the prefill daemon's life begins at its last restart."""
        last = self.rows[-1]
        life = [r for r in self.rows if r[2] == last[2]] if column in (3, 4) else self.rows
        return last[column] - life[1][column]

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("seconds,request,prefill_generation,prefill_rss_mb,prefill_fds,decode_rss_mb,decode_fds\n")
            for row in self.rows:
                f.write(",".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row) + "\n")


def restart_prefill(c: Cluster, generation: int) -> None:
    """Kill the prefill daemon and engine (SIGKILL) and bring both back on the same port."""
    c.prefill.proc.kill()
    c.daemons[0].kill()
    d = DaemonProcess(c.work, f"prefill-daemon-{generation}", side_channel_port=c.port)
    c.daemons[0] = d
    c.prefill = EngineProcess(d.socket, "prefill", SHAPE, c.p_tp)
    c.engines.append(c.prefill)


def test_soak():
    rng = random.Random(1234)
    outcomes = Counter()
    deferred: list[tuple[int, set]] = []  # (seq, allowed prefill outcomes), checked at the end
    restarts = set(range(5000, REQUESTS, 5000)) or {REQUESTS // 2}
    sampler = Sampler()
    generation = 0
    with Cluster(SHAPE, 2, 4) as c:
        t0 = time.monotonic()
        for seq in range(REQUESTS):
            if seq in restarts:
                outcomes["prefill_holds_lost_with_restart"] += len(deferred)  # the old engine's holds
                deferred.clear()
                generation += 1
                restart_prefill(c, seq)
            if seq % SAMPLE_EVERY == 0:
                sampler.sample(c, seq, generation)
            kind = rng.choice(MIX)
            tokens = rng.randint(1, 300)
            if kind == "normal":
                hit = rng.choice([0, 0, 16 * rng.randint(0, tokens // 16)])
                out = c.transfer(seq, tokens, hit_tokens=hit)
                assert out["status"] == "received" and out["released"] == ["sent", "sent"], (seq, out)
                outcomes["received"] += 4
                outcomes["prefill_sent"] += 2
                continue
            if kind == "missing_engine":
                ref = RemoteRef("missing", c.host, c.port, 2, f"req-{seq}")
                c.decode.post_read(seq, tokens, ref, [list(range(20))], 0, 5.0)
                results = c.decode.wait_read(seq, 15)
                c.decode.free(c.decode.drop(seq))
                assert len(results) == 4 and {r[0] for r in results} <= EXPECT[kind][0]
                outcomes["failed"] += 4
                continue
            blocks = c.prefill.prefill(seq, tokens, 0.5)
            remote = c.remote(seq)
            remote_blocks = blocks
            hit = 0
            deadline = 5.0
            if kind == "bad_blocks":
                remote_blocks = [[10_000 + b for b in blocks[0]]]
            elif kind == "lost_notification":
                remote = RemoteRef("prefill", c.host, c.port, 2, f"nobody-{seq}")
            elif kind == "full_hit":
                hit = tokens + 16
            elif kind == "tiny_deadline":
                deadline = 0.0005
            c.decode.post_read(seq, tokens, remote, remote_blocks, hit, deadline)
            results = c.decode.wait_read(seq, 15)
            c.decode.free(c.decode.drop(seq))
            statuses = {r[0] for r in results}
            assert len(results) == 4 and statuses <= EXPECT[kind][0], (seq, kind, results)
            for status, block_ids, reason, _ in results:
                if status == "failed":
                    assert block_ids and reason
                outcomes[status] += 1
            deferred.append((seq, EXPECT[kind][1]))
            c.prefill.free(blocks)  # the engine frees its copy; the daemon's hold ends by itself
        elapsed = time.monotonic() - t0
        time.sleep(0.7)  # every short lease has passed
        for seq, allowed in deferred:
            released = c.prefill.wait_released(seq, 10)
            assert len(released) == 2 and set(released) <= allowed, (seq, released)
            outcomes.update(f"prefill_{r}" for r in released)
        assert c.prefill.pending() == [0, 0], "a hold completed twice"
        assert c.decode.pending() == [0, 0, 0, 0], "a read completed twice"
        p, d = c.status(0), c.status(1)
        assert p.held == [] and d.in_flight == [] and d.quarantined == 0
        sampler.sample(c, REQUESTS, generation)
        if SAMPLES:
            sampler.write(SAMPLES)
        first, last = sampler.rows[1], sampler.rows[-1]
        print(f"\nsoak: {REQUESTS} requests in {elapsed:.1f} s, outcomes {dict(outcomes)}; decode daemon RSS "
              f"{first[5]:.0f} -> {last[5]:.0f} MB, fds {first[6]} -> {last[6]}; prefill daemon (since its last "
              f"restart) RSS {sampler.growth(3):+.0f} MB, fds {sampler.growth(4):+.0f}")
        for name, column, bound in (("decode RSS (MB)", 5, RSS_BOUND_MB), ("decode fds", 6, FD_BOUND),
                                    ("prefill RSS (MB)", 3, RSS_BOUND_MB), ("prefill fds", 4, FD_BOUND)):
            grown = sampler.growth(column)
            assert grown < bound, f"{name} grew {grown:.0f} over the soak (bound {bound})"
