"""Decode side of the daemon: reads from peer daemons, and the polling that ends them.

    read(R) -> handshake (once per peer, shared) -> plan (cached per peer and local rank)
            -> READ per remote rank, notify the rest -> all DONE -> "received"
            -> error / deadline -> "failed" + block ids (running handles quarantined)

Every NIXL call happens on the loop's thread. NIXL cannot cancel a transfer, so a read past
its deadline is reported failed and its handles are polled until they end, with the engine
memory they touch kept mapped and registered until then.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from . import handshake as hs
from . import protocol as P
from .nixl_driver import DONE, TransferError
from .plan.descriptors import RequestBlocks, local_descs, region_addresses, remote_descs, request_indices
from .plan.geometry import GeometryError, validate
from .plan.planner import PlanError, RankPlan, consumers, plan_rank, targets
from .state import EngineRank, Peer, PeerLink, RequestError, Transfer, encode_notif

log = logging.getLogger("kvxferd")


class DecodeSide:
    """Mixed into Daemon; uses its engines, peers, transfers, quarantine, metrics, cfg, nixl."""

    def _read(self, msg: P.Read) -> P.Msg:
        er = self._engine(msg.engine_id, msg.tp_rank)
        key = (msg.engine_id, msg.tp_rank, msg.request_id)
        if key in self.transfers:
            raise RequestError("bad_request", f"request {msg.request_id!r} is already being read")
        if not 0 < msg.deadline_s <= self.cfg.max_deadline_s:
            raise RequestError("bad_request", f"deadline_s {msg.deadline_s} outside (0, {self.cfg.max_deadline_s}]")
        if len(msg.local_blocks) != len(er.geometry.groups) or len(msg.remote_blocks) != len(er.geometry.groups):
            raise RequestError("bad_request", f"block lists for {len(msg.local_blocks)}/{len(msg.remote_blocks)} "
                                              f"groups; the geometry has {len(er.geometry.groups)}")
        now = time.monotonic()
        t = Transfer(er, msg.request_id, msg.remote.engine_id, None, msg.local_blocks, now, now + msg.deadline_s,
                     received_at=self._rpc_started)
        self.transfers[key] = t
        er.pinned += 1
        self.metrics.inflight.set(len(self.transfers))
        peer = self.peers.get((msg.remote.engine_id, msg.remote.host, msg.remote.port))
        if peer is not None and peer.ready.done() and not peer.ready.exception() and not peer.broken \
                and next(iter(peer.ranks.values())).tp_size == msg.remote.tp_size:
            try:  # the common case: a known peer, post right here without a task or an await
                if self._post_or_retire(t, peer, msg):
                    return P.Ok()
            except (PlanError, GeometryError) as exc:
                self._fail(t, "plan", str(exc))
                return P.Ok()
        asyncio.get_running_loop().create_task(self._start_read(t, msg))
        return P.Ok()

    async def _start_read(self, t: Transfer, msg: P.Read) -> None:
        try:
            if not self._post_or_retire(t, await self._peer(msg.remote, t.deadline), msg):
                self._post(t, await self._peer(msg.remote, t.deadline), msg)
        except hs.HandshakeError as exc:
            self._fail(t, "handshake", str(exc))
        except (PlanError, GeometryError) as exc:
            self._fail(t, "plan", str(exc))
        except TransferError as exc:
            if t.peer is not None:
                self._retire_peer(t.peer, str(exc))
            self._fail(t, "engine_gone" if t.engine.closing else "transfer", str(exc))
        except TimeoutError:
            self._fail(t, "deadline", "deadline passed while waiting for the handshake")
        except Exception as exc:
            log.exception("read %s failed unexpectedly", t.request_id)
            self._fail(t, "internal", f"{type(exc).__name__}: {exc}")

    def _post_or_retire(self, t: Transfer, peer: Peer, msg: P.Read) -> bool:
        """Post `t` on `peer`. False: nothing could be posted, most likely because the peer
        restarted behind cached metadata; the peer is retired and the caller retries once on
        a fresh handshake (a new agent, never the stale one)."""
        try:
            self._post(t, peer, msg)
            return True
        except TransferError as exc:
            if t.handles or t.done:
                self._retire_peer(peer, str(exc))
                self._fail(t, "transfer", str(exc))
                return True
            self._retire_peer(peer, f"posting failed: {exc}")
            peer.active -= 1
            t.peer = None
            self._cleanup_retired()
            return False

    async def _peer(self, ref: P.RemoteRef, deadline: float) -> Peer:
        """The peer's handshake, done once and shared by every request waiting on it."""
        key = (ref.engine_id, ref.host, ref.port)
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(ref.engine_id, ref.host, ref.port,
                                          asyncio.get_running_loop().create_future())
            asyncio.get_running_loop().create_task(self._handshake(peer, ref))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        await asyncio.wait_for(asyncio.shield(peer.ready), remaining)
        if peer.ranks and next(iter(peer.ranks.values())).tp_size != ref.tp_size:
            raise PlanError(f"remote engine {ref.engine_id} runs TP {next(iter(peer.ranks.values())).tp_size}, "
                            f"the request says {ref.tp_size}")
        return peer

    async def _handshake(self, peer: Peer, ref: P.RemoteRef) -> None:
        t0 = time.perf_counter()
        try:
            reply = await hs.request(self.zmq, ref.host, ref.port, ref.engine_id, self.cfg.handshake_timeout_s,
                                     self.nixl.name, self.curve)
            ranks = {r.tp_rank: r for r in reply.ranks}
            for r in ranks.values():
                validate(r.geometry)
            peer.agent = self.nixl.add_peer(reply.metadata)
            peer.ranks, peer.since, peer.handshake_s = ranks, time.time(), time.perf_counter() - t0
            self.counters["handshakes"] += 1
            self.metrics.handshakes.labels(peer.label, "ok").inc()
            self.metrics.handshake_seconds.observe(time.perf_counter() - t0)
            self.metrics.peers.set(len(self.peers))
            peer.ready.set_result(None)
        except Exception as exc:
            err = exc if isinstance(exc, hs.HandshakeError) else hs.HandshakeError("invalid", str(exc))
            self.counters["handshake_failures"] += 1
            self.metrics.handshakes.labels(peer.label, "failed").inc()
            self.metrics.handshake_failures.labels(err.reason).inc()
            log.warning("handshake failed: peer=%s address=%s reason=%s: %s", peer.label, peer.address,
                        err.reason, err)
            if self.peers.get((peer.engine_id, peer.host, peer.port)) is peer:
                del self.peers[(peer.engine_id, peer.host, peer.port)]
            peer.ready.set_exception(err)
            peer.ready.exception()  # mark retrieved: waiters each get it via shield

    def _plan(self, peer: Peer, er: EngineRank) -> RankPlan:
        plan = peer.plans.get(er.key)
        if plan is None:
            wanted = targets(er.tp_rank, er.tp_size, next(iter(peer.ranks.values())).tp_size)
            missing = [r for r in wanted if r not in peer.ranks]
            if missing:
                raise PlanError(f"remote engine {peer.engine_id} has no registered ranks {missing}")
            for r in wanted:
                if peer.ranks[r].compat_hash != er.compat_hash:
                    raise PlanError(hs.explain_mismatch(er.geometry, peer.ranks[r].geometry))
                if why := hs.weights_mismatch(er.geometry, peer.ranks[r].geometry):
                    raise PlanError(why)
            t0 = time.perf_counter()
            plan = plan_rank(er.geometry, {r: peer.ranks[r].geometry for r in wanted})
            peer.plans[er.key] = plan
            log.info("planned engine %s rank %d <- %s ranks %s in %.1f ms", er.engine_id, er.tp_rank,
                     peer.engine_id, list(plan.peers), (time.perf_counter() - t0) * 1e3)
        return plan

    def _link(self, peer: Peer, er: EngineRank, plan: RankPlan, rank: int) -> PeerLink:
        key = (*er.key, rank)
        link = peer.links.get(key)
        if link is None:
            info, pp = peer.ranks[rank], plan.peers[rank]
            raddr = region_addresses(info.geometry, info.buffer_addrs)
            kind, dev = er.mappings[0].kind, er.mappings[0].device
            t0 = time.perf_counter()
            link = PeerLink(self.nixl.prep_local(local_descs(pp, er.region_addr, dev), kind),
                            self.nixl.prep_remote(peer.agent, remote_descs(pp, raddr, info.device), info.mem_type))
            peer.links[key] = link
            log.info("prepared %d local / %d remote descriptors for engine %s rank %d <- %s rank %d in %.1f ms",
                     pp.num_local_descs, pp.num_remote_descs, er.engine_id, er.tp_rank, peer.engine_id, rank,
                     (time.perf_counter() - t0) * 1e3)
        return link

    def _post(self, t: Transfer, peer: Peer, msg: P.Read) -> None:
        if t.done:
            return
        er = t.engine
        if er.closing:  # unregistered while the handshake ran: nothing to post, the peer is fine
            self._fail(t, "engine_gone", "engine unregistered before the read was posted")
            return
        t.peer = peer
        peer.active += 1
        plan = self._plan(peer, er)
        req = RequestBlocks.of(msg.num_tokens, msg.local_blocks, msg.remote_blocks)
        reads = request_indices(plan, req)
        expected = consumers(er.tp_size, plan.remote_tp)
        for rank, (lids, rids) in reads.items():
            link = self._link(peer, er, plan, rank)
            notif = encode_notif(peer.engine_id, rank, msg.remote.request_id, expected)
            t.handles.append((rank, self.nixl.read(link.local, lids, link.remote, rids, notif)))
            pp = plan.peers[rank]
            t.nbytes += int(_bytes_of(pp, plan, lids))
            t.descriptors += len(lids)
        for rank in plan.targets:
            if rank not in reads:
                self.nixl.notify(peer.agent, encode_notif(peer.engine_id, rank, msg.remote.request_id, expected))
            self.metrics.notifs_sent.inc()
        self.metrics.descriptors.labels(peer.label).observe(t.descriptors)
        posted = time.perf_counter() - t.received_at
        self.lat_post.append(posted)
        self.metrics.read_post.observe(posted)
        if not t.handles:
            self._finish(t, "received")
        else:
            t.posted_at = time.monotonic()
            self._wake.set()

    def _fail(self, t: Transfer, kind: str, reason: str) -> None:
        if not t.done:
            self.metrics.transfer_failures.labels(t.remote, kind).inc()
        self._finish(t, "failed", f"{kind}: {reason}")

    def _finish(self, t: Transfer, status: str, reason: str = "") -> None:
        """End a read for the engine. Handles still running go to quarantine."""
        if t.done:
            return
        t.done = True
        er, now = t.engine, time.monotonic()
        self.transfers.pop((er.engine_id, er.tp_rank, t.request_id), None)
        self.metrics.inflight.set(len(self.transfers))
        peer_label = t.remote
        seconds = now - t.started
        self.counters[status] += 1
        self.metrics.transfers.labels(peer_label, status).inc()
        self.metrics.transfer_seconds.labels(peer_label, status).observe(seconds)
        blocks = t.local_blocks if status == "failed" else []
        if status == "received":
            self.lat_complete.append(time.perf_counter() - t.received_at)
            self.metrics.transfer_bytes.labels(peer_label).inc(t.nbytes)
            self.rates.append((time.time(), t.nbytes))
        else:
            self._log_failure(t, reason)
        er.complete(P.Completion(t.request_id, status, blocks, reason, t.nbytes if status == "received" else 0,
                                 seconds))
        if t.handles:
            self.quarantine.append(t)
            self.metrics.quarantined.set(len(self.quarantine))
        else:
            self._unpin(t)

    def _unpin(self, t: Transfer) -> None:
        t.engine.pinned -= 1
        if t.peer is not None:
            t.peer.active -= 1
            self._cleanup_retired()
        self._release_if_idle(t.engine)

    def _log_failure(self, t: Transfer, reason: str) -> None:
        peer = t.remote
        entry = {"time": time.time(), "engine": t.engine.engine_id, "rank": t.engine.tp_rank,
                 "request": t.request_id, "peer": peer, "reason": reason}
        self.failures.append(entry)
        log.warning("transfer failed: engine=%s rank=%d request=%s peer=%s reason=%s", entry["engine"],
                    entry["rank"], entry["request"], peer, reason, extra={"fields": entry})

    def _retire_peer(self, peer: Peer, why: str) -> None:
        """Forget a peer: the next request handshakes again (a new agent name, never stale metadata)."""
        if peer.broken:
            return
        peer.broken = True
        key = (peer.engine_id, peer.host, peer.port)
        if self.peers.get(key) is peer:
            del self.peers[key]
        self.retired_peers.append(peer)
        self.metrics.peers.set(len(self.peers))
        log.warning("peer %s at %s retired: %s", peer.label, peer.address, why)
        self._cleanup_retired()

    def _release_links(self, peer: Peer, keep=lambda key: False) -> None:
        """Release a peer's prepared descriptor lists (all, or those `keep` rejects)."""
        for key in [k for k in peer.links if not keep(k)]:
            link = peer.links.pop(key)
            self.nixl.release_dlist(link.local)
            self.nixl.release_dlist(link.remote)

    def _cleanup_retired(self) -> None:
        for peer in [p for p in self.retired_peers if p.active <= 0]:
            self.retired_peers.remove(peer)
            self._release_links(peer)
            if peer.agent:
                try:
                    self.nixl.remove_peer(peer.agent)
                except Exception as exc:
                    log.warning("removing agent %s: %s", peer.agent, exc)

    async def _poll_loop(self) -> None:
        """Transfer states, notifications, quarantine: all on this loop.

        A read is expected to end `nbytes / observed throughput` after it was posted. The loop
        spins (yielding to other tasks each turn) within `spin_s` of a read's posting or of its
        expected end, and otherwise sleeps until the next such window: small reads are seen
        within microseconds, large ones within a spin of their end, and no core burns while
        bytes are moving. Reads past their window are polled every `poll_interval_s`; an idle
        loop wakes every `idle_poll_s` to progress NIXL (peers' reads and notifications need it).
        """
        while True:
            self._drain_notifications()
            now = time.monotonic()
            for t in list(self.transfers.values()):
                if t.handles and not t.done:
                    self._check_transfer(t, now)
            for t in list(self.quarantine):
                self._check_quarantined(t)
            if self.transfers or self.quarantine:
                await asyncio.sleep(self._next_poll(time.monotonic()))
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.cfg.idle_poll_s)
                except TimeoutError:
                    pass

    def _next_poll(self, now: float) -> float:
        """Seconds to sleep before the next poll: 0 inside a spin window."""
        spin, wait = self.cfg.spin_s, self.cfg.poll_interval_s
        for t in self.transfers.values():
            if not t.handles or t.done:
                continue
            for edge in (t.posted_at, t.posted_at + t.nbytes / self._rate):
                if edge - spin <= now <= edge + spin:
                    return 0.0
                if edge - spin > now:
                    wait = min(wait, edge - spin - now) if wait else edge - spin - now
        return wait

    def _drain_notifications(self) -> None:
        try:
            notifs = self.nixl.notifications()
        except Exception as exc:
            log.warning("reading notifications failed: %s", exc)
            return
        for messages in notifs.values():
            for m in messages:
                self._on_notification(m)

    def _check_transfer(self, t: Transfer, now: float) -> None:
        try:
            states = [self.nixl.state(h) for _, h in t.handles]
        except TransferError as exc:
            self._release_terminal(t)
            self._retire_peer(t.peer, str(exc))
            self._fail(t, "transfer", str(exc))
            return
        if all(s == DONE for s in states):
            xfer = 0.0
            for _, h in t.handles:
                tele = self.nixl.telemetry_of(h)
                if tele:
                    self.metrics.nixl_post.observe(tele[0])
                    self.metrics.nixl_xfer.observe(tele[1])
                    xfer = max(xfer, tele[0] + tele[1])
            if t.nbytes >= 1 << 20 and xfer > 0:
                # NIXL's own timing, not when we noticed: a late poll must not slow the estimate
                self._rate = 0.7 * self._rate + 0.3 * (t.nbytes / xfer)
            self._release_terminal(t)
            self._finish(t, "received")
        elif now >= t.deadline:
            self._fail(t, "deadline", f"{t.deadline - t.started:.3g} s passed; memory quarantined")

    def _release_terminal(self, t: Transfer) -> None:
        """Release handles NIXL reports finished (done or failed); keep the ones still running."""
        keep = []
        for rank, h in t.handles:
            try:
                state = self.nixl.state(h)
            except TransferError:
                state = "ERR"
            if state == DONE or state == "ERR":
                self.nixl.release(h)
            else:
                keep.append((rank, h))
        t.handles = keep

    def _check_quarantined(self, t: Transfer) -> None:
        self._release_terminal(t)
        if not t.handles:
            self.quarantine.remove(t)
            self.metrics.quarantined.set(len(self.quarantine))
            self._unpin(t)


def _bytes_of(pp, plan: RankPlan, lids: np.ndarray) -> int:
    """Bytes a set of local descriptor ids covers (lengths are per template)."""
    template = np.searchsorted(pp.local_base, lids, side="right") - 1
    return int(pp.length[template].sum())
