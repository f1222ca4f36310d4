"""What one engine rank, and one uid across all its ranks and connections, may keep at once.

    uid 1000 ── conn A ── rank (e, 0): 3 holds ─┐
             └─ conn B ── rank (f, 0): 2 holds ─┴─ uid 1000: 5 holds  (max_holds_per_uid)
    uid 1001 ── conn C ── rank (g, 0): 1 hold  ─── uid 1001: 1 hold   (its own count)

A rank's quota keeps one engine from crowding out its siblings; a uid's keeps one user, however
many engine ids and connections it opens, from crowding out every other user. A connection is
one uid's, so the uid's quota bounds each of its connections too, and a new connection cannot
reset it. Nothing is evicted to make room: past a quota the new thing is refused, naming the
setting.
"""

from __future__ import annotations

from typing import TypeVar

from .engines import EngineKey, EngineRank
from .protocol import RequestError

K = TypeVar("K")


class Quota:
    """Counts of one kind of thing (holds, reads) by engine rank and by uid."""

    def __init__(self, what: str, per_rank: int, rank_setting: str, per_uid: int, uid_setting: str) -> None:
        self._what = what
        self._per_rank, self._rank_setting = per_rank, rank_setting
        self._per_uid, self._uid_setting = per_uid, uid_setting
        self._by_rank: dict[EngineKey, int] = {}
        self._by_uid: dict[int, int] = {}

    def of_rank(self, rank: EngineKey) -> int:
        return self._by_rank.get(rank, 0)

    def of_uid(self, uid: int) -> int:
        return self._by_uid.get(uid, 0)

    def check(self, er: EngineRank, also_new: int = 0, also_new_of_uid: int | None = None) -> None:
        """RequestError when one more of `er`'s would pass a quota; `also_new`: more of the same
        rank applied before this one (a batch's), `also_new_of_uid` of the same uid (default:
        the rank's)."""
        rank, uid = (er.engine_id, er.tp_rank), er.uid  # no property: the read's hot path
        mine = self.of_rank(rank) + also_new
        if mine >= self._per_rank:
            raise RequestError("bad_request", f"engine {rank[0]!r} rank {rank[1]} has {mine} {self._what} "
                                              f"({self._rank_setting} {self._per_rank})")
        if uid is not None:
            users = self.of_uid(uid) + (also_new if also_new_of_uid is None else also_new_of_uid)
            if users >= self._per_uid:
                raise RequestError("bad_request", f"uid {uid} has {users} {self._what} across its engines "
                                                  f"({self._uid_setting} {self._per_uid})")

    def take(self, er: EngineRank) -> None:
        rank = er.engine_id, er.tp_rank
        self._by_rank[rank] = self._by_rank.get(rank, 0) + 1
        if er.uid is not None:
            self._by_uid[er.uid] = self._by_uid.get(er.uid, 0) + 1

    def give(self, er: EngineRank) -> None:
        """One of `er`'s taken ended (a rank's uid never changes)."""
        _drop(self._by_rank, (er.engine_id, er.tp_rank))
        if er.uid is not None:
            _drop(self._by_uid, er.uid)


def _drop(counts: dict[K, int], key: K) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]
