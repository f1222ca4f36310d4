"""Run a shipped deployment's kvxferd for real on this machine: a pod, a container or a systemd
service, as processes in private mount and network namespaces.

The caller (`run(spec)`) describes what the deployment sets up and this script, run under
`unshare --mount --net`, does it: users and groups (written to an overlay over /etc), volumes
(a tmpfs per emptyDir, with its mode and fsGroup; plain host directories), files (ConfigMap and
Secret contents with their modes), init containers (as root with only the capabilities given), the
daemon (its argv and environment, as its uid/gid/supplementary groups), then engines registering
(each as its own uid), side-channel handshakes with or without keys, the daemon's status and
/readyz. The paths are the deployment's own (/run/kvxferd, /etc/kvxferd/...): nothing outside the
namespaces changes. One JSON object on the last line of stdout reports what happened.

Needs root, unshare(1), setpriv(1) and overlayfs (`unavailable()` says what is missing).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def unavailable() -> str:
    """Why pods cannot be simulated here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("unshare", "setpriv", "mount", "ip"):
        if not shutil.which(tool):
            return f"needs {tool}"
    probe = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /mnt && mkdir /mnt/u /mnt/w && mount -t overlay overlay "
                            "-o lowerdir=/etc,upperdir=/mnt/u,workdir=/mnt/w /etc"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"namespaces or overlayfs unavailable: {probe.stderr.strip()}"


def run(spec: dict[str, Any], workdir: Path, timeout: float = 300) -> dict[str, Any]:
    """Run `spec` in fresh namespaces; the report (see `main`)."""
    path = workdir / "pod.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", sys.executable, __file__,
                           str(path)], capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"pod simulation failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return dict(json.loads(lines[-1]))


# --- what the deployments say (read outside the namespaces) -----------------------------------

