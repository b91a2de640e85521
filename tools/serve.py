"""clover-serve: an OpenAI-compatible HTTP server over one clover.Engine (clover.serve.app).

    clover-serve --artifact DIR | --demo [--backend ort|trt] [--host 127.0.0.1] [--port 8000] [--max-batch N]
                 [--tree auto|NAME] [--heads artifact|lookup|+lookup|none] [--providers cuda,cpu] [--api-key KEY] [--model NAME]
    clover-serve --base DIR|smollm2 [--heads DIR|random:ARCH|lookup|none] [--device cuda] [--dtype bfloat16] ...
    clover-serve ... --ray [--replicas N | --autoscale MIN:MAX] [--threads-per-replica T] [--address auto|HOST:PORT]
    clover-serve ... --ray --print-config > config.yaml      (then: serve deploy config.yaml)

SIGTERM or SIGINT stops accepting connections, lets in-flight requests finish (at most --drain-seconds), and
exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clover.errors import CloverError
from clover.runtime.params import EngineOptions
from clover.tools.cli import run_cli

if TYPE_CHECKING:
    from clover.serve.limits import Cors, RequestLimits
    from clover.serve.tool_calls import ToolOptions

DEMO_MODEL = "smollm2-clover2"  # the model name `--demo` serves
PARSER_NAMES = ("hermes", "llama3_json")  # --tool-call-parser's choices (clover.serve.tool_calls.PARSERS)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, seconds: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll GET /health of a clover-serve on 127.0.0.1:`port` until it answers 200 (True), `seconds` pass or
    `alive()` turns False (False): for scripts and tests that start a server and wait for its warm-up."""
    deadline = time.time() + seconds
    while time.time() < deadline and alive():
        try:
            # nosec B310: a fixed http:// URL on this machine, no user-supplied scheme
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:  # nosec B310
                if r.status == 200:
                    return True
        except OSError:  # refused while starting, 503 until warm, timeouts
            pass
        time.sleep(0.05)
    return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="clover-serve", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", type=Path, help="folder written by clover-export")
    src.add_argument(
        "--base",
        default=None,
        help="an HF checkpoint folder or 'smollm2', served by the torch backend (no export): --heads a head "
        "checkpoint folder, random:ARCH, lookup or none; --device cuda for the stacked runner on a GPU",
    )
    src.add_argument(
        "--demo",
        action="store_true",
        help="the `make demo` artifact (SmolLM2 int4 + the shipped Clover-2 "
        "heads; exported into the cache first if missing)",
    )
    p.add_argument(
        "--backend",
        choices=("ort", "trt", "torch"),
        default=None,
        help="default: trt for an artifact with TensorRT engines, else ort; torch with --base",
    )
    p.add_argument(
        "--device",
        default=None,
        help="with --base: the torch backend's device (cuda, cuda:1, cpu): the stacked runner there, every sequence "
        "in one forward and the whole step on the device, with CUDA graphs on a GPU (default: the per-sequence "
        "runner on the CPU)",
    )
    p.add_argument(
        "--dtype", default=None, help="with --base: float32 (default), float16 or bfloat16 (an artifact has its own)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded at once")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond those (more get 503)")
    p.add_argument("--tree", default="auto", help="'auto' (per step, per sequence, by measured cost) or a tree name")
    p.add_argument(
        "--heads",
        default=None,
        help="what drafts: artifact (its heads), lookup (prompt lookup alone), +lookup (its heads and prompt "
        "lookup), none (plain decoding); default: the artifact's own default, timed at export (its manifest's "
        "drafts). With --base: a shipped head set (smollm2-clover2), a head checkpoint folder, random:ARCH[:SEED], lookup "
        "or none (default)",
    )
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument(
        "--draft-store-mb",
        type=int,
        default=None,
        metavar="N",
        help="memory for the served-answers store prompt lookup drafts from: every finished answer joins it, oldest "
        "out first (drafts only: the same output); 0: off (default: 64; with --ray, per replica). With several API "
        "keys each key's requests draft from its own answers",
    )
    p.add_argument(
        "--draft-store-shared",
        action="store_true",
        help="one served-answers store for every API key (default: one per key, so a response's speed tells no "
        "tenant what another was told)",
    )
    p.add_argument(
        "--draft-store-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the served-answers store across restarts in DIR (written atomically, checked on load)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=None,
        metavar="N",
        help="memory for the prefix cache: a prompt that begins with tokens an ended request computed (a "
        "conversation's earlier turns, a shared system prompt) reuses them and prefills only the rest, the same "
        "output; least recently used first out; 0: off (default: 1/16 of the machine's memory, at most 1024; with "
        "--ray, per replica)",
    )
    p.add_argument(
        "--providers",
        default=None,
        help="ONNX Runtime execution providers (backend ort), comma-separated "
        "in order of preference: cpu (default), cuda, or cuda,cpu (runs on the CPU, saying so in one line, "
        "where CUDA is not available)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template /v1/chat/completions renders with, replacing the artifact's own or adding one to a "
        "base model that has none (without one, chat requests get 400 and /v1/completions serves plain text): a "
        "file holding the Jinja template, or the template itself (as vLLM's --chat-template)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (also what tools without a tool_choice ask for): the model\'s answer is '
        "parsed for calls by --tool-call-parser (as vLLM's flag); without it such requests get 400, and "
        'tool_choice "required" or a named function (constrained calls) are served either way',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=PARSER_NAMES,
        help="how the model writes tool calls, for tool_choice auto: hermes (JSON calls between tool_call tags: "
        "Hermes, Qwen2.5, and the format given to models whose chat template has no tools) or llama3_json (Llama "
        '3.1\'s {"name": ..., "parameters": ...})',
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt of a request with tool_choice "none" (default: rendered, as vLLM)',
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("CLOVER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CLOVER_API_KEY, else none)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model name clients send (default: the artifact folder's name; smollm2-clover2 with --demo)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM / SIGINT, wait this long at most for in-flight requests",
    )
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=64,
        help="stop strings per request (default 64; OpenAI takes 4, vLLM any)",
    )
    p.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string (default 256)")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=2 * 2**20,
        help="largest request body, refused before it is read (default 2 MiB)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="/v1 requests answered at once; more get 503 with Retry-After (default: no limit beyond --max-waiting)",
    )
    p.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help="a prompt's tokens after the chat template (default: what the context allows)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="the most tokens one request may ask for; requests "
        "without max_tokens get at most this many (default: what the context leaves)",
    )
    p.add_argument("--max-messages", type=int, default=1024, help="messages in one chat request (default 1024)")
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=262_144,
        help="a prompt's characters, a chat's messages "
        "together, checked before templating and tokenizing (default 262144)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="read the API keys from this file (one per line) instead of --api-key, so they stay out of the process "
        "list; several keys are several tenants: each one's requests draft only from its own served answers and "
        "share cached prefixes only among themselves",
    )
    p.add_argument(
        "--manifest-sha256",
        default=None,
        metavar="HEX",
        help="refuse to start unless the artifact's "
        "manifest.json has this sha256 (it lists every file's checksum, so this pins the whole artifact; an "
        "artifact is trusted code: TensorRT engines are executable)",
    )
    p.add_argument(
        "--allowed-origins",
        type=json_list,
        default=["*"],
        metavar="JSON",
        help='origins browser front-ends may call from, a JSON list (default ["*"], as vLLM; "[]": no CORS headers)',
    )
    p.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON", help='CORS methods (default ["*"])'
    )
    p.add_argument(
        "--allowed-headers", type=json_list, default=["*"], metavar="JSON", help='CORS headers (default ["*"])'
    )
    p.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send credentials")
    p.add_argument("--metrics-need-key", action="store_true", help="/metrics needs the API key too")
    p.add_argument("--disable-docs", action="store_true", help="serve no /docs, /redoc or /openapi.json")
    p.add_argument(
        "--allow-ignore-eos",
        action="store_true",
        help="honour vLLM's ignore_eos extension (requests run to "
        "max_tokens past end-of-sequence; for load tests); off: such requests get 400",
    )
    ray = p.add_argument_group(
        "Ray Serve",
        "scale out: replicas of this server, each with its own engine, behind Ray Serve's HTTP proxy on "
        "--host/--port (the ray extra; docs/serving.md)",
    )
    ray.add_argument(
        "--ray", action="store_true", help="serve through Ray Serve (starts a local cluster, or --address)"
    )
    ray.add_argument("--replicas", type=int, default=None, metavar="N", help="replicas (default 1)")
    ray.add_argument(
        "--autoscale", default=None, metavar="MIN:MAX", help="autoscale between MIN and MAX replicas instead"
    )
    ray.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        metavar="N",
        help="with --autoscale: requests per replica Serve scales to (default: --max-batch)",
    )
    ray.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        metavar="T",
        help="ONNX Runtime threads of each replica, and the CPUs Ray reserves for it (default: --threads, else 1)",
    )
    ray.add_argument(
        "--address",
        default=None,
        metavar="auto|HOST:PORT",
        help="join this Ray cluster (auto, or the head's HOST:PORT) instead of starting a local one",
    )
    ray.add_argument(
        "--print-config",
        action="store_true",
        help="write a Ray Serve config YAML with these options (for `serve deploy` on a cluster) and exit",
    )
    return p


