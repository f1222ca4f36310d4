"""The benchmarks run end to end (tiny sizes). Their figures are not asserted here: speed is
reported by `kvxferd bench` as ratios against baselines measured in the same run."""

import os

import msgspec
import numpy as np
import pytest

from kvxferd.benchmarks import control, dataplane, framing, handshake, plan, samenode, step
from kvxferd.memory import create_shm


def test_bench_data_runs():
    (row,) = dataplane.run(page_sizes=(16 << 10,), total_mib=2, repeats=2, rounds=2, lane_split_bytes=1 << 20)
    assert row["descriptors"] == 128
    assert all(row[k] > 0 for k in ("kvxferd_gb_s", "lanes_gb_s", "raw_nixl_gb_s", "memcpy_gb_s", "memcpy2_gb_s",
                                    "kvxferd_over_raw", "lanes_over_raw", "raw_same_pages_gb_s",
                                    "daemon_post_ms", "post_over_raw_post"))
    assert row["split_reads"] > 0  # 2 MiB in 1 MiB slices: the lanes pair split every read
    assert "16KiB" in dataplane.render([row])


def test_bench_data_same_node_runs():
    (row,) = samenode.run(page_sizes=(16 << 10,), total_mib=2, repeats=2, rounds=2)
    assert row["descriptors"] == 128
    assert all(row[k] > 0 for k in ("copy_gb_s", "loop_gb_s", "raw_nixl_gb_s", "gather_gb_s", "copy_over_raw",
                                    "loop_over_raw", "copy_of_memcpy", "readv_gb_s"))
    assert "16KiB" in samenode.render([row])


def test_the_raw_baseline_reads_the_engines_own_pages():
    """bench data's parity baseline moves the very pages kvxferd moves: what the raw reader
    reads lands in the decode engine's memory, from the prefill engine's."""
    page, n = 16 << 10, 4
    size = 2 * n * page
    (src_fd, src), (dst_fd, dst) = create_shm(size, "prefill"), create_shm(size, "decode")
    prefill, decode = np.frombuffer(src, dtype=np.uint8), np.frombuffer(dst, dtype=np.uint8)
    prefill[:] = np.arange(size) % 251
    pages = ([(f"/proc/{os.getpid()}/fd/{src_fd}", size)], [(f"/proc/{os.getpid()}/fd/{dst_fd}", size)])
    pair = dataplane.RawPair(page, n, memory=pages)
    try:
        decode[:] = 0  # after the pair's first READs
        times, posts = pair.reads(1)
    finally:
        pair.close()
        os.close(src_fd)
        os.close(dst_fd)
    assert len(times) == len(posts) == 1
    assert np.array_equal(decode, prefill)


def test_bench_control_runs():
    rows = control.run(levels=(4,), requests=40, batched=(8,), batch=4)
    assert [(r["batch"], r["completions"]) for r in rows] == [(1, "poll"), (1, "doorbell"), (4, "poll"),
                                                              (4, "doorbell")]
    for row in rows:  # every read came back "received" (asserted inside), by polls or the doorbell
        assert row["requests"] == 40 and row["req_per_s"] > 0
        assert row["rpc_to_post_p50_us"] > 0 and row["client_p99_us"] >= row["client_p50_us"]
        assert row["raw_req_per_s"] > 0 and row["raw_done_p50_us"] >= row["raw_post_p50_us"] > 0
        assert row["engines_cpu_pct"] >= 0 and row["cpu_us_per_read"] > 0  # all three's CPU, per read
    text = control.render(rows)
    assert "doorbell / poll" in text and "raw NIXL" in text and "CPU us/read" in text


def test_bench_leases_runs():
    rows = control.run_leases(requests=20, rounds=1)
    assert [r["mode"] for r in rows] == ["off", "unannounced", "announced"]
    assert rows[0]["client_ratio"] == 1.0 and all(r["client_p50_us"] > 0 for r in rows)


