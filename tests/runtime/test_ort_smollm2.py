"""SmolLM2-135M-Instruct exported with random Clover-2 heads and run on ONNX Runtime: logits parity with
PyTorch on a real prompt (prefill and a tree step) and greedy token identity (ORT speculative == ORT
plain == torch plain). The export takes about two minutes on 2 CPU cores."""

import numpy as np
import pytest
from helpers import assert_identical

from clover.export.artifact import export_artifact
from clover.export.config import ExportConfig
from clover.runtime.backends.ort import load_runner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import resolve_tree

pytestmark = pytest.mark.slow
PROMPT = "Explain in a few sentences why the sky is blue."
N = 32
HEADS = "random:clover2:1"


@pytest.fixture(scope="module")
def setup(smollm2_path, tmp_path_factory):
    from clover.models.head_io import resolve_heads
    from clover.models.loading import load_base

    # --tree given: the export-time tree timing is covered by the tiny artifacts
    config = ExportConfig(verify=False, tree="mc26")
    out = export_artifact(smollm2_path, HEADS, tmp_path_factory.mktemp("smollm2") / "art", config)
    base = load_base(smollm2_path)
    return out, base, resolve_heads(HEADS, base), Tokenizer.from_dir(smollm2_path)


def test_logits_parity_on_a_real_prompt(setup):
    out, base, heads, tok = setup
    ids = np.array(tok.encode_chat([{"role": "user", "content": PROMPT}]))
    tree = resolve_tree("mc26")
    ort_runner, torch_runner = load_runner(out), TorchRunner(base, heads)
    for r in (ort_runner, torch_runner):
        r.reset(len(ids) + tree.num_nodes)
    logits = [r.forward(ids, np.arange(len(ids)), np.tri(len(ids), dtype=bool)) for r in (ort_runner, torch_runner)]
    prefill = float(np.abs(logits[0] - logits[1]).max())  # every row of the prompt
    nxt = int(logits[1][-1].argmax())
    for r in (ort_runner, torch_runner):
        r.commit(np.arange(len(ids)), np.append(ids[1:], nxt))
    draft = float(np.abs(ort_runner.draft_begin() - torch_runner.draft_begin()).max())
    tokens = np.array([nxt] + [int(t) for t in np.argsort(-logits[1][-1])[: tree.num_nodes - 1]])
    verify = [r.forward(tokens, tree.depth, tree.ancestor_mask) for r in (ort_runner, torch_runner)]
    step = float(np.abs(verify[0] - verify[1]).max())
    print(
        f"\nSmolLM2 fp32 max |ORT - torch| logits: prefill {prefill:.2e}, mc26 verify {step:.2e}, "
        f"clover2 draft_begin {draft:.2e}"
    )
    assert prefill < 1e-3 and step < 1e-3 and draft < 1e-3


def test_greedy_identity_ort_speculative_ort_plain_torch_plain(setup):
    out, base, _, tok = setup
    torch_plain = Generator(TorchRunner(base), tok).generate(
        PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True
    )
    ort_plain = Generator.load(out, heads="none", backend="ort").generate(
        PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True
    )
    assert_identical(ort_plain.token_ids, torch_plain.token_ids, "ORT plain vs torch plain")
    for tree in (None, "small"):
        gen = Generator.load(out, backend="ort", tree=tree)
        r = gen.generate(PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True)
        assert_identical(r.token_ids, torch_plain.token_ids, f"ORT {gen.tree.name} vs torch plain")
    print(
        f"\nSmolLM2 ({N} tokens): torch plain {torch_plain.tokens_per_second:.1f} tok/s, ORT plain "
        f"{ort_plain.tokens_per_second:.1f} tok/s (one run on a shared CPU, not a benchmark)"
    )


def test_json_schema_requests_at_concurrency_8_equal_solo_constrained(setup):
    """The serving path on the real base: 8 concurrent requests, JSON-schema ones beside free ones, each equal
    to solo plain (constrained) decoding on the same graphs, every finished JSON output valid."""
    pytest.importorskip("llguidance")
    import json

    import jsonschema

    from clover.runtime.engine import Engine
    from clover.runtime.grammar import Grammar

    out, _, _, tok = setup
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "rain": {"type": "boolean"}, "days": {"type": "integer"}},
        "required": ["city", "rain", "days"],
        "additionalProperties": False,
    }
    asks = [
        (f"{q} Answer as JSON following {json.dumps(schema)}", Grammar.json_schema(schema)) if i % 2 else (q, None)
        for i, q in enumerate(
            ["Will it rain in Paris?", "Weather in Oslo?", "Is Rome sunny?", "Forecast for Lima?"] * 2
        )
    ]
    plain = Generator.load(out, heads="none", backend="ort")
    want = [plain.generate(q, GenerationParams(max_new_tokens=40, grammar=g), chat=True) for q, g in asks]
    with Engine.load(out, tree="mc26", log=None, options=EngineOptions(max_batch=8)) as engine:
        streams = [engine.stream(q, GenerationParams(max_new_tokens=40, grammar=g), chat=True) for q, g in asks]
        for (q, g), s, w in zip(asks, streams, want):
            r = s.wait()
            assert_identical(r.token_ids, w.token_ids, f"concurrency 8 {'json' if g else 'free'} {q[:20]!r}")
            if g is not None and r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), schema)
