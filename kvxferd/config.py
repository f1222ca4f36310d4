"""Daemon configuration: defaults < TOML file < environment (KVXFERD_*) < command-line flags."""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


class ConfigError(ValueError):
    pass


class Config(msgspec.Struct, forbid_unknown_fields=True):
    socket_path: str = "/run/kvxferd/kvxferd.sock"
    socket_mode: int = 0o600
    socket_group: str = ""  # group that may connect (socket made 0660 for it)
    allowed_uids: list[int] = []  # SO_PEERCRED allow-list; empty: the daemon's own uid and root
    max_connections_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 256  # engine socket connections open at once
    # Keep holds without a read_token (engines before protocol 11, or passing none): any reader
    # that names such a request may read the blocks it names. False refuses them (docs/security.md).
    open_holds: bool = True
    max_holds_per_engine: Annotated[int, msgspec.Meta(ge=1)] = 65536  # held requests per engine rank
    # ... and per uid, across all its engine ranks and connections (quotas.py)
    max_holds_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 1 << 18
    # engine ranks one uid has registered (each maps its memory: vm.max_map_count is the node's),
    # those closing and still mapped included
    max_ranks_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # engine buffers one uid has mapped across its ranks (each a mapping; a host memfd's fd is kept
    # too, to look for holes at each hold: the daemon's open files are every engine's)
    max_buffers_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 16384
    max_reads_per_engine: Annotated[int, msgspec.Meta(ge=1)] = 4096  # reads in flight per engine rank
    max_reads_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 1 << 15  # ... and per uid, across its ranks
    # expectations (reads announced with `expect`) per uid across its ranks; each rank has 4,096
    # (leases.MAX_EXPECTS_PER_RANK). Past either, that rank's or uid's own oldest make room.
    max_expects_per_uid: Annotated[int, msgspec.Meta(ge=1)] = 1 << 14
    # Descriptors (local + remote) a route to one peer may take; a plan above it is refused at
    # handshake (a peer of one-token pages over a large cache would take GBs of descriptor arrays).
    max_plan_descriptors: Annotated[int, msgspec.Meta(ge=1)] = 1 << 27
    side_channel_host: str = "127.0.0.1"  # address the handshake server binds
    advertise_host: str = ""  # address peers should dial; default: side_channel_host
    # Side-channel addresses a read may name (CIDRs or addresses); empty: any. A read naming
    # another address, or a host name (not resolved), fails before anything is dialed.
    allowed_peers: list[str] = []
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
    # Threads copying a read between two engines of this daemon in host memory (copier.py);
    # 0: one per core, at most 4.
    copy_threads: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # Who moves a read between two engines of this daemon in host memory (peers.py): "copy" (its
    # memcpy, the faster here: docs/benchmarks.md) or "loop" (a READ on its own NIXL agent).
    # GPU memory always takes "loop".
    host_lane: Literal["copy", "loop"] = "copy"
    # Whose engines may read each other on this daemon: "same" uid only, or "any" (the daemon
    # maps both engines' memory: across users, only this keeps one from copying the other's KV).
    same_node_uids: Literal["same", "any"] = "same"
    # Reads of GPU memory from a peer slower than this (GB/s, a moving average of reads of 1 MiB
    # and more) mark its route slow: one warning, `kvxferd status`, a metric (rates.py). A device
    # transport moves tens to hundreds; UCX's TCP or its emulation about 0.5. 0: never judged.
    slow_route_gbps: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    ucx: dict[str, str] = {}  # UCX_* environment for the NIXL agent, e.g. {"UCX_TLS": "tcp,cma"}
    curve_secret_key_file: str = ""  # CurveZMQ on the side channel: this daemon's keypair (secret file)
    curve_authorized_keys_dir: str = ""  # public keys of peers allowed to handshake
    curve_server_key_file: str = ""  # public key peers' servers present; default: our own
    # With Curve, answer side-channel requests (and count NIXL notifications) whose requester names
    # no key's fingerprint: daemons before protocol 12, which anyone authorized may pose as. Only
    # while a cluster upgrades (docs/security.md, "Identity is the key").
    unattributed_peers: bool = False
    # Serve the side channel beyond loopback without CurveZMQ keys (see check_side_channel): only
    # where every host that reaches side_channel_port may read the KV blocks this daemon holds.
    side_channel_insecure: bool = False
    handshake_timeout_s: float = 5.0
    # Peer liveness (decode side, liveness.py): probe each peer's side channel every
    # peer_probe_interval_s; retire one silent for peer_dead_after_s, or with no read for
    # peer_idle_ttl_s (0: never).
    peer_probe_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    peer_dead_after_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    peer_idle_ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    # KV integrity audit (integrity.py): as prefill, digest every held request's blocks; as
    # decode, check every read against the prefill's digests before reporting it received.
    # A hold's `digest` and a read's `audit` override it per request.
    integrity_audit: bool = False
    # a hold's lease, and how long claims may keep a hold alive in all (a grant past 1e7 s is
    # refused on the wire: handshake.MAX_GRANT_S)
    max_lease_s: Annotated[float, msgspec.Meta(gt=0, le=1e6)] = 600.0
    # Fail-closed reads (leases.py): a read is `received` only when the prefill daemon vouched that
    # its holds lived through the READ. Off: reads are reported as NIXL ends them (for peers
    # before side-channel version 3, which cannot vouch; their reads otherwise fail `expired`).
    confirm_leases: bool = True
    # Demand-driven leases: from an engine's `expect` (or a read's post) until its read ends, the
    # prefill's holds are claimed for claim_s more seconds, renewed when a third is left.
    lease_renewal: bool = True
    claim_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 20.0
    max_deadline_s: float = 600.0
    poll_interval_s: float = 0.001  # longest sleep between polls while reads are in flight
    spin_s: float = 0.002  # poll on every loop turn this close to a read's posting or expected end
    # No read in flight (see pace.py, serving.py): spin for spin_s after a handshake answered,
    # a reader's request for progress, or a hold, claim or notification while a reader before
    # side-channel version 5 reads; then progress NIXL every idle_poll_s while asked to, while
    # such a reader may read what is held, or for idle_hot_s after that activity; then every
    # idle_max_s.
    idle_poll_s: float = 0.001
    idle_hot_s: float = 1.0
    idle_max_s: float = 0.05
    max_frame_bytes: int = 64 << 20
    log_format: str = "text"  # text or json
    log_level: str = "INFO"
    name: str = "kvxferd"

    def __post_init__(self) -> None:
        for cidr in self.allowed_peers:  # host bits set ("10.0.0.1/8") are refused, not widened
            try:
                ipaddress.ip_network(cidr)
            except ValueError as exc:
                raise ValueError(f"allowed_peers: {exc}") from None
        if self.peer_dead_after_s <= self.peer_probe_interval_s:  # every peer would die between two probes
            raise ValueError(f"peer_dead_after_s ({self.peer_dead_after_s:g}) must exceed peer_probe_interval_s "
                             f"({self.peer_probe_interval_s:g})")

    @property
    def side_channel(self) -> str:
        return f"{self.advertise_host or self.side_channel_host}:{self.side_channel_port}"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also as ::ffff:127.x) or "localhost"; anything else ("*", 0.0.0.0, ::,
    an interface or host name) may be reachable from the network."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """A bind address that listens on every interface ("*", 0.0.0.0, ::)."""
    return host.strip().removeprefix("[").removesuffix("]") in ("*", "0.0.0.0", "::", "")


def check_side_channel(cfg: Config) -> str | None:
    """Refuse a side channel reachable from the network without CurveZMQ keys (ConfigError,
    saying what to do), unless `side_channel_insecure` says so explicitly: then return the
    warning to log at start. Loopback, or Curve keys configured: None."""
    if cfg.curve_secret_key_file or is_loopback(cfg.side_channel_host):
        return None
    where = f"{cfg.side_channel_host}:{cfg.side_channel_port or '<any port>'}"
    if cfg.side_channel_insecure:
        return (f"side channel on {where} without CurveZMQ keys (side_channel_insecure = true): any host "
                "that reaches it can handshake and read the KV blocks this daemon holds")
    raise ConfigError(
        f"refusing to serve the side channel on {where} without CurveZMQ keys: any host that reaches it "
        "could handshake and read the KV blocks this daemon holds. Do one of:\n"
        "  - create keys: `kvxferd keys generate /etc/kvxferd/curve --name kvxferd` (one keypair for the "
        "daemons that talk to each other, copied to each), then set curve_secret_key_file = "
        '"/etc/kvxferd/curve/kvxferd.key_secret" and curve_authorized_keys_dir = "/etc/kvxferd/curve" '
        "(KVXFERD_CURVE_SECRET_KEY_FILE / KVXFERD_CURVE_AUTHORIZED_KEYS_DIR, or --curve-secret-key / "
        "--curve-authorized-keys; docs/deploy.md);\n"
        '  - serve only this host: side_channel_host = "127.0.0.1";\n'
        "  - on a network where every host may read the KV cache, say so: side_channel_insecure = true "
        "(KVXFERD_SIDE_CHANNEL_INSECURE=1, --side-channel-insecure)")


def authorized_keys_dir(cfg: Config) -> str:
    """The public keys a daemon admits: curve_authorized_keys_dir; unset, the `authorized`
    directory beside the secret key (`kvxferd keys generate` makes it), else the secret's own."""
    if cfg.curve_authorized_keys_dir:
        return cfg.curve_authorized_keys_dir
    beside = os.path.join(os.path.dirname(cfg.curve_secret_key_file), "authorized")
    return beside if os.path.isdir(beside) else os.path.dirname(cfg.curve_secret_key_file)


