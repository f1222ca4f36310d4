"""GPU path: engine KV caches in VRAM, shared with the daemons, registered as VRAM with
NIXL, read GPU to GPU and verified byte for byte. Runs on a machine with an NVIDIA GPU:
    python -m pytest -m gpu tests/test_gpu.py

Two ways to share VRAM with the daemon:
  cuda-vmm  shareable VMM allocations, POSIX fd over the Unix socket (what kvxferd uses)
  cuda-ipc  legacy CUDA IPC handles: the daemon opens them, but NIXL 1.5.1's UCX backend
            refuses to register IPC-imported memory (NIXL_ERR_BACKEND); the daemon must
            say so clearly and keep serving.
"""

import functools
import tempfile
from pathlib import Path

import msgspec
import pytest

from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, DemoError, EngineProcess
from kvxferd.plan.models import PRESETS

pytestmark = pytest.mark.gpu
replace = msgspec.structs.replace


@functools.cache
def _no_gpu() -> str:
    """Why no test here can run on this machine ("" where a CUDA device answers)."""
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return f"cuInit: {err.name}"
        err, count = cu.cuDeviceGetCount()
        return "" if err == cu.CUresult.CUDA_SUCCESS and count > 0 else "no CUDA device"
    except Exception as exc:  # no bindings, no driver library
        return f"no CUDA driver here ({type(exc).__name__})"


@pytest.fixture(autouse=True)
def _needs_gpu():
    """Selected with `-m gpu` on a machine without one: skipped, each saying why, not failed."""
    if why := _no_gpu():
        pytest.skip(why)


@pytest.mark.parametrize("model,p_tp,d_tp", [("dense", 2, 4), ("dense", 4, 2), ("mla", 2, 1), ("mamba2", 2, 4)])
def test_vram_transfer_byte_exact(model, p_tp, d_tp):
    shape = replace(PRESETS[model], num_blocks=64)
    with Cluster(shape, p_tp, d_tp, device="cuda-vmm") as cluster:
        for seq in range(4):
            hit = 16 if seq % 2 and model != "mamba2" else 0
            out = cluster.transfer(seq, num_tokens=17 + 23 * seq, hit_tokens=hit)
            assert out["status"] == "received", out
            assert out["released"] == ["sent"] * p_tp
        engines = cluster.status(1).engines
        assert {e.memory for e in engines} == {"VRAM"}
        assert cluster.decode.verify_all() == []


def test_cuda_ipc_refused_clearly_and_daemon_keeps_serving():
    shape = replace(PRESETS["dense"], num_blocks=16)
    with tempfile.TemporaryDirectory() as work:
        daemon = DaemonProcess(Path(work), "d")
        try:
            with pytest.raises(DemoError, match="NIXL cannot register this engine's VRAM memory"):
                EngineProcess(daemon.socket, "ipc-engine", shape, 1, "cuda-ipc")
            assert daemon.proc.poll() is None
            ok = EngineProcess(daemon.socket, "vmm-engine", shape, 1, "cuda-vmm")
            ok.close()
        finally:
            daemon.stop()


@pytest.mark.parametrize("layout,model,p_tp,d_tp", [("LBHNC", "dense", 2, 4), ("BLHNC", "dense", 4, 2),
                                                    ("LBNHC", "mla", 2, 1)])
def test_vram_in_vllms_gpu_layouts_byte_exact(layout, model, p_tp, d_tp):
    """VRAM laid out as vLLM's allocator lays out FlashAttention's / FlashMLA's cache."""
    shape = replace(PRESETS[model], num_blocks=64, layout=layout)
    with Cluster(shape, p_tp, d_tp, device="cuda-vmm") as cluster:
        for seq in range(3):
            out = cluster.transfer(seq, num_tokens=40 + 37 * seq, hit_tokens=16 if seq == 1 else 0)
            assert out["status"] == "received", out
        assert cluster.decode.verify_all() == []


