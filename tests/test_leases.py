"""Leases that never serve stale KV, and leases kept alive by demand (leases.py, holds.py).

Real daemons and synthetic engines in their own processes, real NIXL. A read that comes after
its hold's lease, once the prefill engine refilled the blocks with another prompt, must end
`failed` with reason `expired` and its block ids (and, as a control, with confirmation off it
is reported `received` with the other prompt's bytes: the test can see what it guards
against). A decode that announced its read keeps the hold alive past the prefill's lease, and
a decode that goes away stops doing so.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import msgspec

from kvxferd.client import EngineClient, RemoteRef
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, EngineProcess
from kvxferd.memory import create_shm
from kvxferd.plan.models import PRESETS, build

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=2)
TOKENS = 40


def late_read(c: Cluster, lease_s: float) -> dict:
    """Prefill request 1 under a short lease, let it pass, refill its blocks with prompt 2
    (what the engine does with blocks it got back), then read request 1."""
    blocks = c.prefill.prefill(1, TOKENS, lease_s)
    assert c.prefill.wait_released(1, lease_s + 10) == ["expired"] * c.p_tp
    c.prefill.reuse(blocks, 2)
    return c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)


def test_a_read_after_its_lease_fails_expired_with_its_blocks():
    with Cluster(SHAPE, 2, 2) as c:
        c.transfer(0, TOKENS)  # handshake and route in place: the late read posts at once
        out = late_read(c, 0.3)
        assert out["status"] == "failed"
        assert "expired" in out["reason"] and "no longer holds" in out["reason"], out["reason"]
        assert out["block_ids"] == [out["local_blocks"]] * c.d_tp  # every block it asked for, per rank
        st = c.status(1)
        assert st.counters.failed == c.d_tp and st.counters.received == c.d_tp
        assert any("expired" in f.reason for f in st.failures)
        out = c.transfer(3, TOKENS)  # and the next request is served
        assert out["status"] == "received"


def test_without_confirmation_the_late_read_is_still_refused_before_its_read():
    """Confirmation vouches for a READ after it ran; the grant is asked before it runs
    (docs/security.md). With confirmation off, a read of a hold that ended is still never
    posted: it fails naming the hold, and no READ reached the prefill's memory."""
    with Cluster(SHAPE, 1, 1, daemon_args=["--no-confirm-leases"], metrics=True) as c:
        c.transfer(0, TOKENS)
        reads = nixl_transfers(c, 1)
        out = late_read(c, 0.3)
        assert out["status"] == "failed" and "no longer holds" in out["reason"], out
        assert nixl_transfers(c, 1) == reads


def test_an_announced_read_keeps_the_hold_alive_past_its_lease():
    """The decode expects the request at once, then is busy for longer than the prefill's
    lease: the claims keep the hold, the read gets the request's own bytes, and the hold ends
    `sent` (not `expired`)."""
    with Cluster(SHAPE, 2, 2, daemon_args=["--claim-s", "1"]) as c:
        c.transfer(0, TOKENS)
        blocks = c.prefill.prefill(1, TOKENS, 1.0)
        c.decode.expect(1, c.remote(1))
        time.sleep(3.5)  # three leases: renewed every ~0.7 s
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)  # verified byte for byte
        assert out["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"] * c.p_tp
        assert c.status(0).counters.expired == 0


def test_a_host_paused_past_the_claims_grant_keeps_the_hold():
    """Both daemons stopped (a paused VM, a frozen node) for longer than the decode's claims
    were granted: nobody could renew them meanwhile. On waking, the prefill daemon counts only
    the time it ran: the announced read gets the request's own bytes and the hold ends `sent`."""
    with Cluster(SHAPE, 2, 2, daemon_args=["--claim-s", "1"]) as c:
        c.transfer(0, TOKENS)
        blocks = c.prefill.prefill(1, TOKENS, 1.0)
        c.decode.expect(1, c.remote(1))
        time.sleep(0.5)  # pinned (claimed at once, renewed every ~0.7 s)
        stopped = [d.proc.pid for d in c.daemons]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)  # three grants
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)  # verified byte for byte
        assert out["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"] * c.p_tp
        assert c.status(0).counters.expired == 0


