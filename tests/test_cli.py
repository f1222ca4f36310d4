"""The command line as a user runs it: `kvxferd plan`, `kvxferd serve --config`, `kvxferd keys`."""

import json
import subprocess
import sys

import pytest

from kvxferd.config import ConfigError, load


def kvxferd(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "kvxferd", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("args,reads,notify_only", [
    (["--p-tp", "2", "--d-tp", "4"], [[0], [0], [1], [1]], [[], [], [], []]),
    (["--p-tp", "4", "--d-tp", "2"], [[0, 1], [2, 3]], [[], []]),
    (["--model", "mla", "--p-tp", "8", "--d-tp", "2"], [[0], [4]], [[1, 2, 3], [5, 6, 7]]),
    (["--model", "mamba2", "--p-tp", "4", "--d-tp", "2"], [[0, 1], [2, 3]], [[], []]),
    (["--model", "gemma4", "--p-tp", "2", "--d-tp", "4"], [[0], [0], [1], [1]], [[], [], [], []]),
])
def test_plan_json(args, reads, notify_only):
    doc = json.loads(kvxferd("plan", *args, "--json").stdout)
    assert doc["schema"] == 2
    assert [[p["remote_rank"] for p in r["peers"] if p["read"]] for r in doc["ranks"]] == reads
    assert [r["notify_only"] for r in doc["ranks"]] == notify_only
    for rank in doc["ranks"]:
        for peer in rank["peers"]:
            assert peer["read"] == bool(peer["pieces"])
            for piece in peer["pieces"]:
                assert piece["length"] > 0 and piece["local_offset"] >= 0 and piece["remote_offset"] >= 0


def test_plan_table_gemma4_shows_phases():
    out = kvxferd("plan", "--model", "gemma4", "--p-tp", "2", "--d-tp", "4", "--rank", "1").stdout
    assert "decode rank 1: targets [0]" in out
    assert "full(attention, 32->16 tok/block, chunk 16)" in out
    assert "1/2" in out  # full-attention pieces: one local phase, two remote ones per page


def test_plan_block_size_mismatch_and_file(tmp_path):
    out = json.loads(kvxferd("plan", "--p-block-size", "16", "--d-block-size", "32", "--p-tp", "1", "--d-tp", "1",
                             "--json").stdout)
    assert out["ranks"][0]["groups"][0]["chunk_tokens"] == 16
    f = tmp_path / "pair.toml"
    f.write_text('[prefill]\nkind = "dense"\nkv_heads = 4\ntp = 2\n[decode]\nkind = "dense"\nkv_heads = 4\ntp = 1\n')
    doc = json.loads(kvxferd("plan", "--file", str(f), "--json").stdout)
    assert doc["prefill"]["tp"] == 2 and len(doc["ranks"]) == 1 and len(doc["ranks"][0]["peers"]) == 2


def test_plan_refusals_name_the_case():
    nhd = kvxferd("plan", "--layout", "nhd", "--p-tp", "2", "--d-tp", "4", check=False)
    assert nhd.returncode == 2 and "NHD with heterogeneous TP is unsupported" in nhd.stderr
    odd = kvxferd("plan", "--p-tp", "3", "--d-tp", "2", check=False)
    assert odd.returncode == 2 and "TP sizes do not divide" in odd.stderr
    heads = kvxferd("plan", "--kv-heads", "6", "--d-tp", "4", check=False)
    assert heads.returncode == 2 and "6 units do not divide over TP 4" in heads.stderr


def test_config_precedence(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('socket_path = "/a.sock"\nside_channel_port = 7000\nmetrics_port = 9000\n[ucx]\nUCX_TLS = "tcp"\n')
    cfg = load(str(f), env={"KVXFERD_SIDE_CHANNEL_PORT": "7100", "KVXFERD_BACKENDS": "UCX,GDS"},
               metrics_port=9100)
    assert (cfg.socket_path, cfg.side_channel_port, cfg.metrics_port) == ("/a.sock", 7100, 9100)
    assert cfg.backends == ["UCX", "GDS"] and cfg.ucx == {"UCX_TLS": "tcp"}
    f.write_text('socket_pth = "/typo"\n')
    with pytest.raises(ConfigError, match="socket_pth"):
        load(str(f), env={})


def test_peer_lifecycle_settings_are_checked():
    cfg = load(env={})
    assert (cfg.peer_probe_interval_s, cfg.peer_dead_after_s, cfg.peer_idle_ttl_s) == (10.0, 30.0, 600.0)
    assert load(env={"KVXFERD_PEER_IDLE_TTL_S": "0"}).peer_idle_ttl_s == 0  # never evict idle peers
    for env, words in (({"KVXFERD_PEER_PROBE_INTERVAL_S": "0"}, "peer_probe_interval_s"),
                       ({"KVXFERD_PEER_DEAD_AFTER_S": "-1"}, "peer_dead_after_s"),
                       ({"KVXFERD_PEER_IDLE_TTL_S": "-5"}, "peer_idle_ttl_s"),
                       ({"KVXFERD_PEER_DEAD_AFTER_S": "10"}, "must exceed peer_probe_interval_s")):
        with pytest.raises(ConfigError, match=words):
            load(env=env)


def test_serve_from_config_file(tmp_path):
    from kvxferd.client import Client
    from kvxferd.lab.synthetic.demo import DaemonProcess

    sock = tmp_path / "s" / "k.sock"
    conf = tmp_path / "k.toml"
    conf.write_text(f'socket_path = "{sock}"\nside_channel_port = 0\nmetrics_port = -1\n')
    d = DaemonProcess(tmp_path, "d", socket=str(sock), extra=["--config", str(conf)])
    try:
        with Client(str(sock)) as c:
            assert c.daemon.startswith("kvxferd")
        out = kvxferd("status", "--socket", str(sock), "--json").stdout
        assert json.loads(out)["socket"] == str(sock)
    finally:
        d.stop()


def test_keys_generate(tmp_path):
    out = kvxferd("keys", "generate", str(tmp_path / "keys")).stdout
    assert "kvxferd.key_secret" in out
    secret = tmp_path / "keys" / "kvxferd.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert "curve" in secret.read_text()
