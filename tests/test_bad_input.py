"""Bad input: fuzzed decoders and geometry validation (hypothesis), and a live daemon fed
truncated, oversized, mistyped and out-of-range requests. Every case gets a clear error;
the daemon stays up and serves the next valid request."""

import os
import socket
import struct
import time

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd import handshake as hs
from kvxferd import identity as idn
from kvxferd import leases as leases_mod
from kvxferd import protocol as P
from kvxferd.client import Client, DaemonError
from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.memory import create_shm
from kvxferd.nixl_driver import metadata_agent
from kvxferd.plan.descriptors import RequestBlocks, request_indices
from kvxferd.plan.geometry import ATTENTION, STATE, CacheGroup, Geometry, GeometryError, Region, Segment, View, validate
from kvxferd.plan.models import PRESETS, build
from kvxferd.plan.planner import PlanError, plan_rank
from kvxferd.rpc import FrameError, FrameReader
from kvxferd.vllm.handoff import HandoffError, parse_remote

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64, layers=2)
DECODE_ERRORS = P.DECODE_ERRORS

# --- decoders ---------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
ops = st.sampled_from(["hello", "register", "unregister", "hold", "read", "poll", "status", "bogus"])


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_request_decoder_random_bytes(data):
    try:
        P.request_decoder.decode(data)
    except DECODE_ERRORS:
        pass


@settings(max_examples=400, deadline=None)
@given(ops, st.dictionaries(st.sampled_from(["engine_id", "tp_rank", "tp_size", "geometry", "memory",
                                              "request_id", "lease_s", "remote", "num_tokens", "local_blocks",
                                              "remote_blocks", "wait_s", "version", "x"]), msgpack_values))
def test_request_decoder_wrong_types(op, fields):
    try:
        P.request_decoder.decode(msgspec.msgpack.encode({"op": op, **fields}))
    except DECODE_ERRORS:
        pass


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=40), st.lists(st.integers(0, P.MAX_BLOCK_ID), max_size=8)), max_size=4))
def test_block_lists_of_any_bytes_become_ids_in_range_or_a_refusal(blocks):
    try:
        P.check_blocks(blocks)
    except P.RequestError as exc:
        assert exc.code == "bad_request" and "packed block ids" in str(exc)
        return
    for ids, listed in zip(P.block_arrays(blocks), blocks, strict=True):
        assert ids.dtype == np.int64 and (not len(ids) or 0 <= ids.min() <= ids.max() <= P.MAX_BLOCK_ID)
        assert len(ids) == (len(listed) // 4 if isinstance(listed, bytes) else len(listed))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_notification_decoder_random_bytes(data):
    parsed = hs.decode_notification(data)
    assert parsed is None or isinstance(parsed, hs.Notification)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_handshake_decoders_random_bytes(data):
    for decoder in (hs._req_decoder, hs._reply_decoder, hs._audit_reply_decoder, hs._probe_reply_decoder,
                    hs.lease_reply_decoder):
        try:
            decoder.decode(data)
        except DECODE_ERRORS:
            pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=4), st.lists(st.integers(0, 50), max_size=6))
def test_a_grant_of_any_bytes_is_refused_or_bounds_the_read(blocks, read_ids):
    """What a peer grants (leases.unpack_grant): whole int32 ids, sorted, or nothing; a read's ids
    outside it are named (at most 8 a group) and a read of a group it does not list is refused."""
    granted = leases_mod.unpack_grant(blocks)
    if granted is None:
        assert any(len(b) % 4 for b in blocks)
        return
    read = [np.array(read_ids, dtype=np.int64)] * len(granted)
    outside = leases_mod.ungranted(granted, read)
    for g, ids, out in zip(granted, read, outside):
        assert set(out) == set(ids[~np.isin(ids, g)][:8].tolist())
        assert set(out) <= set(read_ids) and not set(out) & set(g.tolist())
    assert leases_mod.ungranted(granted, [*read, np.array([1])])[-1] == [1]  # a group it does not list: refused


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.sampled_from([k.decode() for k in (zmq.curve_keypair()[0], zmq.curve_keypair()[0])]),
       st.binary(max_size=64), st.text(max_size=50))
