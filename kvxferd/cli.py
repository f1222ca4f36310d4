"""The `kvxferd` command line: serve, status, plan, demo, bench, proxy."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import msgspec
import typer

from . import __version__

if TYPE_CHECKING:
    from .plan.models import ModelShape

app = typer.Typer(help="kvxferd: KV-cache transfer sidecar daemon for disaggregated LLM serving.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Benchmarks; each prints a table, or JSON with --json.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def fail(message: str) -> NoReturn:
    typer.echo(f"kvxferd: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


@app.command()
def plan(
    model: str = typer.Option("dense", help="Preset to start from: dense, mla, mamba2, gdn, gemma4."),
    p_tp: int = typer.Option(2, "--p-tp", help="Prefill tensor-parallel size."),
    d_tp: int = typer.Option(4, "--d-tp", help="Decode tensor-parallel size."),
    layers: int | None = typer.Option(None, help="Attention layers."),
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="KV heads (total)."),
    head_dim: int | None = typer.Option(None, "--head-dim"),
    dtype: str | None = typer.Option(None, help="fp8, bf16, fp16, fp32."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per block on both sides."),
    p_block_size: int | None = typer.Option(None, "--p-block-size"),
    d_block_size: int | None = typer.Option(None, "--d-block-size"),
    kernel_block_size: int | None = typer.Option(None, "--kernel-block-size"),
    layout: str | None = typer.Option(None, help="hnd, nhd or blocks-first."),
    mla: bool = typer.Option(False, "--mla", help="MLA latent cache (same as --model mla)."),
    num_blocks: int | None = typer.Option(None, "--num-blocks"),
    rank: int | None = typer.Option(None, help="Only this decode rank."),
    file: Path | None = typer.Option(None, "--file", "-f", help="JSON or TOML with [prefill] and [decode]."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (docs/plan.md)."),
) -> None:
    """Explain the transfer plan between a prefill and a decode engine, offline."""
    from .plan.explain import SCHEMA_VERSION, rank_plan_dict, render_table
    from .plan.geometry import GeometryError
    from .plan.models import PRESETS, ModelShape, build
    from .plan.planner import PlanError, plan_rank, targets

    try:
        if file is not None:
            p_shape, d_shape, p_tp, d_tp = _plan_file(file)
        else:
            base = PRESETS.get("mla" if mla else model)
            if base is None:
                fail(f"unknown model preset {model!r}; one of {sorted(PRESETS)}")
            over = {k: v for k, v in dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                          block_size=block_size, kernel_block_size=kernel_block_size,
                                          layout=layout, num_blocks=num_blocks).items() if v is not None}
            shape = msgspec.convert({**msgspec.to_builtins(base), **over}, ModelShape)
            p_shape = msgspec.structs.replace(shape, block_size=p_block_size or shape.block_size)
            d_shape = msgspec.structs.replace(shape, block_size=d_block_size or shape.block_size)
        ranks = [rank] if rank is not None else list(range(d_tp))
        docs = []
        for r in ranks:
            local = build(d_shape, d_tp, r)
            remotes = {t: build(p_shape, p_tp, t) for t in targets(r, d_tp, p_tp)}
            docs.append(rank_plan_dict(plan_rank(local, remotes), local, remotes))
    except (PlanError, GeometryError, msgspec.ValidationError) as exc:
        fail(str(exc))
    doc = {"schema": SCHEMA_VERSION, "model": p_shape.identity(),
           "prefill": {"tp": p_tp, "shape": msgspec.to_builtins(p_shape)},
           "decode": {"tp": d_tp, "shape": msgspec.to_builtins(d_shape)}, "ranks": docs}
    typer.echo(json.dumps(doc, indent=2) if as_json else render_table(doc))


def _plan_file(path: Path) -> tuple[ModelShape, ModelShape, int, int]:
    from .plan.models import ModelShape

    raw = path.read_bytes()
    data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    sides = []
    for side in ("prefill", "decode"):
        if side not in data:
            fail(f"{path}: missing [{side}] section")
        body = dict(data[side])
        tp = int(body.pop("tp", 1))
        sides.append((msgspec.convert(body, ModelShape), tp))
    (p_shape, p_tp), (d_shape, d_tp) = sides
    return p_shape, d_shape, p_tp, d_tp


keys_app = typer.Typer(help="CurveZMQ keys for the side channel.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(directory: Path = typer.Argument(..., help="Where to write NAME.key and NAME.key_secret."),
                  name: str = typer.Option("kvxferd"),
                  owner: str = typer.Option("", "--owner", help="The daemon's user (USER or UID[:GID]): DIRECTORY and "
                                                               "the keys become its own, 0700 (as root)."),
                  force: bool = typer.Option(False, "--force", help="Replace an existing keypair of that name.")
                  ) -> None:
    """Create this daemon's CurveZMQ keypair, and DIRECTORY/authorized with its public half: the keys
    the daemon admits (copy each peer daemon's NAME.key there). The daemon's configuration:
    curve_secret_key_file = DIRECTORY/NAME.key_secret (curve_authorized_keys_dir defaults to
    DIRECTORY/authorized). One keypair copied to every node instead works too (docs/security.md says
    what it gives up).

    An existing keypair is never overwritten unless --force is given."""
    import pwd

    from .identity import KeysExist, generate_keys

    ids = None
    if owner:  # USER (its primary group), or UID[:GID] for a user only a container knows
        who, _, group = owner.partition(":")
        try:
            if who.isdigit():
                ids = (int(who), int(group) if group else int(who))
            else:
                user = pwd.getpwnam(who)
                ids = (user.pw_uid, int(group) if group else user.pw_gid)
        except (KeyError, ValueError):
            fail(f"--owner {owner}: not a user, nor UID[:GID]")
    try:
        public, secret = generate_keys(str(directory), name, force, ids)
    except KeysExist as exc:
        fail(str(exc))
    except PermissionError as exc:
        fail(f"{exc} (--owner needs root)")
    except OSError as exc:  # a symlink where the directory or authorized/ should be (O_NOFOLLOW)
        fail(f"cannot write the keys in {directory}: {exc}")
    typer.echo(f"public key: {public} (copy it into each peer daemon's {directory.name}/authorized)\n"
               f"secret key: {secret} (mode 0600{', owned by ' + owner if owner else ''}: the daemon's user alone)")


@bench_app.command("plan")
def bench_plan(
    as_json: bool = typer.Option(False, "--json"),
    blocks: int = typer.Option(64, help="Blocks per request for the index timing."),
) -> None:
    """Descriptor arrays and per-request indices for a 70B-class layout vs a list-of-tuples baseline."""
    from .benchmarks import plan as bp

    rows = bp.run(blocks_per_request=blocks)
    typer.echo(json.dumps(rows, indent=2) if as_json else bp.render(rows))


@bench_app.command("framing")
def bench_framing(as_json: bool = typer.Option(False, "--json")) -> None:
    """A read's block lists as msgpack ints (protocol 7) and packed (protocol 8): engine and daemon cost."""
    from .benchmarks import framing

    rows = framing.run()
    typer.echo(json.dumps(rows, indent=2) if as_json else framing.render(rows))


@bench_app.command("data")
def bench_data(
    as_json: bool = typer.Option(False, "--json"),
    mib: int = typer.Option(64, help="MiB per request."),
    repeats: int = typer.Option(10),
    device: str = typer.Option("cpu", help="cpu (shared host memory) or cuda-vmm (GPU memory)."),
    rounds: int = typer.Option(5, help="Alternating rounds (kvxferd, raw NIXL) per page size; medians over all."),
    page_kib: list[int] = typer.Option([], "--page-kib", help="Page sizes in KiB (repeatable); default 4 to 1024."),
    announce: bool = typer.Option(True, help="The decode engine announces each read (expect) before it, as "
                                             "vLLM's connector does; unannounced, a read's lease claim goes with it."),
    same_node: bool = typer.Option(False, "--same-node", help="Both engines on one daemon: its copy and its "
                                                              "NIXL loopback vs raw NIXL between two agents "
                                                              "vs a gather of the same pages (host memory)."),
) -> None:
    """Throughput through kvxferd vs raw NIXL vs memcpy, pages of 4 KiB to 1 MiB."""
    from .benchmarks import dataplane

    pages = [k << 10 for k in page_kib] or list(dataplane.PAGE_SIZES)
    if same_node:
        if device != "cpu":
            fail("--same-node measures host memory; GPU memory's same-node lane is NIXL's loopback")
        from .benchmarks import samenode

        same = samenode.run(pages, total_mib=mib, repeats=repeats, rounds=rounds)
        typer.echo(json.dumps(same, indent=2) if as_json else samenode.render(same))
        return
    rows = dataplane.run(pages, total_mib=mib, repeats=repeats, rounds=rounds, device=device, announce=announce)
    typer.echo(json.dumps(rows, indent=2) if as_json else dataplane.render(rows))


@bench_app.command("control")
def bench_control(
    as_json: bool = typer.Option(False, "--json"),
    requests: int = typer.Option(2000, help="Requests per concurrency level."),
    pause_ms: float = typer.Option(0.0, help="Between each request's hold and its read (untimed), as a "
                                             "request waits to be scheduled: the prefill daemon's pace settles."),
) -> None:
    """Requests/s and latency at 1, 16 and 256 concurrent reads of 16 blocks, the engine learning
    of completions by long polls and from its doorbell."""
    from .benchmarks import control

    if not 0 <= pause_ms <= 10_000:
        raise typer.BadParameter(f"{pause_ms} outside [0, 10000]", param_hint="--pause-ms")
    rows = control.run(requests=requests, pause_s=pause_ms / 1e3)
    typer.echo(json.dumps(rows, indent=2) if as_json else control.render(rows))


@bench_app.command("leases")
def bench_leases(
    as_json: bool = typer.Option(False, "--json"),
    requests: int = typer.Option(1000, help="Reads per round and mode."),
    rounds: int = typer.Option(3, help="Alternating rounds of the three modes; medians over all."),
) -> None:
    """What fail-closed reads cost: a 16-block read's latency with lease confirmation off and on."""
    from .benchmarks import control

    rows = control.run_leases(requests, rounds)
    typer.echo(json.dumps(rows, indent=2) if as_json else control.render_leases(rows))


@bench_app.command("step")
def bench_step(as_json: bool = typer.Option(False, "--json"), steps: int = typer.Option(2000, min=10)) -> None:
    """The vLLM worker's cost per scheduler step with transfers pending: nothing finishing (vs a
    poll RPC), and one read finishing (vs protocol 6's ring and poll)."""
    from .benchmarks import step

    rows = step.run(steps=steps)
    typer.echo(json.dumps(rows, indent=2) if as_json else step.render(rows))


@bench_app.command("scale")
def bench_scale(as_json: bool = typer.Option(False, "--json"), holds: int = typer.Option(10_000),
                peers: int = typer.Option(1_000)) -> None:
    """Bookkeeping as requests and peers grow: 10,000 holds on a real daemon, 1,000 peers simulated."""
    from .benchmarks import scale

    result = scale.run(holds, peers)
    typer.echo(json.dumps(result, indent=2) if as_json else scale.render(result))


@bench_app.command("handshake")
def bench_handshake(as_json: bool = typer.Option(False, "--json"), peers: int = typer.Option(5)) -> None:
    """First request to a new peer, end to end, against the next one."""
    from .benchmarks import handshake

    rows = handshake.run(peers=peers)
    typer.echo(json.dumps({"rows": rows, "median": handshake.summary(rows)}, indent=2) if as_json
               else handshake.render(rows))


@bench_app.command("integrity")
def bench_integrity(as_json: bool = typer.Option(False, "--json"), repeats: int = typer.Option(7),
                    mib: list[int] = typer.Option([], "--mib", help="MiB per request (repeatable); default 4, 64, 256.")
                    ) -> None:
    """What the KV integrity audit costs: digest GB/s vs memcpy, added latency per request."""
    from .benchmarks import integrity

    result = integrity.run(mib or [4, 64, 256], repeats)
    typer.echo(json.dumps(result, indent=2) if as_json else integrity.render(result))


@bench_app.command("footprint")
def bench_footprint(as_json: bool = typer.Option(False, "--json")) -> None:
    """Daemon RSS idle and with a 70B-class layout registered and planned."""
    from .benchmarks import footprint

    result = footprint.run()
    typer.echo(json.dumps(result, indent=2) if as_json else footprint.render(result))


@bench_app.command("vllm")
def bench_vllm(
    rounds: int = typer.Option(3, help="Alternating rounds of each setup."),
    lengths: list[int] = typer.Option([128, 512, 2048], "--length", help="Prompt tokens (repeatable)."),
    concurrency: list[int] = typer.Option([1, 8], "--concurrency", help="Requests in flight (repeatable)."),
    requests: int = typer.Option(8, help="Requests per case and round (at least the concurrency)."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=2, help="Tokens per decode (two at least: ITL is "
                                                                   "the gaps between them)."),
    idle_s: float = typer.Option(5.0, "--idle-s", help="Idle window for the CPU measurement."),
    workdir: Path | None = typer.Option(None, help="Where logs go (default: a temporary directory)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Real vLLM P/D through kvxferd vs vLLM's NixlConnector vs one plain vLLM: TTFT, decode TTFT,
    inter-token latency, requests/s, idle CPU, and kvxferd's cost per decode step inside vLLM."""
    import tempfile

    from .lab import vllm_bench as bench

    with tempfile.TemporaryDirectory(prefix="kvxferd-bench-vllm-") as tmp:
        result = bench.run(rounds, lengths, concurrency, requests, max_tokens, idle_s, workdir or Path(tmp),
                           say=lambda m: typer.echo(m, err=True))
    out = {"cases": result.table(), "idle_cpu_percent": result.idle_table(), "step_cost": result.step}
    typer.echo(json.dumps(out, indent=2) if as_json else bench.render(out))


@app.command()
def serve(
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML configuration file."),
    socket: str | None = typer.Option(None, "--socket", help="Unix socket engines connect to."),
    socket_mode: str | None = typer.Option(None, "--socket-mode", help="Octal mode of the socket (0600)."),
    side_channel_host: str | None = typer.Option(None, "--side-channel-host", help="Handshake bind address."),
    side_channel_port: int | None = typer.Option(None, "--side-channel-port", help="Handshake port (0: any)."),
    advertise_host: str | None = typer.Option(None, "--advertise-host", help="Address peers dial."),
    metrics_host: str | None = typer.Option(None, "--metrics-host"),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="-1 disables the exporter."),
    backend: list[str] | None = typer.Option(None, "--backend", help="NIXL backend (repeatable)."),
    ucx: list[str] | None = typer.Option(None, "--ucx", help="UCX option KEY=VALUE (repeatable)."),
    handshake_timeout: float | None = typer.Option(None, "--handshake-timeout"),
    integrity_audit: bool | None = typer.Option(None, "--integrity-audit/--no-integrity-audit",
                                                help="Digest held blocks and check every read against them."),
    curve_secret_key: str | None = typer.Option(None, "--curve-secret-key", help="CurveZMQ keypair file."),
    curve_authorized_keys: str | None = typer.Option(None, "--curve-authorized-keys",
                                                        help="Directory of peers' public keys."),
    side_channel_insecure: bool | None = typer.Option(
        None, "--side-channel-insecure", help="Serve the side channel beyond loopback without CurveZMQ keys "
        "(any host that reaches it can read held KV blocks)."),
    allowed_uid: list[int] | None = typer.Option(None, "--allowed-uid", help="SO_PEERCRED allow-list."),
    confirm_leases: bool | None = typer.Option(
        None, "--confirm-leases/--no-confirm-leases",
        help="Report a read received only once the prefill daemon vouched its holds lived through it."),
    lease_renewal: bool | None = typer.Option(
        None, "--lease-renewal/--no-lease-renewal",
        help="Keep prefill holds alive while a decode engine expects or reads them."),
    claim_s: float | None = typer.Option(None, "--claim-s", help="Seconds each claim keeps a prefill hold alive."),
    max_lease_s: float | None = typer.Option(None, "--max-lease-s",
                                             help="Longest lease; longest a claim keeps a hold."),
    name: str | None = typer.Option(None, "--name", help="NIXL agent name prefix."),
    log_format: str | None = typer.Option(None, "--log-format", help="text or json."),
    log_level: str | None = typer.Option(None, "--log-level"),
) -> None:
    """Run the daemon (configuration: file < KVXFERD_* environment < flags)."""
    import asyncio
    import logging

    from . import logs
    from .config import ConfigError, check_curve_files, check_side_channel, load
    from .daemon import LoopEnded, run
    from .sockdir import SocketDirError

    try:
        cfg = load(str(config) if config else None, socket_path=socket, socket_mode=socket_mode,
                   side_channel_host=side_channel_host, side_channel_port=side_channel_port,
                   advertise_host=advertise_host, metrics_host=metrics_host, metrics_port=metrics_port,
                   backends=backend or None, handshake_timeout_s=handshake_timeout, name=name,
                   integrity_audit=integrity_audit,
                   curve_secret_key_file=curve_secret_key, curve_authorized_keys_dir=curve_authorized_keys,
                   side_channel_insecure=side_channel_insecure, allowed_uids=allowed_uid or None,
                   ucx=dict(kv.split("=", 1) for kv in ucx) if ucx else None,
                   confirm_leases=confirm_leases, lease_renewal=lease_renewal, claim_s=claim_s,
                   max_lease_s=max_lease_s, log_format=log_format, log_level=log_level)
        insecure = check_side_channel(cfg)  # beyond loopback: Curve keys, or the operator said so
        check_curve_files(cfg)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    logs.setup(cfg.log_format, cfg.log_level)
    if insecure:
        logging.getLogger("kvxferd").warning(insecure)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        loop_run = asyncio.run
    else:
        loop_run = uvloop.run  # an ImportError inside the daemon is its own failure, not a reason to start again
    try:
        loop_run(run(cfg))
    except (SocketDirError, LoopEnded) as exc:  # the socket's directory breaks its rule (sockdir.py); a loop ended
        fail(str(exc))


@app.command()
def status(
    socket: str = typer.Option("/run/kvxferd/kvxferd.sock", "--socket", envvar="KVXFERD_SOCKET_PATH"),
    as_json: bool = typer.Option(False, "--json"),
    watch: float = typer.Option(0.0, "--watch", help="Refresh every N seconds."),
) -> None:
    """Show what a running daemon is doing."""
    import time

    from .client import Client, DaemonError
    from .logs import escape
    from .status import render

    while True:
        try:
            with Client(socket, timeout=5, client="kvxferd status") as c:
                st = c.status()
        except (ConnectionError, DaemonError, OSError) as exc:
            fail(f"{escape(str(exc))}\n  is the daemon running? start it with `kvxferd serve --socket {socket}`")
        # Text is escaped for the terminal (strings come from engines and peers); JSON escapes itself.
        text = json.dumps(msgspec.to_builtins(st), indent=2) if as_json else render(st)
        if watch > 0:
            typer.echo("\x1b[2J\x1b[H" + text)
            time.sleep(watch)
        else:
            typer.echo(text)
            return


@app.command()
def proxy(
    prefill: list[str] = typer.Option(..., "--prefill", help="Prefill vLLM server, e.g. http://10.0.0.1:8100 "
                                      "(repeatable)."),
    decode: list[str] = typer.Option(..., "--decode", help="Decode vLLM server (repeatable)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address clients connect to."),
    port: int = typer.Option(8000, "--port"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KVXFERD_PROXY_API_KEY",
                                       help="Key clients must send (Authorization: Bearer KEY) on every route "
                                            "but /health; never sent upstream. Default: clients unchecked."),
    upstream_api_key: str | None = typer.Option(None, "--upstream-api-key", envvar="KVXFERD_PROXY_UPSTREAM_API_KEY",
                                                help="Bearer key sent to the vLLM servers (their --api-key). "
                                                     "Default: none."),
    max_concurrency: int = typer.Option(1024, "--max-concurrency", min=1,
                                        help="Requests in flight; past it clients get 503 with Retry-After."),
    max_body_mib: float = typer.Option(4.0, "--max-body-mib", min=0.001,
                                       help="Largest request body, in MiB; larger ones get 413."),
    connect_timeout: float = typer.Option(5.0, "--connect-timeout", help="Seconds to connect to an upstream."),
    prefill_timeout: float = typer.Option(300.0, "--prefill-timeout",
                                          help="Seconds for the whole prefill hop; past it, 504."),
    decode_timeout: float = typer.Option(1800.0, "--decode-timeout",
                                         help="Seconds for the whole decode hop, streaming included; 0: no limit."),
    read_timeout: float = typer.Option(600.0, "--read-timeout", help="Longest silence from an upstream, in seconds."),
    health_timeout: float = typer.Option(2.0, "--health-timeout", help="Seconds per upstream /health check."),
    log_format: str = typer.Option("text", "--log-format", help="text or json."),
    log_level: str = typer.Option("info", "--log-level", help="debug logs every request with its timings."),
) -> None:
    """OpenAI-compatible router for disaggregated prefill/decode with vLLM: try P/D without writing one."""
    try:
        import aiohttp  # noqa: F401  (an optional extra: the daemon itself never needs it)
    except ImportError:
        fail("`kvxferd proxy` needs aiohttp: pip install 'kvxferd[proxy]'")
    from . import logs
    from .proxy import make_app, run

    try:  # bad URLs and values fail here, before logging starts
        server = make_app(prefill, decode, api_key=api_key, upstream_api_key=upstream_api_key,
                          max_concurrency=max_concurrency, max_body_bytes=int(max_body_mib * 2**20),
                          connect_timeout=connect_timeout, prefill_timeout=prefill_timeout,
                          decode_timeout=decode_timeout, read_timeout=read_timeout, health_timeout=health_timeout)
    except ValueError as exc:
        fail(str(exc))
    logs.setup(log_format, log_level)
    try:
        run(server, host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc}")


@app.command()
def demo(
    model: str = typer.Option("dense", help="Preset: dense, mla, mamba2, gdn, gemma4."),
    p_tp: int = typer.Option(2, "--p-tp"),
    d_tp: int = typer.Option(4, "--d-tp"),
    requests: int | None = typer.Option(None, "--requests", "-n", help="Default: 64 synthetic, 8 vllm."),
    max_tokens: int | None = typer.Option(None, "--max-tokens",
                                             help="Synthetic: longest prompt (default 200); vllm: tokens generated "
                                                  "(default 24)."),
    hit_ratio: float = typer.Option(0.3, "--hit-ratio", help="Share of requests with a partial prefix hit."),
    num_blocks: int = typer.Option(256, "--num-blocks"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
    engine: str = typer.Option("synthetic", "--engine",
                               help="synthetic (verifies every byte) or vllm (real vLLM prefill and decode "
                                    "through the router, compared with a single instance)."),
    repeat: int = typer.Option(4, "--repeat", help="vllm: times each prompt sentence is repeated (prompt length)."),
    same_node: bool = typer.Option(False, "--same-node", help="Synthetic: one daemon for both engines (the "
                                                              "node's daemon: reads between its own engines)."),
) -> None:
    """Two daemons and two engines on this machine: synthetic ones (every byte verified) or real vLLM."""
    if engine == "vllm":
        _demo_vllm(requests or 8, max_tokens or 24, repeat, as_json)
        return
    if engine != "synthetic":
        fail(f"unknown engine {engine!r}; synthetic or vllm")
    requests, max_tokens = requests or 64, max_tokens or 200
    from .lab.synthetic.demo import DemoError, run_demo
    from .plan.models import PRESETS

    if model not in PRESETS:
        fail(f"unknown model preset {model!r}; one of {sorted(PRESETS)}")
    shape = msgspec.structs.replace(PRESETS[model], num_blocks=num_blocks)
    typer.echo(f"kvxferd demo: {model}, prefill TP {p_tp} -> decode TP {d_tp}, {requests} requests"
               f"{', one daemon for both' if same_node else ''}", err=True)
    try:
        with typer.progressbar(length=requests, label="transferring", file=sys.stderr) as bar:
            result = run_demo(shape, p_tp, d_tp, requests, max_tokens, hit_ratio, seed, progress=bar.update,
                              same_node=same_node)
    except DemoError as exc:
        fail(f"demo failed: {exc}")
    s = result.summary()
    if as_json:
        typer.echo(json.dumps(s, indent=2))
    else:
        typer.echo(f"{s['received']}/{s['requests']} requests verified byte-exact ({s['prefix_hits']} partial "
                   f"prefix hits), {s['bytes'] / 1e6:.1f} MB moved, {s['throughput_gb_s']:.2f} GB/s per request "
                   f"once connected, latency p50 {s['p50_ms']:.2f} ms p99 {s['p99_ms']:.2f} ms (first request, "
                   f"with the handshake: {s['first_request_ms']:.1f} ms), prefill blocks released: "
                   f"{s['prefill_released']}")
    if result.failed or result.received != requests:
        raise typer.Exit(1)


def _demo_vllm(requests: int, max_tokens: int, repeat: int, as_json: bool) -> None:
    from .lab.vllm_demo import run
    from .lab.vllm_servers import LaunchError

    def say(m: str) -> None:
        typer.echo(m, err=True)

    say(f"kvxferd demo: real vLLM prefill -> decode through kvxferd, {requests} prompts")
    try:
        result = run(requests, max_tokens, repeat, say=say)
    except LaunchError as exc:
        fail(f"demo failed: {exc}")
    s = result.summary()
    if as_json:
        typer.echo(json.dumps(s, indent=2))
    else:
        typer.echo(f"{s['matching']}/{s['prompts']} prompts: the decode's output through kvxferd equals a single "
                   f"vLLM instance's; TTFT p50 {s['ttft_ms_pd_p50']:.1f} ms prefill/decode via the router, "
                   f"{s['ttft_ms_single_p50']:.1f} ms single instance")
    if s["matching"] != s["prompts"]:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    sys.exit(app())
