"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that parses untrusted input.

    python fuzz/fuzz_kvxferd.py TARGET [libFuzzer flags]     e.g. -max_total_time=300 -print_final_stats=1
    python fuzz/fuzz_kvxferd.py all --seconds 60             each target in turn, a summary table

Targets (each must only return or raise the documented error; anything else is a finding):

    request       engine requests off the Unix socket, and   -> msgspec decode errors,
                  their block lists (packed or not) as ids      RequestError
    side_channel  handshake/audit/lease requests and         -> msgspec decode errors, None
                  replies, READ notifications from peers
    grant         a lease reply's granted blocks, unpacked    -> None, or sorted int32 arrays;
                  and checked against a read's block ids        the ids outside them, per group
    frames        the Unix socket's length-prefixed frames   -> FrameError
                  fed in arbitrary chunks
    geometry      registered geometries: presets mutated     -> GeometryError, PlanError
                  field by field, validated, planned against
                  another TP size, indexed (ids in bounds)
    audit_rows    rows an audit names, digested in place     -> AuditError (a bad row must
                  (a wrong bound would read outside memory)     never be read: that crashes)
    audit         a whole audit request's rows against a      -> a refusal, or one digest per
                  held request (bounds, bytes, unaligned)       row (never a read outside it)
    plan_budget   peers of any page size over caches of up    -> PlanError, GeometryError, or
                  to 2^31 blocks: counted, never built          counts that are whole and >= 0,
                                                                refused as the budget says
    doorbell      what an engine reads from its daemon's      -> DoorbellError
                  doorbell: pipe bytes cut anywhere, and a
                  ring page of any head, tail and bytes

The `cov`/`ft` columns count instrumented Python edges and features; msgspec's decoders are C,
which atheris does not see, so `request` and `side_channel` mutate their seeds without coverage
feedback. Needs `pip install -e '.[fuzz]'`. Not part of the test suite's time budget; the hypothesis
tests in tests/test_bad_input.py keep a smaller version of each in CI.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["kvxferd", "msgspec"]):
    import msgspec
    import numpy as np

    from kvxferd import doorbell as D
    from kvxferd import handshake as hs
    from kvxferd import identity as idn
    from kvxferd import integrity
    from kvxferd import leases as leases_mod
    from kvxferd import protocol as P
    from kvxferd.memory import Mapping
    from kvxferd.nixl_driver import metadata_agent
    from kvxferd.plan.descriptors import RequestBlocks, request_indices
    from kvxferd.plan.geometry import Geometry, GeometryError, validate
    from kvxferd.plan.models import PRESETS, build
    from kvxferd.plan.planner import PlanError, plan_rank
    from kvxferd.rpc import FrameError, FrameReader
    from kvxferd.vllm.handoff import HandoffError, parse_remote

DECODE_ERRORS = P.DECODE_ERRORS


def fuzz_request(data: bytes) -> None:
    try:
        msg = P.request_decoder.decode(data)
    except DECODE_ERRORS:
        return
    orders = msg.items if isinstance(msg, P.Batch) else [msg]
    for order in orders:  # block lists, packed or not, become ids in 0..MAX_BLOCK_ID or a refusal
        for blocks in ([order.block_ids] if isinstance(order, P.Hold) else
                       [order.local_blocks, order.remote_blocks] if isinstance(order, P.Read) else []):
            try:
                P.check_blocks(blocks)
                arrays = P.block_arrays(blocks)
            except P.RequestError:
                continue
            for ids in arrays:
                assert ids.dtype == np.int64 and (not len(ids) or 0 <= ids.min() <= ids.max() <= P.MAX_BLOCK_ID)


def fuzz_side_channel(data: bytes) -> None:
    for decoder in (hs._req_decoder, hs._reply_decoder, hs._arriving_decoder, hs._audit_reply_decoder,
                    hs._probe_reply_decoder, hs.lease_reply_decoder):
        try:
            decoder.decode(data)
        except DECODE_ERRORS:
            pass
    parsed = hs.decode_notification(data)
    assert parsed is None or isinstance(parsed, hs.Notification)


