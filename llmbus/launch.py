"""`llmbus up`: one command for one machine — NATS (embedded unless given), kvpool, router, prefill
and decode workers and the gateway, each its own process, with the demo model by default.

Readiness: every service prints ``llmbus-ready <role> <id>`` once it serves; ``up`` waits for all of
them, then prints the URL. A service that exits while the stack runs is reported and takes the
whole stack down (exit 1). SIGINT/SIGTERM shut down in order: the gateway first (stops taking
requests, lets streams finish), then router, workers, kvpool, and NATS last; exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmbus.bus.connection import NATS_URL_ENV, TLS_ENVS, has_credentials
from llmbus.kv.formats import KV_FORMATS

READY = "llmbus-ready"


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    url: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the whole service on this machine")
    p.add_argument("--nats-url", default="", help="use this NATS server instead of starting one (credentials as "
                   "nats://user:password@host:port or nats://token@host:port; the services get them by environment)")
    p.add_argument("--data-dir", default="", help="JetStream store and demo models (default $LLMBUS_DATA_DIR or ~/.cache/llmbus)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                   help="a served model (repeatable; default: the small demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", type=int, default=1, help="prefill worker replicas per model")
    p.add_argument("--decode", type=int, default=1, help="decode worker replicas per model")
    p.add_argument("--colocated", action="store_true",
                   help="no disaggregation: each prefill worker also decodes (no decode workers are started)")
    p.add_argument("--kv-format", default="model", choices=KV_FORMATS)
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="workers draft up to K tokens per decode by n-gram lookup and check them in the same step "
                        "(0: off; the workers' --speculative-ngram and --speculative-max-rows via --worker-arg)")
    p.add_argument("--kvpool-blocks", type=int, default=4096, help="blocks in kvpool's shared-memory CPU tier")
    p.add_argument("--kvpool-arg", action="append", default=[],
                   help="extra kvpool option, e.g. --kvpool-arg=--ssd-bytes=1000000000 (see python -m services.kvpool -h)")
    p.add_argument("--long-threshold", type=int, default=1024, help="prompt tokens above which the long lane is used")
    p.add_argument("--token-timeout", type=float, default=60.0, help="gateway: seconds of stream silence before failing "
                   "(while the model's workers are busy: queued, waits up to the request deadline)")
    p.add_argument("--api-keys-file", default=None,
                   help="gateway: JSON {api key: tenant} (keys of 8+ printable characters, no spaces); /v1 answers only listed keys and tenants never share "
                        "prefix-cache blocks (default: open)")
    p.add_argument("--tenant-limits", default=None, metavar="FILE",
                   help="gateway: JSON per-tenant limits (requests_per_minute, tokens_per_minute, _per_day, "
                        "max_concurrent_requests under \"default\" and \"tenants\"); over one: 429 (default: none)")
    p.add_argument("--tool-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="gateway: read tool calls in chat output (hermes: <tool_call>{json}</tool_call>; "
                        "llama3_json: the answer is {\"name\", \"parameters\"}; mistral: [TOOL_CALLS] [{...}])")
    p.add_argument("--worker-arg", action="append", default=[], help="extra option passed to every prefill/decode worker")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra router option, e.g. --router-arg=--no-kv-routing (see python -m services.router -h)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.set_defaults(func=run)


def _models(args, data_dir: Path) -> list[tuple[str, str]]:
    from llmbus.bus.subjects import check_model_names
    from llmbus.worker.options import parse_model_spec

    if args.model:
        models = [parse_model_spec(m) for m in args.model]
        check_model_names(name for name, _ in models)
    else:
        os.environ.setdefault("LLMBUS_DATA_DIR", str(data_dir))
        from llmbus.model.demo import ensure_demo_model

        models = [("llmbus-demo-small", str(ensure_demo_model("small")))]
    from llmbus.model.config import ModelConfig

    for name, path in models:
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"model {name!r}: no config.json in {path}")
        ModelConfig.from_file(Path(path) / "config.json")  # NOTE: a bad one fails here, before NATS starts
    return models


def _block_bytes(models, args) -> int:
    # NOTE: from llmbus.kv, not the engine: `up` supervises and never imports torch (~200 MB
    # resident, and seconds of start and exit on a busy machine)
    from llmbus.kv.formats import kv_block_bytes
    from llmbus.model.config import ModelConfig

    most = 0
    for _, path in models:
        cfg = ModelConfig.from_file(Path(path) / "config.json")
        most = max(most, kv_block_bytes(cfg.kv_layout(16, args.dtype or cfg.dtype), args.kv_format))
    return most


def _kv_layout(models, args) -> str:
    """The first model's KV layout for kvpool's prefix cache (``--kv-layout``)."""
    from llmbus.model.config import ModelConfig
    from services.kvpool.config import format_layout

    cfg = ModelConfig.from_file(Path(models[0][1]) / "config.json")
    return format_layout(cfg.kv_layout(16, args.dtype or cfg.dtype))


def _worker_option(worker_args: list[str], name: str) -> str | None:
    """The value ``--worker-arg`` gives the workers' option ``name`` (``--name=V`` or ``--name V``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(name)
    known, _ = parser.parse_known_args(worker_args)
    return getattr(known, name.lstrip("-").replace("-", "_"))


