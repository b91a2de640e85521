"""benchmarks/gpu_step.py on a tiny model on the CPU: the same code the GPU runs, its report's figures and its
identity rows (the stacked runner's device-side step against plain greedy, batch 1 and the engine at 8 and 32)."""

import json
from pathlib import Path

from helpers import script_module

GPU_STEP = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_step.py"


def test_quick_run_reports_every_figure_and_identical_tokens(tmp_path):
    with script_module(GPU_STEP) as module:
        data = module.main(["--device", "cpu", "--quick", "--json", str(tmp_path / "report.json")])
    assert json.loads((tmp_path / "report.json").read_text()) == data  # the report on disk is the whole run
    engine = data["engine"]
    for key in (
        "plain_tok_s_135m",
        "spec_over_plain_135m",
        "c32_over_c1_135m",
        "over_hf_compiled",
        "spec_over_plain_8b",
    ):
        assert engine[key] > 0, key
    assert engine["identity_ok"], data["rows"]["identity, stacked runner"]
    assert data["rows"]["tiny batch 1 tokens identical (plain, speculative, both runners)"] is True
    assert data["rows"]["tiny transformers tokens == clover plain"] == {"eager": True}
    assert data["rows"]["tiny engine c1 / c32 tokens/s"]["same"] is True
