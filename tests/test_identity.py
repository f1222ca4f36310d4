"""Identity is the key (identity.py, docs/security.md): per-daemon CurveZMQ keys, attacked through
real daemons.

Each daemon has its own keypair; each admits the others' public keys. A read dials the key its
remote names (the prefill daemon's, from its engine's registration); every side-channel request
is attributed to the key that sent it, so a peer that holds a hold's read token still cannot
claim, unpin or notify in another daemon's name.
"""

from __future__ import annotations

import asyncio
import shutil

import msgspec
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from test_faults import wait_for

from kvxferd import handshake as hs
from kvxferd.identity import CurveKeys, fingerprint, generate_keys, speaks_for
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess
from kvxferd.plan.models import PRESETS

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64, layers=2)
TOKENS = 40


@pytest.fixture
def nodes(tmp_path):
    """Keypairs of a prefill node, a decode node and a third authorized node (the attacker),
    each made by `kvxferd keys generate`; the prefill admits both others, the decode both too."""
    for name in ("p", "d", "a", "stranger"):
        generate_keys(str(tmp_path / name))
    for admitting, admitted in (("p", "d"), ("p", "a"), ("d", "p"), ("d", "a"), ("a", "p")):
        shutil.copy(tmp_path / admitted / "kvxferd.key", tmp_path / admitting / "authorized" / f"{admitted}.key")
    return tmp_path


def start(nodes, name: str) -> DaemonProcess:
    return DaemonProcess(nodes, f"{name}-daemon",
                         extra=["--curve-secret-key", str(nodes / name / "kvxferd.key_secret"),
                                "--handshake-timeout", "1"])


def public(nodes, name: str) -> str:
    return zmq.auth.load_certificate(nodes / name / "kvxferd.key")[0].decode()


