"""KV integrity audit: the digest, the rows of a block, and real daemons catching reused blocks."""

import contextlib
import importlib.util
import os

import msgspec
import numpy as np
import pytest

from kvxferd import integrity
from kvxferd import protocol as P
from kvxferd.benchmarks.harness import BenchEngine
from kvxferd.client import EngineClient, RemoteRef
from kvxferd.lab.synthetic import testing
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess
from kvxferd.memory import Mapping, buffer_address, create_shm
from kvxferd.plan.models import PRESETS, build
from kvxferd.rpc import frame


def host_mapping(nbytes: int, seed: int = 0) -> tuple[Mapping, np.ndarray]:
    fd, mm = create_shm(nbytes)
    os.close(fd)
    view = np.frombuffer(mm, dtype=np.uint8)
    view[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return Mapping("DRAM", buffer_address(mm), nbytes, 0, mm), view


def test_vectorized_digests_match_the_definition():
    m, view = host_mapping(1 << 16)
    rows = np.array([[m.address, 256], [m.address + 4096, 256], [m.address + 8, 4096], [m.address + 3, 13],
                     [m.address + 100, 0], [m.address + 64, 8]], dtype=np.int64)
    got = integrity.digest_rows([m], rows)
    want = [integrity.digest_bytes(view[a - m.address:a - m.address + n]) for a, n in rows.tolist()]
    assert got.tolist() == want
    assert got[0] != got[1]  # different bytes, different digests


def test_any_changed_word_or_swap_changes_the_digest():
    data = np.random.default_rng(1).integers(0, 256, 512, dtype=np.uint8)
    base = integrity.digest_bytes(data)
    for at in (0, 7, 8, 255, 511):
        flipped = data.copy()
        flipped[at] ^= 0x40
        assert integrity.digest_bytes(flipped) != base
    words = data.view("<u8").copy()
    words[[3, 9]] = words[[9, 3]]
    assert words[3] == words[9] or integrity.digest_bytes(words.view(np.uint8)) != base


def test_rows_outside_the_memory_are_refused():
    m, _ = host_mapping(4096)
    for row in ([m.address + 4000, 200], [m.address - 8, 8], [m.address, -1], [2**63 - 2, 3], [m.address, 2**63 - 1],
                [-2**63, 16]):  # the last three wrap an int64 sum
        with pytest.raises(integrity.AuditError, match="outside the engine's registered memory"):
            integrity.digest_rows([m], np.array([row], dtype=np.int64))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_device_path_computes_the_same_digests():
    """The torch digest (what runs on a GPU's memory) gives the numpy digest's bits, here on host memory."""
    m, _ = host_mapping(1 << 16, seed=2)
    first = np.array([0, 5, 100, 7000], dtype=np.int64)
    assert (integrity._digest_uniform_torch(m, first, 32, device="cpu")
            == integrity._digest_uniform(m, first, 32)).all()


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_rows_longer_than_a_chunk_are_digested_a_chunk_at_a_time_by_the_definition(monkeypatch, path):
    """A row as long as a whole hold is digested in chunks (bounded temporaries on the host or on
    the engine's device), each chunk's weights shifted to its place: the definition's bits."""
    if path == "torch" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    monkeypatch.setattr(integrity, "CHUNK_WORDS", 1000)
    m, view = host_mapping(1 << 16, seed=4)
    first = np.array([0, 3, 4500], dtype=np.int64)
    words = 3500  # four chunks, the last one short
    got = (integrity._digest_uniform(m, first, words) if path == "numpy"
           else integrity._digest_uniform_torch(m, first, words, device="cpu"))
    want = [integrity.digest_bytes(view[8 * s:8 * (s + words)]) for s in first.tolist()]
    assert got.tolist() == want


def test_rows_not_in_whole_words_are_digested_a_chunk_at_a_time_by_the_definition(monkeypatch):
    """A row of odd offset and length, as long as a hold, costs a chunk of memory at a time, not its
    length several times over; an empty row's digest is 0."""
    monkeypatch.setattr(integrity, "CHUNK_WORDS", 1000)
    m, view = host_mapping(1 << 16, seed=6)
    spans = [(3, 8 * 3500 + 5), (8 * 7 + 1, 8 * 1000), (100, 17), (5, 0)]
    rows = np.array([(m.address + off, n) for off, n in spans], dtype=np.int64)
    want = [integrity.digest_bytes(view[off:off + n]) for off, n in spans]
    assert integrity.digest_rows([m], rows).tolist() == want
    assert want[-1] == 0


def test_block_rows_cover_exactly_the_blocks_bytes():
    """Writing group 0's block 5 changes only its rows' digests; other blocks' bytes are not in them
    (a hybrid model: attention and state groups share the buffers)."""
    shape = msgspec.structs.replace(PRESETS["mamba2"], num_blocks=16)
    geo = build(shape, 2, 1)
    bufs = testing.allocate(geo)
    maps = [Mapping("DRAM", b.ctypes.data, len(b), 0, b) for b in bufs]
    region_addr = np.array([maps[r.buffer].address + r.offset for r in geo.regions], dtype=np.int64)
    blocks = [[5, 9]] + [[2, 11]] * (len(geo.groups) - 1)  # groups share memory: distinct blocks per group
    rows, group, block = integrity.block_rows(geo, region_addr, blocks)
    assert set(block.tolist()) == {2, 5, 9, 11} and set(group.tolist()) == set(range(len(geo.groups)))
    before = integrity.digest_rows(maps, rows)
    covered = np.zeros(sum(len(b) for b in bufs), dtype=bool)
    starts = np.cumsum([0] + [len(b) for b in bufs])
    for (addr, n) in rows.tolist():
        bi = next(i for i, m in enumerate(maps) if m.address <= addr < m.address + m.nbytes)
        covered[starts[bi] + addr - maps[bi].address:starts[bi] + addr - maps[bi].address + n] = True
    flat_outside = np.flatnonzero(~covered)
    rng = np.random.default_rng(3)
    for i in rng.choice(flat_outside, 50, replace=False):  # bytes of other blocks: no digest changes
        bi = int(np.searchsorted(starts, i, side="right") - 1)
        bufs[bi][i - starts[bi]] ^= 0xFF
    assert (integrity.digest_rows(maps, rows) == before).all()
    g0 = geo.groups[0]
    testing.write_tokens(bufs, geo, 0, seq=99, blocks=[5], first_block=0, lo=0, hi=g0.tokens_per_block)
    changed = integrity.digest_rows(maps, rows) != before
    assert changed.any() and set(block[changed].tolist()) == {5} and set(group[changed].tolist()) == {0}


SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=2)


