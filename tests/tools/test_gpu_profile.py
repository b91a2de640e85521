"""The GPU check's kit on the CPU (what CI can run): `clover-doctor --full` exits 3 with every GPU row explained and
writes its JSON report; the measurements' CPU-runnable parts (identity on every head type at batch 1 and through the
engine, the verify-cost curve, the loop's step times, the projection from the CPU's acceptance, tree auto's pick)
give sane results on small shapes; CUDA graphs are refused off CUDA. On a GPU (marked gpu): the graphed runner is
token-identical to plain greedy decoding."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from clover.errors import CloverError
from clover.models.head_io import random_heads
from clover.runtime.backends.torch_runner import TorchRunner, row_bucket
from clover.runtime.params import GenerationParams
from clover.tools import doctor
from clover.tools import gpu_profile as gp
from clover.tools.machine import cpu_info

SMALL = dataclasses.replace(gp.SHAPES["135m"], num_layers=2, vocab_size=512)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(base, clover2 heads, tokenizer): SmolLM2's width at 2 layers and a 512-word vocabulary."""
    base = gp.random_decoder(SMALL)
    return base, random_heads(base, "clover2", 0), gp.word_tokenizer(tmp_path_factory.mktemp("tok"), SMALL.vocab_size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report of a machine without CUDA")
def test_full_check_without_cuda_exits_3_with_every_gpu_row_explained(tmp_path, monkeypatch, capsys):
    report = tmp_path / "gpu_check.json"
    code = doctor.main(["--no-real-model", "--full", "--only", "GPU", "--json", str(report)])
    assert code == doctor.EXIT_NOT_AVAILABLE == 3
    doc = json.loads(report.read_text())
    assert [r["check"] for r in doc["rows"]] == [name for name, _ in doctor.GPU_CHECKS]
    for row in doc["rows"]:
        assert row["result"] == doctor.NOT_AVAILABLE and row["detail"].startswith("no CUDA device"), row
    assert doc["exit"] == 3 and doc["options"]["full"] is True
    assert doc["machine"]["cpu"]["cores"] >= 1 and "gpu" not in doc["machine"]
    assert set(doc["data"]["seconds"]) == {name for name, _ in doctor.GPU_CHECKS}
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"0 passed, 0 failed, {len(doctor.GPU_CHECKS)} not available: exit 3")


def test_only_that_matches_no_row_is_a_usage_error(capsys):
    assert doctor.main(["--only", "no such row"]) == 2
    assert "matches no row" in capsys.readouterr().err


def test_cpu_info_names_the_vector_isa():
    text = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx2 fma avx512f "
        "avx512_vnni amx_tile amx_int8\nprocessor\t: 1\nmodel name\t: other\n"
    )
    info = cpu_info(text)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["isa"] == ["AVX2", "FMA", "AVX-512", "AVX512-VNNI", "AMX", "AMX-INT8"]
    assert cpu_info("model name\t: AMD EPYC\nflags\t: avx2 fma\n")["isa"] == ["AVX2", "FMA"]


def test_random_decoder_at_smollm2s_depth_writes_varied_greedy_text(tmp_path):
    cfg = dataclasses.replace(gp.SHAPES["135m"], vocab_size=2048)  # all 30 layers, a smaller vocabulary
    base = gp.random_decoder(cfg)
    assert base.lm_head.weight is base.embed_tokens.weight and base.config == cfg
    from clover.runtime.generator import Generator

    gen = Generator(TorchRunner(base), gp.word_tokenizer(tmp_path, cfg.vocab_size))
    outs = [
        gen.generate(p, GenerationParams(max_new_tokens=24, ignore_eos=True)).token_ids
        for p in gp.prompts(cfg.vocab_size, 3)
    ]
    assert all(len(set(o)) > 12 for o in outs), outs  # no loop on one token: identity checks see real text


