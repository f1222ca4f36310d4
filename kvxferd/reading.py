"""What one read moves on its route, as NIXL and the copier take it.

Per remote rank read from: the descriptor ids on both sides (NIXL pairs them by position), the
bytes they cover and, where a READ names its rows instead of prepared lists (the copy lane, a
link whose lists were too large to prepare, a read split across posting lanes), the rows:

    ids   (local, remote)   int32 each         8 B a row
    rows  (local, remote)   [addr, len, dev]   48 B a row, int64

A row is a page of one piece: `peers.over_budget` keeps the mean row of a large route at
MIN_ROW_BYTES or more, so a read's arrays stay a bounded fraction of the bytes it moves. Building
them is numpy at ~0.16 us a row (8.2 M rows of explicit rows took 1.3 s here), so a read of more
than ROWS_ON_LOOP rows is built on the reads' builder thread, never on the daemon's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .plan.descriptors import RequestBlocks, local_rows, remote_rows, request_reads
from .plan.planner import RankPlan

if TYPE_CHECKING:
    from .peers import Route

ROWS_ON_LOOP = 1 << 16  # ~10 ms of numpy with explicit rows: more is built off the loop
MIN_ROW_BYTES = 128  # a large route's mean row (see peers.over_budget)

Rows = tuple[np.ndarray, np.ndarray]  # (local, remote)
T = TypeVar("T")


@dataclass
class Reading:
    """What one request reads on its route, per remote rank."""

    indices: dict[int, Rows]  # remote rank -> (local ids, remote ids)
    nbytes: dict[int, int]
    rows: dict[int, Rows] = field(default_factory=dict)  # explicit rows, where built ahead

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())


def rows_per_block(plan: RankPlan) -> tuple[float, ...]:
    """Per cache group: the descriptor rows a local block of it takes, summed over the remote
    ranks read (the plan's mean: what `estimate` multiplies)."""
    rows = [0] * len(plan.groups)
    for pp in plan.peers.values():
        per_piece = pp.local_phases * pp.local_pages
        for g in pp.by_group:
            rows[g] += int(per_piece[pp.group == g].sum())
    return tuple(r / max(1, p.local_num_blocks) for r, p in zip(rows, plan.groups))


def estimate(per_block: tuple[float, ...], blocks: RequestBlocks) -> float:
    """About how many rows reading `blocks` takes."""
    return sum(rate * len(ids) for rate, ids in zip(per_block, blocks.local))


def explicit(route: Route, rank: int, sliced: bool) -> bool:
    """Whether READs of `rank` on `route` name their rows rather than prepared lists."""
    link = route.links[rank]
    return route.lane == "copy" or sliced or link.local is None or link.remote is None


def build(route: Route, blocks: RequestBlocks, slices: Callable[[int], int]) -> Reading:
    """The read of `blocks` on `route`, explicit rows included where its READs will need them
    (`slices(total)`: posting lanes it is split across, 0 for none). Pure: runs on any thread."""
    reading = Reading({}, {})
    for rank, lids, rids, nbytes in request_reads(route.plan, blocks):
        reading.indices[rank] = lids, rids
        reading.nbytes[rank] = nbytes
    sliced = route.lane == "nixl" and slices(reading.total) > 0
    er = route.rank
    for rank, (lids, rids) in reading.indices.items():
        if explicit(route, rank, sliced):
            pp, link = route.plan.peers[rank], route.links[rank]
            reading.rows[rank] = (local_rows(pp, lids, er.region_addr, er.device),
                                  remote_rows(pp, rids, link.remote_region_addr, link.remote_device))
    return reading


class Builder:
    """The thread large arrays are built on (a route's prepared lists, a large read's ids and
    rows): one, so that at most one is in the making at a time (memory, and a core the loop
    keeps)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvxferd-rows")

    async def run(self, job: Callable[..., T], *args: Any) -> T:
        """`job(*args)` on the builder's thread: a pure function of what it is given."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, job, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