def audited_read(c: Cluster, seq: int, tokens: int, blocks, hit: int = 0, audit=None) -> dict:
    return c.decode.decode(seq, tokens, c.remote(seq), blocks, hit, 10.0, SHAPE, audit)


def test_audited_reads_are_received_byte_exact_and_counted():
    with Cluster(SHAPE, 2, 4, daemon_args=["--integrity-audit"]) as c:
        for seq, (tokens, hit) in enumerate([(37, 0), (300, 160), (16, 0)]):
            out = c.transfer(seq, tokens, hit_tokens=hit)
            assert out["status"] == "received" and out["released"] == ["sent", "sent"], out
        assert c.status(1).counters.integrity_failures == 0


def test_a_block_reused_before_the_read_is_caught_with_its_block_ids():
    with Cluster(SHAPE, 2, 4, daemon_args=["--integrity-audit"]) as c:
        c.transfer(0, 64)
        tokens = 16 * 6
        blocks = c.prefill.prefill(1, tokens, 10.0)
        reused = [[blocks[0][2], blocks[0][4]]]
        c.prefill.reuse(reused, 77)  # another prompt lands in two held blocks
        local = c.decode.post_read(1, tokens, c.remote(1), blocks, 0, 10.0)
        outcomes = c.decode.wait_read(1, 20)
        want = [[local[0][2], local[0][4]]]  # same block size: local block k holds remote block k
        assert [o[0] for o in outcomes] == ["failed"] * 4, outcomes
        assert all(o[1] == want and o[2].startswith("integrity:") for o in outcomes), outcomes
        assert c.status(1).counters.integrity_failures == 4
        c.decode.free(c.decode.drop(1))
        assert c.prefill.wait_released(1, 15) == ["expired", "expired"]  # consumers never notified
        c.prefill.free(blocks)
        out = c.transfer(2, 100)  # the next one is fine
        assert out["status"] == "received", out


def test_per_request_audit_and_a_prefill_without_digests():
    with Cluster(SHAPE, 2, 4) as c:  # integrity_audit off on both daemons
        blocks = c.prefill.prefill(1, 40, 10.0, True)  # this hold asks for digests ...
        out = audited_read(c, 1, 40, blocks, audit=True)  # ... and this read for the audit
        assert out["status"] == "received", out
        assert c.prefill.wait_released(1, 10) == ["sent", "sent"]
        c.prefill.free(blocks)
        blocks = c.prefill.prefill(2, 40, 1.0)  # held without digests
        out = audited_read(c, 2, 40, blocks, audit=True)
        assert out["status"] == "failed" and "held without digests" in out["reason"], out
        assert out["block_ids"] == [out["local_blocks"]] * 4
        assert c.status(1).counters.integrity_failures == 0  # unverifiable, not found corrupt
        c.prefill.wait_released(2, 10)
        c.prefill.free(blocks)


