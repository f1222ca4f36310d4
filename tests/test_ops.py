"""Operations artifacts, each checked by the real tool that would reject it: promtool, a real
Prometheus server scraping real daemons, systemd-analyze, Helm, kubernetes-validate, hadolint."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

import msgspec
import pytest
import yaml
from podsim import image, unavailable
from podsim import run as run_pod

from kvxferd import protocol as P
from kvxferd.client import RemoteRef
from kvxferd.lab.synthetic.demo import Cluster
from kvxferd.plan.models import PRESETS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SHAPE = msgspec.structs.replace(PRESETS["dense"], num_blocks=128, layers=2)


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (scripts/test.sh installs it)"
    return path


def fetch(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def cluster():
    """Two daemons with exporters and JSON logs, under a workload with a failure and an expiry."""
    with Cluster(SHAPE, 2, 4, metrics=True, daemon_args=["--log-format", "json"]) as c:
        for seq in range(6):
            assert c.transfer(seq, num_tokens=20 + 13 * seq, hit_tokens=16 * (seq % 2))["status"] == "received"
        bad = RemoteRef("missing-engine", c.host, c.port, 2, "req-x")
        out = c.decode.decode(99, 20, bad, [[0, 1]], 0, 5.0, SHAPE)
        assert out["status"] == "failed"
        from kvxferd import protocol as P
        from kvxferd.client import Client, DaemonError
        with Client(c.daemons[0].socket) as rpc, pytest.raises(DaemonError, match="unknown_engine"):
            rpc.call(P.Hold("no-such-engine", 0, "r", 1.0), P.Ok)
        blocks = c.prefill.prefill(98, 20, 0.2)
        assert c.prefill.wait_released(98, 10) == ["expired", "expired"]
        c.prefill.free(blocks)
        yield c


def metrics_url(c: Cluster, which: int) -> str:
    return f"http://{c.status(which).metrics}"


def test_metrics_pass_promtool_and_cover_peers(cluster):
    for which in (0, 1):
        status, body = fetch(metrics_url(cluster, which) + "/metrics")
        assert status == 200
        check = subprocess.run([tool("promtool"), "check", "metrics"], input=body, capture_output=True)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check
    text = fetch(metrics_url(cluster, 1) + "/metrics")[1].decode()
    # per decode rank: 6 prompts x 4 ranks
    assert 'kvxferd_transfers_total{lane="nixl",outcome="received",peer="prefill"} 24.0' in text
    assert 'kvxferd_transfer_failures_total{peer="missing-engine",reason="handshake"} 4.0' in text
    p_text = fetch(metrics_url(cluster, 0) + "/metrics")[1].decode()
    assert 'kvxferd_holds_total{outcome="expired"} 2.0' in p_text
    assert 'kvxferd_holds_total{outcome="sent"} 12.0' in p_text


def test_health_endpoints(cluster):
    base = metrics_url(cluster, 0)
    assert fetch(base + "/healthz") == (200, b"ok\n")
    assert fetch(base + "/readyz") == (200, b"ready\n")
    assert fetch(base + "/nope")[0] == 404


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "kvxferd.json").read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", "20s").replace("$__range", "5m")
                    .replace('"$peer"', '".*"'))
            out.append((panel["title"], expr))
    return out


def test_prometheus_scrapes_daemons_and_every_panel_returns_data(cluster, tmp_path):
    targets = [cluster.status(i).metrics for i in (0, 1)]
    port = _free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "scrape_configs": [{"job_name": "kvxferd", "static_configs": [{"targets": targets}]}],
    }))
    prom = subprocess.Popen([tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # keep a little traffic flowing while samples accumulate
            cluster.transfer(int(time.monotonic() * 1000) % 100000 + 1000, num_tokens=33)
            try:
                status, body = fetch(f"{api}/query?query=" + urllib.parse.quote("count(up == 1)"), 2)
                if status == 200 and json.loads(body)["data"]["result"] and \
                        json.loads(body)["data"]["result"][0]["value"][1] == "2" and \
                        time.monotonic() > deadline - 50:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        time.sleep(3)
        empty = []
        for title, expr in _dashboard_queries():
            status, body = fetch(f"{api}/query?query=" + urllib.parse.quote(expr))
            reply = json.loads(body)
            assert status == 200 and reply["status"] == "success", (title, expr, reply)
            if not reply["data"]["result"]:
                empty.append(title)
        assert not empty, f"panels with no data: {empty}"
        status, body = fetch(f"{api}/rules")
        assert {r["name"] for g in json.loads(body)["data"]["groups"] for r in g["rules"]} >= {
            "KvxferdDown", "KvxferdTransferFailureRatio", "KvxferdLeaseExpirations"}
    finally:
        prom.terminate()
        prom.wait(10)


def test_alert_rules_check_and_unit_tests():
    rules = subprocess.run([tool("promtool"), "check", "rules", "alerts.yml"], cwd=DEPLOY / "prometheus",
                           capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    tests = subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=DEPLOY / "prometheus",
                           capture_output=True, text=True)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
    scrape = subprocess.run([tool("promtool"), "check", "config", "--syntax-only", "scrape.yml"],
                            cwd=DEPLOY / "prometheus", capture_output=True, text=True)
    assert scrape.returncode == 0, scrape.stdout + scrape.stderr


def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "kvxferd.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit
    # verify checks that ExecStart exists: point it at this machine's installed kvxferd
    local = tmp_path / "kvxferd.service"
    local.write_text(unit.replace("/usr/local/bin/kvxferd", tool("kvxferd")))
    verify = subprocess.run([tool("systemd-analyze"), "verify", str(local)], capture_output=True, text=True)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    security = subprocess.run([tool("systemd-analyze"), "security", "--offline=yes",
                               str(DEPLOY / "systemd" / "kvxferd.service")], capture_output=True, text=True)
    assert "Overall exposure level for kvxferd.service" in security.stdout
    level = float(security.stdout.split("Overall exposure level for kvxferd.service:")[1].split()[0])
    assert level <= 2.0, security.stdout[-500:]


def test_sd_notify_ready_and_watchdog(tmp_path):
    """The daemon tells systemd READY=1 once its socket and side channel are up, then pings the watchdog."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    proc = subprocess.Popen([sys.executable, "-m", "kvxferd", "serve", "--socket", str(tmp_path / "k.sock"),
                             "--side-channel-port", "0", "--metrics-port", "-1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = sock.recv(4096).decode()
        assert first.startswith("READY=1") and (tmp_path / "k.sock").exists()
        assert sock.recv(4096).decode() == "WATCHDOG=1"
        assert sock.recv(4096).decode() == "WATCHDOG=1"
        proc.terminate()
        assert sock.recv(4096).decode() == "STOPPING=1"
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        sock.close()


