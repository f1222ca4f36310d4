"""The steps of the device check (scripts/gpu-check.sh runs each in a process of its own, under a
timeout of its own, so that one failing or hanging step costs only itself):

  python scripts/gpu_check.py STEP WORKDIR

  env        what the machine is: GPU, driver, torch, cuda-bindings, NIXL and its UCX, the device's
             GPUDirect RDMA / dma-buf / fd-handle attributes, RDMA NICs, ptrace scope
  probe      GPUDirect RDMA end to end in kvxferd.memory: an engine's VmmBuffer asks for it, the
             daemon's import (another process) reads CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
             and both try the dma-buf export UCX (1.22 and later) registers VRAM for RDMA by; the
             same for an allocation made without the flag (what UCX can only emulate)
  pair       two daemons through UCX with UCX_PROTO_INFO=y: kvxferd's READ, raw NIXL, a
             device-to-device copy of the same bytes, and the protocol UCX chose for the READ
  same-node  one daemon serving both engines (lane `loop`, NIXL's loopback) against a torch copy
             and a torch gather of the same pages on the device
  shared-kv  the vLLM connector's memory step (`shared_kv.share`) on CUDA tensors, without vLLM
  table      one table of every step (only the standard library: it runs whatever failed)

Each step writes WORKDIR/STEP.json as it goes: what a step measured before it failed or ran out
of time is still in the table.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = 1 << 20  # 1 MiB pages: the bench's page where emulation and a device copy differ most
MIB = 64  # per read
REPEATS = 5


class Results(dict[str, Any]):
    """A step's figures, written to WORKDIR/STEP.json on every change."""

    def __init__(self, work: Path, step: str) -> None:
        super().__init__()
        self.path = work / f"{step}.json"
        self.save()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self, indent=2, default=str))


def attempt(out: Results, key: str, fn: Callable[[], Any]) -> Any:
    """`out[key] = fn()`; an exception is recorded under the key (and printed) instead: the step
    goes on to its next measurement."""
    try:
        value = fn()
    except Exception as exc:
        value = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"{key}: {value}", flush=True)
    out[key] = value
    return value


# --- env --------------------------------------------------------------------------------------

ATTRIBUTES = ["GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", "GPU_DIRECT_RDMA_SUPPORTED", "DMA_BUF_SUPPORTED",
              "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "HANDLE_TYPE_FABRIC_SUPPORTED",
              "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"]


def device_attributes(device: int = 0) -> dict[str, Any]:
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit: {err.name}")
    err, dev = cu.cuDeviceGet(device)
    found: dict[str, Any] = {}
    for name in ATTRIBUTES:
        attribute = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}", None)
        if attribute is None:
            found[name] = "unknown to these bindings"
            continue
        err, value = cu.cuDeviceGetAttribute(attribute, dev)
        found[name] = int(value) if err == cu.CUresult.CUDA_SUCCESS else err.name
    return found


def ucx_version() -> str:
    """The version of the UCX bundled with the NIXL wheel in use (the one that moves the bytes)."""
    import ctypes
    import importlib

    import nixl  # noqa: F401  (loads the backend for this CUDA: nixl_cu13 or nixl_cu12)

    backend = importlib.import_module(next(m for m in ("nixl_cu13", "nixl_cu12") if m in sys.modules))
    libs = Path(str(backend.__file__)).parent.parent / f"{backend.__name__}.libs"
    found = sorted(glob.glob(str(libs / "libucp*.so*")))
    if not found:
        return f"no libucp in {libs}"
    lib = ctypes.CDLL(found[0])
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    return f"{lib.ucp_get_version_string().decode()} ({backend.__name__})"


