"""Move vLLM's KV cache, once, into memory the daemon can map: re-point, never copy per request.

vLLM allocates each backing buffer privately (`torch.zeros` on CPU, the caching allocator
on GPU) and views it per layer. At `register_kv_caches`, before any request has written KV,
every tensor that views a backing buffer is re-pointed in place (`Tensor.set_`, same offset,
shape and strides) at a shareable allocation holding the same bytes:

    CPU:  memfd (MAP_SHARED)             --fd over SCM_RIGHTS--> daemon mmaps the same pages
    GPU:  CUDA VMM, POSIX-fd handle      --fd over SCM_RIGHTS--> daemon imports and maps it
          (GPUDirect RDMA capable where the device has it: `memory.VmmBuffer`, so READs from
          other hosts can go over RDMA, not UCX's emulation)

The private buffer is given back before the shareable one is allocated (vLLM sizes the cache
to the free memory: two would not fit), its bytes kept on the host meanwhile; where something
else holds it, the copy is made beside it instead (logged). The tensors found
are the ones vLLM handed the connector, the attention layers' bound caches, and any other live
tensor on the same storage (found by a one-time scan), so no view keeps reading the private copy.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..memory import sealed_memfd

log = logging.getLogger("kvxferd.vllm")


@dataclass
class SharedBuffer:
    """One backing allocation, now shareable. `fd` stays open for re-registration."""

    fd: int
    nbytes: int
    address: int
    kind: Literal["shm", "cuda_vmm"]
    device: int = 0
    keep: list[Any] = field(default_factory=list)  # mmap / VMM buffer owning the memory

    def close(self) -> None:
        """Close the fd; the memory stays mapped for as long as the engine's tensors live."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def share(kv_caches: dict[str, Any], also: Iterable[Any] = ()) -> tuple[list[SharedBuffer], dict[str, tuple[int, int]]]:
    """Re-point every view of the caches' backing storages at shareable memory.

    Returns the shared buffers and, per layer, (buffer index, byte offset of the layer's
    first element in that buffer).
    """
    storages: dict[int, Any] = {}
    for t in kv_caches.values():
        st = t.untyped_storage()
        storages.setdefault(st.data_ptr(), st)
    views = _views_of(storages, list(kv_caches.values()) + list(also))
    buffers = [_replace(st, views[ptr]) for ptr, st in storages.items()]
    index = {b.address: i for i, b in enumerate(buffers)}
    layers = {name: (index[t.untyped_storage().data_ptr()], t.storage_offset() * t.element_size())
              for name, t in kv_caches.items()}
    return buffers, layers


def _replace(st: Any, views: list[Any]) -> SharedBuffer:
    """Shareable memory holding `st`'s bytes, with every one of `views` re-pointed at it.

    vLLM sizes its KV cache to what the device has free, so there is no room for a second copy
    beside it: `st`'s own memory is given back first (on a GPU, from torch's cache to the driver
    too), its bytes kept on the host meanwhile (a fresh cache is zeros: nothing to keep). Only
    when the views are all that hold `st`: a holder missed would read freed memory and crash,
    so then the copy is made beside it, as a storage torch did not allocate must be too."""
    import torch

    nbytes, device = st.nbytes(), st.device
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"kvxferd: KV cache on {device.type} devices is not supported (cpu and cuda are)")
    holders = _holders(st)
    release = st.resizable() and holders == len(views) + 1  # the views and `st` itself
    old = _bytes(st, nbytes)
    kept = old.to("cpu", copy=True) if release and bool(old.any()) else None
    if release:
        del old
        st.resize_(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        buf = _allocate(nbytes, device)
    except Exception as exc:
        if release:  # the cache as it was, for whatever vLLM does with the error
            st.resize_(nbytes)
            restored = _bytes(st, nbytes)
            if kept is not None:
                restored.copy_(kept)
            else:
                restored.zero_()
        raise RuntimeError(f"kvxferd: no shareable {device.type} memory for a KV cache buffer of {nbytes} B "
                           f"({type(exc).__name__}: {exc})") from exc
    # A VMM allocation is rounded up to the device's granularity: the bytes go to its first ones.
    new = _bytes(buf.keep[-1], nbytes)
    if not release:
        new.copy_(old)
        log.warning("KV cache buffer of %d B copied beside its private one, which stays allocated until "
                    "vLLM lets it go (%s)", nbytes, "not allocated by torch" if not st.resizable()
                    else f"{holders - 1} holders, {len(views)} of them views found")
    elif kept is not None:
        new.copy_(kept)
    elif device.type == "cuda":
        new.zero_()  # device memory comes uninitialised; a memfd comes zeroed
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the bytes are in place before the daemon is told of them
    for t in views:
        t.set_(buf.keep[-1], t.storage_offset(), t.size(), t.stride())
    rdma = ""
    if buf.kind == "cuda_vmm":  # keep[0] is its VmmBuffer
        rdma = ", GPUDirect RDMA capable" if buf.keep[0].gpu_direct_rdma else \
            ", not GPUDirect RDMA capable (this GPU does not offer it for VMM memory)"
    log.info("KV cache buffer of %d B moved to %s (%d views re-pointed%s%s)", buf.nbytes, buf.kind, len(views),
             ", its private buffer given back first" if release else "", rdma)
    return buf


def _bytes(st: Any, nbytes: int) -> Any:
    """The first `nbytes` of storage `st`, as a uint8 tensor on its device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (nbytes,), (1,))


def _holders(st: Any) -> int:
    """How many tensors and storage objects hold `st`'s memory (-1 where torch does not say)."""
    import torch

    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(st._cdata)) if count is not None else -1


def _views_of(storages: dict[int, Any], known: list[Any]) -> dict[int, list[Any]]:
    """Every live tensor on one of `storages`, each once: the known ones and a one-time gc scan."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor  # compile-time stand-ins own no memory

    found: dict[int, dict[int, Any]] = {ptr: {} for ptr in storages}
    candidates = [t for t in known if isinstance(t, torch.Tensor)]
    candidates += [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)
                   and o.device.type in ("cpu", "cuda")]
    for t in candidates:
        try:
            ptr = t.untyped_storage().data_ptr()
        except RuntimeError:  # tensors without storage (meta, sparse)
            continue
        if ptr in found:
            found[ptr][id(t)] = t
    return {ptr: list(ts.values()) for ptr, ts in found.items()}


def _allocate(nbytes: int, device: Any) -> SharedBuffer:
    """A shareable allocation of `nbytes` on `device` (cpu or cuda: `_replace` checked); its torch
    storage is `keep[-1]`."""
    import torch

    if device.type == "cpu":
        fd = sealed_memfd(nbytes, "kvxferd-vllm-kv")
        try:
            os.posix_fallocate(fd, 0, nbytes)  # its pages now, as the engine's: no shortage found mid-serving
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)  # its pages with it
            raise
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        storage = tensor.untyped_storage()
        return SharedBuffer(fd, nbytes, storage.data_ptr(), "shm", 0, [mm, storage])
    from ..memory import VmmBuffer

    index = device.index if device.index is not None else torch.cuda.current_device()
    vmm = VmmBuffer(nbytes, index)
    tensor = torch.as_tensor(_CudaArray(vmm.address, vmm.nbytes), device=device)
    storage = tensor.untyped_storage()
    return SharedBuffer(vmm.export(), vmm.nbytes, vmm.address, "cuda_vmm", index, [vmm, storage])


class _CudaArray:
    """Lets torch view a VMM allocation without copying (CUDA array interface)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}
