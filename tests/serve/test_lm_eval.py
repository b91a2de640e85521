"""lm-evaluation-harness itself scores the served model through `local-completions`, with its remote tokenizer
(/tokenizer_info, /tokenize, /detokenize): a loglikelihood task and a generate_until task shipped in tests/serve/lm_eval/
(no hub download). Its per-sample numbers are checked against the server's own answers to the same prompts."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import Server
from ort_helpers import tiny_artifact

from clover.runtime.engine import Engine, EngineOptions

pytest.importorskip("lm_eval")
TASKS = Path(__file__).with_name("lm_eval")
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifact = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")
    engine = Engine.load(artifact, log=None, options=EngineOptions(max_batch=4))
    s = Server(engine, MODEL)
    yield s
    s.close()
    engine.close()


def samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def completion(server, **body) -> dict:
    r = httpx.post(server.url + "/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_scores_the_served_model(server, tmp_path):
    for name in ("choice.yaml", "until.yaml"):
        text = (TASKS / name).read_text().replace("test: DATA", f"test: {TASKS / 'tiny.jsonl'}")
        (tmp_path / name).write_text(text)
    out = tmp_path / "out"
    args = f"model={MODEL},base_url={server.url}/completions,tokenizer_backend=remote,num_concurrent=2,max_retries=1"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
        + ["--tasks", "clover_tiny_choice,clover_tiny_until", "--include_path", str(tmp_path)]
        + ["--batch_size", "2", "--output_path", str(out), "--log_samples"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    scores = json.loads(Path(results).read_text())["results"]
    assert 0 <= scores["clover_tiny_choice"]["acc,none"] <= 1
    assert 0 <= scores["clover_tiny_until"]["exact_match,none"] <= 1
    tok = server.engine.tokenizer
    docs = samples(out, "clover_tiny_choice")
    assert len(docs) == 6
    for s in docs:
        context = tok.encode(s["doc"]["context"], add_special_tokens=False)
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            # the continuation's log-probability, from the server's own answer to the whole text alone
            ids = context + tok.encode(choice, add_special_tokens=False)
            lp = completion(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
            assert float(resp[0][0]) == pytest.approx(sum(lp["token_logprobs"][len(context) :]), abs=1e-6)
    generated = samples(out, "clover_tiny_until")
    assert len(generated) == 6
    for s in generated:
        want = completion(server, prompt=s["doc"]["context"], max_tokens=6, stop=["w4"])["choices"][0]["text"]
        assert s["resps"][0][0] == want
