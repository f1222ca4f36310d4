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
               daemon's from before fingerprints: refused, unless the operator accepts such
               unattributed names while a cluster upgrades (`unattributed_peers`).

With one shared keypair every daemon has the same fingerprint: any of them may speak for any
other (docs/security.md says what that gives up).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
import zmq.auth

from . import protocol as P

log = logging.getLogger("kvxferd")

Z85_KEY = re.compile(P.Z85_KEY)
_FINGERPRINTED = re.compile(r".*-(k[0-9a-f]{32})", re.DOTALL)


def fingerprint(public: bytes | str) -> str:
    """What a daemon's NIXL agent name ends with: 128 bits of its public key's (Z85) digest."""
    key = public.encode() if isinstance(public, str) else public
    return "k" + hashlib.sha256(key).hexdigest()[:32]


def fingerprinted(agent: str) -> bool:
    """`agent` is the name of a daemon with a key (one that sends its notices on the side channel)."""
    return bool(fingerprint_of(agent))


def fingerprint_of(agent: str) -> str:
    """The key fingerprint an agent name ends with ("" for a name without one)."""
    named = _FINGERPRINTED.fullmatch(agent)
    return named.group(1) if named is not None else ""


def speaks_for(requester: str, sender: str, unattributed: bool = True) -> bool:
    """`requester` (an agent name a message carries) may be `sender`'s (its Z85 public key, as ZAP
    authenticated it): a name with a fingerprint only the key it was made from; one without (a
    daemon's from before fingerprints) only where `unattributed` names are accepted."""
    named = fingerprint_of(requester)
    if not named:
        return unattributed
    return hmac.compare_digest(named, fingerprint(sender))


class KeyRefused(ValueError):
    """A read named a daemon key that is not authorized (or not a key at all)."""


MAX_KEY_FILE = 4096  # a public certificate is ~130 bytes; a larger `*.key` is not one


