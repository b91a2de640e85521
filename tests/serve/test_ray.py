"""clover-serve on Ray Serve for real: a local Ray cluster on 127.0.0.1 (started once for the module), 2 replicas of
the tiny fused artifact behind Serve's HTTP proxy, driven by the official `openai` client and raw HTTP. Greedy
answers equal solo plain decoding, requests reach both replicas, bad requests get the single-process server's
bodies, a killed replica costs clean errors and comes back, a scale-down lets the streams in flight finish."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from helpers import Server
from ort_helpers import tiny_artifact

from clover.runtime.backends.ort import load_runner
from clover.runtime.engine import Engine
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools.serve import free_port

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'clover-deploy[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'clover-deploy[ray]')")
openai = pytest.importorskip("openai")

from clover.serve.ray import APP_NAME, DEPLOYMENT, RayServeOptions, application, local_cluster_env  # noqa: E402

MODEL = "tiny"
PROMPTS = [f"w{10 + i} w{20 + (i * 7) % 60} w30 w{40 + i}" for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")


def options(artifact, **kw) -> RayServeOptions:
    from clover.serve.limits import RequestLimits

    base = dict(
        artifact=str(artifact),
        model=MODEL,
        tree="auto",
        max_batch=4,
        max_waiting=64,
        threads=1,
        replicas=2,
        limits=RequestLimits(allow_ignore_eos=True),
        drain_seconds=30.0,
        health_check_period_s=1.0,
        health_check_timeout_s=10.0,
        metrics_publish_s=0.5,
    )
    return RayServeOptions(**{**base, **kw})


def replica_states() -> dict[str, int]:
    app = serve.status().applications.get(APP_NAME)
    return {} if app is None else {str(k): v for k, v in app.deployments[DEPLOYMENT].replica_states.items()}


def wait_replicas(running: int, seconds: float) -> dict[str, int]:
    deadline = time.time() + seconds
    while time.time() < deadline:
        states = replica_states()
        if states.get("ReplicaState.RUNNING", states.get("RUNNING", 0)) == running and len(states) == 1:
            return states
        time.sleep(0.25)
    raise AssertionError(f"not {running} running replicas within {seconds} s: {replica_states()}")


@pytest.fixture(scope="module")
def cluster(artifact, tmp_path_factory):
    """A local cluster (4 logical CPUs on whatever cores there are), Serve's proxy on 127.0.0.1:<free port>, 2
    replicas; yields the /v1 base URL."""
    port = free_port()
    local_cluster_env()  # what clover-serve --ray starts a local cluster with (the HAProxy ingress)
    ray.init(
        address="local",
        num_cpus=4,
        object_store_memory=100_000_000,
        include_dashboard=False,
        logging_level="WARNING",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # external_scaler_enabled: the scale-down test sets the replica count the way Serve's REST scale API does
        serve.run(application(options(artifact)), name=APP_NAME, route_prefix="/", external_scaler_enabled=True)
        wait_replicas(2, 60)
        url = f"http://127.0.0.1:{port}/v1"
        wait_both_replicas_answer(url, 60)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def solo(artifact):
    """Plain greedy decoding of each prompt alone (same graphs): what every greedy request must return."""
    gen = Generator(load_runner(artifact, heads="none"), Tokenizer.from_dir(artifact / "tokenizer"), "plain")
    return lambda prompt, **kw: (
        gen.generate(
            [{"role": "user", "content": prompt}],
            GenerationParams(max_new_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw),
        ).text
    )


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def served_by_replica(url: str) -> dict[str, float]:
    """Finished requests by replica label, from /metrics (every live replica's series, through any replica)."""
    out: dict[str, float] = {}
    for name, value in metrics(url).items():
        if name.startswith("clover:request_success_total{"):
            replica = name.split('replica="')[1].split('"')[0]
            out[replica] = out.get(replica, 0.0) + value
    return out


def wait_both_replicas_answer(url: str, seconds: float) -> None:
    """HAProxy learns of a replica a moment after Serve reports it running (it reloads its config): send a few
    small concurrent requests until both replicas have answered some (leastconn spreads concurrent ones)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        chat_many(url, PROMPTS[:4], False, max_tokens=4)
        if len([n for n in served_by_replica(url).values() if n > 0]) == 2:
            return
        time.sleep(0.5)
    raise AssertionError(f"requests did not reach both replicas within {seconds} s: {served_by_replica(url)}")


def chat_many(url: str, prompts: list[str], stream: bool, max_tokens: int = MAX_TOKENS, **extra) -> list[str]:
    async def one(c, prompt):
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=max_tokens,
            stream=stream,
            **extra,
        )
        r = await c.chat.completions.create(**kw)
        if not stream:
            return r.choices[0].message.content
        return "".join([ch.choices[0].delta.content or "" async for ch in r if ch.choices])

    async def main():
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    return asyncio.run(main())


def test_sixteen_concurrent_chats_equal_solo_streamed_and_not_and_reach_both_replicas(cluster, solo):
    before = served_by_replica(cluster)
    for stream in (False, True):
        got = chat_many(cluster, PROMPTS, stream)
        for p, text in zip(PROMPTS, got):
            assert text == solo(p), (stream, p)
    deadline = time.time() + 10  # replicas publish their metrics every 0.5 s
    while time.time() < deadline:
        after = served_by_replica(cluster)
        served = {r: n - before.get(r, 0.0) for r, n in after.items()}
        if sum(served.values()) >= 32 and len([n for n in served.values() if n > 0]) == 2:
            break
        time.sleep(0.25)
    assert sum(served.values()) >= 32 and len([n for n in served.values() if n > 0]) == 2, served
    models = openai.OpenAI(base_url=cluster, api_key="unused", max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(cluster.removesuffix("/v1") + "/health", timeout=5).json() == {"status": "ok"}


def test_bad_requests_get_the_single_process_servers_status_and_body(cluster, artifact):
    engine = Engine.load(artifact, tree="plain", log=None, options=EngineOptions(max_batch=2))
    single = Server(engine, MODEL)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4}
    cases = [
        ("/chat/completions", "{not json"),
        ("/chat/completions", {**chat, "temperature": -1}),
        ("/chat/completions", {**chat, "n": 0}),
        ("/chat/completions", {**chat, "messages": []}),
        ("/chat/completions", {**chat, "model": "gpt-9"}),
        ("/chat/completions", {**chat, "max_tokens": 10**6}),
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": "w7 " * 400}]}),
        ("/completions", {"model": MODEL, "prompt": [1, 2, 99999999], "max_tokens": 4}),
        ("/completions", {"model": MODEL, "prompt": "w1", "stop": ["w"] * 100}),
        ("/completions", b"x" * (3 * 2**20)),
        ("/nothing", {}),
    ]
    try:
        for path, body in cases:
            content = body if isinstance(body, (str, bytes)) else json.dumps(body)
            answers = [
                httpx.post(base + path, content=content, headers={"content-type": "application/json"}, timeout=30)
                for base in (cluster, single.url)
            ]
            (ray_status, ray_body), (one_status, one_body) = [(r.status_code, r.json()) for r in answers]
            assert 400 <= one_status < 500, (path, one_body)
            assert (ray_status, ray_body) == (one_status, one_body), path
    finally:
        single.close()
        engine.close()


def test_an_app_under_a_route_prefix_checks_the_api_key_and_answers(cluster, artifact, solo):
    """Serve mounts an application under its route prefix (ASGI root_path): the key is still required on /v1."""
    serve.run(application(options(artifact, replicas=1, api_key="sesame")), name="keyed", route_prefix="/keyed")
    base = cluster.removesuffix("/v1") + "/keyed/v1"
    try:
        r = httpx.post(base + "/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        c = openai.OpenAI(base_url=base, api_key="sesame", max_retries=0)
        assert [m.id for m in c.models.list().data] == [MODEL]
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=MAX_TOKENS
        )
        assert r.choices[0].message.content == solo(PROMPTS[0])
    finally:
        serve.delete("keyed")


def replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{DEPLOYMENT}#" in a["name"])


def long_streams(url: str, prompts: list[str], during=None) -> list[str]:
    """Stream every prompt's 200 tokens at once (raw SSE); once each has its first event, run `during()` (in a
    thread) beside them. Each stream's text, or "(no [DONE])" for one cut short."""
    started, texts = asyncio.Event(), {}

    async def one(h, i, prompt):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        parts, done = [], False
        try:
            async with h.stream("POST", url + "/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        parts += [c["delta"].get("content") or "" for c in json.loads(line[6:]).get("choices", [])]
                        texts.setdefault(i, None)
                        if len(texts) == len(prompts):
                            started.set()
        except httpx.HTTPError as e:
            parts = [f"({type(e).__name__})"]
        texts[i] = "".join(parts) if done else f"(no [DONE]) {''.join(parts)}"

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10)) as h:
            tasks = [asyncio.create_task(one(h, i, p)) for i, p in enumerate(prompts)]
            if during is not None:
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.to_thread(during, tasks)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)

    asyncio.run(main())
    return [texts[i] for i in range(len(prompts))]