RAY_FLAGS = ("replicas", "autoscale", "target_ongoing_requests", "threads_per_replica", "address", "print_config")


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form for --allowed-origins and the like)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f"a JSON list of strings, such as '[\"https://app.example.com\"]', got {text!r}"
        )
    return value


def cors_policy(args: argparse.Namespace):
    """The server's CORS policy from its flags (None: --allowed-origins '[]', no CORS headers at all)."""
    from clover.serve.limits import Cors

    if not args.allowed_origins:
        return None
    return Cors(
        tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers), args.allow_credentials
    )


def ray_options(args: argparse.Namespace, limits, model: str | None, tools, cors=None):
    """clover-serve --ray's flags as RayServeOptions."""
    from clover.serve.ray import RayServeOptions

    if args.replicas is not None and args.autoscale is not None:
        raise CloverError("--replicas and --autoscale exclude each other: a fixed number, or MIN:MAX")
    autoscale = None
    if args.autoscale is not None:
        try:
            autoscale = tuple(int(n) for n in args.autoscale.split(":"))
        except ValueError:
            autoscale = ()
        if len(autoscale) != 2:
            raise CloverError(f"--autoscale must be MIN:MAX (e.g. 1:4), got {args.autoscale!r}")
    return RayServeOptions(
        artifact=str(args.artifact),
        model=model,
        backend=args.backend,
        tree=args.tree,
        heads=args.heads,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        prefix_cache_mb=args.prefix_cache_mb,
        draft_store_mb=args.draft_store_mb,
        draft_store_shared=args.draft_store_shared,
        threads=args.threads_per_replica or args.threads or 1,
        providers=args.providers,
        replicas=args.replicas or 1,
        autoscale=autoscale,
        target_ongoing_requests=args.target_ongoing_requests,
        api_key=None if args.print_config else (args.api_key or None),
        api_key_file=str(args.api_key_file.resolve()) if args.api_key_file else None,
        metrics_need_key=args.metrics_need_key,
        docs=not args.disable_docs,
        limits=limits,
        tools=tools,
        cors=cors,
        manifest_sha256=args.manifest_sha256,
        drain_seconds=args.drain_seconds,
    )