def test_digests_of_device_memory_are_the_digests_of_its_bytes():
    """Audits digest VRAM where it lies (torch on the device) and rows not in whole words from a
    copy (never through a host pointer): both give the bits numpy gives for the same bytes."""
    import numpy as np

    from kvxferd import integrity
    from kvxferd.memory import Mapping, VmmBuffer

    vmm = VmmBuffer(1 << 21)
    data = np.random.default_rng(5).integers(0, 256, vmm.nbytes, dtype=np.uint8)
    vmm.write(data)
    device = Mapping("VRAM", vmm.address, vmm.nbytes, 0, vmm)
    host = Mapping("DRAM", data.ctypes.data, data.nbytes, 0, data)
    spans = [(0, 256), (4096, 4096), (8, 64), (3, 13), (1001, 1), (vmm.nbytes - 24, 24), (64, 1 << 20)]

    def rows(m):
        return np.array([(m.address + off, n) for off, n in spans], dtype=np.int64)

    got = integrity.digest_rows([device], rows(device))
    assert (got == integrity.digest_rows([host], rows(host))).all()
    assert len(set(got.tolist())) == len(spans)
    device.close()


def test_audited_vram_reads_are_checked_against_the_prefills_device_digests():
    shape = replace(PRESETS["dense"], num_blocks=64)
    with Cluster(shape, 2, 4, device="cuda-vmm", metrics=True, daemon_args=["--integrity-audit"]) as cluster:
        for seq in range(3):
            out = cluster.transfer(seq, num_tokens=40 + 37 * seq, hit_tokens=16 if seq == 1 else 0)
            assert out["status"] == "received", out
        assert cluster.decode.verify_all() == []
        assert cluster.daemons[1].metric('kvxferd_audits_total{outcome="ok"}') >= 3


READ_VMM = """
import hashlib, os, sys
import numpy as np
from kvxferd.memory import _check, _cu, map_cuda_vmm
fd, nbytes, used = (int(a) for a in sys.argv[1:])
m = map_cuda_vmm(fd, nbytes, 0)
out = np.empty(used, dtype=np.uint8)
_check(_cu().cuMemcpyDtoH(out, m.address, used), "cuMemcpyDtoH")
print(hashlib.sha256(out).hexdigest(), m.rdma_capable)
"""