def fuzz_grant(data: bytes) -> None:
    try:
        reply = hs.lease_reply_decoder.decode(data)
    except DECODE_ERRORS:
        return
    read = (np.arange(3, dtype=np.int64), np.array([0, 7, 1 << 30], dtype=np.int64))
    for answer in reply.answers:
        granted = leases_mod.unpack_grant(answer.blocks)
        if granted is None:
            assert any(len(b) % 4 for b in answer.blocks)
            continue
        assert all(g.dtype == np.dtype("<i4") and (np.diff(g) >= 0).all() for g in granted)
        outside = leases_mod.ungranted(granted, read)
        assert len(outside) == len(read) and all(len(o) <= 8 for o in outside)


def fuzz_identity(data: bytes) -> None:
    """Attribution and the daemon keys a peer or a client names: a name with a fingerprint speaks
    for its key alone, a metadata blob names at most a bounded agent, a named key is Z85 or refused."""
    requester, _, sender = data.decode("utf-8", "replace").partition("\0")
    allowed = idn.speaks_for(requester, sender)
    assert allowed == (not idn.fingerprinted(requester) or requester.endswith("-" + idn.fingerprint(sender)))
    strict = idn.speaks_for(requester, sender, unattributed=False)  # a keyed daemon's default
    assert strict == (idn.fingerprinted(requester) and requester.endswith("-" + idn.fingerprint(sender)))
    assert len(metadata_agent(data)) <= 4096
    try:
        remote = msgspec.msgpack.decode(data, type=P.RemoteRef)
    except DECODE_ERRORS:
        remote = None
    assert remote is None or remote.daemon_key == "" or idn.Z85_KEY.fullmatch(remote.daemon_key)
    try:
        params = msgspec.msgpack.decode(data)
    except DECODE_ERRORS:
        return
    if isinstance(params, dict):
        try:
            prefill = parse_remote(params, 1)
        except HandoffError:
            return
        key = prefill.remote.daemon_key
        assert key == "" or idn.Z85_KEY.fullmatch(key)


def fuzz_frames(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    reader = FrameReader(max_frame=fdp.ConsumeIntInRange(0, 512))
    try:
        while fdp.remaining_bytes():
            reader.feed(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64)))
    except FrameError:
        pass


PRESET_NAMES = sorted(PRESETS)


def _int_paths(obj: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int):
        return [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _int_paths(v, (*path, k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _int_paths(v, (*path, i))]
    return []


def _set(obj: object, path: tuple[object, ...], value: object) -> None:
    for key in path[:-1]:
        obj = obj[key]  # type: ignore[index]
    obj[path[-1]] = value  # type: ignore[index]


def fuzz_geometry(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    shape = msgspec.structs.replace(PRESETS[PRESET_NAMES[fdp.ConsumeIntInRange(0, len(PRESET_NAMES) - 1)]],
                                    num_blocks=fdp.ConsumeIntInRange(1, 64))
    local_tp, remote_tp = (1 << fdp.ConsumeIntInRange(0, 3)), (1 << fdp.ConsumeIntInRange(0, 3))
    try:
        local = build(shape, local_tp, fdp.ConsumeIntInRange(0, local_tp - 1))
        remotes = {r: build(shape, remote_tp, r) for r in range(remote_tp)}
    except (GeometryError, PlanError, ValueError):
        return
    tree = msgspec.to_builtins(local)
    paths = _int_paths(tree)
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        _set(tree, paths[fdp.ConsumeIntInRange(0, len(paths) - 1)],
             fdp.ConsumeIntInRange(-4, 1 << 20) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-2, 66))
    try:
        geo = validate(msgspec.convert(tree, Geometry))
        plan = plan_rank(geo, remotes)
        blocks = [fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 8), 0, 70) for _ in geo.groups]
        req = RequestBlocks.of(fdp.ConsumeIntInRange(0, 2000), blocks, blocks)
        for rank, (lids, rids) in request_indices(plan, req).items():
            peer = plan.peers[rank]
            assert lids.min() >= 0 and lids.max() < peer.num_local_descs, "local descriptor id out of range"
            assert rids.min() >= 0 and rids.max() < peer.num_remote_descs, "remote descriptor id out of range"
    except (msgspec.ValidationError, GeometryError, PlanError):
        pass