def test_names_and_keys_a_peer_or_client_sends_are_attributed_or_refused(name, sender, blob, named_key):
    """Attribution (identity.py): a requester with a key's fingerprint speaks for that key alone,
    any other name for nobody else's; a metadata blob names a bounded agent or none; a daemon key a
    client names is 40 characters of Z85 or refused."""
    keyed = f"{name}-{idn.fingerprint(sender)}"
    assert idn.speaks_for(keyed, sender) and idn.fingerprinted(keyed)
    assert idn.speaks_for(name, sender) == (not idn.fingerprinted(name) or name.endswith(idn.fingerprint(sender)))
    assert metadata_agent(blob) == ""  # not NIXL's layout
    named = name.encode()
    assert metadata_agent(b"nixlSerDes|Agent" + len(named).to_bytes(8, "little") + named + blob) == name
    assert metadata_agent(b"nixlSerDes|Agent" + (len(named) + len(blob) + 1).to_bytes(8, "little") + named + blob) == ""
    params = {"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
              "remote_block_ids": [1], "tp_size": 1, "remote_daemon_key": named_key}
    try:
        assert parse_remote(params, 1).remote.daemon_key == named_key
        assert named_key == "" or idn.Z85_KEY.fullmatch(named_key)
    except HandoffError as exc:
        assert "remote_daemon_key" in str(exc) and not idn.Z85_KEY.fullmatch(named_key)


def _mutated_replies():
    """Real replies with bytes changed: deeper than random bytes (a string that is not UTF-8 among
    them, which msgspec reports as UnicodeDecodeError, not as its own DecodeError)."""
    enc = msgspec.msgpack.encode
    done = [P.Completion("r", "received", nbytes=1), P.Completion("s", "failed", [[1]])]
    real = [enc(r) for r in (P.Welcome(10, "kvxferd"), P.Ok(), P.Error("version", "no"), P.Completions(done))]
    return st.tuples(st.sampled_from(real), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4)
                     ).map(lambda t: bytes(_poke(bytearray(t[0]), t[1])))


def _poke(data: bytearray, edits: list[tuple[int, int]]) -> bytearray:
    for at, value in edits:
        if data:
            data[at % len(data)] = value
    return data


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200) | _mutated_replies())
def test_a_daemon_s_reply_of_any_bytes_is_a_reply_or_a_frame_error(data):
    """What the engine's client makes of a reply: the reply, the daemon's refusal, or FrameError
    (the worker treats the connection as lost); never another exception into the engine."""
    from kvxferd.client import _reply

    try:
        _reply(data, P.Completions)
    except (FrameError, DaemonError):
        pass


def _mutated_records():
    """Doorbell records (a completion's, a failure's, the marker) with bytes changed, and one whose
    request id is not UTF-8."""
    def framed(c: P.Completion) -> bytes:
        body = msgspec.msgpack.encode(c)
        return struct.pack("<I", len(body)) + body

    real = [framed(P.Completion("r", "received", nbytes=1 << 20, seconds=0.1)) + struct.pack("<I", 0),
            framed(P.Completion("s", "failed", [[1, 2, 3]], "deadline")),
            framed(P.Completion("xy", "sent")).replace(b"\xa2xy", b"\xa1\xff") + b"\0"]  # not UTF-8
    return st.tuples(st.sampled_from(real), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=3)
                     ).map(lambda t: bytes(_poke(bytearray(t[0]), t[1])))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300) | _mutated_records(),
       st.integers(0, 300), st.integers(0, 1 << 48), st.integers(-(1 << 17), 1 << 17))
