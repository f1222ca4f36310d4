"""The connector's options: `kv_connector_extra_config`, checked once at start."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


class ConnectorOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    socket: str = "/run/kvxferd/kvxferd.sock"  # the local daemon's engine socket
    enforce_handshake_compat: bool = True  # False: same geometry, other weights may exchange KV
    lease_s: float = 120.0  # prefill: how long blocks wait for their decode side
    read_deadline_s: float = 30.0  # decode: a read not done by then fails (policy decides)
    connect_timeout_s: float = 60.0  # worker start: how long to wait for the daemon
    side_channel: str = ""  # prefill: host:port decoders dial; default: what the daemon says
    # A step that schedules no tokens while transfers are pending (vLLM steps on until they end)
    # waits up to this long on the daemon's doorbell instead of spinning: an engine idle but
    # for transfers leaves its cores to others (a step that only read the doorbell would spin
    # them: with TP 2 on two cores, its workers starved the daemons); a completion ends the
    # wait at once; a new request waits at most this long.
    idle_wait_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0  # (the worker's lock is held meanwhile)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        try:
            return msgspec.convert(dict(extra), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"kvxferd connector: bad kv_connector_extra_config: {exc} "
                             f"(options: {', '.join(cls.__struct_fields__)})") from None