_AUDIT_MEMORY = np.zeros(1 << 14, dtype=np.uint8)
_AUDIT_MAPS = [Mapping("DRAM", _AUDIT_MEMORY.ctypes.data, 8192, 0, _AUDIT_MEMORY),
               Mapping("DRAM", _AUDIT_MEMORY.ctypes.data + 8192 + 64, 4096, 0, _AUDIT_MEMORY)]


def fuzz_audit_rows(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    base = _AUDIT_MAPS[0].address
    rows = [(base + fdp.ConsumeIntInRange(-64, (1 << 14) + 64), fdp.ConsumeIntInRange(-8, 9000))
            for _ in range(fdp.ConsumeIntInRange(0, 16))]
    try:
        digests = integrity.digest_rows(_AUDIT_MAPS, np.array(rows, dtype=np.int64).reshape(-1, 2))
        assert len(digests) == len(rows)
    except integrity.AuditError:
        pass


def _held_world() -> tuple[object, object, list[list[int]]]:
    """A tiny registered rank over numpy memory and a hold of some of its blocks."""
    from types import SimpleNamespace

    from kvxferd.holds import HeldDigests
    from kvxferd.plan.descriptors import region_addresses

    geo = build(msgspec.structs.replace(PRESETS["dense"], num_blocks=8, layers=1, block_size=4), 1, 0)
    memory = np.arange(geo.buffers[0], dtype=np.uint64).astype(np.uint8)
    mapping = Mapping("DRAM", memory.ctypes.data, geo.buffers[0], 0, memory)
    er = SimpleNamespace(geometry=geo, mappings=[mapping], region_addr=region_addresses(geo, [mapping.address]))
    held = [[1, 3, 4]]
    return er, HeldDigests.of(er, held), held  # type: ignore[arg-type]


_HELD = None


def fuzz_audit(data: bytes) -> None:
    global _HELD
    from kvxferd.holds import _audit_rows

    if _HELD is None:
        _HELD = _held_world()
    er, when_held, _ = _HELD
    fdp = atheris.FuzzedDataProvider(data)
    spans = when_held.rows  # type: ignore[attr-defined]
    rows = []
    for _ in range(fdp.ConsumeIntInRange(0, 24)):
        if fdp.ConsumeBool():  # near a held row: the edges are where bounds go wrong
            a, n = spans[fdp.ConsumeIntInRange(0, len(spans) - 1)]
            rows.append((int(a) + fdp.ConsumeIntInRange(-16, int(n) + 16), fdp.ConsumeIntInRange(-16, int(n) + 16)))
        else:
            rows.append((fdp.ConsumeIntInRange(-(1 << 63), (1 << 63) - 1),
                         fdp.ConsumeIntInRange(-(1 << 63), (1 << 63) - 1)))
    raw = np.array(rows, dtype="<i8").reshape(-1, 2).tobytes()
    reply, nbytes = _audit_rows(er, when_held, raw, "request r")  # type: ignore[arg-type]
    if reply.ok:
        assert len(reply.digests) == 8 * len(rows) and nbytes >= 0


def fuzz_plan_budget(data: bytes) -> None:
    from kvxferd.peers import FREE_DESCRIPTORS, over_budget
    from kvxferd.reading import MIN_ROW_BYTES

    fdp = atheris.FuzzedDataProvider(data)
    name = PRESET_NAMES[fdp.ConsumeIntInRange(0, len(PRESET_NAMES) - 1)]
    local_tp, remote_tp = (1 << fdp.ConsumeIntInRange(0, 3)), (1 << fdp.ConsumeIntInRange(0, 3))
    try:
        local = build(msgspec.structs.replace(PRESETS[name], num_blocks=fdp.ConsumeIntInRange(1, 1 << 16),
                                              block_size=1 << fdp.ConsumeIntInRange(0, 8)), local_tp, 0)
        remote_shape = msgspec.structs.replace(PRESETS[name], num_blocks=fdp.ConsumeIntInRange(1, (1 << 31) - 1),
                                               block_size=1 << fdp.ConsumeIntInRange(0, 8))
        remotes = {r: build(remote_shape, remote_tp, r) for r in range(remote_tp)}
        plan = plan_rank(validate(local), {r: validate(g) for r, g in remotes.items()})
    except (GeometryError, PlanError, ValueError):
        return
    for pp in plan.peers.values():
        assert int(pp.num_local_descs) >= 0 and int(pp.num_remote_descs) >= 0, "a descriptor count wrapped"
    budget = fdp.ConsumeIntInRange(1, 1 << 40)
    total = sum(int(pp.num_local_descs) + int(pp.num_remote_descs) for pp in plan.peers.values())
    nbytes = sum(int(length) * (int(lph) * int(lpg) + int(rph) * int(rpg)) for pp in plan.peers.values()
                 for length, lph, lpg, rph, rpg in zip(pp.length, pp.local_phases, pp.local_pages, pp.remote_phases,
                                                       pp.remote_pages))
    small_rows = total > FREE_DESCRIPTORS and nbytes < total * MIN_ROW_BYTES
    assert bool(over_budget(plan, budget)) == (total > budget or small_rows)


def fuzz_doorbell(data: bytes) -> None:
    """The first byte cuts the pipe's bytes in two reads; the first 16 are also the engine's tail
    and the daemon's head (as offsets from it), the rest the ring's bytes from the tail on."""
    import mmap

    records = D.Records()
    cut = data[0] % (len(data) + 1) if data else 0
    try:
        for chunk in (data[:cut], data[cut:]):
            out, _ = records.feed(chunk)
            assert all(isinstance(c, P.Completion) for c in out)
    except D.DoorbellError:
        pass
    page = mmap.mmap(-1, D.RING_PAGE)
    reader = D.RingReader(page)
    reader.tail = int.from_bytes(data[:8], "little") % (1 << 48)
    head = reader.tail + int.from_bytes(data[8:16], "little", signed=True) % (2 * D.RING_BYTES) - D.RING_BYTES // 2
    D.U64.pack_into(page, D.RING_HEAD, head % (1 << 64))
    body = data[16:16 + D.RING_BYTES]
    at = reader.tail % D.RING_BYTES
    first = body[:D.RING_BYTES - at]
    page[D.RING_DATA + at:D.RING_DATA + at + len(first)] = first
    page[D.RING_DATA:D.RING_DATA + len(body) - len(first)] = body[len(first):]
    try:
        taken = reader.take()
        assert len(taken) <= D.RING_BYTES
        D.parse_whole(taken)
    except D.DoorbellError:
        pass
    finally:
        page.close()


def seeds(target: str) -> list[bytes]:
    """Valid inputs to start from: mutations of real messages reach deeper than random bytes."""
    enc = msgspec.msgpack.encode
    geo = build(msgspec.structs.replace(PRESETS["dense"], num_blocks=4, layers=1), 1, 0)
    ref = P.RemoteRef("prefill", "10.0.0.1", 5600, 2, "req-1", "ab" * 16)
    if target == "request":
        return [enc(m) for m in (
            P.Hello(3), P.Register("e", 0, 1, geo, [P.MemoryHandle("shm", geo.buffers[0])]), P.Unregister("e", 0),
            P.Hold("e", 0, "r", 5.0, [[1, 2]], True),
            P.Hold("e", 0, "r", 5.0, [[1]], None, "cd" * 16),
            P.Read("e", 0, "r", ref, 40, [[1, 2]], [[3, 4]], 5.0, True),
            P.Read("e", 0, "r", ref, 40, [P.pack_blocks([1, 2])], [P.pack_blocks([3, 4]), [5]], 5.0),
            P.Batch([P.Hold("e", 0, "r", 5.0, [[1]])]), P.Poll("e", 0, 1.0, 16), P.StatusQuery(),
            P.Expect("e", 0, "r", ref),
            P.Batch([P.Expect("e", 0, "r", ref), P.Read("e", 0, "r", ref, 40, [[1]], [[3]], 5.0)]),
            P.Read("e", 0, "r", msgspec.structs.replace(ref, daemon_key="rq[:4ikL5ecO=*C@}2uN8#sBzt(}A.T4+/X7{%Fa"), 40,
                   [[1]], [[3]], 5.0),
            P.Attach("e", 0, "ab" * 16))]
    if target == "side_channel":
        return [enc(hs.HandshakeRequest(hs.HANDSHAKE_VERSION, "prefill", "d")),
                enc(hs.AuditRequest(hs.HANDSHAKE_VERSION, "prefill", 0, "r", np.arange(4, dtype="<i8").tobytes())),
                enc(hs.HandshakeReply(True, agent="a", metadata=b"m",
                                      ranks=[hs.RankInfo(0, 1, "h", [4096], geometry=geo)])),
                enc(hs.AuditReply(True, digests=b"\0" * 16, reused=[[1]])),
                enc(hs.ProbeRequest(hs.HANDSHAKE_VERSION, "prefill")), enc(hs.ProbeReply(True, epoch="e")),
                enc(hs.Notification("prefill", 0, "r", 2)), enc(hs.Notification("prefill", 0, "r", 2, "ab" * 16)),
                enc(hs.LeaseRequest(hs.GRANT_VERSION, 1, "d", 20.0, [hs.Claimed("prefill", 0, "r", "ab" * 16, True)])),
                enc(hs.NoticeRequest(hs.NOTICE_VERSION, "d", [hs.Notification("prefill", 0, "r", 1, "ab" * 16)])),
                enc(hs.LeaseReply(True, seq=1, answers=[hs.ClaimAnswer("held", 20.0, "e", [b"\1\0\0\0"]),
                                                        hs.ClaimAnswer("denied")]))]
    if target == "grant":
        return [enc(hs.LeaseReply(True, seq=1, answers=[
            hs.ClaimAnswer("held", 20.0, "e", [np.arange(5, dtype="<i4").tobytes(), b""]),
            hs.ClaimAnswer("held", 1.0, "", [b"\7\0\0"])]))]
    if target == "identity":
        key = "rq[:4ikL5ecO=*C@}2uN8#sBzt(}A.T4+/X7{%Fa"
        return [f"kvxferd-1-ab-{idn.fingerprint(key)}\0{key}".encode(), b"nixlSerDes|Agent\x05" + bytes(7) + b"agent",
                enc(msgspec.structs.replace(ref, daemon_key=key)),
                enc({"remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600,
                     "remote_block_ids": [1, 2], "tp_size": 1, "remote_daemon_key": key})]
    if target == "doorbell":
        record = D.HEADER.pack(0) + b"".join(
            D.HEADER.pack(len(b)) + b for b in (enc(P.Completion("r", "received", nbytes=1 << 20, seconds=0.1)),
                                                enc(P.Completion("s", "failed", [[1, 2, 3]], "deadline"))))
        return [bytes(16) + record, bytes(8) + len(record).to_bytes(8, "little") + record]
    return []


TARGETS = {"request": fuzz_request, "side_channel": fuzz_side_channel, "frames": fuzz_frames,
           "geometry": fuzz_geometry, "audit_rows": fuzz_audit_rows, "audit": fuzz_audit,
           "plan_budget": fuzz_plan_budget, "doorbell": fuzz_doorbell, "grant": fuzz_grant,
           "identity": fuzz_identity}


def run_all(seconds: int) -> None:
    """Each target in its own libFuzzer process for `seconds`; print runs and coverage."""
    print(f"{'target':<13} {'runs':>10} {'runs/s':>8} {'cov':>6} {'ft':>6}  result")
    for name in TARGETS:
        with tempfile.TemporaryDirectory(prefix=f"kvxferd-fuzz-{name}-") as corpus:
            for i, seed in enumerate(seeds(name)):
                Path(corpus, f"seed-{i}").write_bytes(seed)
            out = subprocess.run([sys.executable, __file__, name, corpus, f"-max_total_time={seconds}",
                                  "-print_final_stats=1"], capture_output=True, text=True)
        log = out.stdout + out.stderr
        runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
        cov = re.findall(r"cov: (\d+) ft: (\d+)", log)
        n = int(runs.group(1)) if runs else 0
        c, f = cov[-1] if cov else ("-", "-")  # no instrumented Python edge reached: C decoders only
        result = "clean" if out.returncode == 0 else f"FINDING (exit {out.returncode}); see the crash file it wrote"
        print(f"{name:<13} {n:>10} {n / seconds:>8.0f} {c:>6} {f:>6}  {result}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "all":
        parser = argparse.ArgumentParser(description="run every target for a while")
        parser.add_argument("all")
        parser.add_argument("--seconds", type=int, default=60)
        run_all(parser.parse_args().seconds)
        return
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}|all}} [libFuzzer flags]")
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
