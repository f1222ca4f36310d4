"""The engine socket's directory (kvxferd/sockdir.py): each rule on real directories, a real daemon
refusing shared scratch space, stopping without removing a newer daemon's socket, and the Helm
chart's pods (sidecar: an emptyDir; daemonset: a hostPath) run for real from the rendered spec."""

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from podsim import pod_from_chart, render_chart, unavailable
from podsim import run as run_pod
from test_faults import wait_for

from kvxferd.client import Client
from kvxferd.lab.synthetic.demo import DaemonProcess, DemoError
from kvxferd.sockdir import SocketDirError, bind, prepare, unlink_if_bound

UID, GID = os.geteuid(), os.getegid()
OTHER = 12345  # a uid/gid that is neither this process's nor root's


def mode_of(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def make_dir(p: Path, mode: int, uid: int = UID, gid: int = GID) -> Path:
    p.mkdir()
    os.chown(p, uid, gid)
    p.chmod(mode)
    return p


needs_root = pytest.mark.skipif(UID != 0, reason="needs root to give directories other owners")


# --- rule 2: an absent directory is created private -------------------------------------------

def test_absent_directory_and_parents_are_created_0700(tmp_path):
    d = prepare(tmp_path / "a" / "b")
    for p in (tmp_path / "a", tmp_path / "a" / "b"):
        st = os.lstat(p)
        assert stat.S_ISDIR(st.st_mode) and mode_of(p) == 0o700 and (st.st_uid, st.st_gid) == (UID, GID)
    assert d == tmp_path / "a" / "b"


def test_created_0750_when_the_socket_lets_its_group_in(tmp_path):
    assert mode_of(prepare(tmp_path / "g", socket_mode=0o660)) == 0o750
    assert mode_of(prepare(tmp_path / "o", socket_mode=0o600)) == 0o700


@needs_root
def test_created_with_socket_group(tmp_path):
    d = prepare(tmp_path / "s", socket_mode=0o600, group=OTHER)
    assert mode_of(d) == 0o750 and os.lstat(d).st_gid == OTHER


# --- rule 1: an existing directory is the daemon's ---------------------------------------------

@needs_root
@pytest.mark.parametrize("mode, owner, group, daemon_uid, socket_group, refusal", [
    (0o700, UID, GID, UID, None, None),
    (0o750, UID, GID, UID, OTHER, None),
    (0o755, 0, 0, 4242, None, None),  # root's directory, a non-root daemon: root could replace it anyway
    (0o700, OTHER, OTHER, UID, None, f"belongs to uid {OTHER}"),
    (0o700, OTHER, OTHER, OTHER, None, None),  # the daemon's own, running as OTHER
    (0o777, UID, GID, UID, None, "world-writable (mode 0777)"),
    (0o1777, 0, 0, UID, None, "world-writable (mode 1777)"),
    (0o2777, 0, OTHER, UID, None, "world-writable (mode 2777)"),
    (0o770, UID, OTHER, UID, None, f"writable by group {OTHER}"),
    (0o770, UID, GID, UID, None, None),  # the daemon's own group
    (0o770, UID, GID, UID, GID, "writable by group"),  # ... but engines are in it (socket_group)
])
def test_existing_directory(tmp_path, mode, owner, group, daemon_uid, socket_group, refusal):
    d = make_dir(tmp_path / "d", mode, owner, group)
    if refusal is None:
        assert prepare(d, 0o600, socket_group, uid=daemon_uid, gid=GID) == d
    else:
        with pytest.raises(SocketDirError, match=re.escape(refusal)):
            prepare(d, 0o600, socket_group, uid=daemon_uid, gid=GID)
    assert mode_of(d) == mode and os.lstat(d).st_uid == owner  # checked, never changed


def test_world_writable_advice_names_the_way_out(tmp_path):
    d = make_dir(tmp_path / "empty", 0o777)
    with pytest.raises(SocketDirError) as err:
        prepare(d)
    assert f'socket_path = "{d}/daemon/kvxferd.sock"' in str(err.value)  # emptyDir: a subdirectory
    sticky = make_dir(tmp_path / "scratch", 0o1777)
    with pytest.raises(SocketDirError) as err:
        prepare(sticky)
    assert "/run/kvxferd" in str(err.value) and "RuntimeDirectory=kvxferd" in str(err.value)


def test_symlink_and_file_are_refused(tmp_path):
    real = make_dir(tmp_path / "real", 0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SocketDirError, match="symbolic link"):
        prepare(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(SocketDirError, match="not a directory"):
        prepare(tmp_path / "file")


@needs_root
def test_directory_the_daemon_cannot_write_is_refused_by_name():
    top = Path(tempfile.mkdtemp(prefix="kvx-sockdir-"))  # reachable by uid 4242, unlike tmp_path
    try:
        top.chmod(0o755)
        d = make_dir(top / "rootdir", 0o755, 0, 0)
        probe = ("import os\nfrom kvxferd.sockdir import prepare, SocketDirError\n"
                 "os.setgroups([]); os.setgid(4242); os.setuid(4242)\n"
                 f"try: prepare({str(d)!r})\nexcept SocketDirError as e: print(e)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert f"socket directory {d} is not writable by the daemon (uid 4242)" in out
    finally:
        shutil.rmtree(top)


# --- rule 3: never created in shared scratch space ---------------------------------------------

def test_not_created_in_sticky_scratch(tmp_path):
    scratch = make_dir(tmp_path / "scratch", 0o1777)  # what /tmp, /var/tmp, /dev/shm are
    with pytest.raises(SocketDirError, match="shared by every local user"):
        prepare(scratch / "kvxferd")
    with pytest.raises(SocketDirError, match="shared by every local user"):
        prepare(scratch / "a" / "b")
    assert list(scratch.iterdir()) == []  # nothing made


def test_not_created_in_a_plain_world_writable_directory(tmp_path):
    open_dir = make_dir(tmp_path / "open", 0o777)
    with pytest.raises(SocketDirError, match="rename it away"):
        prepare(open_dir / "kvxferd")
    assert list(open_dir.iterdir()) == []


def test_existing_private_directory_in_scratch_is_accepted(tmp_path):
    """mkdtemp's kind: an unpredictable name made 0700 by its owner; nobody could take it first."""
    scratch = make_dir(tmp_path / "scratch", 0o1777)
    mine = make_dir(scratch / "kvxferd-x7q2", 0o700)
    assert prepare(mine) == mine


MOUNT_PROBE = """
import json, os, stat, subprocess, sys
from kvxferd.sockdir import prepare
vol = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={sys.argv[2]},gid={sys.argv[3]}", "tmpfs", vol], check=True)
d = prepare(os.path.join(vol, "daemon"), int(sys.argv[4], 8))
st = os.lstat(d)
print(json.dumps({"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                  "vol": stat.S_IMODE(os.stat(vol).st_mode)}))
"""


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
@pytest.mark.parametrize("vol_mode, vol_gid, socket_mode, expect", [
    ("0777", 0, "0600", 0o700),  # an emptyDir
    ("2777", OTHER, "0660", 0o750),  # an emptyDir with fsGroup: setgid, the pod's group
])
def test_created_inside_an_emptydir_like_mount(tmp_path, vol_mode, vol_gid, socket_mode, expect):
    vol = tmp_path / "vol"
    vol.mkdir()
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_PROBE,
                          str(vol), vol_mode, str(vol_gid), socket_mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert made["vol"] == int(vol_mode, 8)
    # the daemon's own directory: no setgid inherited, the daemon's group, nobody else may write
    assert made == {"mode": expect, "uid": UID, "gid": GID, "vol": int(vol_mode, 8)}


# --- a real daemon ------------------------------------------------------------------------------

def test_daemon_refuses_sticky_scratch_and_says_what_to_do(tmp_path):
    scratch = make_dir(tmp_path / "scratch", 0o1777)
    for sock, words in ((scratch / "d.sock", "world-writable (mode 1777)"),
                        (scratch / "kvxferd" / "d.sock", "refusing to create socket directory")):
        with pytest.raises(DemoError, match="exited"):
            DaemonProcess(tmp_path, "d", socket=str(sock))
        log = (tmp_path / "d.log").read_text()
        assert words in log and "RuntimeDirectory=kvxferd" in log and "Traceback" not in log, log
        assert not sock.exists() and not (scratch / "kvxferd").exists()
        (tmp_path / "d.log").unlink()


# --- rule 4: stopping removes only this daemon's socket ---------------------------------------

def test_unlink_only_the_socket_bound(tmp_path):
    path = str(tmp_path / "k.sock")
    first = socket.socket(socket.AF_UNIX)
    bind(first, path)
    first.listen()
    os.unlink(path)  # another daemon takes the path over
    second = socket.socket(socket.AF_UNIX)
    bind(second, path)
    second.listen()
    assert unlink_if_bound(first, path) is False
    probe = socket.socket(socket.AF_UNIX)
    probe.connect(path)  # still the second's
    probe.close()
    assert unlink_if_bound(second, path) is True and not os.path.lexists(path)
    assert unlink_if_bound(second, path) is False  # gone already
    for s in (first, second):
        s.close()
    third = socket.socket(socket.AF_UNIX)
    bind(third, path)
    third.close()
    os.unlink(path)
    Path(path).write_text("not a socket")
    assert unlink_if_bound(third, path) is False and Path(path).read_text() == "not a socket"
    stranger = socket.socket(socket.AF_UNIX)  # never bound through sockdir
    assert unlink_if_bound(stranger, path) is False and os.path.exists(path)
    stranger.close()


def serving(sock: str) -> str:
    """The NIXL agent of the daemon answering at `sock` ('' while none does)."""
    try:
        with Client(sock) as c:
            return c.status().agent
    except OSError:
        return ""


def test_stopping_daemon_leaves_a_newer_daemons_socket(tmp_path):
    sock = str(tmp_path / "run" / "kvxferd.sock")
    old = DaemonProcess(tmp_path, "old", socket=sock)
    try:
        new = DaemonProcess(tmp_path, "new", socket=sock)  # replaces the path's socket (a restart overlap)
        try:
            wait_for(lambda: serving(sock).startswith("new-"), 60, "the new daemon to take the socket over")
            old.stop()
            assert os.path.exists(sock), "the old daemon removed the new one's socket"
            assert serving(sock).startswith("new-")
        finally:
            new.stop()
        assert not os.path.lexists(sock)  # its own socket: removed
    finally:
        old.stop()


def test_stopping_daemon_removes_its_socket(tmp_path):
    d = DaemonProcess(tmp_path, "d", socket=str(tmp_path / "k.sock"))
    assert os.path.exists(d.socket)
    d.stop()
    assert d.proc.returncode == 0 and not os.path.lexists(d.socket)


# --- the Helm chart's pods, run for real ------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """`kvxferd keys generate` as docs/deploy.md says: the cluster's keypair, and a stranger's."""
    base = tmp_path_factory.mktemp("keys")
    for d, name in (("kvxferd-curve", "kvxferd"), ("stranger", "stranger")):
        subprocess.run([sys.executable, "-m", "kvxferd", "keys", "generate", str(base / d), "--name", name],
                       check=True, capture_output=True)
    return base / "kvxferd-curve", base / "stranger"


def handshakes(keys, engine: str) -> tuple[list[dict], list[dict]]:
    """Probes of the side channel: the Secret's keys, none, a stranger's keypair (it knows the
    server's public key). The stranger's files travel into the pod's namespace at /run/stranger."""
    stranger = keys[1]
    files = [{"path": f"/run/stranger/{f.name}", "text": f.read_text(), "mode": "0600"} for f in stranger.iterdir()
             if f.is_file()]
    base = {"engine": engine, "host": "127.0.0.1", "port": 5600}
    return files, [{**base, "label": "keys", "secret": "/etc/kvxferd/curve/kvxferd.key_secret"},
                   {**base, "label": "none"},
                   {**base, "label": "stranger", "secret": "/run/stranger/stranger.key_secret",
                    "server_key": "/etc/kvxferd/curve/kvxferd.key"}]


def assert_side_channel_needs_keys(report: dict) -> None:
    hs = report["handshakes"]
    assert hs["keys"] == {"ok": True, "ranks": 1}, hs
    for label in ("none", "stranger"):
        assert not hs[label]["ok"] and hs[label]["reason"] == "timeout", hs
    assert report["status"]["side_channel_auth"] == "curve"
    assert report["status"]["unauthenticated_peers"] >= 2  # both refused at the ZMTP handshake


needs_pods = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")


@needs_pods
def test_chart_sidecar_pod_serves_its_engine(tmp_path, keys):
    """Sidecar mode as rendered: kvxferd (uid 10001, no capabilities) beside an inference container,
    sharing an emptyDir (a 2777 tmpfs of group fsGroup here, as the kubelet makes it) at /run/kvxferd.
    The daemon keeps its socket in /run/kvxferd/daemon (0750, its own); the engine container's
    processes (fsGroup among their groups) register: root (vLLM's image default) and uid 1000
    (listed in allowedUids). A uid without the pod's group cannot reach the socket; one with it but
    not listed is refused by SO_PEERCRED."""
    docs = render_chart({"mode": "sidecar", "curve": {"existingSecret": "kvxferd-curve"},
                         "config": {"allowedUids": [0, 1000]}})
    fs_group = docs["kvxferd/templates/sidecar.yaml"][0]["spec"]["template"]["spec"]["securityContext"]["fsGroup"]
    files, probes = handshakes(keys, "engine-root")
    spec = pod_from_chart(docs, keys[0], [
        {"name": "engine-root", "uid": 0, "gid": 0, "groups": [fs_group]},
        {"name": "engine-1000", "uid": 1000, "gid": 1000, "groups": [fs_group]},
        {"name": "outsider", "uid": 1001, "gid": 1001},
        {"name": "unlisted", "uid": 1002, "gid": 1002, "groups": [fs_group]},
    ], probes, tmp_path / "stage")
    assert spec["daemon"]["socket"] == "/run/kvxferd/daemon/kvxferd.sock"
    assert spec["engines"][0]["env"]["KVXFERD_SOCKET_PATH"] == spec["daemon"]["socket"]
    assert {"path": "/run/kvxferd", "tmpfs": True, "mode": "2777", "uid": 0, "gid": fs_group} in spec["dirs"]
    spec["files"] += files
    report = run_pod(spec, tmp_path)
    assert report["daemon"]["up"], report["daemon"]["log"]
    assert report["socket_dir"] == {"mode": "0750", "uid": 10001, "gid": 10001}
    assert report["socket"] == {"mode": "0660", "uid": 10001, "gid": 10001}
    engines = report["engines"]
    assert engines["engine-root"]["ok"] and engines["engine-1000"]["ok"], engines
    assert not engines["outsider"]["ok"] and "Permission denied" in engines["outsider"]["error"]
    assert not engines["unlisted"]["ok"] and "forbidden" in engines["unlisted"]["error"]
    assert_side_channel_needs_keys(report)
    assert report["daemon"]["returncode"] == 0 and not report["daemon"]["socket_left"]


@needs_pods
@pytest.mark.parametrize("init", [True, False])
def test_chart_daemonset_pod_serves_node_engines(tmp_path, keys, init):
    """DaemonSet mode as rendered: the hostPath /run/kvxferd as DirectoryOrCreate makes it (root,
    0755); the init container (root with CHOWN and FOWNER only) makes it kvxferd's, 0750, and the
    daemon serves a root engine. Without the init container the daemon refuses, saying why."""
    docs = render_chart({"mode": "daemonset", "curve": {"existingSecret": "kvxferd-curve"},
                         "socketHostPathInit": init})
    files, probes = handshakes(keys, "engine-root")
    spec = pod_from_chart(docs, keys[0], [{"name": "engine-root", "uid": 0, "gid": 0}], probes,
                          tmp_path / "stage")
    spec["files"] += files
    report = run_pod(spec, tmp_path)
    if not init:
        assert not report["daemon"]["up"]
        assert ("socket directory /run/kvxferd is not writable by the daemon (uid 10001)"
                in report["daemon"]["log"]), report["daemon"]["log"]
        return
    assert [i["returncode"] for i in report["init"]] == [0], report["init"]
    assert report["daemon"]["up"], report["daemon"]["log"]
    assert report["socket_dir"] == {"mode": "0750", "uid": 10001, "gid": 10001}
    assert report["engines"]["engine-root"]["ok"], report["engines"]
    assert_side_channel_needs_keys(report)
    assert report["daemon"]["returncode"] == 0 and not report["daemon"]["socket_left"]
