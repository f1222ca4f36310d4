"""Who may talk to a daemon: the engine socket (0700 directory, 0600 socket, SO_PEERCRED
allow-list) and the side channel (CurveZMQ: an unauthenticated peer is refused and counted)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvxferd.client import Client, DaemonError
from kvxferd.lab.synthetic.demo import Cluster, DaemonProcess, DemoError, EngineProcess
from kvxferd.plan.models import PRESETS

SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=64, layers=2)


def test_socket_directory_and_mode(tmp_path):
    d = DaemonProcess(tmp_path, "d", socket=str(tmp_path / "run" / "kvxferd" / "kvxferd.sock"))
    try:
        sock = Path(d.socket)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    finally:
        d.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_other_users_cannot_connect(tmp_path):
    d = DaemonProcess(tmp_path, "d")
    try:
        probe = ("import os, socket; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX);"
                 f"s.connect({d.socket!r})")
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert result.returncode != 0 and "PermissionError" in result.stderr
    finally:
        d.stop()


def test_peercred_allow_list_refuses_and_counts(tmp_path):
    d = DaemonProcess(tmp_path, "d", metrics_port=0, extra=["--allowed-uid", "4242", "--socket-mode", "0666"])
    try:
        with pytest.raises(DaemonError, match=f"forbidden: uid {os.getuid()} may not use this daemon"):
            Client(d.socket)
        log = Path(d.log.name).read_text()
        assert "refused engine connection from uid" in log
    finally:
        d.stop()


def test_world_writable_socket_directory_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(DemoError, match="exited"):
        DaemonProcess(open_dir, "d")
    assert "world-writable" in (open_dir / "d.log").read_text()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from kvxferd.handshake import generate_keys

    base = tmp_path_factory.mktemp("keys")
    cluster_keys = base / "cluster"
    generate_keys(str(cluster_keys), "kvxferd")
    stranger = base / "stranger"
    generate_keys(str(stranger), "stranger")
    return cluster_keys, stranger


def curve_args(directory: Path, name: str) -> list[str]:
    return ["--curve-secret-key", str(directory / f"{name}.key_secret"), "--curve-authorized-keys", str(directory),
            "--handshake-timeout", "1"]


def test_curve_side_channel_transfers_and_refuses_strangers(keys):
    cluster_keys, stranger = keys
    with Cluster(SHAPE, 2, 2, daemon_args=curve_args(cluster_keys, "kvxferd")) as c:
        out = c.transfer(0, num_tokens=40)
        assert out["status"] == "received"
        assert c.status(0).side_channel_auth == "curve"
        # a daemon with another key, and one with none, are both refused by the prefill daemon
        for args in (curve_args(stranger, "stranger"), ["--handshake-timeout", "1"]):
            d = DaemonProcess(c.work, f"intruder-{len(args)}", extra=args)
            try:
                e = EngineProcess(d.socket, "decode-x", SHAPE, 2)
                try:
                    blocks = c.prefill.prefill(50 + len(args), 20, 1.0)
                    e.post_read(50 + len(args), 20, c.remote(50 + len(args)), blocks, 0, 5.0)
                    outcomes = e.wait_read(50 + len(args), 15)
                    assert all(o[0] == "failed" and "no handshake answer" in o[2] for o in outcomes), outcomes
                    c.prefill.wait_released(50 + len(args), 10)
                    c.prefill.free(blocks)
                finally:
                    e.close()
            finally:
                d.stop()
        assert c.status(0).counters.unauthenticated_peers >= 2
        assert c.transfer(1, num_tokens=40)["status"] == "received"
