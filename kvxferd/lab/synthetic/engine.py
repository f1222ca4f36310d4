"""A synthetic inference engine: all TP ranks of one engine, KV caches in shared memory.

It allocates each rank's buffers as memfds, registers them with its daemon, and then
"prefills" prompts (writes the logical bytes, asks the daemon to hold them) or "decodes"
(asks the daemon to read a prompt from a prefill engine and verifies every byte that
arrived against a shadow copy of what the rank should hold).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...client import Completion, EngineClient, MemoryHandle, RemoteRef
from ...memory import create_shm
from ...plan.geometry import ATTENTION, Geometry
from ...plan.models import ModelShape, build
from . import testing


class VerificationError(AssertionError):
    pass


@dataclass
class Rank:
    geometry: Geometry
    client: EngineClient
    # mmaps (host), VmmBuffers or lazily imported torch CUDA tensors (GPU), used by duck typing
    mem: list[Any]
    view: list[np.ndarray]  # host bytes: the shared memory itself, or a staging copy of GPU memory
    shadow: list[np.ndarray]  # what the memory should hold
    pending: dict[str, Completion] = field(default_factory=dict)  # completions polled but not yet waited for
    gpu: bool = False

    def upload(self) -> None:
        """GPU ranks: push the staging copy to device memory (host ranks share it already)."""
        for buf, v in zip(self.mem, self.view) if self.gpu else ():
            if hasattr(buf, "write"):
                buf.write(v)
            else:
                import torch
                buf.copy_(torch.from_numpy(v))
                torch.cuda.synchronize()

    def download(self) -> None:
        for buf, v in zip(self.mem, self.view) if self.gpu else ():
            if hasattr(buf, "read"):
                buf.read(v)
            else:
                v[:] = buf.cpu().numpy()


class SyntheticEngine:
    def __init__(self, socket_path: str, engine_id: str, shape: ModelShape, tp_size: int,
                 device: str = "cpu") -> None:
        self.engine_id, self.shape, self.tp_size = engine_id, shape, tp_size
        self.ranks: list[Rank] = []
        for r in range(tp_size):
            geo = build(shape, tp_size, r)
            client = EngineClient(socket_path, engine_id, r, tp_size)
            if device.startswith("cuda"):
                rank = self._gpu_rank(geo, client, device)
            else:
                fds, mems, views = [], [], []
                for size in geo.buffers:
                    fd, mm = create_shm(size, f"{engine_id}-{r}")
                    fds.append(fd)
                    mems.append(mm)
                    view = np.frombuffer(mm, dtype=np.uint8)
                    view[:] = testing.POISON
                    views.append(view)
                self.side_channel = client.register(geo, shm_fds=fds)
                for fd in fds:
                    os.close(fd)
                rank = Rank(geo, client, mems, views, [v.copy() for v in views])
            self.ranks.append(rank)
        geo0 = self.ranks[0].geometry
        self.pool = list(range(min(g.num_blocks for g in geo0.groups)))
        self.pool.reverse()
        # seq -> (sequence, locally cached blocks per group, blocks read per group, start time)
        self.reading: dict[int, tuple[testing.Sequence, list[int], list[list[int]], float]] = {}

    def _gpu_rank(self, geo: Geometry, client: EngineClient, device: str) -> Rank:
        """cuda-vmm: shareable VMM allocations passed as fds; cuda-ipc: torch tensors, IPC handles."""
        views = [np.full(size, testing.POISON, dtype=np.uint8) for size in geo.buffers]
        bufs: list[Any]  # torch tensors or VmmBuffers, as Rank.mem
        if device == "cuda-ipc":
            import torch

            from ...memory import export_cuda
            tensors = [torch.full((size,), testing.POISON, dtype=torch.uint8, device="cuda") for size in geo.buffers]
            torch.cuda.synchronize()
            memory = [MemoryHandle("cuda_ipc", size, 0, export_cuda(t)) for size, t in zip(geo.buffers, tensors)]
            self.side_channel = client.register(geo, memory=memory)
            bufs = tensors
        else:
            from ...memory import VmmBuffer
            vmm_bufs = [VmmBuffer(size) for size in geo.buffers]
            for b, v in zip(vmm_bufs, views):
                b.write(np.resize(v, b.nbytes))
            fds = [b.export() for b in vmm_bufs]
            self.side_channel = client.register(geo, memory=[MemoryHandle("cuda_vmm", b.nbytes) for b in vmm_bufs],
                                                fds=fds)
            for fd in fds:
                os.close(fd)
            bufs = vmm_bufs
        return Rank(geo, client, bufs, views, [v.copy() for v in views], gpu=True)

    # --- blocks ---------------------------------------------------------------
    def allocate(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        need = testing.blocks_needed(self.ranks[0].geometry, num_tokens)
        if sum(need) > len(self.pool):
            raise RuntimeError(f"{self.engine_id}: out of KV blocks ({sum(need)} needed, {len(self.pool)} free)")
        return tuple(tuple(self.pool.pop() for _ in range(n)) for n in need)

    def free(self, blocks: Iterable[Iterable[int]]) -> None:
        for group in blocks:
            self.pool.extend(group)

    # --- prefill --------------------------------------------------------------
    def prefill(self, seq: int, num_tokens: int, lease_s: float, digest: bool | None = None,
                read_token: str = "", hold: bool = True) -> tuple[tuple[int, ...], ...]:
        """Compute prompt `seq` into new blocks and (`hold`) hold them for its readers."""
        blocks = self.allocate(num_tokens)
        s = testing.Sequence(seq, num_tokens, blocks)
        for rank in self.ranks:
            testing.fill_sequence(rank.view, rank.geometry, s)
            rank.upload()
        if hold:
            self.hold(seq, blocks, lease_s, digest, read_token)
        return blocks

    def hold(self, seq: int, blocks: Sequence[Sequence[int]], lease_s: float, digest: bool | None = None,
             read_token: str = "") -> None:
        for rank in self.ranks:
            rank.client.hold(f"req-{seq}", lease_s, [list(b) for b in blocks], digest, read_token)

    def reuse(self, blocks: Sequence[Sequence[int]], seq: int) -> None:
        """Write another prompt's state into blocks still held (what an engine that frees and
        reuses blocks before its consumers read them does)."""
        for rank in self.ranks:
            for gi, group in enumerate(rank.geometry.groups):
                if group.kind == ATTENTION and blocks[gi]:
                    testing.write_tokens(rank.view, rank.geometry, gi, seq, blocks[gi], 0, 0,
                                         len(blocks[gi]) * group.tokens_per_block)
            rank.upload()

    def wait_released(self, seq: int, timeout_s: float) -> list[str]:
        """Wait for every rank's 'sent' or 'expired' of a prompt; return the statuses."""
        return [self._wait(rank, f"req-{seq}", timeout_s).status for rank in self.ranks]

    # --- decode ---------------------------------------------------------------
    def expect(self, seq: int, remote: RemoteRef) -> None:
        """Announce a read before its blocks are allocated (the daemon keeps the prefill's holds alive)."""
        for rank in self.ranks:
            rank.client.expect(f"d-{seq}", remote)

    def post_read(self, seq: int, num_tokens: int, remote: RemoteRef, remote_blocks: Sequence[Sequence[int]],
                  hit_tokens: int, deadline_s: float, audit: bool | None = None) -> list[list[int]]:
        """Allocate blocks, write the locally cached prefix, ask every rank's daemon to read the rest."""
        blocks = self.allocate(num_tokens)
        s = testing.Sequence(seq, num_tokens, blocks)
        geo0 = self.ranks[0].geometry
        hit = [min(hit_tokens // g.tokens_per_block, len(blocks[i])) if g.kind == ATTENTION else 0
               for i, g in enumerate(geo0.groups)]
        for rank in self.ranks:
            for bufs in (rank.view, rank.shadow):
                _poison_blocks(bufs, rank.geometry, blocks)
                testing.fill_sequence(bufs, rank.geometry, s, upto_block=hit)
            rank.upload()
        local = [list(b[h:]) for b, h in zip(blocks, hit)]
        started = time.perf_counter()
        for rank in self.ranks:
            rank.client.read(f"d-{seq}", remote, num_tokens, local, remote_blocks, deadline_s, audit)
        self.reading[seq] = (s, hit, local, started)
        return local

    def wait_read(self, seq: int, timeout_s: float) -> list[tuple[str, list[list[int]], str, int]]:
        """Every rank's completion of a read (one each), as (status, block_ids, reason, nbytes)."""
        return [(c.status, c.block_ids, c.reason, c.nbytes)
                for c in (self._wait(rank, f"d-{seq}", timeout_s) for rank in self.ranks)]

    def decode(self, seq: int, num_tokens: int, remote: RemoteRef, remote_blocks: Sequence[Sequence[int]],
               hit_tokens: int, deadline_s: float, remote_shape: ModelShape, audit: bool | None = None
               ) -> dict[str, Any]:
        """Read a prompt from the prefill engine, verify it byte for byte, free the blocks."""
        self.post_read(seq, num_tokens, remote, remote_blocks, hit_tokens, deadline_s, audit)
        return self.finish_read(seq, deadline_s + 5, remote_shape, remote.tp_size)

    def finish_read(self, seq: int, timeout_s: float, remote_shape: ModelShape, remote_tp: int) -> dict[str, Any]:
        """Wait for a posted read's completions, verify what arrived byte for byte, free the blocks."""
        results = self.wait_read(seq, timeout_s)
        s, hit, local, started = self.reading.pop(seq)
        latency = time.perf_counter() - started  # read calls -> every rank's completion
        failed = [r for r in results if r[0] != "received"]
        if failed:
            self.free(s.blocks)
            return {"status": "failed", "reason": failed[0][2], "latency_s": latency, "bytes": 0,
                    "block_ids": [r[1] for r in failed], "local_blocks": local}
        chunks = self._chunk_tokens(remote_shape, remote_tp)
        for rank in self.ranks:
            rank.download()
            testing.expect_after_read(rank.shadow, rank.geometry, s, hit, chunks, in_place=True)
            bad = _compare_blocks(rank.view, rank.shadow, rank.geometry, s.blocks)
            if bad:
                raise VerificationError(f"{self.engine_id} rank {rank.geometry.tp_rank} request d-{seq}: {bad}")
        self.free(s.blocks)
        return {"status": "received", "latency_s": latency, "bytes": sum(r[3] for r in results)}

    def drop(self, seq: int) -> tuple[tuple[int, ...], ...]:
        """Forget a read without verifying it (failed reads); returns its blocks for `free`."""
        return self.reading.pop(seq)[0].blocks

    def tokens(self) -> list[str]:
        """Each rank's registration token: what another process `attach`es with to act for it."""
        return [rank.client.token for rank in self.ranks]

    def pending(self) -> list[int]:
        """Completions received but never waited for, per rank (duplicates would show here)."""
        return [len(rank.pending) for rank in self.ranks]

    def _chunk_tokens(self, remote_shape: ModelShape, remote_tp: int) -> list[int]:
        """Per group, the transfer chunk (tokens): the smaller kernel page of the two sides."""
        local = self.ranks[0].geometry.groups
        remote = build(remote_shape, remote_tp, 0).groups
        return [min(lg.tokens_per_page, rg.tokens_per_page) for lg, rg in zip(local, remote)]

    def verify_all(self) -> list[testing.Mismatch]:
        """Full-buffer comparison (catches stray writes outside any request's pages)."""
        out: list[testing.Mismatch] = []
        for rank in self.ranks:
            rank.download()
            out += testing.check(rank.view, rank.shadow, rank.geometry)
        return out

    def _wait(self, rank: Rank, request_id: str, timeout_s: float) -> Completion:
        pending = rank.pending
        deadline = time.monotonic() + timeout_s
        while request_id not in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.engine_id} rank {rank.geometry.tp_rank}: no completion for "
                                   f"{request_id} within {timeout_s:g} s")
            for c in rank.client.poll(wait_s=min(left, 1.0)):
                pending[c.request_id] = c
        return pending.pop(request_id)

    def close(self) -> None:
        for rank in self.ranks:
            try:
                rank.client.unregister()
            except Exception:
                pass
            rank.client.close()
            rank.view.clear()
            for mm in rank.mem:
                if hasattr(mm, "close"):
                    mm.close()


def _block_pages(geo: Geometry, blocks: Sequence[Iterable[int]]) -> Iterator[tuple[int, int, int]]:
    """(buffer, start, stop) byte ranges of every page of the given blocks, per group view."""
    for gi, group in enumerate(geo.groups):
        for view in group.views:
            region = geo.regions[view.region]
            for b in blocks[gi]:
                start = region.offset + b * group.pages_per_block * view.page_stride
                yield region.buffer, start, start + group.pages_per_block * view.page_stride


def _poison_blocks(bufs: list[np.ndarray], geo: Geometry, blocks: Sequence[Iterable[int]]) -> None:
    for buf, start, stop in _block_pages(geo, blocks):
        bufs[buf][start:stop] = testing.POISON


def _compare_blocks(actual: list[np.ndarray], expected: list[np.ndarray], geo: Geometry,
                    blocks: Sequence[Iterable[int]]) -> list[str]:
    bad: list[str] = []
    for buf, start, stop in _block_pages(geo, blocks):
        diff = np.flatnonzero(actual[buf][start:stop] != expected[buf][start:stop])
        if len(diff):
            bad.append(f"{len(diff)} bytes differ, first at {testing.locate(geo, buf, start + int(diff[0]))}")
    return bad