def _plan(args, nats_url: str, models, data_dir: Path | None = None) -> list[Child]:
    """The services to start. A NATS URL with credentials reaches them through ``$LLMBUS_NATS_URL``
    (set by ``up`` for its children), not their command lines, which any local user can read."""
    py = [sys.executable, "-m"]
    common = [] if has_credentials(nats_url) else ["--nats-url", nats_url]
    decoders = 0 if args.colocated else args.decode
    workers = len(models) * (args.prefill + decoders)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    engine = ["--kv-format", args.kv_format, "--threads", str(threads)]
    if args.dtype:
        engine += ["--dtype", args.dtype]
    if args.device:
        engine += ["--device", args.device]
    if args.speculative_tokens:
        engine += ["--speculative-tokens", str(args.speculative_tokens)]
    engine += args.worker_arg
    names = ",".join(n for n, _ in models)
    plan = [
        Child("kvpool", py + ["services.kvpool", *common, "--block-bytes", str(_block_bytes(models, args)),
                              "--capacity-blocks", str(args.kvpool_blocks), "--kv-layout", _kv_layout(models, args),
                              "--kv-format", args.kv_format, "--cpu-bytes", str(256 << 20),
                              *(["--data-dir", str(data_dir)] if data_dir else []), *args.kvpool_arg]),
        Child("router", py + ["services.router", *common, "--models", names, "--long-threshold", str(args.long_threshold),
                              *args.router_arg]),
    ]
    for name, path in models:
        spec = f"{name}={path}"
        colocated = ["--colocated"] if args.colocated else []
        plan += [Child(f"prefill-{name}-{i}", py + ["services.prefill", *common, "--model", spec, *engine, *colocated])
                 for i in range(args.prefill)]
        plan += [Child(f"decode-{name}-{i}", py + ["services.decode", *common, "--model", spec, *engine])
                 for i in range(decoders)]
    gateway = py + ["services.gateway", *common, "--host", args.host, "--port", str(args.port),
                    "--token-timeout", str(args.token_timeout)]
    context = _worker_option(args.worker_arg, "--max-model-len")
    if context is not None:  # the gateway checks prompts against the context the workers serve
        gateway += ["--max-model-len", context]
    for name, path in models:
        gateway += ["--model", f"{name}={path}"]
    if args.api_keys_file:
        gateway += ["--api-keys-file", str(Path(args.api_keys_file).resolve())]
    if args.tenant_limits:
        gateway += ["--tenant-limits", str(Path(args.tenant_limits).resolve())]
    if args.tool_parser:
        gateway += ["--tool-parser", args.tool_parser]
    plan.append(Child("gateway", gateway))
    return plan


def _start(child: Child) -> None:
    # NOTE: own process group, so a terminal's Ctrl-C reaches only `up`, which then stops services in
    # order; but `up`'s session: Linux schedules each session as one group (autogroup), and a session
    # per service made the services share the cores as equal groups, whatever their threads' nice
    # values (large model, c32: 486-492 -> 486-513 tok/s; tests/test_launch_groups.py)
    child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                  bufsize=1, process_group=0)

    def pump() -> None:  # forward output, spot readiness; keeps the pipe from filling
        for line in child.proc.stdout:
            if line.startswith(READY):
                child.ready.set()
            elif line.startswith("llmbus gateway listening "):
                child.url = line.split()[-1]
            sys.stdout.write(f"[{child.name}] {line}")
            sys.stdout.flush()

    threading.Thread(target=pump, daemon=True).start()


