"""Greedy identity on the real base model (SmolLM2-135M-Instruct): every head type and several trees
give plain decoding's tokens; the oracle draft (plain decoding's own continuation) accepts long paths."""

import pytest
from helpers import OracleRunner, assert_identical

from clover.models.head_io import random_heads
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
PROMPT = "Explain in a few sentences why the sky is blue."
N = 40


@pytest.fixture(scope="module")
def setup(smollm2_path):
    from clover.models.loading import load_base

    base = load_base(smollm2_path)
    tok = Tokenizer.from_dir(smollm2_path)
    plain = Generator(TorchRunner(base), tok).generate(
        PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True
    )
    return base, tok, plain


@pytest.mark.parametrize(
    "arch,tree",
    [
        ("medusa", None),
        ("medusa", "chain-2"),
        ("clover", None),
        ("clover2", None),
        ("clover2", "small"),
        ("clover2", "chain-5"),
    ],
)
def test_random_heads_are_lossless_on_smollm2(setup, arch, tree):
    base, tok, plain = setup
    gen = Generator(TorchRunner(base, random_heads(base, arch, seed=1)), tok, tree=tree)
    r = gen.generate(PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True)
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    assert_identical(r.token_ids, plain.token_ids, f"{arch} {gen.tree.name}", TorchRunner(base), ids)


def test_oracle_draft_on_smollm2(setup):
    base, tok, plain = setup
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    gen = Generator(OracleRunner(base, ids + plain.token_ids), tok, tree="mc26")
    r = gen.generate(PROMPT, GenerationParams(max_new_tokens=N, ignore_eos=True), chat=True)
    assert_identical(r.token_ids, plain.token_ids, "oracle mc26", TorchRunner(base), ids)
    assert r.tokens_per_step > 3
    print(f"oracle tokens/step on SmolLM2 (mc26): {r.tokens_per_step:.2f}; steps {r.steps}")


def test_json_schema_output_equals_plain_constrained_on_smollm2(setup):
    """A JSON-schema request on the real base: the shipped Clover-2 heads (branching and dynamic trees), Medusa
    heads (a chain), prompt lookup (pruned by the grammar) and plain constrained decoding give the same tokens, and
    the output validates."""
    pytest.importorskip("llguidance")
    import json

    import jsonschema

    from clover.runtime.grammar import Grammar

    base, tok, _ = setup
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["blue", "red", "green"]},
            "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "confidence": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["color", "reasons", "confidence"],
        "additionalProperties": False,
    }
    prompt = [{"role": "user", "content": f"{PROMPT} Answer as JSON following {json.dumps(schema)}"}]
    grammar = Grammar.json_schema(schema)
    want = Generator(TorchRunner(base), tok).generate(
        prompt, GenerationParams(max_new_tokens=96, grammar=grammar), chat=True
    )
    from clover.models.head_io import resolve_heads

    shipped = resolve_heads("smollm2-clover2", base)
    for gen in (
        Generator(TorchRunner(base, shipped), tok, "small"),
        Generator(TorchRunner(base, shipped), tok, "dynamic-8"),
        Generator(TorchRunner(base, random_heads(base, "medusa", seed=1)), tok, "chain-3"),
        Generator(TorchRunner(base), tok, "chain-8", drafts="lookup"),
    ):
        got = gen.generate(prompt, GenerationParams(max_new_tokens=96, grammar=grammar), chat=True)
        assert_identical(got.token_ids, want.token_ids, f"{gen.drafts} {gen.tree.name} json_schema")
    if want.finish_reason == "stop":
        jsonschema.validate(json.loads(want.text), schema)
    print(f"SmolLM2 JSON ({want.finish_reason}): {want.text}")