def test_what_a_doorbell_brings_is_records_or_a_doorbell_error(data, cut, tail, ahead):
    """The engine's side of the doorbell, from a daemon that writes anything: pipe bytes cut
    anywhere, and a ring whose head is anywhere near the engine's tail (fuzz target `doorbell`)."""
    import mmap

    from kvxferd import doorbell as D

    try:
        records = D.Records()
        for chunk in (data[:cut], data[cut:]):
            assert all(isinstance(c, P.Completion) for c in records.feed(chunk)[0])
    except D.DoorbellError:
        pass
    page = mmap.mmap(-1, D.RING_PAGE)
    reader = D.RingReader(page)
    try:
        reader.tail = tail
        reader.w[D.HEAD] = max(tail + ahead, 0)
        at = tail % D.RING_BYTES
        for i, byte in enumerate(data):  # from the tail on, wrapping as the daemon writes
            page[D.RING_DATA + (at + i) % D.RING_BYTES] = byte
        try:
            taken = reader.take()
            assert len(taken) <= D.RING_BYTES and reader.tail == max(tail + ahead, 0)
            D.parse_whole(taken)
        except D.DoorbellError:
            pass
    finally:
        reader.close()


def test_containers_nested_past_the_interpreter_s_limit_are_refused_by_name():
    """A few KB of nested arrays in a field nobody knows: msgspec skips it recursively and raises
    RecursionError, which every decoder of untrusted bytes reports as what it is."""
    from kvxferd import doorbell as D
    from kvxferd.client import _reply

    deep = b"\x82\xaarequest_id\xa1r\xa1x" + b"\x91" * 3000 + b"\x90"
    with pytest.raises(DECODE_ERRORS):
        P.request_decoder.decode(deep)
    with pytest.raises(FrameError, match="undecodable reply"):
        _reply(deep, P.Completions)
    with pytest.raises(D.DoorbellError, match="undecodable record"):
        D.Records().feed(struct.pack("<I", len(deep)) + deep)
    assert hs.decode_notification(b"\x84\xa6engine\xa1p\xa1x" + b"\x91" * 3000 + b"\x90") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(0, 3))
def test_frame_reader_any_chunking(chunks, cut):
    reader = FrameReader(max_frame=64)
    stream = b"".join(struct.pack(">I", len(c)) + c for c in chunks)
    got = []
    step = cut + 1
    for i in range(0, len(stream), step):
        got += reader.feed(stream[i:i + step])
    assert got == [c for c in chunks]


def test_frame_reader_refuses_oversized_frame():
    with pytest.raises(FrameError, match="exceeds the 64 B limit"):
        FrameReader(max_frame=64).feed(struct.pack(">I", 65) + b"x")


# --- geometry validation ------------------------------------------------------

small = st.integers(-4, 70)


@st.composite
def geometries(draw):
    buffers = tuple(draw(st.lists(st.integers(-10, 4096), min_size=1, max_size=2)))
    regions = tuple(Region(draw(st.integers(-1, 2)), draw(small), draw(st.integers(-10, 2048)))
                    for _ in range(draw(st.integers(1, 3))))
    groups = []
    for gi in range(draw(st.integers(1, 2))):
        segs = tuple(Segment(f"s{i}", draw(small), draw(small), draw(small), draw(small), draw(small), draw(small),
                             draw(st.sampled_from(["unit_major", "token_major", "x"])))
                     for i in range(draw(st.integers(1, 2))))
        views = tuple(View(f"v{vi}", draw(st.integers(-1, 3)), draw(st.integers(-4, 512)), draw(small), segs)
                      for vi in range(draw(st.integers(1, 2))))
        groups.append(CacheGroup(f"g{gi}", draw(st.sampled_from([ATTENTION, STATE, "nope"])), draw(small),
                                 draw(st.integers(-1, 4)), views))
    return Geometry("m", "bf16", 1, draw(st.integers(-1, 1)), buffers, regions, tuple(groups))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries(), st.lists(st.integers(-5, 80), max_size=6), st.integers(-5, 400))
