"""The recorder: one call per event feeds the counters, the windows and Prometheus; the peer
label stays bounded however many peers there are."""

from prometheus_client.parser import text_string_to_metric_families

from kvxferd import protocol as P
from kvxferd import recorder


def peer_labels(r: recorder.Recorder) -> set[str]:
    families = text_string_to_metric_families(r.metrics.render().decode())
    return {s.labels["peer"] for f in families for s in f.samples if "peer" in s.labels}


def test_a_read_is_counted_once_everywhere() -> None:
    r = recorder.Recorder()
    r.read_received("p", "nixl", 4096, 0.01, 0.002)
    r.read_failed("p", "none", "deadline", 0.5, P.FailureRecord(1.0, "d", 0, "x", "p", "deadline: late"))
    assert (r.counters.received, r.counters.failed) == (1, 1)
    assert r.recent().reads == 1 and r.recent().bytes == 4096
    assert r.latency().rpc_to_completion.n == 1
    assert [f.request for f in r.failures] == ["x"]
    body = r.metrics.render().decode()
    assert 'kvxferd_transfers_total{lane="nixl",outcome="received",peer="p"} 1.0' in body
    assert 'kvxferd_transfer_failures_total{peer="p",reason="deadline"} 1.0' in body


def test_peer_labels_are_bounded() -> None:
    r = recorder.Recorder()
    for i in range(recorder.PEER_LABELS + 50):
        r.read_received(f"peer-{i}", "nixl", 1, 0.001, 0.001)
    labels = peer_labels(r)
    assert len(labels) == recorder.PEER_LABELS + 1 and "other" in labels
    assert r.counters.received == recorder.PEER_LABELS + 50  # nothing is lost, only grouped