def test_vmm_memory_is_gpudirect_rdma_capable_where_the_device_offers_it():
    """Engines ask for GPUDirect RDMA where the device reports it for VMM memory (without it UCX
    cannot register the memory for RDMA and moves READs from other hosts by emulation), and the
    daemon's import of the fd, in another process, reads the driver's answer on its own mapping."""
    import os
    import subprocess
    import sys

    from kvxferd.memory import VmmBuffer, _check, _cu

    cu = _cu()
    vmm = VmmBuffer(1 << 21)
    dev = _check(cu.cuDeviceGet(0), "cuDeviceGet")
    offered = bool(_check(cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev), "attribute"))
    assert vmm.gpu_direct_rdma is offered
    prop = _check(cu.cuMemGetAllocationPropertiesFromHandle(vmm.handle), "properties")
    assert bool(prop.allocFlags.gpuDirectRDMACapable) is offered
    fd = vmm.export()
    try:
        seen = subprocess.run([sys.executable, "-c", READ_VMM, str(fd), str(vmm.nbytes), "64"], pass_fds=[fd],
                              capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split()[-1] == str(offered)  # the daemon's Mapping.rdma_capable
    vmm.close()


def test_connector_moves_cuda_caches_into_vmm_memory_another_process_maps(monkeypatch):
    """The vLLM connector's GPU memory path (`shared_kv.share`) without vLLM: layer caches that
    view one CUDA buffer, as vLLM's GPU allocator makes them, in a size that is no multiple of
    the VMM granularity, are re-pointed at a shareable VMM allocation with their bytes, their
    private buffer given back to the driver first; a write through a re-pointed view lands
    there; another process importing the exported fd, as the daemon does, reads the same bytes."""
    import hashlib
    import subprocess
    import sys

    import torch

    from kvxferd.vllm import shared_kv

    layers, blocks = 3, 501  # 12.3 MB: a block of torch's allocator of its own, no multiple of 2 MiB
    per_layer = 2 * blocks * 16 * 2 * 64 * 2  # K and V, blocks of 16 tokens, 2 heads of 64, bf16
    backing = torch.randint(0, 256, (layers * per_layer,), dtype=torch.uint8, device="cuda")
    caches = {f"model.layers.{i}.self_attn.attn": backing[i * per_layer:(i + 1) * per_layer]
              .view(torch.bfloat16).view(2, blocks, 16, 2, 64) for i in range(layers)}
    bound = backing.view(torch.bfloat16)  # another live view, as an attention layer's bound cache
    before = backing.cpu().clone()
    private = backing.untyped_storage()
    del backing
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    allocate, when_allocating = shared_kv._allocate, []
    monkeypatch.setattr(shared_kv, "_allocate", lambda n, d: when_allocating.append(
        (private.nbytes(), torch.cuda.memory_reserved())) or allocate(n, d))

    buffers, where = shared_kv.share(caches, also=[bound])

    assert len(buffers) == 1
    buf = buffers[0]
    assert buf.kind == "cuda_vmm" and buf.nbytes > layers * per_layer  # rounded up to the granularity
    assert {t.untyped_storage().data_ptr() for t in [*caches.values(), bound]} == {buf.address}
    assert where == {name: (0, i * per_layer) for i, name in enumerate(caches)}
    assert torch.equal(bound.view(torch.uint8).cpu(), before)
    (size, reserved), = when_allocating  # given back, to the driver too, before the VMM allocation
    assert size == 0 and reserved <= reserved_before - layers * per_layer
    caches["model.layers.1.self_attn.attn"][1, 7].fill_(1.5)  # a write through a re-pointed view
    torch.cuda.synchronize()
    expected = bound.view(torch.uint8).cpu().numpy()
    assert not (expected == before.numpy()).all()
    used = layers * per_layer
    seen = subprocess.run([sys.executable, "-c", READ_VMM, str(buf.fd), str(buf.nbytes), str(used)],
                          pass_fds=[buf.fd], capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split()[0] == hashlib.sha256(expected.tobytes()).hexdigest()
    assert seen.stdout.split()[1] == str(buf.keep[0].gpu_direct_rdma)  # GPUDirect RDMA where the device has it
    buf.close()


@pytest.mark.parametrize("family,block", [("dense", 16), ("mla", 64)])
def test_real_vllm_gpu_pd_matches_a_single_instance(family, block, tmp_path, monkeypatch):
    """vLLM's CUDA build: FlashAttention (dense) and its MLA backend (FlashMLA or Triton MLA), the
    connector's VMM memory, prefill -> decode on one GPU, every read audited; bf16 TP 1 -> 1 gives
    the single instance's greedy tokens (as on CPU, tests/test_vllm_bf16.py)."""
    import os

    from kvxferd.lab.vllm_servers import VllmServer, handoff, make_model, prompts

    python = os.environ.get("KVXFERD_VLLM_GPU_PYTHON")
    if not python:
        pytest.skip("set KVXFERD_VLLM_GPU_PYTHON to a python with vLLM's CUDA build and kvxferd installed")
    monkeypatch.setenv("KVXFERD_VLLM_PYTHON", python)
    model = make_model(tmp_path / family, 0, family)
    audit = ["--integrity-audit"]
    pd, dd = DaemonProcess(tmp_path, "p", extra=audit), DaemonProcess(tmp_path, "d", 0, extra=audit)
    metrics = dd.metrics_address
    gpu = ["--gpu-memory-utilization", "0.25"]
    servers = [VllmServer(tmp_path, "single", model, block_size=block, args=gpu),
               VllmServer(tmp_path, "prefill", model, role="kv_producer", connector="kvxferd", socket=pd.socket,
                          block_size=block, args=gpu),
               VllmServer(tmp_path, "decode", model, role="kv_consumer", connector="kvxferd", socket=dd.socket,
                          block_size=block, args=gpu, failure_policy="fail")]
    try:
        for s in servers:
            s.wait_ready()
        single, prefill, decode = servers
        for n in (40, 200):
            prompt = prompts(1, n, seed=n)[0]
            _, out = handoff(prefill, decode, prompt)
            if family == "dense":
                assert out["choices"][0]["text"] == single.complete(prompt)["choices"][0]["text"]
        import urllib.request
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        ok = sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                 if line.startswith("kvxferd_audits_total") and 'outcome="ok"' in line)
        assert ok == 2
    finally:
        for s in servers:
            s.stop()
        pd.stop()
        dd.stop()
