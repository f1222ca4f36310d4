"""Soak: thousands of requests through two daemons with faults mixed in; afterwards no lost
and no duplicated completion, no held request left, bounded daemon memory growth.

Short form in CI; the long form: KVXFERD_SOAK_REQUESTS=20000 python -m pytest tests/test_soak.py
"""

import os
import random
import time
from collections import Counter

import msgspec

from kvxferd.client import RemoteRef
from kvxferd.plan.models import PRESETS
from kvxferd.synthetic.demo import Cluster, DaemonProcess, EngineProcess

REQUESTS = int(os.environ.get("KVXFERD_SOAK_REQUESTS", "1000"))
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


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


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
    restarts = {REQUESTS // 2}
    with Cluster(SHAPE, 2, 4) as c:
        rss = {}
        t0 = time.monotonic()
        for seq in range(REQUESTS):
            if seq in restarts:
                outcomes["prefill_holds_lost_with_restart"] += len(deferred)  # the old engine's holds
                deferred.clear()
                restart_prefill(c, seq)
            if seq == 100:
                rss = {"decode": rss_mb(c.daemons[1].proc.pid)}
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
                c.decode.call("post_read", seq, tokens, ref, [list(range(20))], 0, 5.0)
                results = c.decode.call("wait_read", seq, 15)
                c.decode.call("free", c.decode.call("drop", seq))
                assert len(results) == 4 and {r[0] for r in results} <= EXPECT[kind][0]
                outcomes["failed"] += 4
                continue
            blocks = c.prefill.call("prefill", seq, tokens, 0.5)
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
            c.decode.call("post_read", seq, tokens, remote, remote_blocks, hit, deadline)
            results = c.decode.call("wait_read", seq, 15)
            c.decode.call("free", c.decode.call("drop", seq))
            statuses = {r[0] for r in results}
            assert len(results) == 4 and statuses <= EXPECT[kind][0], (seq, kind, results)
            for status, block_ids, reason, _ in results:
                if status == "failed":
                    assert block_ids and reason
                outcomes[status] += 1
            deferred.append((seq, EXPECT[kind][1]))
            c.prefill.call("free", blocks)  # the engine frees its copy; the daemon's hold ends by itself
        elapsed = time.monotonic() - t0
        time.sleep(0.7)  # every short lease has passed
        for seq, allowed in deferred:
            released = c.prefill.call("wait_released", seq, 10)
            assert len(released) == 2 and set(released) <= allowed, (seq, released)
            outcomes.update(f"prefill_{r}" for r in released)
        assert c.prefill.call("pending") == [0, 0], "a hold completed twice"
        assert c.decode.call("pending") == [0, 0, 0, 0], "a read completed twice"
        p, d = c.status(0), c.status(1)
        assert p.held == [] and d.in_flight == [] and d.quarantined == 0
        rss["decode_end"] = rss_mb(c.daemons[1].proc.pid)
        growth = rss["decode_end"] - rss["decode"]
        print(f"\nsoak: {REQUESTS} requests in {elapsed:.1f} s, outcomes {dict(outcomes)}, decode daemon RSS "
              f"{rss['decode']:.0f} -> {rss['decode_end']:.0f} MB")
        assert growth < 64, f"decode daemon grew {growth:.0f} MB over the soak"
