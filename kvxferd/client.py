"""Engine-side library: the reference implementation of the engine half of the protocol.

    with EngineClient("/run/kvxferd/kvxferd.sock", "prefill-0", rank=0, tp_size=2) as c:
        c.register(geometry, shm_fds=[fd])          # or cuda=[export_cuda(kv_tensor)]
        c.hold("req-1", lease_s=30)                 # prefill
        c.read("req-1", remote, num_tokens, local_blocks, remote_blocks)   # decode
        for done in c.poll(wait_s=1.0): ...
"""

from __future__ import annotations

import asyncio

from . import protocol as P
from .plan.geometry import Geometry
from .rpc import AsyncClient, Client, DaemonError

__all__ = ["AsyncEngineClient", "Completion", "DaemonError", "EngineClient", "MemoryHandle", "RemoteRef"]

RemoteRef = P.RemoteRef
Completion = P.Completion


MemoryHandle = P.MemoryHandle


def _memory(geometry: Geometry, shm_fds, memory) -> tuple[list[P.MemoryHandle], list[int]]:
    """shm_fds: one memfd per buffer (sizes from the geometry); or explicit handles."""
    if shm_fds:
        return [P.MemoryHandle("shm", size) for size in geometry.buffers], list(shm_fds)
    return list(memory), []


class EngineClient:
    """One engine rank's synchronous connection to its daemon."""

    def __init__(self, socket_path: str, engine_id: str, rank: int, tp_size: int, timeout: float = 30.0) -> None:
        self.rpc = Client(socket_path, timeout, client=f"{engine_id}/{rank}")
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        self.side_channel = ""

    def register(self, geometry: Geometry, shm_fds: list[int] = (), memory: list[P.MemoryHandle] = (),
                 fds: list[int] = ()) -> str:
        """Hand the daemon this rank's KV memory; returns the side channel peers should dial.

        Host memory: `shm_fds`, one memfd per geometry buffer. GPU memory: `memory` handles
        (cuda_vmm with their fds in `fds`, in order; or cuda_ipc handles).
        """
        memory, shm = _memory(geometry, shm_fds, memory)
        reply = self.rpc.call(P.Register(self.engine_id, self.rank, self.tp_size, geometry, memory),
                              shm or list(fds))
        self.side_channel = reply.side_channel
        return reply.side_channel

    def unregister(self) -> None:
        self.rpc.call(P.Unregister(self.engine_id, self.rank))

    def hold(self, request_id: str, lease_s: float = 30.0, block_ids: list[list[int]] = ()) -> None:
        self.rpc.call(P.Hold(self.engine_id, self.rank, request_id, lease_s, [list(b) for b in block_ids]))

    def read(self, request_id: str, remote: P.RemoteRef, num_tokens: int, local_blocks, remote_blocks,
             deadline_s: float = 30.0) -> None:
        self.rpc.call(P.Read(self.engine_id, self.rank, request_id, remote, num_tokens,
                             [list(map(int, b)) for b in local_blocks], [list(map(int, b)) for b in remote_blocks],
                             deadline_s))

    def poll(self, wait_s: float = 0.0, max_items: int = 1024) -> list[P.Completion]:
        return self.rpc.call(P.Poll(self.engine_id, self.rank, wait_s, max_items), timeout=wait_s + 30).items

    def status(self) -> dict:
        return self.rpc.call(P.StatusQuery()).status

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncEngineClient:
    """The same calls for engines that run an asyncio loop."""

    def __init__(self, rpc: AsyncClient, engine_id: str, rank: int, tp_size: int) -> None:
        self.rpc, self.engine_id, self.rank, self.tp_size = rpc, engine_id, rank, tp_size

    @classmethod
    async def connect(cls, socket_path: str, engine_id: str, rank: int, tp_size: int) -> AsyncEngineClient:
        return cls(await AsyncClient.connect(socket_path, f"{engine_id}/{rank}"), engine_id, rank, tp_size)

    async def register(self, geometry: Geometry, shm_fds: list[int] = (), memory: list[P.MemoryHandle] = (),
                       fds: list[int] = ()) -> str:
        memory, shm = _memory(geometry, shm_fds, memory)
        return (await self.rpc.call(P.Register(self.engine_id, self.rank, self.tp_size, geometry, memory),
                                    shm or list(fds))).side_channel

    async def unregister(self) -> None:
        await self.rpc.call(P.Unregister(self.engine_id, self.rank))

    async def hold(self, request_id: str, lease_s: float = 30.0, block_ids: list[list[int]] = ()) -> None:
        await self.rpc.call(P.Hold(self.engine_id, self.rank, request_id, lease_s, [list(b) for b in block_ids]))

    async def read(self, request_id: str, remote: P.RemoteRef, num_tokens: int, local_blocks, remote_blocks,
                   deadline_s: float = 30.0) -> None:
        await self.rpc.call(P.Read(self.engine_id, self.rank, request_id, remote, num_tokens,
                                   [list(map(int, b)) for b in local_blocks],
                                   [list(map(int, b)) for b in remote_blocks], deadline_s))

    async def poll(self, wait_s: float = 0.0, max_items: int = 1024) -> list[P.Completion]:
        return (await self.rpc.call(P.Poll(self.engine_id, self.rank, wait_s, max_items))).items

    async def stream(self, wait_s: float = 1.0):
        """Completions as they come (long-polls under the hood)."""
        while True:
            for item in await self.poll(wait_s):
                yield item
            await asyncio.sleep(0)

    def close(self) -> None:
        self.rpc.close()
