"""`clover-serve --ray --replicas 2` end to end, as a user runs it: the CLI starts a local Ray cluster on this
machine, deploys 2 replicas of the tiny fused artifact behind Serve's proxy on 127.0.0.1, answers the official
`openai` client with solo plain decoding's text from both replicas, and stops cleanly (exit 0) on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from ort_helpers import tiny_artifact

from clover.runtime.backends.ort import load_runner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools.serve import free_port, wait_healthy

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'clover-deploy[ray]')")
openai = pytest.importorskip("openai")

PROMPTS = [f"w{12 + i} w{30 + (i * 5) % 50} w31 w{44 + i}" for i in range(8)]


def test_clover_serve_ray_replicas_2_serves_and_stops(tmp_path_factory):
    artifact = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clover.tools.serve",
            "--artifact",
            str(artifact),
            "--model",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ray",
            "--replicas",
            "2",
            "--threads-per-replica",
            "1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_healthy(port, 180, alive=lambda: proc.poll() is None), "not healthy in 180 s"
        gen = Generator(load_runner(artifact, heads="none"), Tokenizer.from_dir(artifact / "tokenizer"), "plain")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            want = gen.generate([{"role": "user", "content": prompt}], GenerationParams(max_new_tokens=16)).text
            r = c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=16
            )
            assert r.choices[0].message.content == want
        # both replicas on the board: the proxy is healthy once one replica is, and each publishes every second
        deadline = time.time() + 60
        while True:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines() if 'replica="' in line}
            if len(replicas) == 2 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert len(replicas) == 2, replicas
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log = proc.stderr.read()
    assert code == 0, log[-2000:]
    assert "through Ray Serve (2 replica(s) x 1 thread(s)" in log and "clover-serve: stopped" in log, log[-2000:]
    # the local cluster takes requests through HAProxy (the ray extra brings its binary), not the Python proxy
    assert "ingress: HAProxy" in log, log[-2000:]