def test_bench_step_runs():
    rows = step.run(steps=50)
    assert [(r["scenario"], r["per_step"]) for r in rows] == [
        ("nothing finishes", "bare poll RPC (baseline)"), ("nothing finishes", "worker.results() (ships)"),
        ("nothing finishes, a busy second thread", "poll(2), the GIL let go (baseline)"),
        ("nothing finishes, a busy second thread", "EngineClient.pushed(): the GIL kept (ships)"),
        ("one read finishes", "doorbell ring + poll (protocol 6, baseline)"),
        ("one read finishes", "worker.results() (ships: records)"),
        *((scenario, f"{name}: {what}") for scenario in ("in one process (the floor)",
                                                         "in one process, caches flushed before each read")
          for name, _, _ in step.MECHANISMS
          for what in ("daemon's push()", "pushed(), one record", "pushed(), nothing new"))]
    text = step.render(rows)
    assert all(r["p50_us"] > 0 for r in rows) and text.count("worker / baseline") == 3
    assert text.count("ring (10) / counter + pipe (9)") == 4  # one record and nothing new, warm and cold
    assert rows[4]["found"] > 0.5 and rows[5]["found"] > 0.5  # the reads did finish within their steps


def test_bench_handshake_runs():
    rows = handshake.run(peers=1)
    assert rows[0]["first_ms"] > 0 and rows[0]["handshake_ms"] > 0


def test_bench_plan_runs():
    shape = msgspec.structs.replace(plan.LLAMA70B, layers=2, num_blocks=500)
    rows = plan.run(p_tps=(4,), shape=shape, blocks_per_request=8)
    assert rows[0]["descriptors"] == 2 * 2 * 500 and rows[0]["speedup"] > 0


def test_bench_framing_compares_the_same_reads_both_ways():
    """Below PACK_MIN_IDS both protocols send the same frame; from it on, protocol 8's is packed
    (4 bytes an id)."""
    from kvxferd.client import PACK_MIN_IDS

    shape = msgspec.structs.replace(plan.LLAMA70B, layers=2, num_blocks=2 * PACK_MIN_IDS)
    short, long = framing.run((8, PACK_MIN_IDS), shape)
    assert short["frame_bytes_7"] == short["frame_bytes_8"]
    assert long["frame_bytes_8"] - long["frame_bytes_7"] > 0 and long["daemon_us_8"] > 0 < long["engine_us_8"]
    assert "p8/p7" in framing.render([short, long])


def test_bench_json_is_only_json_on_stdout():
    """NIXL logs to stdout by default; `--json` output must still parse (logs go to stderr)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvxferd", "bench", "data", "--json", "--mib", "4", "--repeats", "1",
                          "--rounds", "1", "--page-kib", "16", "--page-kib", "64"],
                         capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(out.stdout)
    assert rows and all("kvxferd_over_raw" in r for r in rows)
    assert "NIXL INFO" in out.stderr  # the agents' lines are still there, on stderr


def test_histogram_quantiles_come_from_vllms_metrics_text():
    from kvxferd.lab.vllm_bench import histogram_quantile

    text = "\n".join([
        '# TYPE vllm:kvxferd_step_seconds histogram',
        'vllm:kvxferd_step_seconds_bucket{engine="0",le="1e-05"} 10.0',
        'vllm:kvxferd_step_seconds_bucket{engine="0",le="2e-05"} 60.0',
        'vllm:kvxferd_step_seconds_bucket{engine="0",le="5e-05"} 99.0',
        'vllm:kvxferd_step_seconds_bucket{engine="0",le="+Inf"} 100.0',
        'vllm:kvxferd_step_seconds_count{engine="0"} 100.0'])
    # the 50th of 100 is the 40th of the 50 in (10, 20] us: 10 + 10 * 40 / 50, as Prometheus estimates
    assert histogram_quantile(text, "vllm:kvxferd_step_seconds", 0.5) == (pytest.approx(1.8e-05), 1e-05, 2e-05, 100)
    assert histogram_quantile(text, "vllm:kvxferd_step_seconds", 0.99) == (pytest.approx(5e-05), 2e-05, 5e-05, 100)
    assert histogram_quantile(text, "vllm:kvxferd_step_seconds", 1.0) == (5e-05, 5e-05, float("inf"), 100)
    assert histogram_quantile(text, "vllm:kvxferd_read_seconds", 0.5) == (0.0, 0.0, 0.0, 0)
    # label sets (one per engine) are summed
    two = text + "\n" + text.replace('engine="0"', 'engine="1"')
    assert histogram_quantile(two, "vllm:kvxferd_step_seconds", 0.5) == (pytest.approx(1.8e-05), 1e-05, 2e-05, 200)