def run_env(work: Path) -> None:
    out = Results(work, "env")
    out["python"] = sys.version.split()[0]
    out["kernel"] = os.uname().release
    attempt(out, "nvidia_smi", lambda: subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30).stdout.strip())

    def torch_info() -> str:
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
        return f"{torch.__version__} (CUDA {torch.version.cuda}; {name})"
    attempt(out, "torch", torch_info)

    def bindings() -> str:
        import cuda.bindings

        return str(cuda.bindings.__version__)
    attempt(out, "cuda_bindings", bindings)

    def cupy_info() -> str:
        import cupy

        return str(cupy.__version__)
    attempt(out, "cupy", cupy_info)

    def nixl_info() -> str:
        from importlib.metadata import version

        import nixl

        backend = next(m for m in ("nixl_cu13", "nixl_cu12") if m in sys.modules)
        return f"{version('nixl')} ({backend}, {Path(nixl.__file__).parent.parent})"
    attempt(out, "nixl", nixl_info)
    attempt(out, "ucx", ucx_version)

    def needs() -> dict[str, str]:
        """What the daemon imports, and from where: the image's or the carried wheels'."""
        from importlib.metadata import PackageNotFoundError, version

        found = {}
        for name in ("msgspec", "pyzmq", "uvloop", "prometheus-client", "typer", "numpy", "pytest"):
            try:
                found[name] = version(name)
            except PackageNotFoundError:
                found[name] = "error: missing"
        return found
    attempt(out, "packages", needs)
    attempt(out, "attributes", device_attributes)
    ib = Path("/sys/class/infiniband")
    out["rdma_nics"] = sorted(os.listdir(ib)) if ib.is_dir() else []
    attempt(out, "ptrace_scope", lambda: Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    print(json.dumps(out, indent=2), flush=True)


# --- probe ------------------------------------------------------------------------------------


def dmabuf(address: int, nbytes: int) -> str:
    """Whether the driver exports this VRAM range as a dma-buf ("ok" or its error): UCX 1.22 and
    later registers VRAM with its IB memory domain through one, and skips the domain without it."""
    from cuda.bindings import driver as cu

    err, fd = cu.cuMemGetHandleForAddressRange(
        address, nbytes, cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return str(err.name)
    os.close(int(fd))
    return "ok"


def import_elsewhere(fd: int, nbytes: int, used: int = 0) -> dict[str, Any]:
    """What the daemon sees of an engine's allocation: another process imports its fd with
    `memory.map_cuda_vmm` (the `_import` step below)."""
    seen = subprocess.run([sys.executable, __file__, "_import", str(fd), str(nbytes), str(used)], pass_fds=[fd],
                          capture_output=True, text=True, timeout=120)
    if seen.returncode != 0:
        raise RuntimeError(f"import in another process failed: {seen.stderr.strip()[-400:]}")
    return dict(json.loads(seen.stdout.strip().splitlines()[-1]))


def run_import(fd: int, nbytes: int, used: int) -> None:
    import numpy as np

    from kvxferd import memory

    m = memory.map_cuda_vmm(fd, nbytes, 0)
    seen: dict[str, Any] = {"rdma_capable": m.rdma_capable, "dmabuf": dmabuf(m.address, m.nbytes)}
    if used:
        host = np.empty(used, dtype=np.uint8)
        memory._check(memory._cu().cuMemcpyDtoH(host, m.address, used), "cuMemcpyDtoH")
        seen["sha256"] = hashlib.sha256(host.tobytes()).hexdigest()
    m.close()
    print(json.dumps(seen), flush=True)


def run_probe(work: Path) -> None:
    from kvxferd import memory

    cu = memory._cu()
    out = Results(work, "probe")
    nbytes = MIB << 20
    engine = memory.VmmBuffer(nbytes)
    out["engine_asks_rdma"] = engine.gpu_direct_rdma
    out["engine_pointer_rdma"] = memory._rdma_capable(engine.address)
    attempt(out, "engine_dmabuf", lambda: dmabuf(engine.address, engine.nbytes))
    fd = engine.export()
    try:
        attempt(out, "daemon", lambda: import_elsewhere(fd, engine.nbytes))
    finally:
        os.close(fd)

    def without_flag() -> dict[str, Any]:
        """An allocation as engines made them before (no gpuDirectRDMACapable): the contrast."""
        prop = memory._prop(0)
        prop.allocFlags.gpuDirectRDMACapable = 0
        size = memory.vmm_size(nbytes)
        handle = memory._check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        address = memory._map(handle, size, 0)
        try:
            seen: dict[str, Any] = {"pointer_rdma": memory._rdma_capable(address), "dmabuf": dmabuf(address, size)}
            plain_fd = int(memory._check(cu.cuMemExportToShareableHandle(
                handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export"))
            try:
                seen["daemon"] = import_elsewhere(plain_fd, size)
            finally:
                os.close(plain_fd)
            return seen
        finally:
            memory._unmap(address, size, handle)
    attempt(out, "without_flag", without_flag)
    engine.close()
    print(json.dumps(out, indent=2), flush=True)


# --- pair and same-node -----------------------------------------------------------------------


def torch_copy(nbytes: int, repeats: int, page: int = 0) -> float:
    """GB/s of a device-to-device copy of `nbytes` with torch: contiguous, or (`page`) a gather of
    the same pages in a random order, as a READ of scattered blocks moves them."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows = nbytes // page if page else 0
    order = torch.randperm(rows, device="cuda") if rows else None

    def once() -> None:
        if order is None:
            dst.copy_(src)
        else:
            torch.index_select(src.view(rows, page), 0, order, out=dst.view(rows, page))
    once()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if order is not None and not torch.equal(dst.view(rows, page), src.view(rows, page)[order]):
        raise RuntimeError("torch gather: the pages did not arrive")
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def line_buffered() -> list[str]:
    """A daemon's command prefix that makes C stdio line-buffered: UCX's protocol tables reach its
    log as they are printed, not only at exit (which a step out of time never reaches)."""
    return ["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []


PROTO_HEADER = re.compile(r"remote memory read|ucp_get")


def ucx_protocols(text: str) -> list[str]:
    """UCX_PROTO_INFO's tables for remote memory reads of GPU memory: each header line that names
    a read into or from cuda memory, and the rows of its table (protocol | transport/device),
    each distinct table once (every endpoint prints its own)."""
    lines = text.splitlines()
    tables: dict[tuple[str, ...], None] = {}
    for i, line in enumerate(lines):
        if PROTO_HEADER.search(line) and "cuda" in line:
            # UCX 1.23 puts the endpoint (self, intra-node, inter-node) on the line before
            table = [_cells(lines[i - 1])] if i and "cfg#" in lines[i - 1] and "|" in lines[i - 1] else []
            table.append(_cells(line))
            borders = 0  # below the header: the column names' border, the rows' border, the bottom one
            for row in lines[i + 1:i + 40]:
                if PROTO_HEADER.search(row) or ("|" not in row and "+-" not in row):
                    break  # the next table, or not a table line at all
                if "|" in row and set(_cells(row)) - set("+-| "):
                    table.append("    " + _cells(row))
                elif "+-" in row:
                    borders += 1
                    if borders == 3:
                        break
            tables[tuple(table)] = None
    return [row for table in tables for row in table]


def _cells(line: str) -> str:
    """A table line without UCX's log prefix and padding."""
    if "|" in line:
        line = line[line.index("|"):]
    return re.sub(r"\s+", " ", line).strip()


CARRIERS = (("emulation", "software emulation: the cliff, TCP speed"), ("cuda_ipc", "cuda_ipc"),
            ("rc_", "RDMA (ib rc)"), ("dc_", "RDMA (ib dc)"), ("gdr_copy", "gdr_copy"), ("cuda_copy", "cuda_copy"))


def carrier(protocols: list[str]) -> str:
    """What carried the READ, in words: the cliff named, or cleared (every kind the tables name,
    worst first: one range emulated is enough to name it)."""
    if not protocols:
        return "unknown (no UCX_PROTO_INFO table for a read of cuda memory in the logs)"
    rows = " ".join(r for r in protocols if r.startswith("    "))
    named = [words for key, words in CARRIERS if key in rows]
    return "; ".join(named) if named else "see the protocol rows"


def rdma_lines(text: str) -> list[str]:
    """memory.py's word on engines' VRAM at registration (once per device and answer)."""
    return sorted({m.group(0).split(" (docs/")[0][:300] for m in re.finditer(r"GPU \d+: engine VRAM is[^\"\n]*", text)})


def daemon_evidence(out: Results, logs: list[Path]) -> None:
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    out["protocols"] = ucx_protocols(text)
    out["carried_by"] = carrier(out["protocols"])
    out["daemon_rdma"] = rdma_lines(text)


def run_pair(work: Path) -> None:
    from kvxferd.benchmarks import dataplane
    from kvxferd.benchmarks.harness import environment, median
    from kvxferd.lab.synthetic.demo import DaemonProcess

    out = Results(work, "pair")
    nbytes, n = MIB << 20, (MIB << 20) // (2 * PAGE)
    out["read"] = f"{MIB} MiB in {PAGE >> 10} KiB pages, {REPEATS} reads, TP 1 -> 1"
    logs = work / "pair-logs"
    logs.mkdir(exist_ok=True)
    with environment({"UCX_PROTO_INFO": "y", **dataplane.WHOLE}):
        daemons = [DaemonProcess(logs, name, prefix=line_buffered()) for name in ("prefill", "decode")]
    try:
        attempt(out, "kvxferd_gb_s", lambda: nbytes / median(dataplane.through_kvxferd(
            [d.socket for d in daemons], PAGE, n, REPEATS, "cuda-vmm").times) / 1e9)
    finally:
        for d in daemons:
            d.stop()
        daemon_evidence(out, [logs / "prefill.log", logs / "decode.log"])
    with environment({"UCX_PROTO_INFO": "y"}):  # between agents of their own: no raw process maps engines' VMM
        attempt(out, "raw_nixl_gb_s", lambda: nbytes / median(dataplane.raw_nixl(PAGE, n, REPEATS, "cuda-vmm")[0])
                / 1e9)
    attempt(out, "d2d_cumemcpy_gb_s", lambda: nbytes / dataplane.memcpy(nbytes, REPEATS, "cuda-vmm") / 1e9)
    attempt(out, "d2d_torch_gb_s", lambda: torch_copy(nbytes, REPEATS))
    print(json.dumps(out, indent=2), flush=True)


def run_same_node(work: Path) -> None:
    from kvxferd.benchmarks import dataplane
    from kvxferd.benchmarks.harness import environment, median
    from kvxferd.lab.synthetic.demo import DaemonProcess

    out = Results(work, "same-node")
    nbytes = MIB << 20
    logs = work / "same-node-logs"
    logs.mkdir(exist_ok=True)
    with environment({"UCX_PROTO_INFO": "y", **dataplane.WHOLE}):
        daemon = DaemonProcess(logs, "node", prefix=line_buffered())
    pages: dict[str, Any] = {}
    try:
        for page in (64 << 10, PAGE):
            row: dict[str, Any] = {}
            pages[f"{page >> 10}KiB"] = row
            n = nbytes // (2 * page)
            # The prefill's blocks scattered, as in a cache in use; the route must be the loop lane
            for key, fn in (("loop_gb_s", lambda p=page, n=n: nbytes / median(dataplane.through_kvxferd(
                                [daemon.socket, daemon.socket], p, n, REPEATS, "cuda-vmm", scatter=True,
                                lane="loop").times) / 1e9),
                            ("torch_gather_gb_s", lambda p=page: torch_copy(nbytes, REPEATS, p)),
                            ("torch_copy_gb_s", lambda: torch_copy(nbytes, REPEATS))):
                try:
                    row[key] = fn()
                except Exception as exc:
                    row[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{page >> 10} KiB {key}: {row[key]}", flush=True)
                out["pages"] = pages
    finally:
        daemon.stop()
        daemon_evidence(out, [logs / "node.log"])
    print(json.dumps(out, indent=2), flush=True)


# --- shared-kv --------------------------------------------------------------------------------


def run_shared_kv(work: Path) -> None:
    """As tests/test_gpu.py's connector test, reported: layer caches viewing one CUDA buffer, of a
    size no multiple of the VMM granularity, moved into a VMM allocation the daemon can map."""
    import torch

    from kvxferd.vllm import shared_kv

    out = Results(work, "shared-kv")
    layers, blocks = 3, 501
    per_layer = 2 * blocks * 16 * 2 * 64 * 2  # K and V, blocks of 16 tokens, 2 heads of 64, bf16
    backing = torch.randint(0, 256, (layers * per_layer,), dtype=torch.uint8, device="cuda")
    caches = {f"model.layers.{i}.self_attn.attn": backing[i * per_layer:(i + 1) * per_layer]
              .view(torch.bfloat16).view(2, blocks, 16, 2, 64) for i in range(layers)}
    bound = backing.view(torch.bfloat16)
    before = backing.cpu().clone()
    del backing
    t0 = time.perf_counter()
    buffers, _ = shared_kv.share(caches, also=[bound])
    out["share_s"] = time.perf_counter() - t0
    buf = buffers[0]
    out["buffers"] = len(buffers)
    out["kind"] = buf.kind
    out["bytes"] = f"{layers * per_layer} -> {buf.nbytes}"
    out["engine_asks_rdma"] = getattr(buf.keep[0], "gpu_direct_rdma", None)
    out["bytes_kept"] = bool(torch.equal(bound.view(torch.uint8).cpu(), before))
    used = layers * per_layer
    expected = hashlib.sha256(bound.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    seen = attempt(out, "daemon", lambda: import_elsewhere(buf.fd, buf.nbytes, used))
    if isinstance(seen, dict):
        out["daemon_reads_same_bytes"] = seen.get("sha256") == expected
    buf.close()
    print(json.dumps(out, indent=2), flush=True)


# --- table ------------------------------------------------------------------------------------


def _load(work: Path, step: str) -> dict[str, Any]:
    try:
        return dict(json.loads((work / f"{step}.json").read_text()))
    except (OSError, ValueError):
        return {}


def _sub(d: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested result, or {} where the step recorded an error (a string) or nothing."""
    value = d.get(key)
    return value if isinstance(value, dict) else {}


def _gb(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else "-" if value is None else str(value)[:60]


def _yes(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else "-" if value is None else str(value)[:60]


def _summaries(work: Path) -> dict[str, str]:
    s: dict[str, str] = {}
    if (work / "site").is_dir():
        s["install"] = f"the carried wheels, into {work / 'site'} (the image's packages untouched)"
    env = _load(work, "env")
    if env:
        a = _sub(env, "attributes")
        s["env"] = (f"GPUDirect RDMA with VMM {a.get('GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED', '-')}, "
                    f"GPUDirect RDMA {a.get('GPU_DIRECT_RDMA_SUPPORTED', '-')}, "
                    f"dma-buf {a.get('DMA_BUF_SUPPORTED', '-')}, "
                    f"POSIX fd {a.get('HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED', '-')}; RDMA NICs: "
                    f"{', '.join(env.get('rdma_nics') or []) or 'none'}; ptrace_scope {env.get('ptrace_scope', '-')}")
        missing = [name for name, v in _sub(env, "packages").items() if str(v).startswith("error")]
        if missing:
            s["env"] += f"; MISSING: {', '.join(missing)}"
    p = _load(work, "probe")
    if p:
        d, w = _sub(p, "daemon"), _sub(p, "without_flag")
        wd = _sub(w, "daemon")
        s["probe"] = (f"flag asked: {_yes(p.get('engine_asks_rdma'))}; RDMA capable (engine/daemon): "
                      f"{_yes(p.get('engine_pointer_rdma'))}/{_yes(d.get('rdma_capable'))}; dma-buf (engine/daemon): "
                      f"{p.get('engine_dmabuf', '-')}/{d.get('dmabuf', p.get('daemon', '-'))}; without the flag: "
                      f"capable {_yes(w.get('pointer_rdma'))}/{_yes(wd.get('rdma_capable'))}, dma-buf "
                      f"{w.get('dmabuf', p.get('without_flag', '-'))}/{wd.get('dmabuf', '-')}")
    pr = _load(work, "pair")
    if pr:
        s["pair"] = (f"GB/s: kvxferd {_gb(pr.get('kvxferd_gb_s'))}, raw NIXL "
                     f"{_gb(pr.get('raw_nixl_gb_s'))}, d2d cuMemcpy {_gb(pr.get('d2d_cumemcpy_gb_s'))}"
                     f", d2d torch {_gb(pr.get('d2d_torch_gb_s'))}; READ carried by: {pr.get('carried_by', '-')}")
    sn = _load(work, "same-node")
    if sn:
        rows = _sub(sn, "pages")
        parts = [f"{page}: loop {_gb(r.get('loop_gb_s'))} vs torch gather {_gb(r.get('torch_gather_gb_s'))} / copy "
                 f"{_gb(r.get('torch_copy_gb_s'))} GB/s" for page, r in rows.items() if isinstance(r, dict)]
        s["same-node"] = "; ".join(parts) + f"; READ carried by: {sn.get('carried_by', '-')}"
    kv = _load(work, "shared-kv")
    if kv:
        d = _sub(kv, "daemon")
        s["shared-kv"] = (f"{kv.get('buffers', '-')} buffer, {kv.get('kind', '-')}, {kv.get('bytes', '-')} B, "
                          f"bytes kept: {_yes(kv.get('bytes_kept'))}, daemon reads the same: "
                          f"{_yes(kv.get('daemon_reads_same_bytes', kv.get('daemon')))}, flag asked: "
                          f"{_yes(kv.get('engine_asks_rdma'))}, daemon's RDMA answer: {_yes(d.get('rdma_capable'))}")
    try:
        text = (work / "pytest.out").read_text(errors="replace")
        hits = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)\b.*?)\s*=*$", text, re.M)
        if hits:
            s["pytest"] = hits[-1]
        else:  # stopped before its summary: what -v printed of each test so far
            ended = re.findall(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED)", text)
            s["pytest"] = (f"did not finish: {ended.count('PASSED')} passed, {ended.count('FAILED')} failed, "
                           f"{ended.count('ERROR')} errors, {ended.count('SKIPPED')} skipped so far")
    except OSError:
        pass
    try:  # the first row of `bench data`'s first table (dataplane.render's columns)
        text = (work / "bench.out").read_text(errors="replace")
        row = re.search(r"^\s*(\d+)KiB\s+\d+((?:\s+[\d.]+){10})\s*$", text, re.M)
        if row:
            k, raw, _, _, lanes, _, raw2, m1, _, _ = row.group(2).split()
            s["bench"] = (f"{row.group(1)} KiB pages: kvxferd {k}, raw NIXL {raw}, lanes {lanes}, raw 2 agents "
                          f"{raw2}, d2d cuMemcpy {m1} GB/s")
    except OSError:
        pass
    return s


def run_table(work: Path) -> None:
    steps: list[tuple[str, str, str]] = []
    try:
        for line in (work / "steps.tsv").read_text().splitlines():
            name, rc, seconds = line.split("\t")
            steps.append((name, rc, seconds))
    except OSError:
        pass
    summaries = _summaries(work)
    for name, rc, _ in steps:  # a step that ended before its figures: its last words (the exception)
        if name not in summaries and rc != "0":
            try:
                said = [line.strip() for line in (work / f"{name}.out").read_text(errors="replace").splitlines()
                        if line.strip() and not line.startswith("==")]
            except OSError:
                said = []
            summaries[name] = said[-1][:200] if said else "no output"
    env = _load(work, "env")
    print(f"\nkvxferd device check: {env.get('nvidia_smi', '?')}; python {env.get('python', '?')}, torch "
          f"{env.get('torch', '?')}, cuda-bindings {env.get('cuda_bindings', '?')}, NIXL {env.get('nixl', '?')}, "
          f"UCX {env.get('ucx', '?')}")
    width = max([len(n) for n, _, _ in steps] + [6])
    print(f"{'step':<{width}}  {'rc':>7}  {'s':>4}  result")
    for name, rc, seconds in steps:
        status = {"0": "ok", "124": "timeout", "137": "killed"}.get(rc, rc)
        print(f"{name:<{width}}  {status:>7}  {seconds:>4}  {summaries.get(name, '(see gpu-check.log)')}")
    for side in ("pair", "same-node"):
        r = _load(work, side)
        for row in r.get("protocols") or []:
            print(f"  {side} UCX: {row}")
        for row in r.get("daemon_rdma") or []:
            print(f"  {side} daemon: {row}")
    results: dict[str, Any] = {s: _load(work, s) for s in ("env", "probe", "pair", "same-node", "shared-kv")}
    results["steps"] = [{"step": n, "rc": rc, "seconds": s} for n, rc, s in steps]
    results["summaries"] = summaries
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str))


# --- here: the carried NIXL wheel without what kvxferd never loads ---------------------------


def slim_wheel(path: Path, drop: tuple[str, ...] = ("nixl_ep_cu13/", "nixl_ep_cu12/")) -> None:
    """Rewrite a NIXL wheel without its expert-parallel kernels (`nixl_ep_*`, ~27 MB of the ~56 MiB
    nixl-cu13 wheel: one build per torch version), which kvxferd never imports, so the wheels
    and the tree travel within the device tool's 64 MiB. RECORD loses their lines too."""
    import zipfile

    tmp = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.decode().startswith(drop))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    step, arg = argv[0], argv[1]
    # `timeout` ends a step with SIGTERM: unwind (daemons stopped, their logs read) rather than vanish
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if step == "_import":
        run_import(int(arg), int(argv[2]), int(argv[3]))
        return 0
    if step == "slim-wheel":
        for wheel in argv[1:]:
            slim_wheel(Path(wheel))
        return 0
    steps = {"env": run_env, "probe": run_probe, "pair": run_pair, "same-node": run_same_node,
             "shared-kv": run_shared_kv, "table": run_table}
    if step not in steps:
        print(f"unknown step {step!r}; one of {', '.join(steps)}", file=sys.stderr)
        return 2
    steps[step](Path(arg))
    # A measurement that failed fails the step, though the others ran (env only describes)
    return 1 if step not in ("table", "env") and _failed(_load(Path(arg), step)) else 0


def _failed(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_failed(v) for v in value.values())
    if isinstance(value, list):
        return any(_failed(v) for v in value)
    return isinstance(value, str) and value.startswith("error: ")


if __name__ == "__main__":  # raw NIXL's sides are spawned: they import this file without running a step
    sys.exit(main(sys.argv[1:]))