def image() -> dict[str, Any]:
    """The runtime stage of the Dockerfile: ENV, USER, ENTRYPOINT, CMD and its RUN commands."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stage = lines[max(i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")) + 1:]
    out: dict[str, Any] = {"env": {}, "run": []}
    for ln in stage:
        word, _, rest = ln.partition(" ")
        word = word.upper()
        if word == "ENV":
            out["env"].update(kv.split("=", 1) for kv in shlex.split(rest))
        elif word == "USER":
            out["user"] = rest.strip()
        elif word in ("ENTRYPOINT", "CMD"):
            out[word.lower()] = json.loads(rest)
        elif word == "RUN":
            out["run"].append(rest)
    return out


def render_chart(values: dict[str, Any], namespace: str = "inference") -> dict[str, list[dict[str, Any]]]:
    import helm_python as helm
    import yaml

    with helm.Chart.load(str(ROOT / "helm" / "kvxferd")) as chart:
        rendered = chart.render(values, name="kx", namespace=namespace)
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in rendered.items()}


def pod_from_chart(docs: dict[str, list[dict[str, Any]]], secret_dir: Path | None, engines: list[dict[str, Any]],
                   handshakes: list[dict[str, Any]], stage: Path) -> dict[str, Any]:
    """The spec that runs a rendered chart's pod: its volumes (emptyDir: a tmpfs, 0777, or 2777 and
    group fsGroup as the kubelet makes it; hostPath: a root directory, 0755, as DirectoryOrCreate
    makes it; ConfigMap and Secret files with their modes), its init containers, and the kvxferd
    container (image ENTRYPOINT + args, image ENV overridden by the container's, uid/gid and fsGroup).
    Engines get the environment of the container that mounts the socket volume beside kvxferd."""
    workload = next(d for ds in docs.values() for d in ds if d["kind"] in ("DaemonSet", "Deployment"))
    pod = workload["spec"]["template"]["spec"]
    config = next(d for ds in docs.values() for d in ds if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"] == workload["metadata"]["name"])
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    img = image()
    containers = {c["name"]: c for c in pod["containers"]}
    kvx = containers["kvxferd"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    dirs: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    mounted: dict[str, str] = {}
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        for m in c.get("volumeMounts", []):
            key = m["mountPath"]
            if key in mounted:
                assert mounted[key] == m["name"], f"{key}: two volumes"
                continue
            mounted[key] = m["name"]
            v = volumes[m["name"]]
            if "emptyDir" in v:
                dirs.append({"path": key, "tmpfs": True, "mode": "2777" if fs_group else "0777", "uid": 0,
                             "gid": fs_group or 0})
            elif "hostPath" in v:
                assert v["hostPath"]["type"] == "DirectoryOrCreate"
                dirs.append({"path": key, "mode": "0755"})
            elif "configMap" in v:
                assert v["configMap"]["name"] == config["metadata"]["name"]
                items = {m["subPath"]: key} if "subPath" in m else {k: f"{key}/{k}" for k in config["data"]}
                files += [{"path": p, "text": config["data"][k], "mode": "0644", "gid": fs_group or 0}
                          for k, p in items.items()]
            elif "secret" in v:
                assert secret_dir is not None, "the chart mounts a Secret"
                mode = f"{v['secret'].get('defaultMode', 0o644) | (0o440 if fs_group else 0):04o}"
                files += [{"path": f"{key}/{f.name}", "text": f.read_text(), "mode": mode, "gid": fs_group or 0}
                          for f in sorted(secret_dir.iterdir()) if f.is_file()]
            else:
                raise AssertionError(f"volume {v} not simulated")

    def env_of(c: dict[str, Any]) -> dict[str, str]:
        out = {}
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = e["value"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                out[e["name"]] = "127.0.0.1"  # the pod's address; here its network namespace has lo only
        return out

    def ids(c: dict[str, Any]) -> dict[str, Any]:
        sc = c.get("securityContext", {})
        out = {"uid": sc.get("runAsUser", 0), "gid": sc.get("runAsGroup", 0),
               "groups": [fs_group] if fs_group else []}
        if "capabilities" in sc:
            out["caps"] = [cap.lower() for cap in sc["capabilities"].get("add", [])]
        return out

    assert img["entrypoint"] == ["kvxferd"] and "command" not in kvx
    env = {**img["env"], **env_of(kvx)}
    engine_env = {}
    for c in pod["containers"]:
        if c["name"] != "kvxferd":
            engine_env = env_of(c)
    sc = pod.get("securityContext", {})
    return {
        "stage": str(stage), "groups": [["kvxferd", 10001]], "users": [["kvxferd", 10001, 10001]],
        "dirs": dirs, "files": files, "fs_group": sc.get("fsGroup"),
        "init": [{"argv": c["command"], **ids(c)} for c in pod.get("initContainers", [])],
        "daemon": {"argv": kvx.get("args", img["cmd"]), "env": env, **ids(kvx), "socket": env["KVXFERD_SOCKET_PATH"]},
        "engines": [{**e, "env": {"KVXFERD_SOCKET_PATH": env["KVXFERD_SOCKET_PATH"], **engine_env}} for e in engines],
        "handshakes": handshakes,
    }


# --- inside the namespaces ------------------------------------------------------------------

def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def isolate(stage: Path) -> None:
    """Private /etc (overlay), /run (tmpfs) and loopback; Python reachable by any uid."""
    stage.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(stage))
    (stage / "upper").mkdir()
    (stage / "work").mkdir()
    sh("mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/etc,upperdir={stage}/upper,workdir={stage}/work", "/etc")
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run")
    sh("ip", "link", "set", "lo", "up")
    _make_reachable(_TREES)


# what the pod's processes run: this Python (a virtual environment's and the one it was made from)
# and the repository (the editable install's code)
_TREES = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), ROOT}


def _mount_over(path: Path, *mount: str) -> None:
    """Run `mount` (a volume at `path`) without hiding the trees under it (a checkout in /tmp under
    the chart's /tmp emptyDir): each is held aside and moved back inside the volume."""
    holds = _hold([t for t in _TREES if path == t or path in t.parents])
    sh(*mount)
    _put_back(holds)


def _hold(trees: list[Path]) -> list[tuple[Path, Path]]:
    holds = []
    for tree in trees:
        hold = Path(tempfile.mkdtemp(dir="/run"))
        sh("mount", "--bind", str(tree), str(hold))
        holds.append((hold, tree))
    return holds


def _put_back(holds: list[tuple[Path, Path]]) -> None:
    for hold, tree in holds:
        tree.mkdir(parents=True, exist_ok=True)
        sh("mount", "--move", str(hold), str(tree))


def _make_reachable(trees: set[Path]) -> None:
    """Other uids must run this Python (a virtual environment's and the one it was made from) and
    read the repository: where an ancestor of some of them is closed to other uids (/root is
    0700), cover that ancestor with a 0755 tmpfs holding those trees alone. Every tree under one
    closed ancestor is moved into the same tmpfs: a tmpfs mounted for one tree would hide the
    others (a virtual environment in /root beside pyenv's Python)."""
    outermost = {t for t in trees if not any(o != t and o in t.parents for o in trees)}
    by_closed: dict[Path, list[Path]] = {}
    for tree in outermost:
        closed = next((a for a in reversed(tree.parents) if not os.stat(a).st_mode & stat.S_IXOTH), None)
        if closed is not None:
            by_closed.setdefault(closed, []).append(tree)
    for closed, held in by_closed.items():
        holds = _hold(held)
        sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(closed))
        _put_back(holds)


def setup(spec: dict[str, Any]) -> None:
    with open("/etc/group", "a") as f:
        for name, gid in spec.get("groups", []):
            f.write(f"{name}:x:{gid}:\n")
    with open("/etc/passwd", "a") as f:
        for name, uid, gid in spec.get("users", []):
            f.write(f"{name}:x:{uid}:{gid}::/nonexistent:/usr/sbin/nologin\n")
    for m in spec.get("dirs", []):
        path = Path(m["path"])
        path.mkdir(parents=True, exist_ok=True)
        if m.get("tmpfs"):  # an emptyDir: a volume of its own, mounted
            _mount_over(path, "mount", "-t", "tmpfs", "-o", f"mode={m['mode']},uid={m.get('uid', 0)},"
                        f"gid={m.get('gid', 0)}", "tmpfs", str(path))
        else:
            os.chown(path, m.get("uid", 0), m.get("gid", 0))
            os.chmod(path, int(m["mode"], 8))
    for f in spec.get("files", []):
        path = Path(f["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f["text"])
        os.chown(path, f.get("uid", 0), f.get("gid", 0))
        os.chmod(path, int(f.get("mode", "0644"), 8))


def named(p: dict[str, Any]) -> dict[str, Any]:
    """`p` with its "user" (a name an init command made: useradd) as uid and gid, its "group"
    (a group's name) as its primary gid, and that group's gid among its groups."""
    import grp
    import pwd

    p = dict(p)
    if "user" in p:
        user = pwd.getpwnam(p["user"])
        p["uid"], p["gid"] = user.pw_uid, user.pw_gid
    if "group" in p:
        p["gid"] = grp.getgrnam(p["group"]).gr_gid
        p["groups"] = [*p.get("groups", []), p["gid"]]
    return p


def as_user(p: dict[str, Any]) -> list[str]:
    """setpriv prefix: the process's uid, gid, supplementary groups, and capabilities if listed."""
    groups = ",".join(str(g) for g in p.get("groups", []))
    out = ["setpriv", f"--reuid={p.get('uid', 0)}", f"--regid={p.get('gid', 0)}",
           f"--groups={groups}" if groups else "--clear-groups"]
    if "caps" in p:
        caps = "".join(f",+{c}" for c in p["caps"])
        out += [f"--inh-caps=-all{caps}", f"--bounding-set=-all{caps}"]
    return [*out, "--"]


ENGINE = """
import json, os, sys
import msgspec
from kvxferd.lab.synthetic.engine import SyntheticEngine
from kvxferd.plan.models import PRESETS
shape = msgspec.structs.replace(PRESETS["dense"], num_blocks=16, layers=2)
try:
    eng = SyntheticEngine(os.environ["KVXFERD_SOCKET_PATH"], sys.argv[1], shape, 1, "cpu")
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(0)
print(json.dumps({"ok": True, "side_channel": eng.side_channel, "uid": os.getuid(), "groups": os.getgroups()}),
      flush=True)
sys.stdin.read()  # registered until the runner closes stdin
"""


def wait_up(proc: subprocess.Popen[bytes], socket: str, timeout: float = 90) -> bool:
    from kvxferd.client import Client, DaemonError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            Client(socket, 5).close()
            return True
        except DaemonError:  # it answered (and refused root): up
            return True
        except OSError:
            time.sleep(0.05)
    return False


async def handshake(h: dict[str, Any]) -> dict[str, Any]:
    import zmq
    import zmq.asyncio
    import zmq.auth

    from kvxferd import handshake as hs
    from kvxferd.identity import CurveKeys, fingerprint

    curve, requester = None, "podsim"
    if h.get("secret"):
        public, secret = zmq.auth.load_certificate(h["secret"])
        server = zmq.auth.load_certificate(h["server_key"])[0] if h.get("server_key") else public
        curve = CurveKeys(public, secret, server, os.path.dirname(h["secret"]))
        requester = f"podsim-{fingerprint(public)}"  # a keyed daemon answers only names it can attribute
    ctx = zmq.asyncio.Context()
    try:
        reply = await hs.request(ctx, h["host"], h["port"], h["engine"], h.get("timeout", 2.0), requester, curve)
        return {"ok": True, "ranks": len(reply.ranks)}
    except hs.HandshakeError as exc:
        return {"ok": False, "reason": exc.reason, "error": str(exc)}
    finally:
        ctx.destroy(0)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    log_path = Path(spec["stage"]).parent / "daemon.log"
    log = open(log_path, "w+")  # noqa: SIM115  (before a volume may cover its directory: /tmp)
    isolate(Path(spec["stage"]))
    setup(spec)
    report: dict[str, Any] = {"init": [], "engines": {}, "handshakes": {}}
    for init in spec.get("init", []):
        r = subprocess.run([*as_user(init), *init["argv"]], capture_output=True, text=True, cwd=init.get("cwd"))
        report["init"].append({"argv": init["argv"], "returncode": r.returncode, "stderr": r.stderr})
    d = named(spec["daemon"])
    spec["engines"] = [named(e) for e in spec.get("engines", [])]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/", **d.get("env", {})}
    daemon = subprocess.Popen([*as_user(d), sys.executable, "-m", "kvxferd", *d["argv"]], env=env,
                              stdout=log, stderr=subprocess.STDOUT, cwd="/")
    socket = d["socket"]
    up = wait_up(daemon, socket)
    report["daemon"] = {"up": up}
    engines: list[subprocess.Popen[str]] = []
    if up:
        st = os.lstat(os.path.dirname(socket))
        report["socket_dir"] = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid}
        st = os.lstat(socket)
        report["socket"] = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid}
        for e in spec.get("engines", []):
            p = subprocess.Popen([*as_user(e), sys.executable, "-c", ENGINE, e["name"]], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                 env={"PATH": env["PATH"], "HOME": "/", **e.get("env", {})})
            engines.append(p)
            assert p.stdout is not None
            line = p.stdout.readline()
            report["engines"][e["name"]] = json.loads(line) if line else {
                "ok": False, "error": (p.communicate()[1] or "")[-2000:]}
        for h in spec.get("handshakes", []):
            report["handshakes"][h["label"]] = asyncio.run(handshake(h))
        from kvxferd.client import Client, DaemonError

        try:
            with Client(socket, 5) as c:
                st_ = c.status()
            report["status"] = {"side_channel_auth": st_.side_channel_auth, "side_channel": st_.side_channel,
                                "unauthenticated_peers": st_.counters.unauthenticated_peers}
        except (DaemonError, OSError) as exc:
            report["status"] = {"error": str(exc)}
        report["after"] = []
        for a in spec.get("after", []):  # commands run as a user while the daemon serves
            r = subprocess.run([*as_user(named(a)), *a["argv"]], capture_output=True, text=True)
            report["after"].append({"argv": a["argv"], "returncode": r.returncode, "stderr": r.stderr})
        if spec.get("readyz"):
            try:
                with urllib.request.urlopen(spec["readyz"], timeout=5) as r:
                    report["readyz"] = r.status
            except (urllib.error.URLError, OSError) as exc:
                report["readyz"] = str(exc)
    for p in engines:
        if p.poll() is None:
            p.communicate("", timeout=30)
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    report["daemon"]["returncode"] = daemon.returncode
    report["daemon"]["socket_left"] = os.path.lexists(socket)
    log.seek(0)
    report["daemon"]["log"] = log.read()[-6000:]
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
