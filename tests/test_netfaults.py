"""Network faults between two daemons in their own network namespaces, over UCX/TCP.

The link between the namespaces (tests/netlab.py) delays, reorders and drops real IP packets.
For each fault: every request ends exactly once (`received` and byte-exact, or `failed` with
its block ids) within its deadline; once the network is back the next request succeeds and
nothing is left held, in flight or quarantined.
"""

import threading
import time

import msgspec
import pytest
from netlab import Netlab, unavailable
from test_faults import wait_for

from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess
from kvxferd.plan.models import PRESETS

pytestmark = pytest.mark.skipif(bool(why := unavailable()), reason=f"network faults need namespaces: {why}")

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=1024, layers=4, block_size=16)
LONG = 16000  # tokens: ~260 MB in all, a few seconds through the link
# The side channel binds the namespaces' veth addresses without CurveZMQ keys: said explicitly.
UCX = ["--ucx", "UCX_TLS=tcp", "--handshake-timeout", "2", "--side-channel-insecure"]


@pytest.fixture(scope="module")
def lab():
    lab = Netlab()
    yield lab
    lab.close()


def prefill_daemon(lab: Netlab, work, name: str) -> DaemonProcess:
    return DaemonProcess(work, name, extra=[*UCX, "--ucx", "UCX_NET_DEVICES=kvxp", "--side-channel-host",
                                            lab.prefill_ip], prefix=lab.exec_prefix(lab.ns_p))


@pytest.fixture
def cluster(lab, tmp_path):
    lab.impair()
    lab.partition(False)
    # claims of 2 s: a read's claim pins its hold that long past the last renewal, and a
    # partition keeps the decode from unpinning it when the read fails
    decode = DaemonProcess(tmp_path, "decode-daemon", extra=[*UCX, "--ucx", "UCX_NET_DEVICES=kvxd",
                                                             "--side-channel-host", lab.decode_ip,
                                                             "--claim-s", "2"],
                           prefix=lab.exec_prefix(lab.ns_d))
    with Cluster(SHAPE, 2, 4, workdir=str(tmp_path),
                 daemons=[prefill_daemon(lab, tmp_path, "prefill-daemon"), decode]) as c:
        assert c.host == lab.prefill_ip
        yield c
        lab.impair()
        lab.partition(False)
        assert_nothing_left(c)


def assert_nothing_left(c: Cluster) -> None:
    wait_for(lambda: (lambda d: not d.in_flight and d.quarantined == 0)(c.status(1)), 60,
             "the decode daemon to have nothing in flight or quarantined")
    wait_for(lambda: c.status(0).held == [], 40, "the prefill daemon to hold nothing")
    assert c.decode.pending() == [0] * 4, "a read completed twice"
    assert c.prefill.pending() == [0] * 2, "a hold completed twice"


def received(c: Cluster, seq: int, tokens: int, hit: int = 0, deadline_s: float = 30.0) -> float:
    """One request, verified byte for byte on every decode rank; returns its latency."""
    out = c.transfer(seq, tokens, hit_tokens=hit, deadline_s=deadline_s)
    assert out["status"] == "received", out
    assert out["latency_s"] < deadline_s
    assert out["released"] == ["sent", "sent"], out
    return out["latency_s"]


def at(delay_s: float, action) -> threading.Timer:
    t = threading.Timer(delay_s, action)
    t.start()
    return t


def test_latency_with_jitter(lab, cluster):
    lab.impair(delay_ms=25, jitter_ms=20)  # 5-45 ms each way, packets reordered
    latencies = [received(cluster, seq, tokens, hit) for seq, (tokens, hit) in
                 enumerate([(64, 0), (700, 160), (2000, 0), (33, 0), (1500, 1488)])]
    assert min(latencies) > 0.005  # the link really was slow
    assert lab.impairment.forwarded.value > 0


@pytest.mark.parametrize("loss", [0.01, 0.05])
def test_packet_loss(lab, cluster, loss):
    lab.impair(delay_ms=1, loss=loss)
    for seq, tokens in enumerate([64, 3000, 900]):
        received(cluster, seq, tokens)
    assert lab.impairment.dropped.value > 0