def test_identity_every_head_type_batch_1_and_engine(small):
    base, _, tok = small
    result = gp.identity(base, tok, "cpu", graphs=False, tokens=12, concurrency=3)
    assert result["ok"], result
    assert [c["arch"] for c in result["cases"]] == ["medusa", "medusa", "clover", "clover", "clover2", "clover2"]
    assert [c["tree"] for c in result["cases"][::2]] == ["chain-3"] * 3
    assert all(c["nodes"] > 10 for c in result["cases"][1::2])  # the default tree, branching, at the heads' depth
    assert all(c["engine_identical"] == "3/3" for c in result["cases"])
    assert gp.identity_line(result).startswith("6 cases (medusa, clover, clover2 x chain + tree): batch 1 6/6")


def test_margin_at_reads_plain_greedys_top2_margin(small):
    base, _, _ = small
    runner = TorchRunner(base)
    ids = gp.prompts(SMALL.vocab_size, 1)[0]
    runner.reset(len(ids) + 1)
    logits = runner.forward(np.array(ids), np.arange(len(ids)), np.tri(len(ids), dtype=bool))
    top = np.sort(logits[5])
    assert gp.margin_at(TorchRunner(base), ids, 6) == pytest.approx(top[-1] - top[-2], abs=1e-4)


def test_curve_host_time_projection_and_tree_auto_on_the_cpu(small):
    base, heads, tok = small
    points = gp.curve(base, graphs=False, kv=40, rows=(1, 4, 16), reps=2)
    assert [p.rows for p in points] == [1, 4, 16] and all(p.runner_ms > 0 for p in points)
    assert "1 row" in gp.curve_line({"cpu": points})

    rows = gp.host_time(base, heads, tok, ("plain", "chain-2", "small"), graphs=False, tokens=8)
    assert [r["tree"] for r in rows] == ["plain", "chain-2", "small"] and all(r["step_ms"] > 0 for r in rows)
    steps = {(r["tree"], r["graphs"]): r["step_ms"] for r in rows}

    acceptance = gp.cpu_acceptance()
    assert {(a["prompts"], a["tree"]) for a in acceptance} >= {("mtbench", "chain-2"), ("code", "chain-2")}
    assert all(a["tokens_per_step"] > 1 and a["drafts"].startswith("smollm2-clover2") for a in acceptance)
    projected = gp.projection(steps, acceptance)
    one = next(p for p in projected if p["tree"] == "chain-2")
    assert one["projected_speedup"] == pytest.approx(
        one["tokens_per_step"] * steps[("plain", False)] / steps[("chain-2", False)], abs=1e-3
    )

    rates = gp.cpu_depth_rates()
    picked = gp.tree_auto(base, heads, tok, False, rates["top1"], rates["top3"])
    assert picked["levels"][0] == "plain" and 0 <= picked["picked_level"] < len(picked["levels"])
    assert picked["expected_tokens"][0] == 1.0 and picked["expected_tokens"] == sorted(picked["expected_tokens"])
    assert set(picked["rows_ms"]) >= {1, 2, 4}


def test_kernel_rows_check_the_kernel_on_the_runtimes_trees():
    """In a process of its own under TRITON_INTERPRET=1 (set before triton is imported); fp16 only (the
    interpreter's bf16 dot is numpy's, which has no bf16)."""
    code = (
        "import json, torch; from clover.tools import gpu_profile as gp; print(json.dumps(gp.kernel_rows("
        "'cpu', ('135m',), ('plain', 'small'), (40,), timed_past=None, dtypes=(torch.float16,))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["tree"], r["new_tokens"], r["past"]) for r in rows] == [("plain", 1, 40), ("small", 10, 40)]
    assert all(r["correct"] and r["max_abs_err"] <= r["tolerance"] and "speedup" not in r for r in rows), rows


def test_cuda_graphs_need_a_cuda_device(small):
    base, _, _ = small
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA")
    with pytest.raises(CloverError, match="cuda_graphs needs the model on a CUDA device"):
        TorchRunner(base, cuda_graphs=True)


def test_row_buckets_are_powers_of_two():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 26, 64, 65)] == [1, 2, 4, 4, 8, 32, 64, 128]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_are_token_identical_to_plain_greedy(small):
    base, _, tok = small
    result = gp.identity(base, tok, "cuda", graphs=True, tokens=16, concurrency=4)
    assert result["ok"], json.dumps(result, indent=1)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