def test_geometry_validation_and_planning_never_crash(geo, blocks, num_tokens):
    """Invalid geometries are refused with GeometryError; valid ones plan and index in bounds."""
    try:
        validate(geo)
    except GeometryError:
        return
    try:
        plan = plan_rank(geo, {0: geo})
        ids = RequestBlocks.of(num_tokens, [blocks] * len(geo.groups), [blocks] * len(geo.groups))
        for rank, (lids, rids) in request_indices(plan, ids).items():
            peer = plan.peers[rank]
            assert lids.min() >= 0 and lids.max() < peer.num_local_descs
            assert rids.min() >= 0 and rids.max() < peer.num_remote_descs
    except PlanError:
        pass


def test_geometry_errors_name_the_field():
    geo = build(SHAPE, 1, 0)
    bad = msgspec.structs.replace(geo, regions=(Region(0, 0, geo.buffers[0] * 2), *geo.regions[1:]))
    with pytest.raises(GeometryError, match=r"region 0: \[0, \+\d+\) outside buffer 0"):
        validate(bad)


# --- a live daemon ------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    with Cluster(SHAPE, 1, 2) as c:
        yield c


def raw(c: Cluster, payload: bytes, close: bool = True) -> bytes:
    """Send raw bytes to the decode daemon; return what it answers before closing."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(c.daemons[1].socket)
    s.sendall(payload)
    if close:
        s.shutdown(socket.SHUT_WR)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        pass
    s.close()
    return out


def reply_of(data: bytes) -> P.Msg:
    (n,) = struct.unpack(">I", data[:4])
    return P.reply_decoder.decode(data[4:4 + n])


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_oversized_frame_is_refused_and_connection_closed(cluster):
    reply = reply_of(raw(cluster, struct.pack(">I", 1 << 30) + b"xxxx", close=False))
    assert isinstance(reply, P.Error) and reply.code == "bad_request" and "exceeds" in reply.message


def test_truncated_frame_and_garbage(cluster):
    assert raw(cluster, struct.pack(">I", 100) + b"only-ten-b") == b""  # nothing to answer, no crash
    reply = reply_of(raw(cluster, frame(b"\xc1\xff\x00garbage")))
    assert isinstance(reply, P.Error) and reply.code == "bad_request" and "malformed request" in reply.message
    reply = reply_of(raw(cluster, frame(msgspec.msgpack.encode({"op": "read", "engine_id": 5}))))
    assert isinstance(reply, P.Error) and "engine_id" in reply.message


def call_error(c: Cluster, msg: P.Msg, fds=(), as_rank: int | None = None) -> DaemonError:
    """The error the decode daemon answers `msg` with; `as_rank`: sent on a connection attached
    to that decode rank (it belongs to the engine's process, not this one)."""
    with Client(c.daemons[1].socket) as client:
        if as_rank is not None:
            client.call(P.Attach("decode", as_rank, c.decode.tokens()[as_rank]), P.Ok)
        with pytest.raises(DaemonError) as err:
            client.call(msg, P.Ok, list(fds))
    return err.value


def test_register_with_bad_geometry_or_memory(cluster):
    geo = build(SHAPE, 2, 0)
    fd, mm = create_shm(geo.buffers[0])
    try:
        huge = msgspec.structs.replace(geo, buffers=(1 << 50,))
        e = call_error(cluster, P.Register("x", 0, 2, huge, [P.MemoryHandle("shm", 1 << 50)]), [os.dup(fd)])
        assert e.code == "bad_request" and "shared memory fd holds" in str(e), str(e)
        e = call_error(cluster, P.Register("x", 5, 2, geo, [P.MemoryHandle("shm", geo.buffers[0])]), [os.dup(fd)])
        assert "geometry is for rank 0/2, registration for 5/2" in str(e)
        e = call_error(cluster, P.Register("x", 0, 2, geo, [P.MemoryHandle("shm", geo.buffers[0])]))
        assert "1 file descriptors, 0 arrived" in str(e)
        e = call_error(cluster, P.Register("x", 0, 2, geo, [P.MemoryHandle("shm", 16)]), [os.dup(fd)])
        assert "buffer 0: handle of 16 B" in str(e)
        e = call_error(cluster, P.Register("decode", 0, 2, build(SHAPE, 2, 0),
                                           [P.MemoryHandle("shm", geo.buffers[0])]), [os.dup(fd)])
        assert "already registered" in str(e)
    finally:
        os.close(fd)
        mm.close()


def test_requests_for_unknown_engines_and_bad_values(cluster):
    e = call_error(cluster, P.Hold("ghost", 0, "r"))
    assert e.code == "unknown_engine"
    e = call_error(cluster, P.Poll("decode", 7))
    assert e.code == "unknown_engine" and "rank 7" in str(e)
    remote = P.RemoteRef("prefill", cluster.host, cluster.port, 1, "r")
    e = call_error(cluster, P.Read("decode", 0, "r1", remote, 10, [[0]], [[0]], deadline_s=-1))
    assert "deadline_s -1" in str(e)
    e = call_error(cluster, P.Read("decode", 0, "r1", remote, 10, [[0], [1]], [[0]]))
    assert e.code == "forbidden"  # the rank is the engine process's
    e = call_error(cluster, P.Read("decode", 0, "r1", remote, 10, [[0], [1]], [[0]]), as_rank=0)
    assert "block lists for 2/1 groups" in str(e)
    e = call_error(cluster, P.Hello(99))
    assert e.code == "version"


def test_holds_name_distinct_blocks_the_engine_has_and_a_batch_is_all_or_nothing(cluster):
    """A hold with an unknown or repeated block is refused and leaves nothing held (with digests
    it once stayed held for ever); a batch with one such hold applies none of its items."""
    for ids, why in [([[64]], "out of range 0..63"), ([[3, 5, 3]], "appears twice"), ([[1], [2]], "groups")]:
        e = call_error(cluster, P.Hold("decode", 0, "bad", 5.0, ids, digest=True), as_rank=0)
        assert e.code == "bad_request" and why in str(e), e
    with Client(cluster.daemons[1].socket) as client:
        client.call(P.Attach("decode", 0, cluster.decode.tokens()[0]), P.Ok)
        results = client.call(P.Batch([P.Hold("decode", 0, "b1", 0.5, [[1]], digest=True),
                                        P.Hold("decode", 0, "b2", 0.5, [[2, 1 << 20]], digest=True),
                                        P.Hold("decode", 0, "b3", 0.5, [[3]], digest=True)]), P.Results)
        assert [r.message.startswith(P.NOT_APPLIED) for r in results.items] == [True, False, True], results
        assert "out of range" in results.items[1].message
        assert not {h.request for h in cluster.status(1).held} & {"b1", "b2", "b3", "bad"}
        again = client.call(P.Batch([P.Hold("decode", 0, "b1", 0.5, [[1]], digest=True),
                                      P.Hold("decode", 0, "b3", 0.5, [[3]], digest=True)]), P.Results)
    assert [type(r).__name__ for r in again.items] == ["Ok", "Ok"], again
    assert {"b1", "b3"} <= {h.request for h in cluster.status(1).held}
    deadline = time.monotonic() + 10  # they end by their lease
    while {h.request for h in cluster.status(1).held} & {"b1", "b3"} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {h.request for h in cluster.status(1).held} & {"b1", "b2", "b3", "bad"}


def test_packed_block_lists_are_checked_as_lists_are(cluster):
    """Protocol 8's packed ids come from the engine's process too: a length that is not whole
    ids, a negative id, an id the geometry lacks or a repeated one is refused by name (a batch
    with such an item applies none), and nothing is held or read."""
    def packed(*ids: int) -> bytes:
        return np.array(ids, dtype="<i4").tobytes()

    for ids, why in [([b"\x01\x00\x00"], "3 bytes: not a whole number of 4-byte ids"),
                     ([packed(1, -5)], "packed block ids [-5] out of range 0..2147483647"),
                     ([packed(2, 64)], "block ids [64] out of range 0..63"),
                     ([packed(3, 5, 3)], "appears twice"),
                     ([packed(*range(64), 7)], "65 block ids for 64 blocks")]:
        e = call_error(cluster, P.Hold("decode", 0, "bad", 5.0, ids), as_rank=0)
        assert e.code == "bad_request" and why in str(e), e
    remote = P.RemoteRef("prefill", cluster.host, cluster.port, 1, "r")
    e = call_error(cluster, P.Read("decode", 0, "r1", remote, 10, [packed(0)], [b"\x00" * 5]), as_rank=0)
    assert e.code == "bad_request" and "5 bytes" in str(e), e
    with Client(cluster.daemons[1].socket) as client:
        client.call(P.Attach("decode", 0, cluster.decode.tokens()[0]), P.Ok)
        results = client.call(P.Batch([P.Hold("decode", 0, "p1", 0.5, [packed(1)]),
                                        P.Read("decode", 0, "p2", remote, 10, [packed(0)], [packed(-1)])]), P.Results)
    assert results.items[0].message.startswith(P.NOT_APPLIED), results
    assert "out of range" in results.items[1].message, results
    st = cluster.status(1)
    assert not {h.request for h in st.held} & {"bad", "p1"} and not st.in_flight


def test_the_client_never_packs_an_id_that_would_wrap():
    """Packing is int32: an id past MAX_BLOCK_ID would land on another block, so `pack_blocks`
    refuses it and the client sends such a list as ints, which the daemon refuses by name, as
    before protocol 8; below PACK_MIN_IDS ids, and for protocol 7 daemons, lists stay ints."""
    from kvxferd.client import PACK_MIN_IDS, Requests

    remote = P.RemoteRef("prefill", "h", 1, 1, "r")
    long = list(range(PACK_MIN_IDS))
    read = Requests("d", 0, 1, 8).read("r", remote, 10, [long, long[:3]], [np.array(long)], 1.0)
    assert read.local_blocks == [np.array(long, dtype="<i4").tobytes(), [0, 1, 2]]
    assert P.block_arrays(read.remote_blocks)[0].tolist() == long
    assert Requests("d", 0, 1, 7).read("r", remote, 10, [long], [long], 1.0).local_blocks == [long]
    for bad in ([*long, 1 << 31], [*long, 1 << 32], [*long, -1], [*long, 1 << 70]):
        with pytest.raises(ValueError, match="block ids"):
            P.pack_blocks(bad)
        assert Requests("d", 0, 1, 8).hold("r", 1.0, [bad]).block_ids == [bad]
        with pytest.raises((msgspec.ValidationError, OverflowError)):  # the daemon's decoder refuses it
            P.request_decoder.decode(P.encoder.encode(Requests("d", 0, 1, 8).hold("r", 1.0, [bad])))  # (2**70: no
            # msgpack int holds it, the encoder raises first, as before protocol 8)


def test_block_ids_out_of_range_fail_the_request(cluster):
    blocks = cluster.prefill.prefill(1, 20, 1.0)
    cluster.decode.post_read(1, 20, cluster.remote(1), [[1000, 1001]], 0, 5.0)
    outcomes = cluster.decode.wait_read(1, 10)
    assert all(o[0] == "failed" and "remote block ids [1000, 1001] out of range" in o[2] for o in outcomes)
    cluster.prefill.wait_released(1, 10)
    cluster.prefill.free(blocks)


def test_handshake_garbage(cluster):
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://{cluster.host}:{cluster.port}")
        req.send(b"\xa3\xff\xfe\xfd")  # a msgpack string of invalid UTF-8
        assert req.poll(5000)
        reply = hs._reply_decoder.decode(req.recv())
        assert not reply.ok and "malformed side-channel request" in reply.reason
        dealer = ctx.socket(zmq.DEALER)  # wrong envelope: ignored
        dealer.connect(f"tcp://{cluster.host}:{cluster.port}")
        dealer.send_multipart([b"a", b"b", b"c"])
        req2 = ctx.socket(zmq.REQ)
        req2.connect(f"tcp://{cluster.host}:{cluster.port}")
        req2.send(msgspec.msgpack.encode(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "nobody")))
        assert req2.poll(5000)
        assert "not registered" in hs._reply_decoder.decode(req2.recv()).reason
        for s in (req, dealer, req2):
            s.close(0)
    finally:
        ctx.term()