def test_partition_that_heals_mid_transfer(lab, cluster):
    c = cluster
    received(c, 0, 64)  # handshake done: the partition hits READs, not the handshake
    blocks = c.prefill.prefill(1, LONG, 30.0)
    dropped = lab.impairment.dropped.value
    timers = [at(0.2, lab.partition), at(3.2, lambda: lab.partition(False))]
    try:
        out = c.decode.decode(1, LONG, c.remote(1), blocks, 0, 30.0, SHAPE)
    finally:
        for t in timers:
            t.join()
    assert out["status"] == "received" and out["latency_s"] > 3.2, out  # verified byte for byte
    assert c.prefill.wait_released(1, 30) == ["sent", "sent"]
    c.prefill.free(blocks)
    assert lab.impairment.dropped.value > dropped
    received(c, 2, 500)


def test_partition_that_does_not_heal(lab, cluster):
    c = cluster
    received(c, 0, 64)
    blocks = c.prefill.prefill(1, LONG, 3.0)
    # announced, as vLLM does: the hold's grant is in before the read, whose READs then leave at
    # once (an unannounced read waits a round trip for it, which the partition could cut)
    c.decode.expect(1, c.remote(1))
    time.sleep(0.5)
    t0 = time.monotonic()
    local = c.decode.post_read(1, LONG, c.remote(1), blocks, 0, 4.0)
    lab.partition()
    outcomes = c.decode.wait_read(1, 20)
    elapsed = time.monotonic() - t0
    assert len(outcomes) == 4 and elapsed < 4.0 + 1.5, (elapsed, outcomes)
    assert all(o[0] == "failed" and o[1] == local and o[2].startswith("deadline") for o in outcomes), outcomes
    # UCX cannot cancel a READ: while the peer is unreachable its memory stays quarantined. A rank
    # whose slices all still waited on a lane (behind a post the partition holds up) was never
    # posted: its slices are dropped, and its memory is its engine's again at once.
    posted = [o for o in outcomes if o[2].endswith("memory quarantined")]
    assert posted and all(o in posted or o[2].endswith("nothing was posted yet") for o in outcomes), outcomes
    st = c.status(1)
    assert st.quarantined == len(posted), st
    assert sorted(e.pinned for e in st.engines) == [0] * (4 - len(posted)) + [1] * len(posted), st
    assert c.prefill.wait_released(1, 10) == ["expired", "expired"]  # the lease and the claim passed
    c.prefill.free(blocks)
    c.decode.free(c.decode.drop(1))
    # a new request to the unreachable peer fails within its own deadline too
    blocks = c.prefill.prefill(2, 300, 2.0)
    out = c.decode.decode(2, 300, c.remote(2), blocks, 0, 2.0, SHAPE)
    assert out["status"] == "failed" and out["latency_s"] < 2.0 + 1.0 and out["block_ids"], out
    c.prefill.wait_released(2, 10)
    c.prefill.free(blocks)
    # nothing posted: its grant never came through the partition, so no READ waits in UCX for it
    assert c.status(1).quarantined == len(posted)
    lab.partition(False)  # the network comes back: TCP retransmits, the quarantined READs end
    wait_for(lambda: c.status(1).quarantined == 0, 60, "quarantined READs to end once the network is back")
    received(c, 3, 500)


def test_prefill_host_moves_to_a_new_address(lab, cluster, tmp_path):
    c = cluster
    received(c, 0, 200)
    old = c.remote(1)
    c.prefill.proc.kill()  # the prefill host goes away (SIGKILL) and comes back elsewhere
    c.daemons[0].kill()
    new_ip = lab.move_prefill(3)
    try:
        d = prefill_daemon(lab, tmp_path, "prefill-daemon-moved")
        c.daemons[0] = d
        c.prefill = EngineProcess(d.socket, "prefill", SHAPE, 2)
        c.engines.append(c.prefill)
        host, port = c.prefill.side_channel.rsplit(":", 1)
        assert host == new_ip
        c.host, c.port = host, int(port)
        # a decode still naming the old address fails within its deadline, with its block ids ...
        local = c.decode.post_read(1, 100, RemoteRef("prefill", old.host, old.port, 2, "req-old"),
                              [list(range(7))], 0, 3.0)
        t0 = time.monotonic()
        outcomes = c.decode.wait_read(1, 20)
        assert time.monotonic() - t0 < 3.0 + 1.0
        assert [o[0] for o in outcomes] == ["failed"] * 4 and all(o[1] == local for o in outcomes), outcomes
        c.decode.free(c.decode.drop(1))
        # ... and the new address serves the next requests
        received(c, 2, 777)
        received(c, 3, 64, hit=48)
    finally:
        lab.move_prefill(1)