def _render(values: dict) -> dict[str, list[dict]]:
    import helm_python as helm

    with helm.Chart.load(str(ROOT / "helm" / "kvxferd")) as chart:
        rendered = chart.render(values, name="kx", namespace="inference")
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in rendered.items()}


CURVE = {"curve": {"existingSecret": "kvxferd-curve"}}


def _validate(docs: dict[str, list[dict]]) -> None:
    """Every manifest, strictly, against the newest Kubernetes schema kubernetes-validate has."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for ds in docs.values():
        for d in ds:
            if d["kind"] == "ServiceMonitor":  # a CRD: no schema offline, check its shape
                assert (d["apiVersion"] == "monitoring.coreos.com/v1"
                        and d["spec"]["endpoints"][0]["port"] == "metrics")
                continue
            kubernetes_validate.validate(d, version, strict=True)


def _pod(docs: dict[str, list[dict]]) -> dict:
    return next(d for ds in docs.values() for d in ds if d["kind"] in ("DaemonSet", "Deployment"))["spec"]["template"]


def _kvxferd_env(docs: dict[str, list[dict]]) -> dict[str, str]:
    kvx = next(c for c in _pod(docs)["spec"]["containers"] if c["name"] == "kvxferd")
    return {e["name"]: e.get("value", "(from)") for e in kvx["env"]}


def test_helm_chart_lints_and_renders_valid_manifests():
    import helm_python as helm

    for values in ({}, CURVE):
        lint = helm.lint(str(ROOT / "helm" / "kvxferd"), values)
        assert not lint["errors"] and all(m["severity"] < 2 for m in lint["messages"]), lint
    for mode in ("daemonset", "sidecar"):
        docs = _render({"mode": mode, "serviceMonitor": {"enabled": True}, "dashboard": {"enabled": True},
                        "config": {"allowedUids": [1000], "ucx": {"UCX_TLS": "rc,cuda_copy"}, "metricsHost": "0.0.0.0"},
                        **CURVE})
        kinds = {d["kind"] for ds in docs.values() for d in ds}
        workload = "DaemonSet" if mode == "daemonset" else "Deployment"
        assert {workload, "ConfigMap", "Service", "ServiceMonitor"} <= kinds
        _validate(docs)
        config = next(d for d in docs["kvxferd/templates/configmap.yaml"])
        parsed = tomllib.loads(config["data"]["kvxferd.toml"])
        from kvxferd.config import load
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(config["data"]["kvxferd.toml"])
            f.flush()
            cfg = load(f.name, env={})
        assert (cfg.allowed_uids == [1000] and cfg.ucx == {"UCX_TLS": "rc,cuda_copy"}
                and parsed["side_channel_port"] == 5600)
        pod = next(d for d in docs[f"kvxferd/templates/{'daemonset' if mode == 'daemonset' else 'sidecar'}.yaml"])
        spec = pod["spec"]["template"]["spec"]
        assert not spec.get("hostIPC") and not spec.get("shareProcessNamespace")  # nothing of the host's IPC
        if mode == "sidecar":
            names = [c["name"] for c in spec["containers"]]
            assert names == ["inference", "kvxferd"]
            mounts = {c["name"]: [m["mountPath"] for m in c["volumeMounts"]] for c in spec["containers"]}
            assert "/run/kvxferd" in mounts["inference"] and "/run/kvxferd" in mounts["kvxferd"]
        # the Curve Secret, mounted where the environment says the keys are
        assert {"name": "curve", "secret": {"secretName": "kvxferd-curve", "defaultMode": 0o440}} in spec["volumes"]
        kvx = next(c for c in spec["containers"] if c["name"] == "kvxferd")
        assert {"name": "curve", "mountPath": "/etc/kvxferd/curve", "readOnly": True} in kvx["volumeMounts"]
        env = _kvxferd_env(docs)
        assert env["KVXFERD_CURVE_SECRET_KEY_FILE"] == "/etc/kvxferd/curve/kvxferd.key_secret"
        assert env["KVXFERD_CURVE_AUTHORIZED_KEYS_DIR"] == "/etc/kvxferd/curve"
        assert env["KVXFERD_SIDE_CHANNEL_HOST"] == "0.0.0.0" and env["KVXFERD_SIDE_CHANNEL_INSECURE"] == "false"
        assert env["KVXFERD_METRICS_HOST"] == "0.0.0.0"  # asked for, with the ServiceMonitor
        probe = kvx["readinessProbe"]["exec"]["command"]
        assert "http://127.0.0.1:9410/readyz" in probe[-1] and "httpGet" not in kvx["livenessProbe"]
    # the defaults keep the metrics on the node; a ServiceMonitor must ask for them beyond it
    default = _render(CURVE)
    assert _kvxferd_env(default)["KVXFERD_METRICS_HOST"] == "127.0.0.1"
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        with pytest.raises(helm.HelmRenderError, match=r"serviceMonitor\.enabled needs the metrics beyond loopback"):
            _render({"serviceMonitor": {"enabled": True}, "config": {"metricsHost": loopback}, **CURVE})
    for host, url in (("::", "http://[::1]:9410"), ("fd00::7", "http://[fd00::7]:9410"), ("10.0.0.7", "http://10.0.0.7:9410")):
        probe = _pod(_render({"config": {"metricsHost": host}, **CURVE}))["spec"]["containers"][0]["readinessProbe"]
        assert f"{url}/readyz" in probe["exec"]["command"][-1], probe
    # per-node keys from the node: the authorized directory beside the key
    per_node = _render({"curve": {"hostPath": "/etc/kvxferd/curve"}})
    _validate(per_node)
    spec = _pod(per_node)["spec"]
    assert {"name": "curve", "hostPath": {"path": "/etc/kvxferd/curve", "type": "Directory"}} in spec["volumes"]
    env = _kvxferd_env(per_node)
    assert env["KVXFERD_CURVE_SECRET_KEY_FILE"] == "/etc/kvxferd/curve/kvxferd.key_secret"
    assert env["KVXFERD_CURVE_AUTHORIZED_KEYS_DIR"] == "/etc/kvxferd/curve/authorized"
    asked = next(d for d in _render({"hostIPC": True, **CURVE})["kvxferd/templates/daemonset.yaml"])
    assert asked["spec"]["template"]["spec"]["hostIPC"] is True  # for engines with legacy CUDA IPC handles
    dashboard = next(d for d in _render({"dashboard": {"enabled": True}, **CURVE})["kvxferd/templates/dashboard.yaml"])
    assert json.loads(dashboard["data"]["kvxferd.json"]) == json.loads(
        (DEPLOY / "grafana" / "kvxferd.json").read_text())


def test_helm_chart_refuses_to_render_an_open_side_channel():
    """No Curve Secret: the render fails, saying how to make one; an explicit insecure setting or a
    loopback side channel renders without keys (and the daemon's own check agrees)."""
    import helm_python as helm

    from kvxferd.config import ConfigError, check_side_channel, load

    for mode in ("daemonset", "sidecar"):
        with pytest.raises(helm.HelmRenderError) as err:
            _render({"mode": mode})
        message = str(err.value)
        for words in ("curve.existingSecret (or curve.hostPath) is required", "side channel listens on 0.0.0.0:5600",
                      "--set curve.hostPath=/etc/kvxferd/curve",
                      "kvxferd keys generate ./kvxferd-curve --name kvxferd",
                      "kubectl -n inference create secret generic kvxferd-curve --from-file=./kvxferd-curve",
                      "--set curve.existingSecret=kvxferd-curve", "--set config.sideChannelInsecure=true"):
            assert words in message, message
        for values, insecure in (({"config": {"sideChannelInsecure": True}}, True),
                                 ({"config": {"sideChannelHost": "127.0.0.1"}}, False)):
            docs = _render({"mode": mode, **values})
            _validate(docs)
            spec = _pod(docs)["spec"]
            assert not any(v["name"] == "curve" for v in spec["volumes"])
            env = {k: v for k, v in _kvxferd_env(docs).items() if v != "(from)"}
            assert env["KVXFERD_CURVE_SECRET_KEY_FILE"] == "" and env["KVXFERD_CURVE_AUTHORIZED_KEYS_DIR"] == ""
            assert env["KVXFERD_SIDE_CHANNEL_INSECURE"] == str(insecure).lower()
            # the image's environment overridden by the container's: what the daemon checks at start
            cfg = load(env={**image()["env"], **env})
            if insecure:
                assert "side_channel_insecure = true" in (check_side_channel(cfg) or "")
            else:
                assert check_side_channel(cfg) is None
            with pytest.raises(ConfigError, match="refusing to serve the side channel"):
                check_side_channel(load(env={**image()["env"], **env, "KVXFERD_SIDE_CHANNEL_INSECURE": "false",
                                             "KVXFERD_SIDE_CHANNEL_HOST": "0.0.0.0"}))


def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_and_toml_bind_beyond_loopback_only_with_keys():
    from kvxferd.config import check_curve_files, check_side_channel, load

    for cfg, authorized in ((load(env=image()["env"]), ""),
                            (load(str(DEPLOY / "kvxferd.toml"), env={}), "/etc/kvxferd/curve/authorized")):
        assert cfg.side_channel_host == "0.0.0.0" and not cfg.side_channel_insecure
        assert cfg.metrics_host == "127.0.0.1"  # not beyond the node unless the operator asks
        assert cfg.curve_secret_key_file == "/etc/kvxferd/curve/kvxferd.key_secret"
        assert cfg.curve_authorized_keys_dir == authorized  # "": `authorized` beside the key, if there
        assert check_side_channel(cfg) is None
        with pytest.raises(ValueError, match="does not exist: create them with `kvxferd keys generate"):
            check_curve_files(cfg)  # no keys on this machine there: the start fails by name


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """`kvxferd keys generate` as docs/deploy.md says: the cluster's keypair, and a stranger's."""
    base = tmp_path_factory.mktemp("keys")
    for d, name in (("curve", "kvxferd"), ("stranger", "stranger")):
        subprocess.run([sys.executable, "-m", "kvxferd", "keys", "generate", str(base / d), "--name", name],
                       check=True, capture_output=True)
    return base / "curve", base / "stranger"


def _key_files(directory: Path, to: str, uid: int, gid: int, secret_mode: str) -> list[dict]:
    return [{"path": f"{to}/{f.relative_to(directory)}", "text": f.read_text(), "uid": uid, "gid": gid,
             "mode": secret_mode if f.name.endswith("_secret") else "0644"}
            for f in sorted(directory.rglob("*")) if f.is_file()]


def _probes(keys) -> tuple[list[dict], list[dict]]:
    """Side-channel probes from another process: the deployment's keys, none, a stranger's."""
    base = {"engine": "engine", "host": "127.0.0.1", "port": 5600}
    return _key_files(keys[1], "/run/stranger", 0, 0, "0600"), [
        {**base, "label": "keys", "secret": "/etc/kvxferd/curve/kvxferd.key_secret"},
        {**base, "label": "none"},
        {**base, "label": "stranger", "secret": "/run/stranger/stranger.key_secret",
         "server_key": "/etc/kvxferd/curve/kvxferd.key"}]


def _assert_serves_with_keys_only(report: dict) -> None:
    assert report["daemon"]["up"], report["daemon"]["log"]
    assert report["engines"]["engine"]["ok"], report["engines"]
    hs = report["handshakes"]
    assert hs["keys"] == {"ok": True, "ranks": 1}, hs
    assert hs["none"]["reason"] == "timeout" and hs["stranger"]["reason"] == "timeout", hs
    assert report["status"]["side_channel_auth"] == "curve" and report["status"]["unauthenticated_peers"] >= 2
    assert report["readyz"] == 200  # the image's HEALTHCHECK, the chart's readinessProbe
    assert report["daemon"]["returncode"] == 0 and not report["daemon"]["socket_left"]


needs_pods = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")


@needs_pods
@pytest.mark.parametrize("mounted", [True, False])
def test_image_runs_as_configured_with_mounted_keys(tmp_path, keys, mounted):
    """The image as `docker run` starts it (docs/deploy.md): its ENV, USER and CMD, /run/kvxferd as
    its RUN makes it, keys mounted at /etc/kvxferd/curve owned by uid 10001, its own network
    namespace. The side channel (0.0.0.0:5600) answers the keys' holder only. Without the keys
    mounted the daemon does not start, and says which file is missing."""
    img = image()
    assert "chown kvxferd:kvxferd /run/kvxferd" in img["run"][0] and "chmod 0750 /run/kvxferd" in img["run"][0]
    uid, gid = (int(x) for x in img["user"].split(":"))
    files, probes = _probes(keys)
    if mounted:
        files += _key_files(keys[0], "/etc/kvxferd/curve", uid, gid, "0600")
    spec = {"stage": str(tmp_path / "stage"), "groups": [["kvxferd", gid]], "users": [["kvxferd", uid, gid]],
            "dirs": [{"path": "/run/kvxferd", "mode": "0750", "uid": uid, "gid": gid}], "files": files,
            "daemon": {"argv": img["cmd"], "env": img["env"], "uid": uid, "gid": gid,
                       "socket": img["env"]["KVXFERD_SOCKET_PATH"]},
            "engines": [{"name": "engine", "env": {"KVXFERD_SOCKET_PATH": img["env"]["KVXFERD_SOCKET_PATH"]}}],
            "handshakes": probes, "readyz": "http://127.0.0.1:9410/readyz"}
    report = run_pod(spec, tmp_path)
    if mounted:
        _assert_serves_with_keys_only(report)
    else:
        assert not report["daemon"]["up"]
        assert ("kvxferd: curve_secret_key_file /etc/kvxferd/curve/kvxferd.key_secret does not exist"
                in report["daemon"]["log"]), report["daemon"]["log"]


def _documented_systemd_steps() -> list[str]:
    """The shell lines of docs/deploy.md's systemd block that set up this host (those that
    install packages or talk to systemd are what the unit's own tests cover)."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    block = doc[doc.index("## systemd"):]
    block = block[block.index("```\n") + 4:]
    lines = [line.split("  #")[0].strip() for line in block[:block.index("```")].splitlines()]
    skipped = ("pip ", "systemctl ", "install -m 0644 deploy/systemd")
    return [line for line in lines if line and not line.startswith(skipped)]


@needs_pods
def test_systemd_service_runs_as_documented_with_keys(tmp_path, keys):
    """docs/deploy.md's systemd steps, run as written (an engine user made first), then the daemon
    as deploy/systemd/kvxferd.service runs it (its user, its RuntimeDirectory) with
    deploy/kvxferd.toml. The daemon reads its own key and starts; an engine user in the kvxferd
    group registers (the socket is the group's) and cannot read the secret key; the side channel
    answers the key's holder only."""
    unit = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / "kvxferd.service").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    assert unit["User"] == unit["Group"] == unit["RuntimeDirectory"] == "kvxferd"
    exe, *argv = unit["ExecStart"].split()
    assert exe.endswith("/kvxferd") and argv == ["serve", "--config", "/etc/kvxferd/kvxferd.toml"]
    cfg = tomllib.loads((DEPLOY / "kvxferd.toml").read_text())
    steps = _documented_systemd_steps()
    assert any(s.startswith("kvxferd keys generate /etc/kvxferd/curve --owner kvxferd") for s in steps), steps
    kvxferd = f"{sys.executable} -m kvxferd"
    shell = [f"cd {ROOT} && " + step.replace("<engine user>", "engine").replace("kvxferd keys", f"{kvxferd} keys")
             for step in ["useradd --user-group engine", *steps]]
    files, probes = _probes(keys)
    spec = {"stage": str(tmp_path / "stage"), "files": files,
            "init": [{"argv": ["sh", "-c", line]} for line in shell]  # as root, as the docs' steps are
            + [{"argv": ["install", "-d", "-o", "kvxferd", "-g", "kvxferd", "-m", unit["RuntimeDirectoryMode"],
                         "/run/kvxferd"]}],  # what RuntimeDirectory= makes
            "daemon": {"argv": argv, "env": {}, "user": "kvxferd", "group": "kvxferd", "socket": cfg["socket_path"]},
            "engines": [{"name": "engine", "user": "engine", "group": "kvxferd",
                         "env": {"KVXFERD_SOCKET_PATH": cfg["socket_path"]}}],
            "after": [{"user": "engine", "group": "kvxferd", "argv": ["cat", cfg["curve_secret_key_file"]]},
                      {"user": "engine", "group": "kvxferd", "argv": ["ls", "/etc/kvxferd/curve"]}],
            "handshakes": probes, "readyz": f"http://127.0.0.1:{cfg['metrics_port']}/readyz"}
    report = run_pod(spec, tmp_path)
    assert all(i["returncode"] == 0 for i in report["init"]), report["init"]
    _assert_serves_with_keys_only(report)
    secret, listing = report["after"]
    assert secret["returncode"] != 0 and "Permission denied" in secret["stderr"], secret
    assert listing["returncode"] != 0 and "Permission denied" in listing["stderr"], listing
    assert report["socket"]["mode"] == "0660"


def test_status_cli_tables_json_and_no_daemon(cluster, tmp_path):
    sock = cluster.daemons[1].socket
    text = subprocess.run([tool("kvxferd"), "status", "--socket", sock], capture_output=True, text=True)
    assert text.returncode == 0
    assert "engines" in text.stdout and "decode" in text.stdout and "prefill" in text.stdout  # engine + peer
    assert "missing-engine" in text.stdout  # the recent failure, with its reason
    js = subprocess.run([tool("kvxferd"), "status", "--socket", sock, "--json"], capture_output=True, text=True)
    st = msgspec.json.decode(js.stdout, type=P.Status)  # the JSON is the typed reply, field for field
    assert len(st.engines) == 4 and st.peers[0].engine == "prefill" and st.counters.received >= 6
    none = subprocess.run([tool("kvxferd"), "status", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True)
    assert none.returncode == 2 and "no kvxferd daemon at" in none.stderr and "kvxferd serve" in none.stderr


def test_failures_are_one_json_log_line(cluster):
    log = Path(cluster.daemons[1].log.name).read_text().splitlines()
    entries = [json.loads(line) for line in log if line.startswith("{")]
    failures = [e for e in entries if e.get("request") == "d-99"]
    assert sorted(f["rank"] for f in failures) == [0, 1, 2, 3]  # one line per failed rank request
    for f in failures:
        assert f["level"] == "warning" and f["peer"] == "missing-engine" and "not registered" in f["reason"]
