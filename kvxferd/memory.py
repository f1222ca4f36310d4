"""Mapping engine memory into the daemon without copying, and unmapping it.

Host memory: the engine allocates a memfd, the file descriptor travels over the Unix
socket (SCM_RIGHTS), the daemon maps the same pages MAP_SHARED. GPU memory: the engine
exports a CUDA IPC handle of its KV cache storage (torch), the daemon opens it. The
engine keeps owning its memory in both cases.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass


class MappingError(RuntimeError):
    """Engine memory could not be mapped; the message names the buffer."""


def create_shm(nbytes: int, name: str = "kvxferd-kv") -> tuple[int, mmap.mmap]:
    """Engine side: a shareable host buffer (memfd) and the engine's own mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def buffer_address(buf: mmap.mmap) -> int:
    """The virtual address of an mmap, without keeping an export alive (so it can close)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


@dataclass
class Mapping:
    """One engine buffer as the daemon sees it."""

    kind: str  # "DRAM" or "VRAM" (NIXL memory type)
    address: int
    nbytes: int
    device: int
    _keep: object  # the mmap or the CUDA storage that keeps the mapping alive

    def close(self) -> None:
        if isinstance(self._keep, mmap.mmap):
            self._keep.close()
        self._keep = None


def map_shm(fd: int, nbytes: int) -> Mapping:
    """Daemon side: map an engine's memfd. The fd is closed; the mapping keeps the pages."""
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise MappingError(f"shared memory fd holds {size} B, engine declared {nbytes} B")
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise MappingError(f"cannot map shared memory fd: {exc}") from exc
    finally:
        os.close(fd)
    return Mapping("DRAM", buffer_address(buf), nbytes, 0, buf)


def export_cuda(tensor) -> bytes:
    """Engine side: a CUDA IPC handle for a tensor's storage, as bytes for the wire."""
    import msgspec

    storage = tensor.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, event_sync = storage._share_cuda_()
    return msgspec.msgpack.encode([device, handle, size, offset, ref_handle, ref_offset, event, event_sync])


def map_cuda(handle: bytes, nbytes: int) -> Mapping:
    """Daemon side: open a CUDA IPC handle exported by `export_cuda`.

    A legacy IPC handle can be opened once per process; the daemon maps each buffer once
    and keeps the storage for as long as the engine is registered.
    """
    import msgspec
    import torch  # only here: the GPU path

    parts = msgspec.msgpack.decode(handle)
    device, size = int(parts[0]), int(parts[2])
    if size < nbytes:
        raise MappingError(f"CUDA IPC handle covers {size} B, engine declared {nbytes} B")
    try:
        torch.cuda.set_device(device)
        storage = torch.UntypedStorage._new_shared_cuda(*parts)
    except Exception as exc:
        raise MappingError(f"cannot open CUDA IPC handle on device {device}: {exc}") from exc
    return Mapping("VRAM", storage.data_ptr(), nbytes, device, storage)
