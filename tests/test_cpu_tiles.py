"""AMX tile permission (kvxferd/vllm/cpu_tiles.py): asked for where the CPU has AMX, in a real
process through the real syscall; nothing asked where it has not."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from kvxferd.vllm import cpu_tiles

CPU_HAS_AMX = cpu_tiles.cpu_has_amx_tiles(cpu_tiles._read_cpuinfo())


def test_the_amx_tile_flag_is_read_from_cpuinfo_flags_only():
    assert cpu_tiles.cpu_has_amx_tiles("processor : 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not cpu_tiles.cpu_has_amx_tiles("flags\t\t: fpu avx512f amx_bf16 amx_int8\n")  # no amx_tile
    assert not cpu_tiles.cpu_has_amx_tiles("model name : amx_tile\nflags : fpu\n")  # not a flag
    assert not cpu_tiles.cpu_has_amx_tiles("")


def test_a_fresh_process_gets_the_permission_on_an_amx_cpu_and_asks_nothing_elsewhere():
    script = ("from kvxferd.vllm import cpu_tiles as c\n"
              "before = c.tile_permission_held()\n"
              "print(before, c.request_amx_tiles(), c.tile_permission_held(), c.request_amx_tiles())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    if CPU_HAS_AMX:
        assert out == ["False", "granted", "True", "held"], out
    else:
        assert out == ["False", "absent", "False", "absent"], out


def test_the_raw_request_reaches_the_kernel():
    """The syscall's plumbing: granted on an AMX CPU, refused with EOPNOTSUPP (the kernel's word
    for a state the CPU lacks) on one without; never an error of our own making (ENOSYS, EFAULT)."""
    import errno

    err = cpu_tiles._arch_prctl(cpu_tiles.ARCH_REQ_XCOMP_PERM, cpu_tiles.XFEATURE_XTILEDATA)
    assert err == (0 if CPU_HAS_AMX else errno.EOPNOTSUPP), err


def test_vllm_loads_it_in_every_process_as_a_general_plugin():
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvxferd_amx_tiles"]
    assert plugin.load() is cpu_tiles.vllm_plugin
