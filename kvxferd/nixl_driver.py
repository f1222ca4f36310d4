"""The one module that calls `nixl._api`.

One NIXL agent per daemon process (NIXL's maintainers advise one agent per process); it
registers the memory of every engine rank the daemon serves. Every call happens on the
daemon's event-loop thread, so the agent runs without a listener thread and without
thread synchronisation. The agent name carries a random epoch, so a restarted daemon
never matches metadata cached by its peers.

Peers learn only the memory they asked for: a handshake for one engine carries metadata for
that engine's registrations alone (`partial_metadata`), so a peer holds no remote key for any
other engine's memory and NIXL refuses a READ naming it (NIXL_ERR_NOT_FOUND, verified with
NIXL 1.5.1). Loading metadata for an agent already known adds the registrations it names to
those loaded before (duplicates are skipped, connection info must match): a second engine's
handshake extends what a peer may read, it replaces nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Literal, NewType

import numpy as np
import numpy.typing as npt

from .logs import Throttle
from .memory import MemType

log = logging.getLogger("kvxferd")

DONE, PENDING = "DONE", "PROC"
XferState = Literal["DONE", "PROC"]

# NIXL's handles, opaque to kvxferd; distinct types so one is never passed for another.
Registration = NewType("Registration", object)  # registered memory (deregister takes it)
PreparedList = NewType("PreparedList", object)  # a prepared descriptor list, local or remote
XferHandle = NewType("XferHandle", object)  # one posted READ


class TransferError(RuntimeError):
    """NIXL reported a failed transfer (remote disconnect, backend error)."""


def nixl_api() -> ModuleType:
    """NIXL's Python API, its own log lines moved from stdout to stderr.

    NIXL configures its logger with a handler on stdout; kvxferd keeps stdout for what a
    command prints (`--json` must stay parseable) and logs to stderr.
    """
    from nixl import _api  # heavy import, kept local

    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    return _api


METADATA_HEAD = b"nixlSerDes|Agent"  # NIXL's serialized agent metadata: this, u64 LE length, the name


def metadata_agent(blob: bytes) -> str:
    """The agent a metadata blob names ("" if it is not NIXL's layout): read without loading it,
    so a peer's blob that names an agent other than its own is refused before NIXL merges it."""
    head = len(METADATA_HEAD)
    if not blob.startswith(METADATA_HEAD) or len(blob) < head + 8:
        return ""
    size = int.from_bytes(blob[head:head + 8], "little")
    name = blob[head + 8:head + 8 + min(size, 4096)]
    return name.decode("utf-8", "replace") if size <= 4096 and len(name) == size else ""


class NixlDriver:
    def __init__(self, name_prefix: str = "kvxferd", backends: tuple[str, ...] = ("UCX",),
                 telemetry: bool = True, progress_thread: bool = True, threads: int = 0,
                 shared: bool = False, name_suffix: str = "") -> None:
        """`name_suffix`: the daemon key's fingerprint (identity.py).

        `threads` > 0: the UCX backend's own worker threads, which split a transfer's
        descriptors among them (NIXL's `num_threads`). `shared`: more than one thread calls
        this agent (NIXL serializes its calls; see lanes.py)."""
        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        # 64 random bits: peers' notifications name their sender as the sender itself declares
        # it (holds.py trusts agents that handshook), so a name must not be guessable.
        self.name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(8)}" + (f"-{name_suffix}" if name_suffix else "")
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if shared else None
        config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                                   capture_telemetry=telemetry, backends=list(backends), num_threads=threads,
                                   sync_mode=sync)
        self.agent = nixl_agent(self.name, config)
        self.telemetry = telemetry
        # Remote agents loaded and not removed: what `status` counts, so a peer leak shows.
        self.remote_agents: set[str] = set()
        self._refusals = Throttle(60.0)  # handles NIXL would not release: one log line a minute

    # --- memory ---------------------------------------------------------------
    def register(self, addr: int, nbytes: int, mem_type: MemType = "DRAM", device: int = 0) -> Registration:
        """Register one buffer; returns the handle `deregister` takes."""
        descs = self.agent.get_reg_descs([(addr, nbytes, device, "")], mem_type)
        return Registration(self.agent.register_memory(descs, mem_type))

    def deregister(self, handle: Registration) -> None:
        self.agent.deregister_memory(handle)

    def metadata(self) -> bytes:
        """Metadata for every registration of this agent (posting lanes' own peers only)."""
        return bytes(self.agent.get_agent_metadata())

    def partial_metadata(self, buffers: Sequence[tuple[int, int, MemType, int]]) -> list[bytes]:
        """Metadata naming only these registered buffers `(address, bytes, memory type, device)`,
        with this agent's connection info: one blob per memory type (NIXL serializes one
        descriptor list, of one type, at a time); the common case is one."""
        by_type: dict[MemType, list[tuple[int, int, int, str]]] = {}
        for addr, nbytes, mem_type, device in buffers:
            by_type.setdefault(mem_type, []).append((addr, nbytes, device, ""))
        return [bytes(self.agent.get_partial_agent_metadata(self.agent.get_reg_descs(descs, mem_type), True))
                for mem_type, descs in by_type.items()]

    # --- peers ----------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. For an agent already loaded, NIXL adds
        the registrations the metadata names to the ones it had (it never drops any)."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.remote_agents.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.remote_agents.discard(name)  # a failed removal leaves nothing we could remove later
        self.agent.remove_remote_agent(name)

    # --- descriptor lists ------------------------------------------------------
    def prep_local(self, descs: npt.NDArray[np.int64], mem_type: MemType = "DRAM") -> PreparedList:
        return PreparedList(self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.agent.get_xfer_descs(descs, mem_type),
                                                       mem_type))

    def prep_remote(self, peer: str, descs: npt.NDArray[np.int64], mem_type: MemType = "DRAM") -> PreparedList:
        return PreparedList(self.agent.prep_xfer_dlist(peer, self.agent.get_xfer_descs(descs, mem_type), mem_type))

    def release_dlist(self, handle: PreparedList) -> None:
        self.agent.release_dlist_handle(handle)

    # --- transfers ------------------------------------------------------------
    def read(self, local_handle: PreparedList, local_ids: np.ndarray, remote_handle: PreparedList,
             remote_ids: np.ndarray, notif: bytes) -> XferHandle:
        """Post a READ; returns the transfer handle. Raises TransferError if NIXL refuses it."""
        return self._post(lambda: self.agent.make_prepped_xfer("READ", local_handle, local_ids, remote_handle,
                                                                remote_ids, notif))

    def read_rows(self, local: npt.NDArray[np.int64], local_mem: MemType, remote: npt.NDArray[np.int64],
                  remote_mem: MemType, peer: str) -> XferHandle:
        """Post a READ of explicit (N, 3) [addr, len, dev] rows, without prepared lists; no
        notification. Raises TransferError if NIXL refuses it."""
        return self._post(lambda: self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, local_mem),
                                                             self.agent.get_xfer_descs(remote, remote_mem), peer))

    def _post(self, make: Callable[[], object]) -> XferHandle:
        """The transfer `make` prepares, posted; TransferError (its handle released) if NIXL refuses it."""
        try:
            handle = make()
            state = self.agent.transfer(handle)
        except Exception as exc:  # nixl raises its own typed exceptions
            raise TransferError(f"posting READ failed: {exc}") from exc
        if state == "ERR":
            self.release(XferHandle(handle))  # one NIXL keeps is its own to free (its leak list)
            raise TransferError("posting READ failed: NIXL returned ERR")
        return XferHandle(handle)

    def state(self, handle: XferHandle) -> XferState:
        """DONE or PROC; raises TransferError on any failure NIXL reports."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception as exc:
            raise TransferError(str(exc)) from exc
        if state in (DONE, PENDING):
            return state
        raise TransferError(f"transfer state {state}")

    def telemetry_of(self, handle: XferHandle) -> tuple[float, float] | None:
        """(post seconds, transfer seconds) of a finished transfer, when telemetry is on."""
        if not self.telemetry:
            return None
        try:
            t = self.agent.get_xfer_telemetry(handle)
            return t.postDuration / 1e6, t.xferDuration / 1e6
        except Exception:
            return None

    def release(self, handle: XferHandle) -> bool:
        """Free a transfer's handle; False when NIXL refused (it cancels a running transfer, and
        keeps a handle it could not cancel): the handle is still NIXL's, to be released again
        later, never asked about after a release that succeeded."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            if self._refusals.due():
                log.warning("NIXL kept a transfer handle it was asked to release (retried): %s", exc)
            return False
        return True

    # --- notifications --------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as exc:
            raise TransferError(f"notification to {peer} failed: {exc}") from exc

    def notifications(self) -> dict[str, list[bytes]]:
        return dict(self.agent.get_new_notifs())
