"""A hold is a capability (docs/security.md), attacked through real daemons as a hostile decode
engine, HTTP client or peer would.

Each attack worked before read tokens and grants: a READ was posted at once and claimed in
parallel, so the bytes reached the attacker's memory whatever the claim said. Now nothing is
read that the hold does not grant to the token presented; `kvxferd_nixl_transfer_seconds_count`
on the decode daemon (READs it saw DONE) shows that no READ ran.
"""

from __future__ import annotations

import msgspec
import pytest
from test_leases import nixl_transfers
from test_serving import _side_channel

from kvxferd import handshake as hs
from kvxferd.client import new_read_token
from kvxferd.lab.synthetic.demo import Cluster, DemoError
from kvxferd.plan.models import PRESETS

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=2)
TOKENS = 40


def test_a_read_of_another_requests_blocks_under_its_own_hold_is_refused_before_a_byte_moves():
    """The attacker's own request is held (it holds the token), and its read names the victim's
    block ids: refused `forbidden`, naming the blocks, with no READ."""
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)  # the route exists
        victim = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        own = c.prefill.prefill(2, TOKENS, 30.0, read_token=c.read_token(2))
        reads = nixl_transfers(c, 1)
        out = c.decode.decode(2, TOKENS, c.remote(2), victim, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "forbidden" in out["reason"], out["reason"]
        assert not set(victim[0]) & set(own[0])
        assert f"does not grant blocks [[{victim[0][0]}" in out["reason"], out["reason"]
        assert out["block_ids"] == [out["local_blocks"]]  # the engine learns which blocks hold nothing
        assert nixl_transfers(c, 1) == reads
        assert c.transfer(3, TOKENS)["status"] == "received"  # and honest reads go on


def test_a_read_without_the_holds_token_is_refused_and_reads_nothing():
    """Request ids are not secrets: a decode that names the victim's request and blocks but not
    its token is denied by the prefill daemon, before any READ."""
    with Cluster(SHAPE, 2, 1, metrics=True) as c:
        c.transfer(0, TOKENS)
        victim = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        guessed = msgspec.structs.replace(c.remote(1), read_token=new_read_token())
        reads = nixl_transfers(c, 1)
        out = c.decode.decode(1, TOKENS, guessed, victim, 0, 5.0, c.p_shape)
        assert out["status"] == "failed" and "read token" in out["reason"], out["reason"]
        assert nixl_transfers(c, 1) == reads
        # the victim's own read still gets its bytes (verified byte for byte), and its hold ends sent
        assert c.decode.decode(1, TOKENS, c.remote(1), victim, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"] * c.p_tp
        assert c.status(1).counters.failed == 1


def test_a_read_naming_a_request_that_is_not_held_reads_nothing():
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        ghost = msgspec.structs.replace(c.remote(1), request_id="req-never-held")
        reads = nixl_transfers(c, 1)
        out = c.decode.decode(1, TOKENS, ghost, blocks, 0, 1.0, c.p_shape)
        assert out["status"] == "failed" and "expired" in out["reason"], out["reason"]
        assert nixl_transfers(c, 1) == reads


def test_a_notice_in_another_readers_name_without_the_token_does_not_end_its_hold():
    """A peer that handshook sends notices in the victim decode daemon's agent name for the
    victim's request: without the hold's token they count for nothing, the victim's read is
    received with its own bytes, and its notice ends the hold `sent`."""
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)
        victim_agent = c.status(1).agent
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        forged = hs.Notification("prefill", 0, "req-1", 1)  # no token: all the forger knows
        _side_channel(c, hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", "forger"),
                      hs.NoticeRequest(hs.NOTICE_VERSION, victim_agent, [forged, forged]))
        assert c.status(0).held, "the forged notices ended the victim's hold"
        assert c.status(0).counters.unauthorized_notifs >= 2
        assert c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"]


def test_a_hold_refuses_a_short_token_and_a_renewal_under_another():
    with Cluster(SHAPE, 1, 1) as c:
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        with pytest.raises(DemoError, match="at least 32"):
            c.prefill.hold(2, blocks, 30.0, read_token="short")
        with pytest.raises(DemoError, match="another read_token"):
            c.prefill.hold(1, blocks, 30.0, read_token=new_read_token())


def test_a_grant_is_not_reused_once_the_hold_it_came_from_ended():
    """A decode engine announces a second local request for a prefill request, then reads it
    once: that read's notice ends the hold `sent` (its one consumer) and the prefill engine
    reuses the blocks. The announced second read's grant is no longer alive: it fails, and no
    READ reaches the reused blocks."""
    with Cluster(SHAPE, 1, 1, metrics=True) as c:
        c.transfer(0, TOKENS)
        blocks = c.prefill.prefill(1, TOKENS, 30.0, read_token=c.read_token(1))
        c.decode.expect(2, c.remote(1))  # granted now, for the read that comes second
        assert c.decode.decode(1, TOKENS, c.remote(1), blocks, 0, 5.0, c.p_shape)["status"] == "received"
        assert c.prefill.wait_released(1, 5) == ["sent"]
        c.prefill.reuse(blocks, 3)  # another prompt's KV in the freed blocks
        reads = nixl_transfers(c, 1)
        out = c.decode.decode(2, TOKENS, c.remote(1), blocks, 0, 3.0, c.p_shape)
        assert out["status"] == "failed" and "no longer holds" in out["reason"], out["reason"]
        assert nixl_transfers(c, 1) == reads


class _RawEngine:
    """One rank of a geometry of its own choosing on a real daemon, its memory at hand."""

    def __init__(self, socket: str, engine_id: str, geo) -> None:
        import os

        import numpy as np

        from kvxferd.client import EngineClient
        from kvxferd.memory import buffer_address, create_shm
        from kvxferd.plan.descriptors import region_addresses

        self.geo, self.client = geo, EngineClient(socket, engine_id, geo.tp_rank, geo.tp_size)
        fd, self.mm = create_shm(geo.buffers[0], engine_id)
        self.view = np.frombuffer(self.mm, dtype=np.uint8)
        self.side_channel = self.client.register(geo, shm_fds=[fd])
        os.close(fd)
        self.base = buffer_address(self.mm)
        self.region_addr = region_addresses(geo, [self.base])

    def _spans(self, blocks):
        from kvxferd.integrity import block_rows

        rows, _, _ = block_rows(self.geo, self.region_addr, blocks)
        return [(a - self.base, n) for a, n in rows.tolist()]

    def fill(self, blocks, value: int) -> None:
        for off, n in self._spans(blocks):
            self.view[off:off + n] = value

    def values(self, blocks) -> set[int]:
        return {int(v) for off, n in self._spans(blocks) for v in set(self.view[off:off + n].tolist())}


@pytest.mark.parametrize("same_node", [False, True])
def test_a_reader_listing_its_cache_groups_in_another_order_reads_only_what_is_granted(tmp_path, same_node):
    """The planner pairs cache groups by name. A decode engine registering the same hybrid model
    with its groups in another order named its own hold's swa ids in its full list (and the other
    way round): a grant checked by group position passed, and the READ took another request's
    blocks. The grant is now checked by group name: refused with nothing read; the same reader
    naming its own blocks in its own order is received, with its own bytes."""
    from kvxferd import protocol as P
    from kvxferd.lab.synthetic.demo import DaemonProcess
    from kvxferd.plan.models import build

    shape = msgspec.structs.replace(PRESETS["gemma4"], num_blocks=64, layers=1, full_kv_heads=8, full_head_dim=32)
    pgeo = build(shape, 1, 0)  # groups swa and full, 16 tokens a block each
    dgeo = msgspec.structs.replace(pgeo, groups=tuple(reversed(pgeo.groups)))  # same model, groups reordered
    assert [g.name for g in pgeo.groups] != [g.name for g in dgeo.groups]
    prefill_daemon = DaemonProcess(tmp_path, "p")
    decode_daemon = prefill_daemon if same_node else DaemonProcess(tmp_path, "d")
    try:
        pre = _RawEngine(prefill_daemon.socket, "prefill", pgeo)
        dec = _RawEngine(decode_daemon.socket, "decode", dgeo)
        host, port = pre.side_channel.rsplit(":", 1)
        victim, own = [[20, 21, 22], [0, 1, 2]], [[0, 1, 2], [20, 21, 22]]  # per prefill group
        pre.fill(victim, 0xAA)
        pre.fill(own, 0x11)
        token = new_read_token()
        pre.client.hold("victim", 60.0, victim, read_token=new_read_token())
        pre.client.hold("own", 60.0, own, read_token=token)
        ref = P.RemoteRef("prefill", host, int(port), 1, "own", token, pre.client.daemon_key)
        tokens, local = 3 * shape.block_size, [[5, 6, 7], [8, 9, 10]]

        def read(request: str, remote) -> P.Completion:
            dec.client.read(request, ref, tokens, local, remote, 10.0)
            done = []
            while not done:
                done = dec.client.poll(10.0)
            return done[0]
        swapped = read("r1", [own[0], own[1]])  # the decode's full list = own swa ids: the victim's full blocks
        assert swapped.status == "failed" and "does not grant" in swapped.reason, swapped
        assert dec.values(local) == {0}
        honest = read("r2", [own[1], own[0]])  # its own blocks, in its own group order
        assert honest.status == "received", honest
        assert dec.values(local) == {0x11}
    finally:
        prefill_daemon.stop()
        if not same_node:
            decode_daemon.stop()
