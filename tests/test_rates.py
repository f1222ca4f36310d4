"""Each peer's read rate (rates.py): measured on real reads through real daemons and shown in
`kvxferd status`; a route of GPU memory far below a device transport is judged slow once, with
one warning naming the fix, and the metric carries the rate."""

from __future__ import annotations

import logging

import msgspec

from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.plan.models import PRESETS
from kvxferd.rates import MEASURED_BYTES, SLOW_AFTER_READS, Rates
from kvxferd.recorder import Recorder
from kvxferd.status import render

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64)  # 256 KiB a block at TP 1


def test_a_peer_s_read_rate_is_measured_on_its_reads_and_shown():
    with Cluster(SHAPE, 1, 1) as c:
        assert [p.read_gbps for p in c.status(1).peers] == []
        c.transfer(0, 16)  # one block: too small to measure the transport
        [peer] = c.status(1).peers
        assert peer.read_gbps is None
        for seq in range(1, 4):  # 8 blocks, 2 MiB each
            assert c.transfer(seq, 128)["status"] == "received"
        [peer] = c.status(1).peers
        assert peer.read_gbps is not None and peer.read_gbps > 0 and not peer.slow  # host memory is never judged
        assert "GB/s" in render(c.status(1))


class Peer:  # rates are kept by the peer object's identity
    pass


def test_a_gpu_route_below_slow_route_gbps_is_slow_with_one_warning(caplog):
    recorder = Recorder()
    rates = Rates(recorder, slow_gbps=5.0)
    slow, fast, host = Peer(), Peer(), Peer()
    with caplog.at_level(logging.WARNING, logger="kvxferd"):
        for _ in range(SLOW_AFTER_READS + 2):
            rates.observe(slow, "tcp-peer", "10.0.0.1:5600", "VRAM", 64 << 20, (64 << 20) / 0.5e9)
            rates.observe(fast, "nvlink-peer", "10.0.0.2:5600", "VRAM", 64 << 20, (64 << 20) / 200e9)
            rates.observe(host, "host-peer", "10.0.0.3:5600", "DRAM", 64 << 20, (64 << 20) / 0.5e9)
            rates.observe(fast, "nvlink-peer", "10.0.0.2:5600", "VRAM", MEASURED_BYTES - 1, 1.0)  # not measured
    assert rates.of(slow).slow and not rates.of(fast).slow and not rates.of(host).slow
    assert abs(rates.of(slow).bytes_per_s - 0.5e9) < 1e6 and abs(rates.of(fast).bytes_per_s - 200e9) < 1e8
    warnings = [r.getMessage() for r in caplog.records if "slow_route_gbps" in r.getMessage()]
    assert len(warnings) == 1 and "tcp-peer" in warnings[0] and "Slow GPU routes" in warnings[0]
    sample = recorder.metrics.registry.get_sample_value
    assert sample("kvxferd_peer_read_rate_bytes_per_second", {"peer": "tcp-peer", "memory": "VRAM"}) == \
        rates.of(slow).bytes_per_s
    assert Rates(Recorder(), slow_gbps=0.0).of(slow) is None
    off = Rates(Recorder(), slow_gbps=0.0)  # 0: never judged
    for _ in range(SLOW_AFTER_READS):
        off.observe(slow, "tcp-peer", "10.0.0.1:5600", "VRAM", 64 << 20, 1.0)
    assert not off.of(slow).slow
