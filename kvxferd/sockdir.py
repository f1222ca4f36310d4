"""Where the engine socket may live, and removing it only while it is this daemon's.

Engines hand the daemon their memory (file descriptors) over the Unix socket: whoever can put a
socket at `socket_path` before the daemon, or replace the daemon's, receives them. The rule:

1. The socket's directory belongs to the daemon: a real directory (not a symbolic link), owned by
   the daemon's uid or by root, writable by nobody else: not by others, and by its group only when
   that group is the daemon's own and not `socket_group` (no engine may write it). Then only the
   daemon and root can create, replace or remove the socket. Checked at every start.
2. Absent, the daemon creates it (and missing parents): mode 0700, or 0750 when the socket lets its
   group in (`socket_group`, or a socket_mode like 0660), group `socket_group` or the daemon's own.
   A name that appears meanwhile is judged by rule 1, never adopted.
3. Not in shared scratch space. The directory the daemon creates it in may be world-writable only
   without the sticky bit and as a mount point: what Kubernetes makes of an emptyDir volume (0777,
   2777 with fsGroup), which only the pod's containers reach (the chart's sidecar mode). /tmp,
   /var/tmp, /dev/shm (sticky, every local user's) are refused: at boot or after a crash anyone
   could create the directory first and bind a socket there, and engines would connect to it. A
   plain world-writable directory is refused too (anyone could also rename ours away). A private
   directory that already exists there (made by mkdtemp, say) passes by rule 1.
4. Stopping, the daemon removes the socket only if the path still names the socket it bound (same
   st_dev and st_ino): a newer daemon's socket at that path stays (`unlink_if_bound`).
"""

from __future__ import annotations

import grp
import os
import re
import socket
import stat
import weakref
from pathlib import Path

__all__ = ["SocketDirError", "bind", "prepare", "unlink_if_bound"]


class SocketDirError(PermissionError):
    """The socket's directory breaks the rule; the message says what to do."""


_SHARED_ADVICE = ("Use a directory only the daemon and root can write, e.g. /run/kvxferd (systemd: "
                  "RuntimeDirectory=kvxferd), or in a Kubernetes emptyDir a subdirectory the daemon creates "
                  "(docs/deploy.md, \"The engine socket\")")


def prepare(directory: str | os.PathLike[str], socket_mode: int = 0o600, group: int | None = None, *,
            uid: int | None = None, gid: int | None = None) -> Path:
    """Check the socket's directory against the rule, creating it if absent; raise SocketDirError.

    `socket_mode`, `group`: the socket's mode and group (socket_group's gid), which decide the mode
    and group of a directory created here. `uid`, `gid`: the daemon's (default: this process's
    effective ones)."""
    d = Path(os.path.abspath(directory))
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    missing: list[Path] = []
    p = d
    while True:
        try:
            os.lstat(p)
            break
        except FileNotFoundError:
            missing.append(p)
            p = p.parent
        except OSError as exc:
            raise SocketDirError(f"socket directory {d}: {p}: {exc.strerror}") from None
    if missing:
        _check_creation_parent(p, d)
        mode = 0o750 if socket_mode & 0o070 or group is not None else 0o700
        for m in reversed(missing):
            try:
                os.mkdir(m, mode)
            except FileExistsError:  # made meanwhile by someone else: judged as found, below
                _check_owned(m, os.lstat(m), uid, gid, group)
                continue
            except OSError as exc:
                raise SocketDirError(f"cannot create socket directory {m}: {exc.strerror}; create {d} for "
                                     f"the daemon's user (uid {uid}), mode 0700 or 0750") from None
            os.chmod(m, mode)  # past the umask; drops a setgid bit inherited from an fsGroup volume
            os.chown(m, -1, gid if group is None else group)
    _check_owned(d, os.lstat(d), uid, gid, group)
    if uid == os.geteuid() and not os.access(d, os.W_OK | os.X_OK):
        raise SocketDirError(f"socket directory {d} is not writable by the daemon (uid {uid}): make the daemon's "
                             f"user its owner (chown {uid} {d}; systemd: RuntimeDirectory=kvxferd)")
    return d


def _check_owned(d: Path, st: os.stat_result, uid: int, gid: int, group: int | None) -> None:
    """Rule 1: only the daemon and root can change what is in `d`."""
    if stat.S_ISLNK(st.st_mode):
        raise SocketDirError(f"socket directory {d} is a symbolic link: name the real directory in socket_path")
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"socket directory {d} is not a directory")
    if st.st_uid not in (uid, 0):
        raise SocketDirError(
            f"socket directory {d} belongs to uid {st.st_uid}, neither this daemon (uid {uid}) nor root: its "
            f"owner could replace the socket and receive the engines' memory. Remove it, or choose another. "
            f"{_SHARED_ADVICE}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        if mode & stat.S_ISVTX:
            fix = _SHARED_ADVICE
        else:
            fix = (f"in a Kubernetes emptyDir, put the socket in a subdirectory the daemon creates, e.g. "
                   f"socket_path = \"{d / 'daemon' / 'kvxferd.sock'}\"; elsewhere, chmod o-w {d}")
        raise SocketDirError(
            f"socket directory {d} is world-writable (mode {mode:04o}): anyone could bind a socket there first "
            f"or replace the daemon's, and engines would hand them their memory. {fix}")
    if mode & stat.S_IWGRP and (st.st_gid != gid or st.st_gid == group):
        raise SocketDirError(
            f"socket directory {d} is writable by group {_group_name(st.st_gid)} (mode {mode:04o}): its members "
            f"could replace the socket. chmod g-w {d} (connecting needs only the socket's group access)")


def _check_creation_parent(parent: Path, d: Path) -> None:
    """Rule 3: the directory the daemon creates `d` in is not shared scratch space."""
    try:
        st = os.stat(parent)
    except OSError as exc:
        raise SocketDirError(f"cannot create socket directory {d}: {parent}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"cannot create socket directory {d}: {parent} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if not mode & stat.S_IWOTH:
        return
    if mode & stat.S_ISVTX:
        raise SocketDirError(
            f"refusing to create socket directory {d} in {parent} (mode {mode:04o}, shared by every local "
            f"user): anyone could create it before the daemon (at boot, after a crash) and engines would "
            f"connect to their socket. {_SHARED_ADVICE}")
    if not _is_mount_point(parent):
        raise SocketDirError(
            f"refusing to create socket directory {d} in world-writable {parent} (mode {mode:04o}): anyone could "
            f"create it first or rename it away. {_SHARED_ADVICE}")


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _is_mount_point(path: Path) -> bool:
    """A mount point in this mount namespace (a Kubernetes volume is one in its container)."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            if any(len(fields) > 4 and _unescape(fields[4]) == real for fields in (line.split() for line in f)):
                return True
    except OSError:
        pass
    return os.path.ismount(real)


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


_bound: weakref.WeakKeyDictionary[socket.socket, tuple[int, int]] = weakref.WeakKeyDictionary()


def bind(sock: socket.socket, path: str) -> None:
    """Bind `sock` at `path` and remember which file that made (for `unlink_if_bound`)."""
    sock.bind(path)
    st = os.lstat(path)
    _bound[sock] = (st.st_dev, st.st_ino)


def unlink_if_bound(sock: socket.socket, path: str) -> bool:
    """Remove `path` if it is still the socket file `bind` made for `sock` (rule 4); True if removed."""
    ident = _bound.get(sock)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if ident is None or (st.st_dev, st.st_ino) != ident or not stat.S_ISSOCK(st.st_mode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