class AuthorizedKeys:
    """The public keys (`*.key` certificates) in a directory, read again when it or one of them
    changes (a key copied in, a Secret's update): what the ZAP handler admits and reads may dial."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._seen: tuple[object, ...] | None = None
        self._keys: frozenset[bytes] = frozenset()

    def __contains__(self, public: bytes) -> bool:
        return public in self.keys()

    def keys(self) -> frozenset[bytes]:
        try:
            seen = self._signature()
        except OSError as exc:  # gone (an unmounted Secret): nobody is admitted
            log.warning("curve authorized keys directory %s: %s", self.directory, exc)
            return frozenset()
        if seen != self._seen:
            self._seen, self._keys = seen, self._read()
        return self._keys

    def callback(self, domain: str, public: bytes) -> bool:
        """pyzmq's ZAP credentials provider: `public` (Z85) may connect."""
        return public in self

    def _signature(self) -> tuple[object, ...]:
        """What changes when a key is added, removed or rewritten: the directory and each entry."""
        st = os.stat(self.directory)
        entries = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".key"):
                    try:
                        e = entry.stat()  # follows a Secret's symlinks to the file they name
                    except OSError:  # a dangling link (a key being removed): skipped by _read too
                        entries.append((entry.name, 0, 0, -1))
                        continue
                    entries.append((entry.name, e.st_ino, e.st_mtime_ns, e.st_size))
        return (st.st_mtime_ns, st.st_ino, *sorted(entries))

    def _read(self) -> frozenset[bytes]:
        found = set()
        for path in sorted(Path(self.directory).glob("*.key")):
            try:
                st = path.stat()
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE:
                    raise ValueError("not a public key certificate (a regular file of at most 4 KiB)")
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
    proved to hold (a handshake under it succeeded): what links dial, and reads that name none."""

    def __init__(self, curve: CurveKeys) -> None:
        self.curve = curve
        self.authorized = AuthorizedKeys(curve.authorized_dir)
        self.fingerprint = fingerprint(curve.public)
        self._proved: OrderedDict[tuple[str, int], str] = OrderedDict()  # least recently used first

    @property
    def public(self) -> str:
        return self.curve.public.decode()

    def authorize(self, daemon_key: str) -> None:
        """KeyRefused unless a read may dial `daemon_key` (Z85): it is among the authorized keys."""
        if daemon_key.encode() not in self.authorized:
            raise KeyRefused(f"daemon key {daemon_key} is not among the authorized keys in "
                             f"{self.authorized.directory}: that daemon is not one this daemon trusts")

    def proved(self, host: str, port: int, server: str) -> None:
        """The daemon at host:port answered a handshake under `server`."""
        self._proved[(host, port)] = server
        self._proved.move_to_end((host, port))
        if len(self._proved) > MAX_PROVED:
            self._proved.popitem(last=False)

    def at(self, host: str, port: int) -> str:
        """The key to dial host:port with: the one it proved, else the default server key."""
        server = self._proved.get((host, port))
        if server is None:
            return self.curve.server_public.decode()
        self._proved.move_to_end((host, port))
        return server


MAX_PROVED = 65536  # addresses remembered, least recently used out (dialed with the default key again)


class KeysExist(FileExistsError):
    """A keypair of that name is there already (replace it with force=True)."""


def generate_keys(directory: str, name: str = "kvxferd", force: bool = False,
                  owner: tuple[int, int] | None = None) -> tuple[str, str]:
    """Write a CurveZMQ keypair in pyzmq's certificate format (`name.key` public,
    `name.key_secret`) and put a copy of the public half in `directory/authorized` (the keys
    this daemon admits: its own, and the peers' that the operator copies in); returns both
    paths. `directory` becomes 0700 (the daemon's alone); with `owner` (uid, gid) it and
    everything written become that user's. Every file is made inside the directory opened once
    (no path is looked up again, so no symlink or rename swapped in meanwhile is followed), with
    its final mode and owner before it is closed, O_EXCL: no overwrite of an existing pair
    unless `force` (KeysExist)."""
    top = Path(directory)
    top.mkdir(parents=True, exist_ok=True, mode=0o700)
    at = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a symlink: refused
    try:
        existing = [f"{top}/{n}" for n in (f"{name}.key", f"{name}.key_secret") if _exists(n, at)]
        if existing and not force:
            raise KeysExist(f"{', '.join(existing)} already exist(s); pass --force to replace the keypair")
        if not _exists("authorized", at):
            os.mkdir("authorized", 0o755, dir_fd=at)
        trust = os.open("authorized", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
        pub_key, sec_key = (k.decode() for k in zmq.curve_keypair())
        now = datetime.datetime.now().isoformat(timespec="seconds")
        body = f'metadata\ncurve\n    public-key = "{pub_key}"\n'
        public_text = f"#   ZeroMQ CURVE Public Certificate ({now})\n\n{body}"
        secret_text = (f"#   ZeroMQ CURVE **Secret** Certificate ({now})\n#   keep it private\n\n"
                       f'{body}    secret-key = "{sec_key}"\n')
        try:
            for where, entry, mode, text in ((at, f"{name}.key_secret", 0o600, secret_text),
                                             (at, f"{name}.key", 0o644, public_text),
                                             (trust, f"{name}.key", 0o644, public_text)):
                with contextlib.suppress(FileNotFoundError):  # a fresh file, never a write through an old one
                    if force or where == trust:
                        os.unlink(entry, dir_fd=where)
                fd = os.open(entry, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                             dir_fd=where)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    if owner is not None:
                        os.fchown(f.fileno(), *owner)
                    f.write(text)
            if owner is not None:
                os.fchown(trust, *owner)
                os.fchown(at, *owner)
            os.fchmod(at, 0o700)
        finally:
            os.close(trust)
    finally:
        os.close(at)
    return str(top / f"{name}.key"), str(top / f"{name}.key_secret")


def _exists(entry: str, dir_fd: int) -> bool:
    try:
        os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
