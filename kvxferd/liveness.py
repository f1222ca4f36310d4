"""Decode side: noticing that a peer is gone, and retiring it (peers.Peers.retire).

    every peer_probe_interval_s, per ready peer: ProbeRequest -> its daemon's side channel
        registered, same epoch (or a daemon before probes: epoch unknown) -> heard from
        registered, another epoch      -> retire "restarted"    (the engine registered again: other memory)
        not registered                 -> retire "engine_gone"
        no answer                      -> nothing yet; none for peer_dead_after_s -> retire "silent"
    (silence counts the daemon's own running time: one that was paused, SIGSTOP or a frozen
    container, heard nothing because it asked nothing, and probes before it judges)
    no read posted to it for peer_idle_ttl_s (0: never), none in flight -> retire "idle"

Only the side channel counts as a sign of life: a READ that completes says the NIXL agent is
there, not that the engine it names is the one we planned for.

Retiring costs the next read to that engine a handshake (and a plan per local rank). Reads in
flight on a retired peer carry on: its lists and its agent stay until none uses them
(`Peers.collect`), and an agent another engine of the same daemon still uses stays loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from . import handshake as hs
from .peers import Peer, Peers
from .recorder import Recorder

log = logging.getLogger("kvxferd")

# Between two ticks, wall time the loop thread spent off the CPU beyond this: the daemon itself
# was not running (SIGSTOP, a frozen cgroup, starved). A loop held up by work it does itself (a
# CMA copy inside a READ's post) burns CPU meanwhile, and its peers' silence counts.
PAUSE_S = 1.0


class Liveness:
    def __init__(self, peers: Peers, recorder: Recorder, interval_s: float, dead_after_s: float,
                 idle_ttl_s: float, in_use: Callable[[Peer], int],
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self._peers = peers
        self._recorder = recorder
        self._interval_s = interval_s
        self._dead_after_s = dead_after_s
        self._idle_ttl_s = idle_ttl_s  # 0: peers are never evicted for idleness
        self._in_use = in_use  # reads (in flight or quarantined) on the peer's routes
        self._probes: set[asyncio.Task[None]] = set()
        self._cpu_clock = cpu_clock  # the loop thread's CPU time (the daemon's housekeeping calls tick)
        self._ticked: tuple[float, float] | None = None  # (monotonic, loop thread CPU) at the last tick

    def tick(self, now: float) -> None:
        """Retire the peers found gone; probe the ones due (the daemon's housekeeping calls this)."""
        cpu = self._cpu_clock()
        paused = 0.0
        if self._ticked is not None:
            paused = (now - self._ticked[0]) - (cpu - self._ticked[1])
        self._ticked = now, cpu
        for peer in self._peers.revoked():  # an operator took its key out: nothing more is read of it
            self._peers.retire(peer, f"its daemon key {peer.server} is no longer among the authorized keys", "revoked")
        for peer in self._peers.ready():
            if peer.retired:
                continue
            if paused > PAUSE_S:  # time this daemon did not run is nobody's silence
                peer.heard = min(peer.heard + paused, now)
            if now - peer.heard > self._dead_after_s:
                self._peers.retire(peer, f"its side channel has not answered for {now - peer.heard:.1f} s "
                                         f"(peer_dead_after_s {self._dead_after_s:g})", "silent")
            elif self._idle_ttl_s and now - peer.used > self._idle_ttl_s and not self._in_use(peer):
                self._peers.retire(peer, f"no read for {now - peer.used:.0f} s (peer_idle_ttl_s "
                                         f"{self._idle_ttl_s:g})", "idle")
            elif not peer.probing and now - peer.probed >= self._interval_s:
                peer.probing, peer.probed = True, now
                task = asyncio.get_running_loop().create_task(self._probe(peer))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, peer: Peer) -> None:
        try:
            reply = await self._peers.probe(peer, self._dead_after_s)
        except hs.HandshakeError as exc:  # counted; `tick` retires it once silent long enough
            self._recorder.peer_probed("no_answer")
            log.debug("probe of %s at %s: %s", peer.engine_id, peer.address, exc)
            return
        finally:
            peer.probing = False
        if peer.retired:
            return
        if reply.gone:
            self._recorder.peer_probed("engine_gone")
            self._peers.retire(peer, hs.printable(reply.reason), "engine_gone")
        elif reply.ok and reply.epoch and peer.epoch and reply.epoch != peer.epoch:
            self._recorder.peer_probed("restarted")
            self._peers.retire(peer, f"registered again (epoch {reply.epoch}, was {peer.epoch})", "restarted")
        else:  # registered as we knew it; or a daemon that cannot say (before probes): alive all the same
            self._recorder.peer_probed("alive" if reply.ok and reply.epoch else "epoch_unknown")
            peer.heard = time.monotonic()

    async def close(self) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