def test_a_read_dials_the_prefill_daemons_own_key_and_only_an_authorized_one(nodes):
    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        assert c.daemon_key == public(nodes, "p")  # what the prefill's registration handed out
        assert c.status(1).agent.endswith("-" + fingerprint(public(nodes, "d")))
        # naming no key, the decode daemon dials its default (its own key): the prefill is not it
        blocks = c.prefill.prefill(0, TOKENS, 30.0, read_token=c.read_token(0))
        nameless = msgspec.structs.replace(c.remote(0), daemon_key="")
        out = c.decode.decode(0, TOKENS, nameless, blocks, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "no handshake answer" in out["reason"], out["reason"]
        # a key the decode daemon has not authorized is not dialed at all
        stranger = msgspec.structs.replace(c.remote(0), daemon_key=public(nodes, "stranger"))
        out = c.decode.decode(0, TOKENS, stranger, blocks, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "is not among the authorized keys" in out["reason"], out["reason"]
        assert public(nodes, "stranger") in out["reason"]
        # the key the remote names: received, byte for byte
        assert c.decode.decode(0, TOKENS, c.remote(0), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        c.prefill.wait_released(0, 5)
        c.prefill.free(blocks)
        assert c.transfer(1, TOKENS)["status"] == "received"
        # a full prefix hit reads nothing: its notification still ends the hold (on the side channel)
        whole = SHAPE.block_size * 3
        assert c.transfer(2, whole, hit_tokens=whole)["released"] == ["sent"]


def test_an_announced_read_claims_under_the_key_its_remote_names_before_any_handshake(nodes):
    """vLLM announces a read (`expect`) before it reads: the claims leave before any handshake
    proved the prefill daemon's key, and dial the key the remote names (a claim dialing another
    key would be refused at the ZMTP handshake, counted `unauthenticated` by the prefill)."""
    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        blocks = c.prefill.prefill(0, TOKENS, 30.0, read_token=c.read_token(0))
        c.decode.expect(0, c.remote(0))
        wait_for(lambda: c.status(0).held and c.status(0).held[0].age_s >= 0, 5, "the hold")
        assert c.decode.decode(0, TOKENS, c.remote(0), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.status(0).counters.unauthenticated_peers == 0


def test_a_key_taken_out_of_the_authorized_directory_is_read_no_more(nodes):
    """The operator removes the prefill daemon's key from the decode daemon's authorized keys:
    the peer is retired (`revoked`) without a restart, and a read naming that key is refused
    before anything is dialed."""
    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        assert c.transfer(0, TOKENS)["status"] == "received"
        (nodes / "d" / "authorized" / "p.key").unlink()
        wait_for(lambda: c.status(1).counters.peers_retired >= 1, 15, "the peer's retirement")
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        out = c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "is not among the authorized keys" in out["reason"], out["reason"]


async def _as_attacker(nodes, c: Cluster, requests: list[hs.SideRequest]) -> list[hs.SideReply | None]:
    """Send each request on one link under the attacker's own (authorized) key; the replies to
    those that are answered, None for notices."""
    pub, sec = zmq.auth.load_certificate(nodes / "a" / "kvxferd.key_secret")
    curve = CurveKeys(pub, sec, c.daemon_key.encode(), "")
    ctx = zmq.asyncio.Context()
    link = ctx.socket(zmq.DEALER)
    link.setsockopt(zmq.LINGER, 1000)
    link.curve_secretkey, link.curve_publickey, link.curve_serverkey = curve.secret, curve.public, curve.server_public
    link.connect(f"tcp://{c.host}:{c.port}")
    out: list[hs.SideReply | None] = []
    try:
        for req in requests:
            await link.send_multipart([b"", hs.encode(req)])
            if isinstance(req, hs.NoticeRequest):
                out.append(None)
                continue
            assert await link.poll(10_000), f"no answer to {req}"
            kind = hs.LeaseReply if isinstance(req, hs.LeaseRequest) else hs.HandshakeReply
            out.append(msgspec.msgpack.decode((await link.recv_multipart())[-1], type=kind))
        return out
    finally:
        link.close()
        ctx.term()


def test_a_peer_holding_the_token_cannot_act_in_another_daemons_name(nodes):
    """The attacker's daemon key is authorized and it was given the victim request's read token
    (it saw the prefill's answer). In the victim decode daemon's name, its handshake, claim (an
    unpin) and notices are refused, counted `misattributed`; the victim reads its bytes and its
    own notice ends the hold `sent`. Under its own name the same token works (the control)."""
    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        c.transfer(0, TOKENS)
        victim = c.status(1).agent
        mine = f"kvxferd-1-00-{fingerprint(public(nodes, 'a'))}"
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        token = c.read_token(1)
        notice = hs.Notification("prefill", 0, "req-1", 1, token)
        unpin = hs.LeaseRequest(hs.GRANT_VERSION, 7, victim, 0.0, [hs.Claimed("prefill", 0, "req-1", token)],
                                release=True)
        handshake, lease, _ = asyncio.run(_as_attacker(nodes, c, [
            hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", victim), unpin,
            hs.NoticeRequest(hs.NOTICE_VERSION, victim, [notice])]))
        assert isinstance(handshake, hs.HandshakeReply) and not handshake.ok
        assert "not the agent of the key" in handshake.reason
        assert isinstance(lease, hs.LeaseReply) and not lease.ok and lease.seq == 7
        assert "not the agent of the key" in lease.reason and public(nodes, "a") in lease.reason
        assert c.status(0).counters.misattributed == 3
        assert [h.request for h in c.status(0).held] == ["req-1"], "a forged notice ended the victim's hold"
        assert c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"]
        c.prefill.free(blocks)

        # the control: under the attacker's own name the token is honoured (it may consume)
        blocks = c.prefill.prefill(2, TOKENS, 30.0, read_token=c.read_token(2))
        own = hs.Notification("prefill", 0, "req-2", 1, c.read_token(2))
        handshake, _ = asyncio.run(_as_attacker(nodes, c, [
            hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", mine),
            hs.NoticeRequest(hs.NOTICE_VERSION, mine, [own])]))
        assert isinstance(handshake, hs.HandshakeReply) and handshake.ok
        assert c.prefill.wait_released(2, 5) == ["sent"]
        assert c.status(0).counters.misattributed == 3
        c.prefill.free(blocks)


def test_speaks_for_binds_fingerprinted_names_to_their_key():
    a, b = (zmq.curve_keypair()[0].decode() for _ in range(2))
    name = f"kvxferd-12-abcdef-{fingerprint(a)}"
    assert speaks_for(name, a) and not speaks_for(name, b)
    other = fingerprint(a)[:-1] + ("1" if fingerprint(a)[-1] == "0" else "0")
    assert not speaks_for(f"kvxferd-12-abcdef-{other}", a)
    assert speaks_for("kvxferd-12-abcdef", b)  # a daemon's from before fingerprints: unattributed
    assert speaks_for("", b)
    assert not speaks_for("kvxferd-12-abcdef", b, unattributed=False)  # ... refused where none are accepted
    assert not speaks_for("", b, unattributed=False)
    assert speaks_for(name, a, unattributed=False)


def test_a_read_naming_another_authorized_key_fails_alone(nodes):
    """A hostile client names the attacker's key (authorized at the decode, public as every key
    is) for the prefill's address, before any honest read: its handshake fails, and only it. An
    honest read at the same moment dials the key its own remote names and is received."""
    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        wrong = c.prefill.prefill(0, TOKENS, 30.0, read_token=c.read_token(0))
        right = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        c.decode.post_read(0, TOKENS, msgspec.structs.replace(c.remote(0), daemon_key=public(nodes, "a")), wrong, 0,
                           5.0)
        c.decode.post_read(1, TOKENS, c.remote(1), right, 0, 5.0)
        assert [o[0] for o in c.decode.wait_read(1, 15)] == ["received"]
        failed = c.decode.wait_read(0, 15)
        assert [o[0] for o in failed] == ["failed"] and "no handshake answer" in failed[0][2], failed


def test_a_nixl_notification_in_a_keyed_daemons_name_counts_for_nothing(nodes):
    """NIXL reports the sender name its sender declares. An attacker that handshook under its own
    key names its NIXL agent as the victim decode daemon (whose name carries its key's
    fingerprint) and notifies, with the token, over NIXL: a keyed daemon's notices travel on the
    side channel, so the prefill counts this one `unauthorized`, and the victim's hold stays."""
    from kvxferd.nixl_driver import nixl_api

    with Cluster(SHAPE, 1, 1, daemons=[start(nodes, "p"), start(nodes, "d")]) as c:
        c.transfer(0, TOKENS)
        victim = c.status(1).agent
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        pub, sec = zmq.auth.load_certificate(nodes / "a" / "kvxferd.key_secret")

        async def handshake() -> hs.HandshakeReply:
            ctx = zmq.asyncio.Context()
            try:
                return await hs.request(ctx, c.host, c.port, "prefill", 5.0, f"kvxferd-1-00-{fingerprint(pub)}",
                                        CurveKeys(pub, sec, c.daemon_key.encode(), ""))
            finally:
                ctx.destroy(0)
        reply = asyncio.run(handshake())
        api = nixl_api()
        poser = api.nixl_agent(victim, api.nixl_agent_config(backends=["UCX"]))
        target = poser.add_remote_agent(reply.all_metadata[0])
        before = c.status(0).counters.unauthorized_notifs
        poser.send_notif(target, msgspec.msgpack.encode(hs.Notification("prefill", 0, "req-1", 1, c.read_token(1))))
        wait_for(lambda: c.status(0).counters.unauthorized_notifs > before, 10, "the forged notification")
        assert [h.request for h in c.status(0).held] == ["req-1"]
        assert c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"]


def test_metadata_names_its_agent():
    from kvxferd.nixl_driver import metadata_agent, nixl_api

    api = nixl_api()
    agent = api.nixl_agent("kvxferd-7-ab-k" + "0" * 32, api.nixl_agent_config(backends=["UCX"]))
    assert metadata_agent(agent.get_agent_metadata()) == "kvxferd-7-ab-k" + "0" * 32
    assert metadata_agent(b"nixlSerDes|Agent" + (1 << 40).to_bytes(8, "little") + b"x") == ""
    assert metadata_agent(b"something else") == ""


@pytest.mark.parametrize("accepted", [False, True])
def test_a_requester_name_without_a_fingerprint_is_refused_unless_the_operator_accepts_them(nodes, accepted):
    """A name without a key's fingerprint (a daemon's from before protocol 12) could be posed as
    by any authorized peer. A keyed daemon refuses such requests by default, counted
    `misattributed`, and counts no NIXL notification at all; `unattributed_peers = true` (an
    upgrade under way) answers them."""
    import os

    os.environ["KVXFERD_UNATTRIBUTED_PEERS"] = "true" if accepted else "false"
    try:
        prefill = start(nodes, "p")
    finally:
        del os.environ["KVXFERD_UNATTRIBUTED_PEERS"]
    with Cluster(SHAPE, 1, 1, daemons=[prefill, start(nodes, "d")]) as c:
        c.transfer(0, TOKENS)  # the honest pair is attributed either way
        legacy = "kvxferd-1-00"
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        claim = hs.LeaseRequest(hs.GRANT_VERSION, 3, legacy, 0.0, [hs.Claimed("prefill", 0, "req-1", c.read_token(1))])
        handshake, lease = asyncio.run(_as_attacker(nodes, c, [
            hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", legacy), claim]))
        assert isinstance(handshake, hs.HandshakeReply) and isinstance(lease, hs.LeaseReply)
        if accepted:
            assert handshake.ok and lease.ok, (handshake.reason, lease.reason)
            assert c.status(0).counters.misattributed == 0
        else:
            assert not handshake.ok and "names no daemon key's fingerprint" in handshake.reason
            assert not lease.ok and "unattributed_peers" in lease.reason
            assert c.status(0).counters.misattributed == 2
        assert c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        if accepted:  # what the setting gives up: the name's claim pins the hold past its reader's notice
            assert [h.request for h in c.status(0).held] == ["req-1"]
        else:
            assert c.prefill.wait_released(1, 5) == ["sent"]