def test_a_host_paused_past_a_reads_deadline_still_delivers_it():
    """A read's bytes arrived, and it waits for the prefill daemon to vouch for them: the
    prefill engine's hold is not at its daemon yet (in vLLM the prefill answers its client a
    step before its worker sends the hold). The host then stops both daemons for longer than the
    read's deadline. A deadline counts the daemon's running time: on waking the read still
    waits, the hold comes, and the read is received with the request's bytes."""
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)  # the route exists: the read posts at once
        blocks = c.prefill.prefill(1, TOKENS, 30.0, hold=False)  # the prompt's KV; its hold not sent yet
        reads = nixl_transfers(c, 1)
        c.decode.post_read(1, TOKENS, c.remote(1), blocks, 0, 10.0)
        time.sleep(1.0)
        assert nixl_transfers(c, 1) == reads, "nothing is read before the hold grants it"
        assert c.status(1).in_flight, "the read waits for its hold"
        stopped = [d.proc.pid for d in c.daemons]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(12.0)  # past the read's deadline
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        c.prefill.hold(1, blocks, 30.0, read_token=c.read_token(1))  # the hold reaches the prefill daemon
        out = c.decode.finish_read(1, 20.0, c.p_shape, c.p_tp)  # verified byte for byte
        assert out["status"] == "received", out["reason"]
        assert c.prefill.wait_released(1, 5) == ["sent"] * c.p_tp  # our notification ended it
        assert c.status(1).counters.failed == 0


def test_a_read_completes_while_the_prefill_daemon_is_stopped_and_its_notice_ends_the_hold():
    """No READ carries a NIXL notification: with one, a READ completes only once the serving
    daemon's UCX worker progresses (notices.py). So over CMA a read announced (its grant came
    while the prefill daemon ran) whose lease needs no answer (confirmation off) is received,
    byte for byte, while the prefill daemon is stopped; once it runs again, the consumer's notice
    on the side channel ends the hold `sent`."""
    with Cluster(SHAPE, 1, 1, daemon_args=["--no-confirm-leases"]) as c:
        c.transfer(0, TOKENS)  # the route exists: the read posts at once
        blocks = c.prefill.prefill(1, TOKENS, 30.0)
        c.decode.expect(1, c.remote(1))
        time.sleep(0.5)  # its claim granted
        # and the UCX endpoint wired up whole (a READ on an endpoint still wiring up waits for the
        # peer's progress: 1 in 5 here without this second transfer)
        c.transfer(2, TOKENS)
        prefill_daemon = c.daemons[0].proc.pid
        os.kill(prefill_daemon, signal.SIGSTOP)
        try:
            out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 10.0, c.p_shape)  # verified byte for byte
        finally:
            os.kill(prefill_daemon, signal.SIGCONT)
        assert out["status"] == "received", out["reason"]
        assert c.prefill.wait_released(1, 5) == ["sent"]
        assert c.status(0).counters.unauthorized_notifs == 0


def nixl_transfers(c: Cluster, which: int) -> float:
    """READs a daemon saw DONE (its NIXL transfer-time histogram's count)."""
    with urllib.request.urlopen(f"http://{c.status(which).metrics}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvxferd_nixl_transfer_seconds_count"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(what: str, check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.02)


def test_a_read_announced_before_the_prefill_holds_keeps_the_hold_once_it_comes():
    """The decode learns of a request before the prefill engine's hold reaches its daemon (in
    vLLM the prefill answers its client before its worker's next step sends the hold): the claim
    is answered `pending` and asked again until the hold exists, then pinned past its lease.

    The claim is asked again 0.05 s after the first answer, doubling (leases.PENDING_RETRY_S): at
    ~0.77 s and ~1.57 s after the expectation. The hold's 2 s lease outlives the gap between them
    wherever its prefill lands in it (a hold of 0.5 s landing just after 0.77 s expired before
    1.57 s on a slow host, and the read failed closed, as it must)."""
    with Cluster(SHAPE, 2, 2, daemon_args=["--claim-s", "1"]) as c:
        c.transfer(0, TOKENS)
        c.decode.expect(1, c.remote(1))  # nothing held yet: pending
        time.sleep(0.5)
        blocks = c.prefill.prefill(1, TOKENS, 2.0)
        time.sleep(3.5)  # past the hold's own lease
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)  # verified byte for byte
        assert out["status"] == "received", out["reason"]
        assert c.prefill.wait_released(1, 5) == ["sent"] * c.p_tp
        assert c.status(0).counters.expired == 0


