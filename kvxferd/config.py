"""Daemon configuration: defaults < TOML file < environment (KVXFERD_*) < command-line flags."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec


class ConfigError(ValueError):
    pass


class Config(msgspec.Struct, forbid_unknown_fields=True):
    socket_path: str = "/run/kvxferd/kvxferd.sock"
    socket_mode: int = 0o600
    socket_group: str = ""  # group that may connect (socket made 0660 for it)
    allowed_uids: list[int] = []  # SO_PEERCRED allow-list; empty: the daemon's own uid and root
    side_channel_host: str = "127.0.0.1"  # address the handshake server binds
    advertise_host: str = ""  # address peers should dial; default: side_channel_host
    side_channel_port: int = 5600  # 0: pick a free port
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9410  # -1: no exporter; 0: pick a free port
    backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    # NIXL's own progress thread busy-polls (its Python API fixes the delay at 0) and takes a
    # core; off, the daemon's loop progresses NIXL every time it polls.
    nixl_progress_thread: bool = False
    nixl_threads: int = 0  # UCX backend worker threads splitting each transfer (NIXL's num_threads)
    # Posting lanes (lanes.py): a read of at least 2 x lane_split_bytes is split across up to
    # `lanes` extra NIXL agents, each posting its slice from its own thread. 0: no lanes.
    lanes: Annotated[int, msgspec.Meta(ge=0, le=64)] = 2
    lane_split_bytes: Annotated[int, msgspec.Meta(ge=1 << 16)] = 16 << 20
    ucx: dict[str, str] = {}  # UCX_* environment for the NIXL agent, e.g. {"UCX_TLS": "tcp,cma"}
    curve_secret_key_file: str = ""  # CurveZMQ on the side channel: this daemon's keypair (secret file)
    curve_authorized_keys_dir: str = ""  # public keys of peers allowed to handshake
    curve_server_key_file: str = ""  # public key peers' servers present; default: our own
    handshake_timeout_s: float = 5.0
    # KV integrity audit (integrity.py): as prefill, digest every held request's blocks; as
    # decode, check every read against the prefill's digests before reporting it received.
    # A hold's `digest` and a read's `audit` override it per request.
    integrity_audit: bool = False
    max_lease_s: float = 600.0
    max_deadline_s: float = 600.0
    poll_interval_s: float = 0.001  # longest sleep between polls while reads are in flight
    spin_s: float = 0.002  # poll on every loop turn this close to a read's posting or expected end
    # No read in flight (see pace.py): spin for spin_s after a hold, a notification or a
    # handshake answered; then progress NIXL every idle_poll_s while requests are held or for
    # idle_hot_s after that activity; then every idle_max_s.
    idle_poll_s: float = 0.001
    idle_hot_s: float = 1.0
    idle_max_s: float = 0.05
    max_frame_bytes: int = 64 << 20
    log_format: str = "text"  # text or json
    log_level: str = "INFO"
    name: str = "kvxferd"

    @property
    def side_channel(self) -> str:
        return f"{self.advertise_host or self.side_channel_host}:{self.side_channel_port}"


_ENV_PREFIX = "KVXFERD_"


def load(path: str | None = None, env: Mapping[str, str] | None = None, **flags: Any) -> Config:
    """Build a Config; unknown keys and bad types raise ConfigError naming the key."""
    data: dict[str, Any] = {}
    if path:
        try:
            data.update(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    env = os.environ if env is None else env
    fields = set(Config.__struct_fields__)
    for key, value in env.items():
        if key.startswith(_ENV_PREFIX) and key[len(_ENV_PREFIX):].lower() in fields:
            data[key[len(_ENV_PREFIX):].lower()] = _env_value(key, value)
    data.update({k: v for k, v in flags.items() if v is not None})
    if isinstance(data.get("socket_mode"), str):
        data["socket_mode"] = int(data["socket_mode"], 8)
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None


def _env_value(key: str, value: str) -> str | list[str] | dict[str, str]:
    field = key[len(_ENV_PREFIX):].lower()
    if field in ("backends", "allowed_uids"):
        return [v for v in value.split(",") if v]
    if field == "ucx":
        return dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
    return value
