"""Who a side-channel peer is: CurveZMQ keys, this daemon's and its peers'.

Each daemon has a keypair: its own (per-daemon keys, docs/deploy.md) or the cluster's (one
shared pair). A peer is known by its public key, never by a name it writes:

    admitting  a connecting daemon's key must be in the authorized directory (ZAP, checked
               again whenever the directory changes: a Secret's update, a key copied in)
    dialing    a read names the prefill daemon's public key (kv_transfer_params'
               remote_daemon_key, RemoteRef.daemon_key; the engine had it from its daemon's
               registration). It must be authorized too, and the daemon at that address must
               prove it holds the secret half (CurveZMQ) or nothing is asked of it. A read that
               names no key dials the configured server key (curve_server_key_file), else our own
               (one shared pair).
    attributing  a side-channel message carries its sender's key (ZAP's User-Id). A daemon's NIXL
               agent name ends with its key's fingerprint (`-k` and 32 hex digits), and a
               message's `requester` with a fingerprint speaks only for that key (speaks_for):
               a peer pins, unpins and notifies only under its own name. A name without one is a
               daemon's from before fingerprints: unattributed, as every name is without Curve.

With one shared keypair every daemon has the same fingerprint: any of them may speak for any
other (docs/security.md says what that gives up).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
import zmq.auth

log = logging.getLogger("kvxferd")

Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")  # a 32-byte key in Z85
_FINGERPRINTED = re.compile(r".*-(k[0-9a-f]{32})")


def fingerprint(public: bytes | str) -> str:
    """What a daemon's NIXL agent name ends with: 128 bits of its public key's (Z85) digest."""
    key = public.encode() if isinstance(public, str) else public
    return "k" + hashlib.sha256(key).hexdigest()[:32]


def speaks_for(requester: str, sender: str) -> bool:
    """`requester` (an agent name a message carries) may be `sender`'s (its Z85 public key, as ZAP
    authenticated it): a name with a fingerprint only the key it was made from."""
    named = _FINGERPRINTED.fullmatch(requester)
    return named is None or hmac.compare_digest(named.group(1), fingerprint(sender))


class KeyRefused(ValueError):
    """A read named a daemon key that is not authorized (or not a key at all)."""


class AuthorizedKeys:
    """The public keys (`*.key` certificates) in a directory, read again when it changes."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._seen: tuple[int, int] | None = None
        self._keys: frozenset[bytes] = frozenset()

    def __contains__(self, public: bytes) -> bool:
        return public in self.keys()

    def keys(self) -> frozenset[bytes]:
        try:
            st = os.stat(self.directory)
        except OSError as exc:  # gone (an unmounted Secret): nobody is admitted
            log.warning("curve authorized keys directory %s: %s", self.directory, exc)
            return frozenset()
        if self._seen != (st.st_mtime_ns, st.st_ino):
            self._seen, self._keys = (st.st_mtime_ns, st.st_ino), self._read()
        return self._keys

    def callback(self, domain: str, public: bytes) -> bool:
        """pyzmq's ZAP credentials provider: `public` (Z85) may connect."""
        return public in self

    def _read(self) -> frozenset[bytes]:
        found = set()
        for path in sorted(Path(self.directory).glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:  # one bad file keeps none of the others out
                log.warning("curve authorized keys: skipping %s: %s", path, exc)
                continue
            if public:
                found.add(public)
        return frozenset(found)


@dataclass(frozen=True)
class CurveKeys:
    """This daemon's keypair and the public key of the server it dials (all Z85)."""

    public: bytes
    secret: bytes
    server_public: bytes
    authorized_dir: str

    def dialing(self, server_public: bytes) -> CurveKeys:
        return self if server_public == self.server_public else replace(self, server_public=server_public)


def load_curve(secret_file: str, authorized_dir: str, server_key_file: str = "") -> CurveKeys:
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key")
    if not Path(authorized_dir).is_dir():
        raise ValueError(f"curve authorized keys directory {authorized_dir} does not exist")
    server = zmq.auth.load_certificate(server_key_file)[0] if server_key_file else public
    return CurveKeys(public, secret, server, authorized_dir)


class PeerKeys:
    """This daemon's CurveZMQ identity, the keys it admits, and the key each peer daemon's address
    proved to hold (a handshake under it succeeded): what links and probes dial with."""

    def __init__(self, curve: CurveKeys) -> None:
        self.curve = curve
        self.authorized = AuthorizedKeys(curve.authorized_dir)
        self.fingerprint = fingerprint(curve.public)
        self._proved: dict[tuple[str, int], bytes] = {}

    @property
    def public(self) -> str:
        return self.curve.public.decode()

    def named(self, daemon_key: str) -> bytes:
        """The server key a read that names `daemon_key` dials ("" names none: the default).
        KeyRefused unless it is authorized."""
        if not daemon_key:
            return self.curve.server_public
        key = daemon_key.encode()
        if key not in self.authorized:
            raise KeyRefused(f"daemon key {daemon_key} is not among the authorized keys in "
                             f"{self.authorized.directory}: that daemon is not one this daemon trusts")
        return key

    def proved(self, host: str, port: int, server_public: bytes) -> None:
        """The daemon at host:port answered a handshake under `server_public`."""
        self._proved[(host, port)] = server_public
        if len(self._proved) > MAX_PROVED:
            del self._proved[next(iter(self._proved))]

    def at(self, host: str, port: int) -> CurveKeys:
        """What to dial host:port with: the key it proved, else the default server key."""
        return self.curve.dialing(self._proved.get((host, port), self.curve.server_public))


MAX_PROVED = 65536  # addresses remembered; the oldest is dialed with the default key again


class KeysExist(FileExistsError):
    """A keypair of that name is there already (replace it with force=True)."""


def generate_keys(directory: str, name: str = "kvxferd", force: bool = False,
                  owner: tuple[int, int] | None = None) -> tuple[str, str]:
    """Write a CurveZMQ keypair in pyzmq's certificate format (`name.key` public,
    `name.key_secret`) and put a copy of the public half in `directory/authorized` (the keys
    this daemon admits: its own, and the peers' that the operator copies in); returns both
    paths. Each file is created with its final mode (the secret never readable by others,
    whatever the umask), O_EXCL and O_NOFOLLOW: no overwrite, no write through a planted
    symlink. `owner` (uid, gid): the directory and files become the daemon user's, the directory
    0700 (engine users read nothing there). An existing pair raises KeysExist unless `force`."""
    top = Path(directory)
    top.mkdir(parents=True, exist_ok=True, mode=0o700)
    authorized = top / "authorized"
    authorized.mkdir(exist_ok=True, mode=0o755)
    public, secret = top / f"{name}.key", top / f"{name}.key_secret"
    trusted = authorized / f"{name}.key"
    existing = [str(p) for p in (public, secret) if p.exists() or p.is_symlink()]
    if existing and not force:
        raise KeysExist(f"{', '.join(existing)} already exist(s); pass --force to replace the keypair")
    pub_key, sec_key = (k.decode() for k in zmq.curve_keypair())
    now = datetime.datetime.now().isoformat(timespec="seconds")
    body = f'metadata\ncurve\n    public-key = "{pub_key}"\n'
    public_text = f"#   ZeroMQ CURVE Public Certificate ({now})\n\n{body}"
    for path, mode, text in ((secret, 0o600, f"#   ZeroMQ CURVE **Secret** Certificate ({now})\n#   keep it private\n\n"
                              f'{body}    secret-key = "{sec_key}"\n'),
                             (public, 0o644, public_text), (trusted, 0o644, public_text)):
        if force or path == trusted:
            path.unlink(missing_ok=True)  # a fresh file, not a write through an old one's mode or a symlink
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    if owner is not None:
        for path in (top, authorized, public, secret, trusted):
            os.chown(path, *owner, follow_symlinks=False)
        top.chmod(0o700)
    return str(public), str(secret)
