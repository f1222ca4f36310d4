"""Mapping engine memory into the daemon without copying, and unmapping it.

Host memory: the engine allocates a memfd, the file descriptor travels over the Unix
socket (SCM_RIGHTS), the daemon maps the same pages MAP_SHARED. GPU memory: the engine
allocates with CUDA VMM (`cuMemCreate`), exports a POSIX fd that travels the same way, and the
daemon imports and maps it (a legacy CUDA IPC handle can be opened, but NIXL's UCX backend
refuses to register what it maps). The engine keeps owning its memory in both cases. VMM
allocations ask for GPUDirect RDMA where the device has it, and the daemon keeps the driver's
word on each mapping (`Mapping.rdma_capable`): without it READs from other hosts cannot go over
RDMA, and UCX says nothing when it falls back.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import mmap
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np

MemType = Literal["DRAM", "VRAM"]  # NIXL's names

log = logging.getLogger("kvxferd")


class MappingError(RuntimeError):
    """Engine memory could not be mapped; the message names the buffer."""


TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs, where MFD_HUGETLB-less memfds live


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def fs_type(fd: int) -> int:
    """The statfs magic of the filesystem an fd's file lives on (-1 if unknown)."""
    buf = _StatFs()
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, ctypes.byref(buf)) != 0:
        return -1
    return int(buf.f_type)


def sealed_memfd(nbytes: int, name: str = "kvxferd-kv") -> int:
    """Engine side: a memfd of `nbytes`, sealed against shrinking (the daemon refuses one that is
    not: pages cut off under its mapping would kill it with SIGBUS on the next read), its pages
    allocated now, charged to the engine (the daemon refuses a sparse one: see `map_shm`)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_shm(nbytes: int, name: str = "kvxferd-kv") -> tuple[int, mmap.mmap]:
    """Engine side: a shareable host buffer (sealed memfd) and the engine's own mapping of it."""
    fd = sealed_memfd(nbytes, name)
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

    kind: MemType
    address: int
    nbytes: int
    device: int
    _keep: object  # the mmap or the CUDA storage that keeps the mapping alive
    fd: int = -1  # a host memfd's, kept to see whether its engine punched a hole since (`sparse`)
    # A VMM import's CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: whether a NIC may read it
    # directly (READs from other hosts over RDMA). None: host memory, or the driver did not say.
    rdma_capable: bool | None = None

    def sparse(self) -> str:
        """Why the engine's memfd now lacks pages ("": it has them all, or it is not a memfd)."""
        return sparse(self.fd) if self.fd >= 0 else ""

    def close(self) -> None:
        try:
            if hasattr(self._keep, "close"):  # mmap or VMM mapping; CUDA IPC storages just drop
                self._keep.close()
            self._keep = None
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def map_shm(fd: int, nbytes: int) -> Mapping:
    """Daemon side: map an engine's memfd; the mapping keeps the fd (see `Mapping.sparse`).

    The engine pays for its memory: every page must be allocated when it registers. A hole would
    be allocated by whoever touches it first: the daemon's digest, a peer's READ through the
    daemon's mapping, charged to the daemon. (Sealing it against new writers would stop holes
    being punched after, but a restarted daemon could then no longer map it writable.)"""
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd: nothing stops its owner truncating it
        if fs_type(fd) != TMPFS_MAGIC:  # hugetlbfs memfds let a punched hole SIGBUS us despite the seal
            raise MappingError("shared memory fd must be a memfd on tmpfs (a hugetlb memfd can lose pages "
                               "under the daemon's mapping whatever its seals)")
        if not seals & fcntl.F_SEAL_SHRINK:
            raise MappingError("shared memory fd must be a memfd sealed against shrinking (F_SEAL_SHRINK; "
                               "kvxferd.memory.sealed_memfd makes one): its owner could cut pages from under "
                               "the daemon's mapping")
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise MappingError(f"shared memory fd holds {size} B, engine declared {nbytes} B")
        _drop_past_end(fd, size, seals)
        if why := sparse(fd):
            raise MappingError(f"{why}; allocate its pages before registering (posix_fallocate; "
                               "kvxferd.memory.sealed_memfd does), or the daemon would pay for them")
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise MappingError(f"cannot map shared memory fd: {exc}") from exc
        raise
    return Mapping("DRAM", buffer_address(buf), nbytes, 0, buf, fd)


_FALLOC_PUNCH_HOLE = 0x03  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _drop_past_end(fd: int, size: int, seals: int) -> None:
    """No page kept past the memfd's end, now or later: `sparse` counts a file's pages, and pages
    fallocated past its end would make up for holes punched in it. Sealed against growing first
    (a KEEP_SIZE fallocate past the end is then refused), then whatever is there punched away."""
    if not seals & fcntl.F_SEAL_GROW:
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
        except PermissionError:
            raise MappingError("shared memory fd must be sealed against growing (F_SEAL_GROW), or let the "
                               "daemon seal it (it carries F_SEAL_SEAL)") from None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, _FALLOC_PUNCH_HOLE, ctypes.c_long(size), ctypes.c_long(1 << 62)) != 0:
        err = ctypes.get_errno()
        raise MappingError(f"cannot drop the pages past the shared memory fd's end: {os.strerror(err)}")