def test_a_read_that_outlives_its_hold_is_not_vouched_for():
    """The lease passed before the read: the prefill engine may have reused the blocks. Refused
    at its grant, before a READ (an audit would find the hold gone too)."""
    with Cluster(SHAPE, 2, 4, daemon_args=["--integrity-audit"]) as c:
        blocks = c.prefill.prefill(1, 40, 0.3)
        assert c.prefill.wait_released(1, 10) == ["expired", "expired"]
        out = audited_read(c, 1, 40, blocks)
        assert out["status"] == "failed" and "no longer holds" in out["reason"], out
        c.prefill.free(blocks)


@pytest.mark.parametrize("batched", [False, True])
def test_a_hold_whose_connection_closes_before_its_reply_is_still_audited(tmp_path, batched):
    """The hold's digests belong to the hold, not to the connection that asked for it: a
    connection gone while they are computed (its reply waits for them) leaves them to finish,
    and the consumer's audit is answered. (It was not: the closed connection's reply was
    cancelled, the digests with it, and every audit of that hold waited out its deadline.)"""
    shape = msgspec.structs.replace(PRESETS["dense"], num_blocks=256, layers=8)
    geo = build(shape, 1, 0)  # 128 MiB held: digested for tens of ms, time for the hang-up
    with contextlib.ExitStack() as stack:
        pd = DaemonProcess(tmp_path, "p", extra=["--integrity-audit"])
        stack.callback(pd.stop)
        dd = DaemonProcess(tmp_path, "d", extra=["--integrity-audit"])
        stack.callback(dd.stop)
        p = BenchEngine(pd.socket, "p", geo)
        stack.callback(p.close)
        d = BenchEngine(dd.socket, "d", geo)
        stack.callback(d.close)
        tokens = shape.block_size * 4
        prompt = testing.Sequence(7, tokens, ((0, 1, 2, 3),))
        testing.fill_sequence(p.views, geo, prompt)  # the prefill's KV of the prompt read below
        before = [v.copy() for v in d.views]
        blocks = [list(range(shape.num_blocks))]
        hold = p.client.requests.hold("r", 30.0, blocks, digest=True)
        msg = P.Batch([hold]) if batched else hold
        with EngineClient(pd.socket, "p", 0, 1) as hangs_up:
            hangs_up.attach(p.client.token)
            hangs_up.rpc.sock.sendall(frame(P.encoder.encode(msg)))  # no wait for the reply
        host, port = p.side_channel.rsplit(":", 1)
        d.client.read("r", RemoteRef("p", host, int(port), 1, "r"), tokens, [[0, 1, 2, 3]], [[0, 1, 2, 3]], 10.0,
                      audit=True)
        out = d.wait("r", 30.0)
        assert out.status == "received", out
        want = testing.expect_after_read(before, geo, prompt, [0], [shape.block_size])
        assert testing.check(d.views, want, geo) == []  # the prompt's bytes, and nothing else touched


def test_an_audit_without_the_holds_read_token_is_refused():
    """An audit's digests of small rows give their bytes back (a digest of one word is the word
    times an odd constant): a side-channel client that handshook but was never given the hold's
    token asked for the digests of every word of a held request and recovered it all, with no
    READ. An audit is a read: without the token it is refused; with it (the reader's) answered."""
    import asyncio

    import zmq.asyncio

    from kvxferd import handshake as hs
    from kvxferd.plan.descriptors import region_addresses

    with Cluster(SHAPE, 1, 1, daemon_args=["--integrity-audit"]) as c:
        victim = c.prefill.prefill(1, 40, 30.0, read_token=c.read_token(1))

        async def audit(token: str) -> hs.AuditReply:
            ctx = zmq.asyncio.Context()
            try:
                reply = await hs.request(ctx, c.host, c.port, "prefill", 10.0, "a-stranger")
                rank = reply.ranks[0]
                rows, _, _ = integrity.block_rows(rank.geometry, region_addresses(rank.geometry, rank.buffer_addrs),
                                                  victim)
                words = np.concatenate([np.arange(a, a + n, 8) for a, n in rows[:4].tolist()])
                asked = np.stack([words, np.full_like(words, 8)], axis=1).astype("<i8").tobytes()
                return await hs.audit(ctx, c.host, c.port, hs.AuditRequest(
                    hs.HANDSHAKE_VERSION, "prefill", 0, "req-1", asked, token), 10.0)
            finally:
                ctx.destroy(0)
        stranger = asyncio.run(audit(""))
        assert not stranger.ok and "another read token" in stranger.reason and not stranger.digests
        assert not asyncio.run(audit("x" * 32)).ok  # a guessed token
        assert asyncio.run(audit(c.read_token(1))).ok  # the reader's own audit
        out = c.decode.decode(1, 40, c.remote(1), victim, 0, 10.0, c.p_shape, audit=True)
        assert out["status"] == "received", out
