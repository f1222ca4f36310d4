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

    a handshake, or a claim from a reader not known to ask ──► a short spell of progress (pace.py):
        the READ that follows may wire up a new endpoint, or come from a reader before version 5

A reader is known to ask once an authorized version 5 notice of its came (its first read's).
Names are what peers declare: anyone who can reach the side channel and knows a reader's agent
name (any daemon's handshake reply gives its own) can speak for it, as for notifications; a
version 4 notice under that name puts it back (a reader from before notices sends none:
docs/protocol.md).
"""

from __future__ import annotations

from collections import OrderedDict

LEGACY_S = 600.0  # a reader that does not ask was heard this recently: keep progressing for it
MAX_READERS = 4096  # agents remembered as asking (the oldest forgotten: then taken for legacy)


class Readers:
    """What this daemon knows of its readers' needs (owned by the daemon; one per daemon)."""

    def __init__(self) -> None:
        self._asking: OrderedDict[str, None] = OrderedDict()  # agents that ask for progress
        self._legacy_heard = float("-inf")
        self._serve_until = float("-inf")

    def asks(self, agent: str) -> bool:
        """`agent` is known to ask for progress when its READs need it."""
        return agent in self._asking

    def notified(self, agent: str, now: float, asks: bool) -> None:
        """An authorized notification from `agent`: in a notice, `asks` as its version says (5);
        on a READ or in a notice of version 4, not (which overrides an earlier word: names are
        declared, not proven). Not for a NIXL notification from an agent known to ask: a reader
        that asks notifies a full hit through NIXL."""
        if asks:
            self._asking[agent] = None
            self._asking.move_to_end(agent)
            if len(self._asking) > MAX_READERS:
                self._asking.popitem(last=False)
            return
        self._asking.pop(agent, None)
        self._legacy_heard = now

    def serve(self, seconds: float, now: float) -> None:
        """A reader asked for progress for `seconds` (at most hs.MAX_SERVE_S, checked on decoding).
        Anyone may ask: it costs this daemon 10 s of progress at most, as a stream of claims or
        handshakes would; whether a reader asks is learnt from its authorized notices only."""
        self._serve_until = max(self._serve_until, now + seconds)

    def unasked(self, now: float) -> bool:
        """A reader that does not ask was heard within LEGACY_S: progress as if every hold were read."""
        return now - self._legacy_heard < LEGACY_S

    def serving(self, now: float) -> bool:
        """A reader asked for progress until after `now`."""
        return now < self._serve_until

    def need_progress(self, now: float, holding: bool) -> bool:
        """Readers need this daemon's NIXL progress now: one asked for it, or one that does not
        ask may read what it holds."""
        return self.serving(now) or (holding and self.unasked(now))
