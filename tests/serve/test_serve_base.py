"""clover-serve --base: a checkpoint served by the torch backend without an export, with --device the stacked runner
(every sequence in one forward, the whole speculative step on the device). The process starts for real; its answers
equal plain greedy decoding of the same checkpoint, requests at once; the flags that need an artifact are refused
with the fix."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import httpx
import pytest
from helpers import tiny_hf_folder

from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.tools.serve import free_port, wait_healthy
from clover.tools.serve import main as serve_main

PROMPTS = ["w10 w11 w12", "w40 w7", "w33 w34 w35 w36 w37", "w90"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("serve-base") / "base")


def test_base_served_on_the_stacked_runner_equals_plain_greedy(folder):
    plain = Generator.load(folder, None, "torch", "plain")
    want = [plain.generate(p, GenerationParams(max_new_tokens=16, ignore_eos=True)).text for p in PROMPTS]
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clover.tools.serve",
            "--base",
            str(folder),
            "--heads",
            "random:clover2",
            "--device",
            "cpu",
            "--tree",
            "small",
            "--max-batch",
            "4",
            "--port",
            str(port),
            "--model",
            "tiny",
            "--allow-ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CLOVER_API_KEY": ""},
    )
    try:
        if not wait_healthy(port, 120, alive=lambda: proc.poll() is None):
            raise AssertionError(proc.stderr.read() if proc.poll() is not None else "not healthy in 120 s")

        def complete(prompt: str) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert [g["choices"][0]["text"] for g in got] == want
        assert all(g["usage"]["completion_tokens"] == 16 for g in got)
        assert got[0]["clover"]["tree"] == "small" and got[0]["clover"]["acceptance_length"] >= 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--backend", "ort"], "--base serves a checkpoint with the torch backend"),
        (["--manifest-sha256", "0" * 64], "--base serves a checkpoint with the torch backend"),
        (["--ray"], "--ray serves an artifact"),
    ],
)
def test_flags_that_need_an_artifact_are_refused_with_base(folder, capsys, flags, says):
    assert serve_main(["--base", str(folder), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_an_artifact_refuses_the_checkpoint_flags(tmp_path, capsys):
    from ort_helpers import tiny_artifact

    art = tiny_artifact(tmp_path, "clover2")
    for flags, says in (
        (["--device", "cpu"], "use it with --backend torch"),
        (["--dtype", "bfloat16"], "give it with --base"),
        (["--backend", "torch"], "give it with --base"),
    ):
        assert serve_main(["--artifact", str(art), "--port", str(free_port()), *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (flags, err)