def _signal_group(child: Child, sig: int) -> None:
    """``sig`` to ``child``'s process group (its own, ``_start``'s): the service and whatever it
    started, such as a C compiler building the CPU kernels, which would outlive it otherwise."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def _stop(children: list[Child], timeout: float = 30.0) -> None:
    """Gateway first, kvpool last: each group gets SIGTERM and ``timeout`` seconds before SIGKILL;
    what a service leaves of its process group when it exits is killed with it."""
    order = [c for c in children if c.name == "gateway"] + [c for c in children if c.name == "router"]
    order += [c for c in children if c.name.startswith("prefill")] + [c for c in children if c.name.startswith("decode")]
    order += [c for c in children if c.name == "kvpool"]
    for group in (order[:1], order[1:2], [c for c in order if c.name.startswith(("prefill", "decode"))], order[-1:]):
        live = [c for c in group if c.proc and c.proc.poll() is None]
        for c in live:
            _signal_group(c, signal.SIGTERM)
        start = time.monotonic()
        for c in live:
            try:
                c.proc.wait(max(0.1, start + timeout - time.monotonic()))
                print(f"llmbus up: {c.name} stopped in {time.monotonic() - start:.1f}s", flush=True)
            except subprocess.TimeoutExpired:
                _signal_group(c, signal.SIGKILL)
                c.proc.wait()
                print(f"llmbus up: {c.name} did not stop within {timeout:.0f}s of SIGTERM; killed", file=sys.stderr,
                      flush=True)
            _signal_group(c, signal.SIGKILL)  # its group's leftovers, if any


def drop_tls_settings() -> list[str]:
    """Take ``$LLMBUS_NATS_TLS_*`` out of the environment the services inherit (they would refuse
    the embedded server, which speaks plain TCP on 127.0.0.1); the names that were set."""
    return [name for name in TLS_ENVS if os.environ.pop(name, None) is not None]


def run(args: argparse.Namespace) -> int:
    from llmbus.bus.server import EmbeddedNats

    data_dir = Path(args.data_dir or os.environ.get("LLMBUS_DATA_DIR") or Path.home() / ".cache" / "llmbus")
    data_dir.mkdir(parents=True, exist_ok=True)
    if args.prefill < 1 or (args.decode < 1 and not args.colocated):  # (--colocated starts no decode workers)
        raise ValueError("--prefill and --decode must be >= 1")
    # NOTE: what the gateway would refuse, checked now: one line before anything starts, not after
    # NATS, kvpool, the router and the workers have (the workers' first start compiles for seconds)
    if args.tenant_limits:
        from services.gateway.limits import TenantLimits

        TenantLimits.load(args.tenant_limits)
    if args.api_keys_file:
        from services.gateway.tenants import Tenants

        Tenants.load(args.api_keys_file)
    models = _models(args, data_dir)
    from services.gateway.listen import bind

    bind(args.host, args.port).close()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    nats = None
    if not args.nats_url:
        if dropped := drop_tls_settings():
            print(f"llmbus up: {', '.join(dropped)} apply to a NATS server given with --nats-url; the embedded one "
                  "listens on 127.0.0.1 without TLS", file=sys.stderr)  # fmt: skip
        nats = EmbeddedNats(data_dir / "nats")
        nats.start()
        print(f"llmbus up: nats-server at {nats.url} (store {data_dir / 'nats'})", flush=True)
    nats_url = args.nats_url or nats.url
    if has_credentials(nats_url):
        os.environ[NATS_URL_ENV] = nats_url  # the children inherit it (_plan)
    children = _plan(args, nats_url, models, data_dir)
    code = 0
    try:
        for child in children:
            _start(child)
        deadline = time.monotonic() + args.ready_timeout
        while not all(c.ready.is_set() for c in children):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead or stop.is_set() or time.monotonic() > deadline:
                for c in dead:
                    print(f"llmbus up: {c.name} exited with code {c.proc.returncode} before it was ready", file=sys.stderr)
                if not dead and not stop.is_set():
                    late = ", ".join(c.name for c in children if not c.ready.is_set())
                    print(f"llmbus up: not ready after {args.ready_timeout:.0f}s: {late}", file=sys.stderr)
                return 1 if not stop.is_set() else 0
            time.sleep(0.1)
        gateway = children[-1]
        print(f"llmbus up: ready — OpenAI API at {gateway.url or f'http://{args.host}:{args.port}'}/v1 "
              f"(models: {', '.join(n for n, _ in models)})", flush=True)
        while not stop.is_set():
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                for c in dead:
                    print(f"llmbus up: {c.name} exited unexpectedly with code {c.proc.returncode}; stopping",
                          file=sys.stderr, flush=True)
                code = 1
                break
            stop.wait(0.2)
        return code
    finally:
        print("llmbus up: shutting down", flush=True)
        _stop(children)
        if nats is not None:
            nats.stop()
        print("llmbus up: stopped", flush=True)