def serve(app, host: str, port: int, drain_seconds: float, ready=None) -> None:
    """Run `app` under uvicorn until SIGTERM / SIGINT, then drain and return (exit 0, not the signal's)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a captured signal after its graceful shutdown, so the process would die of
            # SIGTERM (exit 143) having drained: handle it, and let main return 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_seconds)
    server = Server(config)
    if ready is not None:
        ready(server)
    server.run()


@dataclass(frozen=True)
class _RequestPolicy:
    """What the server checks each request against: a single server and the Ray replicas get the same."""

    limits: RequestLimits
    tools: ToolOptions
    cors: Cors | None  # None: no CORS headers


def _import_server() -> None:
    """Load the server's modules, with the install hint where the serve extra is missing: a broken install fails
    before any flag is checked or anything loaded."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CloverError(
            f"clover-serve needs the serve extra ({e.name} is missing): pip install 'clover-deploy[serve]'"
        ) from None
    import clover.artifact  # noqa: F401
    import clover.runtime.engine  # noqa: F401
    import clover.serve.app  # noqa: F401


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations and values that need nothing loaded; --demo: point --artifact at its artifact
    (exported into the cache first if missing)."""
    given = [f"--{f.replace('_', '-')}" for f in RAY_FLAGS if getattr(args, f) not in (None, False)]
    if given and not args.ray:
        raise CloverError(f"{given[0]} is an option of clover-serve --ray (Ray Serve): add --ray, or drop it")
    if args.demo:
        from clover.tools.demo import demo_artifact

        args.artifact = demo_artifact()
    if not 0 < args.port < 65536:
        raise CloverError(f"--port must be in 1..65535, got {args.port}")
    if args.drain_seconds < 0:
        raise CloverError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")


def _request_policy(args: argparse.Namespace) -> _RequestPolicy:
    """The request limits, tool-call and CORS options from the flags, and the key of --api-key-file into
    args.api_key: all checked before minutes of loading."""
    from clover.serve.limits import RequestLimits, read_api_key_file
    from clover.serve.tool_calls import ToolOptions

    limits = RequestLimits(
        args.max_stop_strings,
        args.max_stop_chars,
        args.allow_ignore_eos,
        args.max_body_bytes,
        args.max_concurrent_requests,
        args.max_input_tokens,
        args.max_tokens_cap,
        args.max_messages,
        args.max_prompt_chars,
    )
    tools = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.exclude_tools_when_tool_choice_none)
    cors = cors_policy(args)
    if args.api_key_file is not None:
        args.api_key = read_api_key_file(args.api_key_file)
    return _RequestPolicy(limits, tools, cors)


def _run_on_ray(args: argparse.Namespace, policy: _RequestPolicy) -> int:
    """--ray: write the Ray Serve config (--print-config), or serve the artifact's replicas until stopped."""
    from clover.artifact import check_pin, read_manifest
    from clover.serve.ray import config_yaml, serve_on_ray

    if args.base is not None or args.device is not None or args.dtype is not None:
        raise CloverError(
            "--ray serves an artifact (each replica loads it): export the checkpoint with clover-export, and "
            "serve --artifact without --base, --device or --dtype"
        )

    if args.chat_template is not None:
        raise CloverError(
            "--chat-template is not passed to Ray Serve replicas: store the template in the artifact "
            "(clover-export --chat-template FILE_OR_TEMPLATE) and serve that"
        )

    model = args.model or (DEMO_MODEL if args.demo else None)
    options = ray_options(args, policy.limits, model, policy.tools, policy.cors)
    if args.print_config:
        if args.api_key and not args.api_key_file:
            print(
                "clover-serve: the API key is not written to the config: pass --api-key-file PATH (a file on "
                "every node), or set CLOVER_API_KEY in the replicas' environment",
                file=sys.stderr,
            )
        sys.stdout.write(config_yaml(options, args.host, args.port))
        return 0
    if args.address is None:  # a local cluster: fail now rather than in every replica
        read_manifest(args.artifact)
        if args.manifest_sha256 is not None:
            check_pin(args.artifact, args.manifest_sha256)
    return serve_on_ray(options, args.host, args.port, args.address)