def test_audit_requests_out_of_bounds(cluster):
    """Audits come from the network: rows outside the request's blocks (wrapping int64 sums among
    them, once a SIGSEGV), floods of rows, unknown requests, torn rows."""
    blocks = cluster.prefill.prefill(20, 40, 5.0, True)  # held with digests
    ctx = zmq.Context()

    def ask(request_id: str, rows: bytes) -> hs.AuditReply:
        sock = ctx.socket(zmq.REQ)
        sock.connect(f"tcp://{cluster.host}:{cluster.port}")
        sock.send(msgspec.msgpack.encode(hs.AuditRequest(hs.HANDSHAKE_VERSION, "prefill", 0, request_id, rows)))
        assert sock.poll(5000)
        reply = hs._audit_reply_decoder.decode(sock.recv())
        sock.close(0)
        return reply

    try:
        for rows in ([[0, 64]], [[1 << 40, 8]], [[4096, -8]], [[2**63 - 2, 3]], [[16, 2**63 - 1]], [[-2**63, 8]]):
            reply = ask("req-20", np.array(rows, dtype="<i8").tobytes())
            assert not reply.ok and "lies outside request 'req-20'" in reply.reason, reply
        flood = ask("req-20", np.ones((1 << 20, 2), dtype="<i8").tobytes())
        assert not flood.ok and "not in whole 8-byte words" in flood.reason, flood
        assert "not whole (address, length) pairs" in ask("req-20", b"\0" * 24).reason
        never = ask("req-nothing", b"")  # not held yet: a read may overtake its engine's hold
        assert not never.ok and never.retry and "is not held yet" in never.reason
        reply = ask("req-20", b"")  # no rows: nothing to answer, and a re-digest of the hold saved
        assert not reply.ok and not reply.retry and "must name the rows" in reply.reason
        cluster.prefill.wait_released(20, 10)
        ended = ask("req-20", b"")  # its hold ended: no more waiting for it
        assert not ended.ok and not ended.retry and "lease passed" in ended.reason
    finally:
        ctx.term()
    cluster.prefill.free(blocks)


def test_daemon_still_serves_after_all_of_the_above(cluster):
    for seq in range(10, 13):
        out = cluster.transfer(seq, num_tokens=45, hit_tokens=16)
        assert out["status"] == "received" and out["released"] == ["sent"]
    assert cluster.daemons[1].proc.poll() is None and cluster.daemons[0].proc.poll() is None


@pytest.mark.parametrize("items, why", [
    ([P.Ok()], "1 results to a batch of 2"),
    ([P.Ok(), P.Ok(), P.Ok()], "3 results to a batch of 2"),
    ([P.Error("bad_request", P.NOT_APPLIED + "x")] * 2, "held back all 2 orders"),
])
def test_a_batch_answer_that_is_not_one_result_per_order_is_a_frame_error(items, why):
    """From a daemon that answers a batch wrongly, no order passes for accepted unanswered."""
    from kvxferd.client import _each_applied

    with pytest.raises(FrameError, match=why):
        _each_applied([P.Expect("e", 0, "a", P.RemoteRef("p", "h", 1, 1, "a"))] * 2, lambda todo: P.Results(items))
