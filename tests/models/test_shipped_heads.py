"""The trained heads shipped for SmolLM2 load by name, stay lossless, and actually predict the base."""

import json

import pytest

from clover.models.head_io import PRETRAINED_DIR, pretrained_names, read_head_config, resolve_heads
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.tokenizer import Tokenizer

SHIPPED = {"smollm2-medusa": "medusa", "smollm2-clover": "clover", "smollm2-clover2": "clover2"}
PROMPTS = ["Write a short poem about the sea.", "What are the main causes of climate change? Answer briefly."]


def test_every_shipped_head_set_is_present_with_provenance():
    assert set(SHIPPED) <= set(pretrained_names())
    for name, arch in SHIPPED.items():
        cfg = read_head_config(PRETRAINED_DIR / name)
        assert cfg.arch == arch and cfg.base_config.architecture == "LlamaForCausalLM"
        prov = json.loads((PRETRAINED_DIR / name / "training.json").read_text())
        assert prov["command"].startswith("clover-train ") and prov["train_config"]["arch"] == arch
        assert prov["epochs"] and prov["data"]["train_loss_tokens"] > 0 and prov["wall_seconds"] > 0


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from clover.models.loading import load_base

    base = load_base(smollm2_path)
    tok = Tokenizer.from_dir(smollm2_path)
    plain = Generator(TorchRunner(base), tok)
    refs = [plain.generate(p, GenerationParams(max_new_tokens=48, ignore_eos=True), chat=True) for p in PROMPTS]
    return base, tok, refs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_heads_are_lossless_and_accept_tokens(smollm2, name):
    base, tok, refs = smollm2
    gen = Generator(TorchRunner(base, resolve_heads(name, base), heads_name=name), tok)
    accepted = []
    for prompt, ref in zip(PROMPTS, refs):
        r = gen.generate(prompt, GenerationParams(max_new_tokens=48, ignore_eos=True), chat=True)
        assert r.token_ids == ref.token_ids
        accepted.append(r.tokens_per_step)
    # untrained heads accept ~1.0-1.15 tokens/step here; trained ones must do better
    assert sum(accepted) / len(accepted) > 1.25, accepted
