"""SmolLM2-135M-Instruct with the shipped Clover-2 heads, exported with --weights int4: speculative decoding
equals plain decoding of the same int4 graphs on real chat prompts, the quantized graphs are recorded and
smaller, and the greedy agreement with fp32 is measured. The export takes about two minutes on 2 CPU cores."""

import pytest
from helpers import assert_identical

from clover.artifact import open_artifact
from clover.export.artifact import export_artifact
from clover.export.config import ExportConfig
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams

pytestmark = pytest.mark.slow
PROMPTS = [
    "Give me three tips for staying healthy.",
    "Explain in a few sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
]
N = 64


@pytest.fixture(scope="module")
def int4(smollm2_path, tmp_path_factory):
    # --tree given: the export-time tree timing is covered by the tiny artifacts
    config = ExportConfig(weights="int4", tree="chain-2")
    return export_artifact(smollm2_path, "smollm2-clover2", tmp_path_factory.mktemp("smollm2") / "int4", config)


def test_int4_speculative_equals_int4_plain(int4):
    plain = Generator.load(int4, heads="none", backend="ort")
    params = GenerationParams(max_new_tokens=N, ignore_eos=True)
    wants = [plain.generate(p, params, chat=True) for p in PROMPTS]  # greedy: one plain run per prompt
    steps = tokens = 0
    for tree in ("chain-2", "mc26"):
        spec = Generator.load(int4, backend="ort", tree=tree)
        for p, want in zip(PROMPTS, wants):
            got = spec.generate(p, params, chat=True)
            assert_identical(got.token_ids, want.token_ids, f"int4 {tree} vs int4 plain, {p!r}")
            steps, tokens = steps + got.steps, tokens + got.new_tokens - 1
    assert tokens / steps > 1.2, "the shipped heads should draft accepted tokens on the int4 base"


def test_int4_artifact_records_its_scheme_and_agreement(int4):
    m = open_artifact(int4)
    assert m.weights.scheme == "int4" and m.weights.embedding == "int4"
    base_bytes = sum(m.files[f]["bytes"] for f in (m.graphs["base"].file, *m.graphs["base"].external_data))
    assert base_bytes < 0.25 * 538e6, base_bytes  # fp32: 538 MB
    assert 0.5 <= m.weights.agreement["top1"] <= 1.0
