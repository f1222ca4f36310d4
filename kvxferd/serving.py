"""Whether the daemons reading this daemon's memory need its NIXL progress now.

A peer's READ of our memory needs our UCX worker to progress when it carries a NIXL
notification, when it runs over UCX's TCP transport alone, and while a new endpoint is wired
up. Over CMA (and RDMA) a READ without a notification needs nothing of us: measured over CMA,
the copy runs inside the reader's post call (docs/benchmarks.md).

    reader from side-channel version 5 (its notices say so)
        a READ not done once posted ──► ServeRequest(serve_s) ──► progress often until then
        otherwise                  ──► nothing asked: this daemon idles, holds or not

    reader from before (its notices say 4, or its notifications ride NIXL)
        heard ──► for LEGACY_S: the old pace (progress while holding, spin after each hold,
                  claim and notification), which its READs count on

A handshake always starts a short spell of progress (pace.py): the first READ on a new endpoint
wires it up, whichever version reads.
"""

from __future__ import annotations

from collections import OrderedDict

LEGACY_S = 60.0  # a reader that never asks was heard this recently: keep progressing for it
MAX_READERS = 4096  # agents remembered as asking (the oldest forgotten: then taken for legacy)


class Readers:
    """What this daemon knows of its readers' needs (owned by the daemon; one per daemon)."""

    def __init__(self) -> None:
        self._asking: OrderedDict[str, None] = OrderedDict()  # agents that ask for progress
        self._legacy_heard = float("-inf")
        self._serve_until = float("-inf")

    def heard(self, agent: str, now: float, asks: bool = False) -> bool:
        """An authorized notification from `agent` (in a notice, `asks` when its version says the
        reader asks for progress; or on a READ). True when it comes from a reader that never asks."""
        if asks:
            self._asking[agent] = None
            self._asking.move_to_end(agent)
            if len(self._asking) > MAX_READERS:
                self._asking.popitem(last=False)
            return False
        if agent in self._asking:  # its notification of a read nothing was posted for (a full hit)
            return False
        self._legacy_heard = now
        return True

    def serve(self, seconds: float, now: float) -> None:
        """A reader asked for progress for `seconds` (at most hs.MAX_SERVE_S, checked on decoding).
        Anyone may ask: the cost is this daemon's progress for 10 s, as a claim or handshake
        costs; whether a reader is taken for one that asks is learnt from its authorized notices."""
        self._serve_until = max(self._serve_until, now + seconds)

    def unasked(self, now: float) -> bool:
        """A reader that never asks was heard within LEGACY_S: progress as if every hold were read."""
        return now - self._legacy_heard < LEGACY_S

    def serving(self, now: float) -> bool:
        """A reader asked for progress until after `now`."""
        return now < self._serve_until