def test_a_killed_replica_costs_clean_errors_and_comes_back(cluster, solo):
    """One replica's actor is killed while 32 long requests run (half streamed): each ends within a bound, with its
    solo text or a clean 5xx (a stream under way is cut short); new requests succeed at once; Serve replaces the
    replica."""
    before = replica_actors()
    assert len(before) == 2, before
    want = {p: solo(p, max_tokens=200, ignore_eos=True) for p in PROMPTS}
    outcomes = []

    async def one(c, prompt, stream):
        t0 = time.perf_counter()
        try:
            r = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=200,
                stream=stream,
                extra_body={"ignore_eos": True},
            )
            text = (
                "".join([ch.choices[0].delta.content or "" async for ch in r if ch.choices])
                if stream
                else r.choices[0].message.content
            )
            outcome = "ok" if text == want[prompt] else "cut" if stream and want[prompt].startswith(text) else "bad"
        except openai.APIStatusError as e:
            outcome = e.status_code
        except openai.APIError as e:  # a stream whose connection ended mid-way
            outcome = type(e).__name__ if stream else f"bad: {e!r}"
        outcomes.append((outcome, round(time.perf_counter() - t0, 2)))

    async def main():
        async with openai.AsyncOpenAI(base_url=cluster, api_key="unused", max_retries=0, timeout=60) as c:
            tasks = [asyncio.create_task(one(c, p, i % 2 == 1)) for i, p in enumerate(PROMPTS * 2)]
            while len(outcomes) < 2:  # both replicas are decoding
                await asyncio.sleep(0.01)
            ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert len(outcomes) == 32
    assert all(o in ("ok", "cut") or (isinstance(o, int) and 500 <= o < 600) or "Error" in str(o) for o, _ in outcomes)
    assert not any(str(o).startswith("bad") for o, _ in outcomes), outcomes
    assert any(o != "ok" for o, _ in outcomes), f"no request was on the killed replica: {outcomes}"
    assert max(s for _, s in outcomes) < 30, outcomes
    assert chat_many(cluster, PROMPTS[:4], stream=False) == [solo(p) for p in PROMPTS[:4]]  # new requests succeed
    deadline = time.time() + 90
    while (len(replica_actors()) != 2 or before[0] in replica_actors()) and time.time() < deadline:
        time.sleep(0.25)
    after = replica_actors()
    assert len(after) == 2 and before[0] not in after and before[1] in after, (before, after)
    wait_replicas(2, 60)
    assert chat_many(cluster, PROMPTS[4:8], stream=True) == [solo(p) for p in PROMPTS[4:8]]


