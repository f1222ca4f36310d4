"""Waiting under a deadline that may move while we wait (a pause of the daemon moves a read's on)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

X = TypeVar("X")


async def until_deadline(job: Awaitable[X], deadline: Callable[[], float]) -> X:
    """`job`'s result, waited for until `deadline()` (monotonic, judged afresh after each wait);
    TimeoutError once it passes first. The job is cancelled on every path: done, nothing; not
    done, abandoned; either way an error nobody took is not logged as lost (pass a shield to
    leave a shared future running)."""
    fut = asyncio.ensure_future(job)
    try:
        while not fut.done():
            until = deadline()
            if until <= time.monotonic():
                raise TimeoutError()
            await asyncio.wait((fut,), timeout=until - time.monotonic())
            if not fut.done() and deadline() <= until:  # its time is up (the timer may round early)
                raise TimeoutError()
        return fut.result()
    finally:
        fut.cancel()
