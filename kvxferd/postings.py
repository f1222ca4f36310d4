"""A READ in flight, wherever it was posted: the one kind of work `reads` polls, releases and times.

    AgentRead  a whole READ on the daemon's own agent (prepared lists, or explicit rows)
    SliceRead  one slice of a split read, posted from a lane's thread (lanes.py)

    ended()            True once DONE; TransferError when it failed; False while it runs (or
                       while a slice is still being posted)
    release_if_ended() released if it ended (done or failed); False while it still runs, or
                       while NIXL keeps its handle (then asked again later)
    release()          release one that `ended()` saw DONE (no second state query); False
                       when NIXL kept the handle: it stays, and is never released twice
    timing()           NIXL's (post seconds, transfer seconds) once DONE; None when not known
    ended_at()         monotonic time its end was seen where it ran (a lane: as its post
                       returned DONE); 0 when not known
    cancel()           drop it if it was not posted yet (a slice still queued on its lane);
                       True when dropped (NIXL cannot cancel a posted READ)
    wakes_loop         its end wakes the daemon's loop by itself: a lane's post returns on the
                       loop with the copy done (CMA copies inside the post), so the loop need
                       not spin for it
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from .nixl_driver import DONE, NixlDriver, TransferError, XferHandle

if TYPE_CHECKING:
    from .lanes import Lane


class Posting(Protocol):
    wakes_loop: bool

    def ended(self) -> bool: ...
    def release_if_ended(self) -> bool: ...
    def release(self) -> bool: ...
    def timing(self) -> tuple[float, float] | None: ...
    def ended_at(self) -> float: ...
    def cancel(self) -> bool: ...


class AgentRead:
    """A whole READ posted on the daemon's agent (from the loop's thread)."""

    wakes_loop = False
    __slots__ = ("handle", "nixl")

    def __init__(self, nixl: NixlDriver, handle: XferHandle) -> None:
        self.nixl, self.handle = nixl, handle

    def ended(self) -> bool:
        return self.nixl.state(self.handle) == DONE

    def release_if_ended(self) -> bool:
        try:
            if self.nixl.state(self.handle) != DONE:
                return False
        except TransferError:
            pass
        return self.nixl.release(self.handle)

    def release(self) -> bool:
        return self.nixl.release(self.handle)

    def timing(self) -> tuple[float, float] | None:
        return self.nixl.telemetry_of(self.handle)

    def ended_at(self) -> float:
        return 0.0

    def cancel(self) -> bool:
        return False


class Posted:
    """What a lane's thread returns for a slice: its handle, and when (monotonic) its post
    returned with the slice DONE (the copy ran inside it); 0 when it was not DONE then."""

    __slots__ = ("done_at", "handle")

    def __init__(self, handle: XferHandle, done_at: float) -> None:
        self.handle, self.done_at = handle, done_at


class SliceRead:
    """One slice of a split read: posted, or being posted, on a lane."""

    wakes_loop = True
    __slots__ = ("lane", "posting")

    def __init__(self, lane: Lane, posting: Future[Posted]) -> None:
        self.lane, self.posting = lane, posting

    def ended(self) -> bool:
        if self.posting.cancelled():
            raise TransferError(f"lane {self.lane.index}: slice cancelled before it was posted")
        if not self.posting.done():
            return False
        posted = self.posting.result()  # re-raises the post's TransferError
        return self.lane.nixl.state(posted.handle) == DONE

    def release_if_ended(self) -> bool:
        if self.posting.cancelled():
            return True  # never posted
        if not self.posting.done():
            return False
        if self.posting.exception() is not None:
            return True  # nothing was posted
        handle = self.posting.result().handle
        try:
            if self.lane.nixl.state(handle) != DONE:
                return False
        except TransferError:
            pass
        return self.lane.nixl.release(handle)

    def release(self) -> bool:
        return self.lane.nixl.release(self.posting.result().handle)

    def timing(self) -> tuple[float, float] | None:
        return None  # lanes run without NIXL telemetry

    def ended_at(self) -> float:
        return self.posting.result().done_at

    def cancel(self) -> bool:
        return self.posting.cancel()


__all__ = ["AgentRead", "Posted", "Posting", "SliceRead"]
