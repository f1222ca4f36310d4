"""GPU path: engine KV caches in VRAM, shared with the daemons, registered as VRAM with
NIXL, read GPU to GPU and verified byte for byte. Runs on a machine with an NVIDIA GPU:
    python -m pytest -m gpu tests/test_gpu.py

Two ways to share VRAM with the daemon:
  cuda-vmm  shareable VMM allocations, POSIX fd over the Unix socket (what kvxferd uses)
  cuda-ipc  legacy CUDA IPC handles: the daemon opens them, but NIXL 1.5.1's UCX backend
            refuses to register IPC-imported memory (NIXL_ERR_BACKEND); the daemon must
            say so clearly and keep serving.
"""

import tempfile
from pathlib import Path

import msgspec
import pytest

from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, DemoError, EngineProcess
from kvxferd.plan.models import PRESETS

pytestmark = pytest.mark.gpu
replace = msgspec.structs.replace


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
        assert {e["memory"] for e in engines} == {"VRAM"}
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
