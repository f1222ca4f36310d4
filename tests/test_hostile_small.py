"""Smaller hostile-input defects: the Curve secret key's mode from creation, strings from engines
and peers reaching the operator's terminal and the text log, the metrics exporter's request caps,
and CUDA VMM resources released on every failed step of a mapping."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from kvxferd import logs, memory
from kvxferd import protocol as P
from kvxferd.client import Client, EngineClient
from kvxferd.lab.synthetic.demo import DaemonProcess
from kvxferd.memory import MappingError, create_shm
from kvxferd.plan.models import ModelShape, build
from kvxferd.status import render

SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=8, block_size=4, num_blocks=16)

# Terminal attacks: OSC title set + BEL, clear screen, CSI in its 8-bit C1 form, a bidi override,
# DEL, and a newline starting what looks like a line of its own.
HOSTILE = "e\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e\x7f\nFAKE LINE"
CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def kvxferd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "kvxferd", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# --- 1. keys generate ---------------------------------------------------------------------------


def test_keys_generate_secret_never_readable_by_others(tmp_path, monkeypatch):
    """Under umask 0 the secret is 0600 from its creation: no chmod afterwards ever finds it open
    to others (a chmod spy records the file's mode whenever one is made)."""
    from typer.testing import CliRunner

    from kvxferd.cli import app

    seen: list[int] = []
    real_chmod, real_fchmod = os.chmod, os.fchmod

    def chmod(path, mode, *a, **kw):
        seen.append(os.stat(path).st_mode & 0o777)
        return real_chmod(path, mode, *a, **kw)

    def fchmod(fd, mode):
        seen.append(os.fstat(fd).st_mode & 0o777)
        return real_fchmod(fd, mode)

    monkeypatch.setattr(os, "chmod", chmod)
    monkeypatch.setattr(os, "fchmod", fchmod)
    with umask(0):
        result = CliRunner().invoke(app, ["keys", "generate", str(tmp_path / "keys")])
    assert result.exit_code == 0, result.output
    secret = tmp_path / "keys" / "kvxferd.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert all(mode & 0o077 == 0 for mode in seen), [oct(m) for m in seen]


def test_keys_generate_umask_0_refuses_overwrite_and_force(tmp_path):
    import zmq.auth

    keys = tmp_path / "keys"
    with umask(0):
        out = kvxferd("keys", "generate", str(keys)).stdout
    assert "kvxferd.key_secret" in out
    secret, public = keys / "kvxferd.key_secret", keys / "kvxferd.key"
    assert secret.stat().st_mode & 0o777 == 0o600
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert sec is not None and zmq.auth.load_certificate(str(public)) == (pub, None)
    assert zmq.curve_public(sec) == pub  # a real keypair

    before = secret.read_bytes()
    again = kvxferd("keys", "generate", str(keys), check=False)
    assert again.returncode == 2 and "--force" in again.stderr
    assert secret.read_bytes() == before

    with umask(0):
        kvxferd("keys", "generate", str(keys), "--force")
    assert secret.read_bytes() != before and secret.stat().st_mode & 0o777 == 0o600
    assert zmq.auth.load_certificate(str(public))[0] == zmq.auth.load_certificate(str(secret))[0]


def test_keys_generate_does_not_write_through_a_planted_symlink(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    (keys / "kvxferd.key_secret").symlink_to(victim)
    refused = kvxferd("keys", "generate", str(keys), check=False)
    assert refused.returncode == 2
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644
    kvxferd("keys", "generate", str(keys), "--force")  # replaces the link, never follows it
    assert victim.read_text() == "precious\n"
    assert not (keys / "kvxferd.key_secret").is_symlink()


# --- 2. status ----------------------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, "daemon", metrics_port=0)
    yield d
    d.stop()


def registered(d: DaemonProcess, engine_id: str) -> tuple[EngineClient, object]:
    geo = build(SHAPE, 1, 0)
    fd, mm = create_shm(geo.buffers[0])
    engine = EngineClient(d.socket, engine_id, 0, 1)
    try:
        engine.register(geo, shm_fds=[fd])
    finally:
        os.close(fd)
    return engine, mm


def test_status_escapes_engine_strings_keeps_json_exact(daemon):
    engine, mm = registered(daemon, HOSTILE)
    try:
        engine.hold("req" + HOSTILE, 60.0, [[1]])
        text = kvxferd("status", "--socket", daemon.socket).stdout
        assert not CONTROLS.search(text), repr(text)
        assert not any(line.startswith("FAKE LINE") for line in text.splitlines())
        assert logs.escape(HOSTILE) in text and "\\x1b]0;pwned\\x07" in text
        doc = json.loads(kvxferd("status", "--socket", daemon.socket, "--json").stdout)
        assert [e["engine"] for e in doc["engines"]] == [HOSTILE]
        assert [h["request"] for h in doc["held"]] == ["req" + HOSTILE]
    finally:
        engine.close()
        mm.close()


def test_status_render_escapes_peer_fields(daemon):
    with Client(daemon.socket) as c:
        st = c.status()
    clean = render(st)
    peer = P.PeerStatus(HOSTILE, "10.0.0.1:5\x1b[1A" + HOSTILE, HOSTILE, 1.0, 0.01, 1, [0], 0)
    failure = P.FailureRecord(0.0, HOSTILE, 0, HOSTILE, HOSTILE, "reason\r\n" + HOSTILE)
    st = msgspec.structs.replace(st, peers=[peer], failures=[failure], agent=HOSTILE)
    text = render(st)
    assert not CONTROLS.search(text), repr(text)
    # Each table's "(none)" becomes a title and one row: no line comes from the strings.
    assert len(text.splitlines()) == len(clean.splitlines()) + 2
    assert "reason\\r\\ne\\x1b]0;pwned\\x07" in text


# --- 3. logs ------------------------------------------------------------------------------------

FORGED = "x\n2026-01-01 00:00:00,000 INFO kvxferd.engines: registered engine evil rank 0/1: m, 1 B\x1b[2K"


def test_text_log_cannot_be_forged_by_an_engine_id(tmp_path):
    d = DaemonProcess(tmp_path, "daemon")  # text logs, the default
    try:
        engine, mm = registered(d, FORGED)
        engine.close()
        mm.close()
    finally:
        d.stop()
    log = (tmp_path / "daemon.log").read_text()
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log
    assert "\x1b" not in log
    assert "registered engine " + logs.escape(FORGED) in log


def record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord("kvxferd.test", logging.ERROR, __file__, 1, msg, args,
                             (type(exc), exc, exc.__traceback__) if exc else None)


def test_text_formatter_escapes_message_and_fences_traceback():
    try:
        raise ValueError("boom\n2026-01-01 00:00:00,000 INFO fake: forged")
    except ValueError as exc:
        caught = exc
    out = logs.TextFormatter().format(record("request %s failed", FORGED, exc=caught))
    first, *rest = out.split("\n")
    assert first.endswith("request " + logs.escape(FORGED) + " failed")
    assert rest and all(line.startswith("  | ") for line in rest), out
    assert "\x1b" not in out


def test_json_formatter_is_one_exact_line():
    out = logs.JsonFormatter().format(record("request %s failed", FORGED))
    assert "\n" not in out and "\x1b" not in out
    assert json.loads(out)["msg"] == f"request {FORGED} failed"


# --- 4. metrics exporter ------------------------------------------------------------------------


def http(address: str, request: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            return b"(reset)" + b"".join(chunks)
    return b"".join(chunks)


def test_a_throttled_message_is_logged_once_per_key_and_period_with_bounded_memory():
    """Repeated causes (a peer refusing every claim, a flood of forged notices) make one log line
    per key and period; keys off the wire cannot grow the memory past MAX_KEYS."""
    now = [100.0]
    throttle = logs.Throttle(10.0, clock=lambda: now[0])
    assert throttle.due(("a", 1)) and throttle.due(("b", 1)) and not throttle.due(("a", 1))
    now[0] = 109.9
    assert not throttle.due(("a", 1))
    now[0] = 110.0
    assert throttle.due(("a", 1)) and not throttle.due(("a", 1))
    for i in range(3 * logs.Throttle.MAX_KEYS):
        throttle.due(("peer", i))
    assert len(throttle._last) <= logs.Throttle.MAX_KEYS


def test_metrics_http_caps_request_head(daemon):
    with Client(daemon.socket) as c:
        address = c.status().metrics
    assert address
    long_line = b"GET /" + b"a" * (100 << 10) + b" HTTP/1.1\r\n\r\n"
    long_header = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"b" * (100 << 10) + b"\r\n\r\n"
    many_headers = b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n"
    for request, status in ((long_line, b"400"), (long_header, b"431"), (many_headers, b"431")):
        answer = http(address, request)
        assert answer.startswith(b"HTTP/1.0 " + status + b" "), answer[:200]
        assert http(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 200 OK")
    ordinary = http(address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 50 + b"\r\n")
    assert ordinary.startswith(b"HTTP/1.0 200 OK") and b"kvxferd_build_info" in ordinary
    assert daemon.proc.poll() is None
    log = Path(daemon.log.name).read_text()
    assert "Traceback" not in log and "exception" not in log.lower(), log


# --- 5. CUDA VMM mapping undo -------------------------------------------------------------------


class FakeDriver:
    """Stands in for `cuda.bindings.driver`: no GPU can exist where these tests run, so the
    driver calls are recorded (what is held: imported/created handles, address reservations,
    mappings) and the one named in `fail_at` returns an error, as the real driver would."""

    def __init__(self, fail_at: str = "", rdma_with_vmm: int = 1, rdma_pointer: int | None = None) -> None:
        """`rdma_with_vmm`: the device's GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED; `rdma_pointer`: what
        IS_GPU_DIRECT_RDMA_CAPABLE answers for a mapping (None: the allocation's own flag)."""
        self.fail_at, self.calls = fail_at, []
        self.rdma_with_vmm, self.rdma_pointer = rdma_with_vmm, rdma_pointer
        self.created: list[SimpleNamespace] = []  # the props cuMemCreate was given
        self.granularity_of: list[SimpleNamespace] = []  # the props granularity was asked for
        self.handles: set[int] = set()
        self.reserved: set[int] = set()
        self.mapped: dict[int, int] = {}  # address -> the handle mapped there
        self._next = 0x1000
        ok, err = SimpleNamespace(name="CUDA_SUCCESS"), SimpleNamespace(name="CUDA_ERROR_INVALID_VALUE")
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=ok)
        self._err = err
        self.CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
        self.CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
        self.CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED=110)
        self.CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE=15)
        self.props: dict[int, SimpleNamespace] = {}  # handle -> its allocation's properties

    @staticmethod
    def CUmemAllocationProp():  # the driver's names
        return SimpleNamespace(location=SimpleNamespace(), allocFlags=SimpleNamespace(gpuDirectRDMACapable=0))

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(location=SimpleNamespace())

    def _step(self, name: str, *result: object) -> tuple:
        self.calls.append(name)
        if name == self.fail_at:
            return (self._err, *(None for _ in result))  # as the bindings: every output there, None
        return (self.CUresult.CUDA_SUCCESS, *result)

    def _new(self) -> int:
        self._next += 0x1000
        return self._next

    def cuInit(self, flags):
        return self._step("cuInit")

    def cuDeviceGet(self, device):
        return self._step("cuDeviceGet", device)

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._step("cuDevicePrimaryCtxRetain", "ctx")

    def cuCtxSetCurrent(self, ctx):
        return self._step("cuCtxSetCurrent")

    def cuMemGetAllocationGranularity(self, prop, flags):
        self.granularity_of.append(prop)
        return self._step("cuMemGetAllocationGranularity", 2 << 20)

    def cuDeviceGetAttribute(self, attribute, dev):
        assert attribute == 110
        return self._step("cuDeviceGetAttribute", self.rdma_with_vmm)

    def cuPointerGetAttribute(self, attribute, ptr):
        assert attribute == 15 and ptr in self.mapped
        flag = self.props[self.mapped[ptr]].allocFlags.gpuDirectRDMACapable
        return self._step("cuPointerGetAttribute", flag if self.rdma_pointer is None else self.rdma_pointer)

    def cuMemImportFromShareableHandle(self, fd, kind):
        os.fstat(fd)  # the fd is still open when imported
        result = self._step("cuMemImportFromShareableHandle", self._new())
        if result[0] is self.CUresult.CUDA_SUCCESS:
            self.handles.add(result[1])
            # An engine that asked for GPUDirect RDMA (another build's prop, not this process's)
            self.props[result[1]] = SimpleNamespace(allocFlags=SimpleNamespace(gpuDirectRDMACapable=1), imported=True)
        return result

    def cuMemCreate(self, size, prop, flags):
        self.created.append(prop)
        result = self._step("cuMemCreate", self._new())
        if result[0] is self.CUresult.CUDA_SUCCESS:
            self.handles.add(result[1])
            self.props[result[1]] = prop
        return result

    def cuMemGetAllocationPropertiesFromHandle(self, handle):
        assert handle in self.handles
        return self._step("cuMemGetAllocationPropertiesFromHandle", self.props[handle])

    def cuMemAddressReserve(self, size, align, addr, flags):
        result = self._step("cuMemAddressReserve", self._new())
        if result[0] is self.CUresult.CUDA_SUCCESS:
            self.reserved.add(result[1])
        return result

    def cuMemMap(self, ptr, size, offset, handle, flags):
        assert ptr in self.reserved and handle in self.handles
        result = self._step("cuMemMap")
        if len(result) == 1 and result[0] is self.CUresult.CUDA_SUCCESS:
            self.mapped[ptr] = handle
        return result

    def cuMemSetAccess(self, ptr, size, descs, count):
        assert ptr in self.mapped
        return self._step("cuMemSetAccess")

    def cuMemUnmap(self, ptr, size):
        assert ptr in self.mapped, "unmapping what is not mapped"
        del self.mapped[ptr]
        return (self.CUresult.CUDA_SUCCESS,)

    def cuMemAddressFree(self, ptr, size):
        assert ptr in self.reserved and ptr not in self.mapped, "freeing a range still mapped"
        self.reserved.discard(ptr)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuMemRelease(self, handle):
        assert handle in self.handles
        self.handles.discard(handle)
        return (self.CUresult.CUDA_SUCCESS,)

    def held(self) -> tuple[set[int], set[int], set[int]]:
        return self.handles, self.reserved, set(self.mapped)


@pytest.fixture(autouse=True)
def _fresh_rdma_answers():
    """memory.py asks each device about GPUDirect RDMA once and logs each answer once: each test's
    fake driver answers anew."""
    memory._rdma_with_vmm.cache_clear()
    memory._rdma_told.clear()
    yield
    memory._rdma_with_vmm.cache_clear()
    memory._rdma_told.clear()


STEPS = ["cuMemImportFromShareableHandle", "cuMemGetAllocationPropertiesFromHandle", "cuMemGetAllocationGranularity",
         "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]


@pytest.mark.parametrize("fail_at", STEPS)
def test_map_cuda_vmm_undoes_every_step_on_failure(monkeypatch, fail_at):
    cu = FakeDriver(fail_at)
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(MappingError, match=fail_at if fail_at != "cuMemGetAllocationGranularity" else "granularity"):
        memory.map_cuda_vmm(fd, 2 << 20, 0)
    assert fail_at in cu.calls
    assert cu.held() == (set(), set(), set()), cu.calls
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_map_cuda_vmm_success_then_close_releases(monkeypatch):
    cu = FakeDriver()
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    mapping = memory.map_cuda_vmm(os.open(os.devnull, os.O_RDONLY), 2 << 20, 0)
    assert all(cu.held()) and mapping.address in cu.mapped
    mapping.close()
    assert cu.held() == (set(), set(), set())


@pytest.mark.parametrize("fail_at", ["cuMemGetAllocationPropertiesFromHandle", "cuMemAddressReserve", "cuMemMap",
                                     "cuMemSetAccess"])
def test_vmm_buffer_releases_its_allocation_on_failure(monkeypatch, fail_at):
    cu = FakeDriver(fail_at)
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    with pytest.raises(MappingError, match=fail_at):
        memory.VmmBuffer(1 << 20)
    assert cu.held() == (set(), set(), set()), cu.calls


@pytest.mark.parametrize("supported", [1, 0])
def test_vmm_buffer_asks_for_gpudirect_rdma_where_the_device_has_it(monkeypatch, supported):
    """Without gpuDirectRDMACapable UCX cannot export the memory as dma-buf and moves READs from
    other hosts by emulation; asking for it where the device lacks it would fail cuMemCreate."""
    cu = FakeDriver(rdma_with_vmm=supported)
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    buffers = [memory.VmmBuffer(1 << 20), memory.VmmBuffer(3 << 20)]
    assert [p.allocFlags.gpuDirectRDMACapable for p in cu.created] == [supported] * 2
    assert [b.gpu_direct_rdma for b in buffers] == [bool(supported)] * 2
    assert cu.calls.count("cuDeviceGetAttribute") == 1  # asked once per device
    # The size is rounded with the prop it is allocated with, the mapping aligned with the allocation's own
    assert all(p.allocFlags.gpuDirectRDMACapable == supported for p in cu.granularity_of)
    for b in buffers:
        b.close()
    assert cu.held() == (set(), set(), set())


def test_device_attribute_refused_means_no_rdma_flag(monkeypatch):
    cu = FakeDriver("cuDeviceGetAttribute")  # a driver that does not know the attribute
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    memory.VmmBuffer(1 << 20).close()
    assert cu.created[0].allocFlags.gpuDirectRDMACapable == 0


@pytest.mark.parametrize("pointer,expected", [(None, True), (0, False), (1, True)])
def test_map_cuda_vmm_keeps_the_drivers_rdma_answer_and_aligns_to_the_allocations_own_props(
        monkeypatch, caplog, pointer, expected):
    cu = FakeDriver(rdma_with_vmm=0, rdma_pointer=pointer)  # this process's device would not ask for it
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    with caplog.at_level(logging.INFO, "kvxferd"):
        first = memory.map_cuda_vmm(os.open(os.devnull, os.O_RDONLY), 2 << 20, 0)
        second = memory.map_cuda_vmm(os.open(os.devnull, os.O_RDONLY), 2 << 20, 0)
    assert first.rdma_capable is second.rdma_capable is expected
    assert [getattr(p, "imported", False) for p in cu.granularity_of] == [True, True]  # the engine's prop
    told = [r for r in caplog.records if "GPUDirect RDMA" in r.getMessage()]
    assert len(told) == 1  # once per device and answer
    assert ("is GPUDirect RDMA capable" in told[0].getMessage()) is expected
    if not expected:
        assert "software emulation" in told[0].getMessage()
        assert "does not report GPUDirect RDMA with CUDA VMM" in told[0].getMessage()
    first.close()
    second.close()
    assert cu.held() == (set(), set(), set())


def test_an_rdma_answer_the_driver_refuses_is_unknown_not_a_failure(monkeypatch, caplog):
    cu = FakeDriver("cuPointerGetAttribute")
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    with caplog.at_level(logging.INFO, "kvxferd"):
        mapping = memory.map_cuda_vmm(os.open(os.devnull, os.O_RDONLY), 2 << 20, 0)
    assert mapping.rdma_capable is None
    assert any("the driver did not say" in r.getMessage() for r in caplog.records)
    mapping.close()
    fd, mm = create_shm(4096)
    host = memory.map_shm(fd, 4096)
    assert host.rdma_capable is None  # host memory: no such question
    host.close()
    mm.close()


def test_allocated_without_the_flag_on_a_device_that_has_it_is_a_warning(monkeypatch, caplog):
    cu = FakeDriver(rdma_with_vmm=1, rdma_pointer=0)
    monkeypatch.setattr(memory, "_cu", lambda: cu)
    with caplog.at_level(logging.INFO, "kvxferd"):
        memory.map_cuda_vmm(os.open(os.devnull, os.O_RDONLY), 2 << 20, 0).close()
    (told,) = [r for r in caplog.records if "GPUDirect RDMA" in r.getMessage()]
    assert told.levelno == logging.WARNING and "allocated without gpuDirectRDMACapable" in told.getMessage()


def test_status_says_rdma_only_when_the_driver_said_it_of_every_buffer():
    from types import SimpleNamespace

    from kvxferd.engines import _rdma

    def of(*answers):
        return _rdma([SimpleNamespace(rdma_capable=a) for a in answers])
    assert of() is None and of(None) is None and of(True, None) is None  # host memory, or not asked
    assert of(True, True) is True and of(True, False) is False
