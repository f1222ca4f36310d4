"""How fast each peer's reads move, and whether a GPU route is on a transport far below the device.

    read done ── NIXL's own seconds, bytes ──► observe(peer, memory, nbytes, seconds)
                                                  │  reads of at least 1 MiB only (small ones
                                                  │  measure latency, not the transport)
                                                  ▼
                                   per peer: bytes/s, a moving average
                                                  │  VRAM, >= SLOW_AFTER_READS reads, below slow_gbps
                                                  ▼
                                   slow: one warning, `kvxferd status` RATE "slow",
                                   kvxferd_peer_read_rate_bytes_per_second{peer, memory}

Why measured on real reads and not with a probe READ at the handshake: the cliff this catches
(UCX staging imported VMM memory through TCP, docs/deploy.md "Slow GPU routes") belongs to the
engines' own memory, and no hold has granted any of its blocks at the handshake; a probe of a
buffer of the daemon's own would take another path. The first large reads of a route tell.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from .recorder import Recorder

log = logging.getLogger("kvxferd")

MEASURED_BYTES = 1 << 20  # a read this large measures the transport
SLOW_AFTER_READS = 3  # large reads before a route is judged
WEIGHT = 0.3  # of the newest read in the moving average


@dataclass(eq=False)
class Rate:
    bytes_per_s: float = 0.0
    reads: int = 0  # large reads measured
    memory: str = "DRAM"  # VRAM once any of its reads moved device memory
    slow: bool = False  # judged below slow_gbps (VRAM only)


def is_slow(rate: Rate, slow_gbps: float) -> bool:
    """A route of device memory whose measured rate is below what a device transport gives."""
    return rate.memory == "VRAM" and rate.reads >= SLOW_AFTER_READS and rate.bytes_per_s < slow_gbps * 1e9


class Rates:
    """The read rate of each peer (a peers.Peer, by identity: a peer handshaken anew starts over)."""

    def __init__(self, recorder: Recorder, slow_gbps: float) -> None:
        self._recorder = recorder
        self._slow_gbps = slow_gbps
        self._rates: weakref.WeakKeyDictionary[object, Rate] = weakref.WeakKeyDictionary()

    def of(self, peer: object) -> Rate | None:
        return self._rates.get(peer)

    def observe(self, peer: object, label: str, address: str, memory: str, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` took `seconds` (NIXL's timing) from `peer`."""
        if nbytes < MEASURED_BYTES or seconds <= 0:
            return
        rate = self._rates.get(peer)
        if rate is None:
            rate = self._rates[peer] = Rate()
        now = nbytes / seconds
        rate.bytes_per_s = now if not rate.reads else (1 - WEIGHT) * rate.bytes_per_s + WEIGHT * now
        rate.reads += 1
        if memory == "VRAM":
            rate.memory = "VRAM"
        self._recorder.peer_rate(label, rate.memory, rate.bytes_per_s)
        slow = is_slow(rate, self._slow_gbps)
        if slow and not rate.slow:
            log.warning("reads of GPU memory from %s (%s) move %.2f GB/s, below slow_route_gbps %g: the transport "
                        "is not a device one (UCX's TCP or its emulation; docs/deploy.md, \"Slow GPU routes\", has "
                        "the fix)", label, address, rate.bytes_per_s / 1e9, self._slow_gbps)
        rate.slow = slow
