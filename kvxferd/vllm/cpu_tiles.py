"""AMX tile permission for vLLM's CPU processes.

Linux runs a process's AMX tile instructions only once the process asked for the tile state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); one that executes them unasked is
killed with SIGILL. vLLM CPU 0.32's own AMX code does not ask: its attention at ISA "amx"
(bfloat16, blocks a multiple of 32 tokens: `cpu_attn._get_attn_isa`) loads tiles directly, and
the only request in its `_C` library is oneDNN's (`dnnl::impl::cpu::x64::amx::is_available`),
made when oneDNN first considers AMX: a GEMM whose weight is over 1 MiB (smaller bfloat16 weights
take vLLM's own kernels), or a prefill through PyTorch's SDPA. So a worker whose first forward is
a decode step of a small model never asked, and dies at that step: a P/D decode instance, whose
prompt's KV came through a connector (kvxferd's or vLLM's NixlConnector alike; docs/vllm.md).

    a vLLM process starts (general plugin: every process; the connector's worker: again)
        CPU without amx_tile, or not x86-64 Linux ─► "absent": nothing to ask
        permission already held                     ─► "held"
        otherwise ask once                          ─► "granted" (logged), or "refused: <errno>" (warned)

Asking costs nothing the process would not pay on its first oneDNN AMX GEMM (the tile state in
its threads' saved context); it is process-wide and idempotent.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("kvxferd.vllm")

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx_tiles(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text lists the `amx_tile` flag."""
    return any(line.startswith("flags") and "amx_tile" in line.split(":", 1)[-1].split()
               for line in cpuinfo.splitlines())


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _arch_prctl(code: int, arg: int | ctypes._Pointer[ctypes.c_uint64]) -> int:
    """The raw syscall: 0, or the errno it failed with."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, code, arg) == 0:
        return 0
    return ctypes.get_errno() or -1


def tile_permission_held() -> bool:
    """This process may execute AMX tile instructions (x86-64 Linux only)."""
    mask = ctypes.c_uint64(0)
    return _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.pointer(mask)) == 0 and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_amx_tiles() -> str:
    """Ask for AMX tile permission where the CPU has AMX and it is not held yet (see the module)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "absent"
    if not cpu_has_amx_tiles(_read_cpuinfo()):
        return "absent"
    if tile_permission_held():
        return "held"
    err = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if err:
        log.warning("kvxferd: AMX tile permission refused (%s): vLLM CPU's AMX kernels may die with SIGILL "
                    "(docs/vllm.md, 'AMX CPUs')", os.strerror(err) if err > 0 else err)
        return f"refused: {os.strerror(err) if err > 0 else err}"
    log.info("kvxferd: asked for AMX tile permission for this process (vLLM CPU's AMX kernels assume it)")
    return "granted"


def vllm_plugin() -> None:
    """vLLM's `vllm.general_plugins` entry point: loaded in each vLLM process, workers included."""
    request_amx_tiles()