def check_curve_files(cfg: Config) -> None:
    """The configured CurveZMQ files exist (a missing Secret or volume mount fails here, by name)."""
    if not cfg.curve_secret_key_file:
        return
    hint = ("create them with `kvxferd keys generate DIR --name kvxferd` and mount or copy DIR there "
            "(docs/deploy.md)")
    if not os.path.isfile(cfg.curve_secret_key_file):
        raise ConfigError(f"curve_secret_key_file {cfg.curve_secret_key_file} does not exist: {hint}")
    if not os.access(cfg.curve_secret_key_file, os.R_OK):
        raise ConfigError(f"curve_secret_key_file {cfg.curve_secret_key_file} is not readable by uid "
                          f"{os.geteuid()}: the key belongs to the daemon's user (`kvxferd keys generate DIR "
                          "--owner USER`, or chown -R USER DIR), never to the engines' group")
    authorized = authorized_keys_dir(cfg)
    if not os.path.isdir(authorized):
        raise ConfigError(f"curve_authorized_keys_dir {authorized} does not exist: {hint}")
    if cfg.curve_server_key_file and not os.path.isfile(cfg.curve_server_key_file):
        raise ConfigError(f"curve_server_key_file {cfg.curve_server_key_file} does not exist: {hint}")


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
    if field in ("backends", "allowed_uids", "allowed_peers"):
        return [v for v in value.split(",") if v]
    if field == "ucx":
        return dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
    return value
