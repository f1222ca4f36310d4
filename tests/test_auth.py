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
from kvxferd.identity import load_curve
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
    from kvxferd.identity import generate_keys

    base = tmp_path_factory.mktemp("keys")
    cluster_keys = base / "cluster"
    generate_keys(str(cluster_keys), "kvxferd")
    stranger = base / "stranger"
    generate_keys(str(stranger), "stranger")
    (stranger / "cluster.key").write_text((cluster_keys / "kvxferd.key").read_text())  # it trusts the cluster
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


# --- the side channel beyond loopback needs keys (config.check_side_channel) -------------------

def side_cfg(host: str, **over):
    from kvxferd.config import load

    return load(env={}, side_channel_host=host, **over)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"])
def test_loopback_side_channel_needs_no_keys(host):
    from kvxferd.config import check_side_channel

    assert check_side_channel(side_cfg(host)) is None


NETWORK_HOSTS = ["0.0.0.0", "::", "*", "10.1.2.3", "192.168.0.5", "fe80::1", "eth0", "node1.example", "::ffff:10.0.0.1"]


@pytest.mark.parametrize("host", NETWORK_HOSTS)
def test_network_side_channel_without_keys_is_refused_saying_what_to_do(host):
    from kvxferd.config import ConfigError, check_side_channel

    with pytest.raises(ConfigError) as err:
        check_side_channel(side_cfg(host, side_channel_port=5600))
    message = str(err.value)
    assert f"on {host}:5600 without CurveZMQ keys" in message
    for remedy in ("kvxferd keys generate", "curve_secret_key_file", "KVXFERD_CURVE_SECRET_KEY_FILE",
                   'side_channel_host = "127.0.0.1"', "side_channel_insecure = true",
                   "KVXFERD_SIDE_CHANNEL_INSECURE=1", "--side-channel-insecure"):
        assert remedy in message


@pytest.mark.parametrize("host", NETWORK_HOSTS)
def test_network_side_channel_with_keys_or_explicitly_insecure(host):
    from kvxferd.config import check_side_channel

    assert check_side_channel(side_cfg(host, curve_secret_key_file="/k/kvxferd.key_secret")) is None
    warning = check_side_channel(side_cfg(host, side_channel_insecure=True))
    assert warning is not None and "without CurveZMQ keys (side_channel_insecure = true)" in warning


def test_insecure_flag_from_environment_and_file(tmp_path):
    from kvxferd.config import load

    assert load(env={}).side_channel_insecure is False
    for value, expected in (("1", True), ("true", True), ("0", False), ("false", False)):
        assert load(env={"KVXFERD_SIDE_CHANNEL_INSECURE": value}).side_channel_insecure is expected
    f = tmp_path / "k.toml"
    f.write_text("side_channel_insecure = true\n")
    assert load(str(f), env={}).side_channel_insecure is True


def test_missing_curve_files_are_named(tmp_path, keys):
    from kvxferd.config import ConfigError, check_curve_files

    cluster_keys, _ = keys
    check_curve_files(side_cfg("0.0.0.0", curve_secret_key_file=str(cluster_keys / "kvxferd.key_secret")))
    with pytest.raises(ConfigError, match=f"curve_secret_key_file {tmp_path}/none.key_secret does not exist: "
                                          "create them with `kvxferd keys generate"):
        check_curve_files(side_cfg("0.0.0.0", curve_secret_key_file=str(tmp_path / "none.key_secret")))
    with pytest.raises(ConfigError, match=f"curve_authorized_keys_dir {tmp_path}/nowhere does not exist"):
        check_curve_files(side_cfg("0.0.0.0", curve_secret_key_file=str(cluster_keys / "kvxferd.key_secret"),
                                   curve_authorized_keys_dir=str(tmp_path / "nowhere")))


def serve(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--socket", str(tmp_path / "k.sock"),
                           "--side-channel-port", "0", "--metrics-port", "-1", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_serve_refuses_network_side_channel_without_keys(tmp_path):
    for args, env in ((["--side-channel-host", "0.0.0.0"], None),
                      ([], {**os.environ, "KVXFERD_SIDE_CHANNEL_HOST": "::"})):
        out = serve(tmp_path, *args, env=env)
        assert out.returncode == 2, out
        assert "kvxferd: refusing to serve the side channel on" in out.stderr and "kvxferd keys generate" in out.stderr
        assert not (tmp_path / "k.sock").exists()  # refused before anything started


def test_serve_with_missing_key_file_says_so(tmp_path):
    out = serve(tmp_path, "--side-channel-host", "0.0.0.0", "--curve-secret-key", str(tmp_path / "k.key_secret"))
    assert out.returncode == 2 and f"curve_secret_key_file {tmp_path}/k.key_secret does not exist" in out.stderr


def test_serve_insecure_side_channel_starts_and_warns(tmp_path):
    d = DaemonProcess(tmp_path, "d", extra=["--side-channel-host", "0.0.0.0", "--side-channel-insecure"])
    try:
        with Client(d.socket) as c:
            st = c.status()
        assert st.side_channel_auth == "none" and st.side_channel.startswith("0.0.0.0:")
        log = Path(d.log.name).read_text()
        assert "WARNING" in log.upper() and "without CurveZMQ keys (side_channel_insecure = true)" in log
    finally:
        d.stop()


def test_network_side_channel_with_keys_refuses_a_peer_without(tmp_path, keys):
    """Bound on every address with keys: a peer with the keys gets its answer, one without none."""
    import asyncio

    import zmq.asyncio

    from kvxferd import handshake as hs

    cluster_keys, _ = keys
    d = DaemonProcess(tmp_path, "d", extra=["--side-channel-host", "0.0.0.0", *curve_args(cluster_keys, "kvxferd")])
    try:
        with Client(d.socket) as c:
            port = int(c.status().side_channel.rsplit(":", 1)[1])

        async def ask(curve) -> str:
            ctx = zmq.asyncio.Context()
            try:
                await hs.request(ctx, "127.0.0.1", port, "nobody", 1.0, "probe", curve)
                return "answered"
            except hs.HandshakeError as exc:
                return exc.reason
            finally:
                ctx.destroy(0)

        secret = str(cluster_keys / "kvxferd.key_secret")
        assert asyncio.run(ask(load_curve(secret, str(cluster_keys)))) == "refused"  # answered: unknown engine
        assert asyncio.run(ask(None)) == "timeout"
        with Client(d.socket) as c:
            assert c.status().counters.unauthenticated_peers >= 1
    finally:
        d.stop()