def test_a_decode_that_goes_away_stops_renewing():
    """Claims last claim_s past the last renewal: a decode engine that disconnects lets the hold
    expire, as its lease alone would."""
    with Cluster(SHAPE, 1, 1, daemon_args=["--claim-s", "1"]) as c:
        c.transfer(0, TOKENS)
        c.prefill.prefill(1, TOKENS, 0.5)
        c.decode.expect(1, c.remote(1))
        time.sleep(1.5)
        assert c.status(0).totals.held == 1  # kept past its 0.5 s lease
        c.decode.close()  # the decode engine goes: its expectation with it
        assert c.prefill.wait_released(1, 5) == ["expired"]


def test_with_renewal_off_an_announced_read_still_fails_closed():
    with Cluster(SHAPE, 1, 1, daemon_args=["--no-lease-renewal"]) as c:
        c.transfer(0, TOKENS)
        blocks = c.prefill.prefill(1, TOKENS, 0.5)
        c.decode.expect(1, c.remote(1))  # nothing kept: renewal is off
        assert c.prefill.wait_released(1, 5) == ["expired"]
        c.prefill.reuse(blocks, 2)
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "expired" in out["reason"]


def test_expiry_follows_deadlines_not_arrival():
    """A hold kept alive by claims does not hold up one behind it whose lease passed (the reaper
    that strands expired entries behind a renewed head, vllm#58222)."""
    with Cluster(SHAPE, 1, 1, daemon_args=["--claim-s", "1"]) as c:
        c.transfer(0, TOKENS)
        c.prefill.prefill(1, TOKENS, 0.5)
        c.decode.expect(1, c.remote(1))  # renewed: outlives its lease
        c.prefill.prefill(2, TOKENS, 0.5)  # arrived later, nobody claims it
        t0 = time.monotonic()
        assert c.prefill.wait_released(2, 5) == ["expired"]
        assert time.monotonic() - t0 < 2.0
        assert [h.request for h in c.status(0).held] == ["req-1"]


def test_a_read_planned_against_an_engine_restarted_under_its_id_handshakes_anew_before_its_read():
    """Before any probe notices (default every 10 s), a route still names the old registration's
    memory: the grant carries the new registration's epoch, so nothing is read on that route;
    the peer is retired and the read handshakes anew, then gets the new registration's bytes."""
    other = msgspec.structs.replace(SHAPE, num_blocks=200)  # the restarted engine's memory differs
    with Cluster(SHAPE, 2, 2) as c:
        c.transfer(0, TOKENS)  # route planned against this registration
        c.prefill.prefill(9, TOKENS, 60.0)  # its lease keeps the old memory registered after the kill
        c.prefill.proc.kill()
        deadline = time.monotonic() + 15
        while any(e.engine == "prefill" and e.state == "serving" for e in c.status(0).engines):
            assert time.monotonic() < deadline, "the killed engine's ranks never left"
            time.sleep(0.05)
        c.prefill = EngineProcess(c.daemons[0].socket, "prefill", other, 2)
        c.engines.append(c.prefill)
        c.p_shape = other
        blocks = c.prefill.prefill(1, TOKENS, 2.0)
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, other)  # verified byte for byte
        assert out["status"] == "received", out["reason"]
        assert c.prefill.wait_released(1, 30) == ["sent"] * c.p_tp
        c.prefill.free(blocks)
        assert c.transfer(2, TOKENS)["status"] == "received"  # a fresh handshake: the new memory


def test_a_refused_read_in_a_batch_lets_go_of_what_its_engine_expected(tmp_path):
    """An engine expects a request, then its read is refused (here: block lists for the wrong
    number of groups); nothing keeps the prefill's hold alive for it any more."""
    def claims_open(address: str) -> float:
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        return float(next(x for x in body.splitlines() if x.startswith("kvxferd_lease_claims_open ")).split()[1])

    daemon = DaemonProcess(tmp_path, "d", metrics_port=0)
    try:
        geo = build(SHAPE, 1, 0)
        fd, mm = create_shm(geo.buffers[0])
        with EngineClient(daemon.socket, "d", 0, 1) as c:
            c.register(geo, shm_fds=[fd])
            remote = RemoteRef("p", "127.0.0.1", 9, 2, "req-1")
            assert c.batch([c.requests.expect("d-1", remote)]) == [None]
            assert claims_open(daemon.metrics_address) == 2  # both prefill ranks' holds
            refused = c.requests.read("d-1", remote, 40, [[1, 2]], [[1, 2], [3]], 5.0)  # 2 groups: refused
            [err] = c.batch([refused])
            assert err is not None and "groups" in str(err)
            assert claims_open(daemon.metrics_address) == 0
        mm.close()
    finally:
        daemon.stop()