def test_scaling_down_lets_the_streams_in_flight_finish(cluster, solo):
    """48 long streams over the 2 replicas (each decodes 4 and queues the rest); once each has its first event, the
    deployment is scaled to 1 replica (Serve's external-scaler call, what its REST scale endpoint does): a replica
    stops while streams run on it, and every stream still ends with [DONE] and its whole solo text."""
    from ray.serve._private.common import DeploymentID

    prompts = PROMPTS * 3
    seen = []

    def scale_down(tasks):
        controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=DEPLOYMENT, app_name=APP_NAME), 1))
        while not all(t.done() for t in tasks):
            seen.append(replica_states())
            time.sleep(0.1)

    texts = long_streams(cluster, prompts, during=scale_down)
    assert texts == [solo(p, max_tokens=200, ignore_eos=True) for p in prompts]
    assert any(any("STOPPING" in k for k in states) for states in seen), f"no replica stopped mid-load: {seen}"
    wait_replicas(1, 60)


def test_print_config_is_a_serve_deploy_config_with_every_option(artifact, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    key = tmp_path / "key"
    key.write_text("sesame\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "clover.tools.serve",
            "--ray",
            "--print-config",
            "--artifact",
            str(artifact),
            "--autoscale",
            "1:3",
            "--threads-per-replica",
            "2",
            "--max-batch",
            "6",
            "--max-waiting",
            "10",
            "--api-key-file",
            str(key),
            "--host",
            "0.0.0.0",
            "--port",
            "8123",
            "--max-stop-strings",
            "2",
            "--heads",
            "lookup",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    import yaml

    doc = yaml.safe_load(out.stdout)
    ServeDeploySchema.model_validate(doc)
    assert doc["http_options"] == {"host": "0.0.0.0", "port": 8123}
    app = doc["applications"][0]
    args = RayServeOptions.from_args(app["args"])
    assert args.artifact == str(artifact.resolve()) and args.api_key is None and args.api_key_file == str(key)
    assert (args.autoscale, args.threads, args.max_batch, args.limits.max_stop_strings) == ((1, 3), 2, 6, 2)
    assert args.heads == "lookup"
    deployment = app["deployments"][0]
    assert deployment["max_ongoing_requests"] == 16 and deployment["ray_actor_options"] == {"num_cpus": 2}
    assert deployment["autoscaling_config"]["max_replicas"] == 3
    assert "sesame" not in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "clover.tools.serve", "--artifact", str(artifact), "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--ray" in bad.stderr and "Traceback" not in bad.stderr