@functools.cache
def _tail_page() -> int:
    """What a memfd's last page may take past its end: a huge page where memfds get them whatever
    their size (shmem_enabled always or force), else a page."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            huge = "[always]" in (mode := f.read()) or "[force]" in mode
    except OSError:
        huge = False
    return 2 << 20 if huge else mmap.PAGESIZE


def sparse(fd: int) -> str:
    """Why the memfd has pages missing ("" when every page is allocated). st_blocks counts
    fallocated pages too (SEEK_HOLE does not: tmpfs reports those as holes), over the whole file,
    blocks kept past its end included: more than its size rounded to a page would hide holes
    (the daemon seals it against growing: none is added past its end after it registered)."""
    st = os.fstat(fd)
    allocated = st.st_blocks * 512
    if allocated < st.st_size:
        return f"shared memory fd is sparse: {allocated} of its {st.st_size} B have pages"
    if allocated > -(-st.st_size // _tail_page()) * _tail_page():
        return f"shared memory fd keeps pages past its end ({allocated} B allocated for {st.st_size} B)"
    return ""


def export_cuda(tensor: Any) -> bytes:  # a torch.Tensor on a CUDA device
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

    try:
        parts = msgspec.msgpack.decode(handle)
        device, size = int(parts[0]), int(parts[2])
    except Exception as exc:  # an engine's bytes: whatever they hold is a refusal, never a crash
        raise MappingError(f"malformed CUDA IPC handle: {type(exc).__name__}: {str(exc)[:200]}") from None
    if size < nbytes:
        raise MappingError(f"CUDA IPC handle covers {size} B, engine declared {nbytes} B")
    try:
        torch.cuda.set_device(device)
        storage = torch.UntypedStorage._new_shared_cuda(*parts)
    except Exception as exc:
        raise MappingError(f"cannot open CUDA IPC handle on device {device}: {exc}") from exc
    return Mapping("VRAM", storage.data_ptr(), nbytes, device, storage)


# --- CUDA VMM: shareable POSIX fd, the fallback when IPC-imported memory cannot be registered ---
#
#   engine: cuMemCreate(POSIX_FD) -> cuMemMap -> cuMemExportToShareableHandle -> fd ==SCM_RIGHTS==>
#   daemon: cuMemImportFromShareableHandle(fd) -> cuMemAddressReserve -> cuMemMap -> register VRAM


def _cu() -> ModuleType:
    try:
        from cuda.bindings import driver as cu  # only here: the GPU path
    except ImportError as exc:
        raise MappingError(f"CUDA driver bindings are not available: {exc}") from None
    return cu


def _check(result: Any, what: str) -> Any:  # CUDA driver results and handles
    cu = _cu()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise MappingError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    return rest[0] if len(rest) == 1 else rest


def _context(device: int) -> None:
    cu = _cu()
    _check(cu.cuInit(0), "cuInit")
    dev = _check(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@functools.cache
def _rdma_with_vmm(device: int) -> bool:
    """Whether `device` lets VMM allocations be read by a NIC directly (GPUDirect RDMA), asked once
    per device: an allocation asking for it where the device cannot is refused by cuMemCreate, and a
    driver (or bindings) too old to know the attribute answers an error, taken as no."""
    cu = _cu()
    err, dev = cu.cuDeviceGet(device)
    if err != cu.CUresult.CUDA_SUCCESS:
        return False
    try:
        attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    except AttributeError:
        return False
    err, value = cu.cuDeviceGetAttribute(attribute, dev)
    return err == cu.CUresult.CUDA_SUCCESS and bool(value)


def _prop(device: int) -> Any:  # a CUmemAllocationProp
    """What engines allocate: pinned device memory exportable as a POSIX fd, and GPUDirect RDMA
    capable where the device allows it. Without that flag UCX (1.22 and later) cannot export the
    memory as dma-buf, skips its RDMA transports for it and moves READs from other hosts by
    software emulation (docs/deploy.md, GPU hosts)."""
    cu = _cu()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if _rdma_with_vmm(device):
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def _granularity(prop: Any) -> int:
    cu = _cu()
    return int(_check(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))


def _map(handle: Any, nbytes: int, device: int) -> int:
    cu = _cu()
    # The allocation's own properties, not the ones this process would allocate with: an engine of
    # another build (or one on a device answering otherwise) may have asked for other flags, and
    # the address range must be aligned to what its allocation needs.
    prop = _check(cu.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
    gran = _granularity(prop)
    # Each step that succeeds queues its undo: a later failure (an engine can declare a size its
    # allocation does not have) gives back the address range, not leaks it for the daemon's life.
    with contextlib.ExitStack() as undo:
        ptr = _check(cu.cuMemAddressReserve(nbytes, gran, 0, 0), "cuMemAddressReserve")
        undo.callback(cu.cuMemAddressFree, ptr, nbytes)
        _check(cu.cuMemMap(ptr, nbytes, 0, handle, 0), "cuMemMap")
        undo.callback(cu.cuMemUnmap, ptr, nbytes)
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(ptr, nbytes, [access], 1), "cuMemSetAccess")
        undo.pop_all()  # mapped: the caller owns it now
    return int(ptr)


def vmm_size(nbytes: int, device: int = 0) -> int:
    """`nbytes` rounded up to the allocation granularity (VMM sizes must be multiples of it)."""
    _context(device)
    gran = _granularity(_prop(device))
    return -(-nbytes // gran) * gran


class VmmBuffer:
    """Engine side: device memory allocated shareable; `export()` gives an fd for the daemon."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        cu = _cu()
        self.nbytes, self.device = vmm_size(nbytes, device), device
        prop = _prop(device)
        self.gpu_direct_rdma = bool(prop.allocFlags.gpuDirectRDMACapable)  # asked for; see `_prop`
        self.handle = _check(cu.cuMemCreate(self.nbytes, prop, 0), "cuMemCreate")
        try:
            self.address = _map(self.handle, self.nbytes, device)
        except BaseException:
            cu.cuMemRelease(self.handle)  # not mapped: nothing else holds the allocation
            raise

    def export(self) -> int:
        cu = _cu()
        return int(_check(cu.cuMemExportToShareableHandle(
            self.handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle"))

    def write(self, data: np.ndarray) -> None:
        _check(_cu().cuMemcpyHtoD(self.address, data, data.nbytes), "cuMemcpyHtoD")

    def read(self, out: np.ndarray) -> None:
        _check(_cu().cuMemcpyDtoH(out, self.address, out.nbytes), "cuMemcpyDtoH")

    def close(self) -> None:
        _unmap(self.address, self.nbytes, self.handle)


def _unmap(address: int, nbytes: int, handle: Any) -> None:
    cu = _cu()
    cu.cuMemUnmap(address, nbytes)
    cu.cuMemAddressFree(address, nbytes)
    cu.cuMemRelease(handle)


class _VmmKeep:
    def __init__(self, address: int, nbytes: int, handle: Any) -> None:
        self.address, self.nbytes, self.handle = address, nbytes, handle

    def close(self) -> None:
        _unmap(self.address, self.nbytes, self.handle)


def map_cuda_vmm(fd: int, nbytes: int, device: int) -> Mapping:
    """Daemon side: import an engine's VMM allocation from its fd and map it here, at an address
    range of its own: each allocation is NIXL-registered on its own (engines.py), and the driver's
    answers on it (GPUDirect RDMA among them) are per allocation."""
    cu = _cu()
    try:
        _context(device)
        handle = _check(cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle")
        try:
            address = _map(handle, nbytes, device)
        except BaseException:
            cu.cuMemRelease(handle)  # the imported handle would keep the engine's GPU memory alive
            raise
    finally:
        os.close(fd)
    rdma = _rdma_capable(address)
    _tell_rdma(device, rdma)
    return Mapping("VRAM", address, nbytes, device, _VmmKeep(address, nbytes, handle), rdma_capable=rdma)


def _rdma_capable(address: int) -> bool | None:
    """The driver's word on whether a NIC may read this mapping directly (None: it did not say).
    Only shown, never a refusal: READs work without it, by UCX's emulation, so bindings that
    cannot ask (an unknown attribute raises there) do not fail a registration either."""
    cu = _cu()
    try:
        err, value = cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, address)
    except Exception as exc:
        log.debug("cannot ask whether VRAM at %#x is GPUDirect RDMA capable: %s", address, exc)
        return None
    return bool(value) if err == cu.CUresult.CUDA_SUCCESS else None


_rdma_told: set[tuple[int, bool | None]] = set()


def _tell_rdma(device: int, rdma: bool | None) -> None:
    """Log, once per device and answer, whether engines' VRAM can go over RDMA: UCX falls back to
    its emulation for memory it cannot register for RDMA without a word, so the cliff (READs from
    other hosts at TCP speed, not the NIC's) is named here."""
    if (device, rdma) in _rdma_told:
        return
    _rdma_told.add((device, rdma))
    if rdma:
        log.info("GPU %d: engine VRAM is GPUDirect RDMA capable: READs from other hosts can go over UCX's RDMA "
                 "transports (where UCX can export it as dma-buf)", device)
        return
    if rdma is None:
        why, level = "the driver did not say", logging.INFO
    elif _rdma_with_vmm(device):  # the engine could have asked for it: worth an operator's look
        why, level = "allocated without gpuDirectRDMACapable", logging.WARNING
    else:
        why, level = "this GPU does not report GPUDirect RDMA with CUDA VMM", logging.INFO
    log.log(level, "GPU %d: engine VRAM is not GPUDirect RDMA capable (%s): READs of it from other hosts go "
            "through UCX's software emulation, at TCP speed, not over RDMA (docs/deploy.md, GPU hosts)", device, why)