def _load_engine(args: argparse.Namespace):
    """The engine over --base (torch backend) or --artifact (its pin checked first), and what it was loaded from."""
    from clover.artifact import check_pin, read_manifest
    from clover.runtime.engine import Engine

    if args.base is not None:
        source, backend = args.base, args.backend or "torch"
        if backend != "torch" or args.manifest_sha256 is not None:
            raise CloverError(
                "--base serves a checkpoint with the torch backend: --backend ort / trt and --manifest-sha256 take "
                "an --artifact (clover-export makes one)"
            )
    else:
        if args.manifest_sha256 is not None:
            check_pin(args.artifact, args.manifest_sha256)
        if args.backend == "torch" or args.dtype is not None:
            raise CloverError("--backend torch and --dtype serve a checkpoint: give it with --base")
        source = args.artifact
        backend = args.backend or ("trt" if read_manifest(args.artifact).backend == "trt" else "ort")
    engine = Engine.load(
        source,
        backend=backend,
        tree=args.tree,
        heads=args.heads,
        options=EngineOptions(
            max_batch=args.max_batch,
            threads=args.threads,
            max_waiting=args.max_waiting,
            prefix_cache_mb=args.prefix_cache_mb,
            draft_store_mb=args.draft_store_mb,
            draft_store_shared=args.draft_store_shared,
            draft_store_dir=args.draft_store_dir,
            providers=args.providers,
            chat_template=args.chat_template,
            dtype=args.dtype,
            device=args.device,
        ),
    )
    return engine, source


def _serve_engine(args: argparse.Namespace, engine, model: str, policy: _RequestPolicy) -> None:
    """Serve `engine` as `model` on --host/--port until SIGTERM / SIGINT, saying what it serves first."""
    from clover.serve.app import AppOptions, create_app

    options = AppOptions(
        api_key=args.api_key or None,
        limits=policy.limits,
        docs=not args.disable_docs,
        metrics_need_key=args.metrics_need_key,
        tools=policy.tools,
        cors=policy.cors,
    )
    app = create_app(engine, model, options)
    print(
        f"clover-serve: serving {model} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, tree "
        f"{args.tree}, drafts {engine.drafts}{', API key required' if args.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    if not engine.tokenizer.has_chat_template:
        print(
            f"clover-serve: {model} has no chat template (a base model): /v1/chat/completions answers 400, "
            "/v1/completions serves plain text (--chat-template FILE_OR_TEMPLATE adds one)",
            file=sys.stderr,
            flush=True,
        )
    serve(app, args.host, args.port, args.drain_seconds)


def run(args: argparse.Namespace) -> int:
    _import_server()
    _check_flags(args)
    policy = _request_policy(args)
    if args.ray:
        return _run_on_ray(args, policy)
    engine, source = _load_engine(args)
    model = args.model or (DEMO_MODEL if args.demo else Path(source).resolve().name)
    try:
        _serve_engine(args, engine, model, policy)
    finally:
        engine.close()
    print("clover-serve: stopped", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-serve", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
