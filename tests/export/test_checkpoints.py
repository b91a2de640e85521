"""Checkpoints as users bring them, made by transformers here (no downloads): Llama, Llama with Llama-3 RoPE
scaling, Mistral with a sliding window shorter than prompt + answer, Qwen2 with its qkv biases, Qwen3 with its
per-head q/k norms, OLMo-2 with its norms on the sublayers' outputs and the whole q/k projections, Phi-3 with its fused projections
and Phi-4-mini's partial rotary and Phi-3.5's LongRoPE, Gemma 2 (scaled embedding, 1 + w norms around each sublayer,
GeGLU, soft-capped scores and logits, sliding layers between global ones) and Gemma 3 (q/k norms, its sliding layers'
own RoPE); stored in float32
or bfloat16, sharded with an index, tied and untied embeddings, `eos_token_id` a list, and a base model's tokenizer
(no chat template). Clover's greedy output equals transformers' greedy `generate`, token for token and stopping
where it stops, on the torch backend and on ONNX exports (fused attention where the family allows it, portable
otherwise), plain and speculative with random heads. Each family is exported once per module."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, tiny_tokenizer_dir

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.export.artifact import export_artifact
from clover.export.config import ExportConfig
from clover.models.config import BaseConfig
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams

transformers = pytest.importorskip("transformers")

VOCAB = 300
PROMPTS = ([5, 17, 33, 120, 250, 7], [9, 44, 201, 63, 12, 290, 88])
NEW = 20  # generated tokens: prompt + answer is longer than Mistral's window
WINDOW = 8
NEVER = VOCAB - 1  # the tokenizer's EOS, first of each eos_token_id list


@dataclass(frozen=True)
class Family:
    """One checkpoint: transformers' config class and its options, and how it is stored."""

    name: str
    config: str  # transformers config class
    dtype: torch.dtype  # of the stored weights
    tied: bool
    options: tuple[tuple[str, object], ...] = ()

    def hf_config(self):
        return getattr(transformers, self.config)(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            initializer_range=0.2,  # peaked next-token laws: no near ties for rounding to flip
            tie_word_embeddings=self.tied,
            **dict(self.options),
        )


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# Phi-3.5's scaling: 64 positions of original context in a 128 one (each frequency's own short factor, cos and sin
# scaled by sqrt(1 + ln 2 / ln 64)); prompt + answer stay within the 64
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
    "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0],
    "original_max_position_embeddings": 64,
}
GEMMA = (("head_dim", 16), ("query_pre_attn_scalar", 24), ("sliding_window", WINDOW), ("pad_token_id", 0))
GEMMA = (*GEMMA, ("layer_types", ["sliding_attention", "full_attention"]), ("eos_token_id", NEVER))
# caps low enough to bend these scores and logits
GEMMA2 = (*GEMMA, ("attn_logit_softcapping", 3.0), ("final_logit_softcapping", 4.0))
GEMMA3 = GEMMA
PHI3 = (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", NEVER))  # its defaults are past VOCAB
FAMILIES = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", torch.float32, tied=True),
        Family("llama3", "LlamaConfig", torch.bfloat16, tied=False, options=(("rope_scaling", LLAMA3_ROPE),)),
        Family("mistral", "MistralConfig", torch.float32, tied=False, options=(("sliding_window", WINDOW),)),
        Family("qwen2", "Qwen2Config", torch.bfloat16, tied=True),
        Family("qwen3", "Qwen3Config", torch.float32, tied=False, options=(("head_dim", 32),)),
        Family("olmo2", "Olmo2Config", torch.bfloat16, tied=False),
        Family("phi3", "Phi3Config", torch.bfloat16, tied=False, options=PHI3),
        Family("phi4mini", "Phi3Config", torch.float32, tied=True, options=(*PHI3, ("partial_rotary_factor", 0.75))),
        Family("gemma2", "Gemma2Config", torch.bfloat16, tied=False, options=GEMMA2),
        Family("gemma3", "Gemma3TextConfig", torch.float32, tied=False, options=GEMMA3),
        Family(
            "phi35",
            "Phi3Config",
            torch.float32,
            tied=False,
            options=(*PHI3, ("rope_parameters", LONGROPE), ("original_max_position_embeddings", 64)),
        ),
    )
}


def make_checkpoint(folder: Path, family: Family) -> Path:
    """A random checkpoint saved by transformers in `family.dtype`, sharded with an index, and a base model's
    tokenizer beside it. Its eos_token_id is a list: the tokenizer's EOS (never emitted here) and a token greedy
    decoding of PROMPTS[0] first emits after a few others, so generation stops early there."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family.hf_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero: make Qwen2's count
                p.normal_(std=0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight")):  # and the norms at one
                p.uniform_(-0.5, 0.5) if family.name.startswith("gemma") else p.uniform_(0.5, 1.5)  # Gemma's: 1 + w
    model = model.to(family.dtype).float()  # the stored weights, computed in float32 (as the references are)
    greedy = generated(model, PROMPTS[0], eos=None)
    k = next(i for i in range(5, NEW) if greedy[i] not in greedy[:i])
    eos = [NEVER, greedy[k]]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.to(family.dtype).save_pretrained(folder, max_shard_size="60KB")
    tiny_tokenizer_dir(folder, vocab=VOCAB, eos=NEVER)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]  # a base model ships none
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def generated(model, prompt: list[int], **kw) -> list[int]:
    """transformers' greedy continuation of `prompt` (the EOS it stops at included)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(root / name, f) for name, f in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy output per family and prompt, from the saved folder in float32."""
    out = {}
    for name, folder in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = [generated(model, p) for p in PROMPTS]
    return out


def test_the_checkpoints_are_what_users_bring(checkpoints, references):
    for name, folder in checkpoints.items():
        family = FAMILIES[name]
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and ("lm_head.weight" in index["weight_map"]) != family.tied
        config = BaseConfig.from_dir(folder)
        assert config.eos_token_ids[0] == NEVER and len(config.eos_token_ids) == 2
        gemma = name.startswith("gemma")
        assert config.sandwich_norms == config.norm_offset == config.embed_scale == gemma
        if gemma:
            assert config.layer_window(0) == WINDOW and config.layer_window(1) is None  # sliding, then global
            assert config.query_scale == 24**-0.5 and (config.attn_softcap, config.final_softcap) == (
                (3.0, 4.0) if name == "gemma2" else (None, None)
            )
            assert (config.local_rope is not None) == (name == "gemma3")
        assert (
            config.sliding_window if not gemma else None,
            config.rope.type,
            config.attention_bias,
            config.qk_norm,
            config.post_norms,
        ) == (
            WINDOW if name == "mistral" else None,
            {"llama3": "llama3", "phi35": "longrope"}.get(name, "default"),
            name == "qwen2",
            {"qwen3": "head", "olmo2": "projection", "gemma3": "head"}.get(name, ""),
            name == "olmo2",
        )
        assert config.rope_dim == (12 if name == "phi4mini" else config.head_dim)  # 0.75 of 16
        if name == "phi35":  # LongRoPE serves its original context, where transformers uses the short factors
            assert config.rope.attention_factor > 1.05 and config.max_position_embeddings == 64
        assert config.head_dim == (32 if name == "qwen3" else 16)  # Qwen3's own head_dim, wider than hidden / heads
        stopped = references[name][0]
        assert len(stopped) < NEW and stopped[-1] == config.eos_token_ids[1]  # transformers stopped at the list's EOS
        assert len(PROMPTS[0]) + NEW > WINDOW


def outputs(gen: Generator) -> list[list[int]]:
    return [list(gen.generate(p, GenerationParams(max_new_tokens=NEW)).token_ids) for p in PROMPTS]


def assert_outputs(gen: Generator, want: list[list[int]], what: str) -> None:
    for prompt, got, expected in zip(PROMPTS, outputs(gen), want):
        assert_identical(got, expected, f"{what}, prompt {prompt}")


@pytest.mark.parametrize("name", FAMILIES)
def test_torch_backend_equals_transformers(checkpoints, references, name):
    folder = checkpoints[name]
    assert_outputs(Generator.load(folder, backend="torch", tree="plain"), references[name], f"{name} torch plain")
    speculative = Generator.load(folder, "random:clover2", backend="torch", tree="small")
    assert_outputs(speculative, references[name], f"{name} torch random:clover2 small")
    stacked = Generator.load(
        folder, "random:clover2", backend="torch", tree="small", options=EngineOptions(device="cpu")
    )
    assert_outputs(stacked, references[name], f"{name} stacked torch runner random:clover2 small")


# (family, attention, heads): fused where the family allows it, portable where it does not (Mistral's and Gemma's
# sliding windows, OLMo-2's post-norms, Phi-4-mini's partial rotary; the portable graph is traced from the decoder
# the torch backend runs, and costs ~10 s per export here; Medusa's graph is the quickest beside it). Qwen3's and
# Phi-3's other forms run the same decoder code (the torch tests above cover every family there).
EXPORTS = [
    ("llama", "fused", "random:clover2"),
    ("llama3", "fused", "random:clover2"),
    ("qwen2", "fused", "random:clover2"),
    ("qwen3", "fused", "random:clover2"),
    ("olmo2", "portable", "random:clover2"),
    ("phi4mini", "portable", "random:clover2"),
    ("phi35", "fused", "random:clover2"),
    ("gemma2", "portable", "random:clover2"),
    ("gemma3", "portable", "random:medusa"),
    ("mistral", "portable", "random:medusa"),
]


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    """The artifact of each of EXPORTS, exported once on first use (tree given: no timing)."""
    root, done = tmp_path_factory.mktemp("exports"), {}

    def get(name: str, attention: str, heads: str) -> Path:
        if (name, attention) not in done:
            config = ExportConfig(attention=attention, tree="chain-2" if "medusa" in heads else "small", max_batch=2)
            done[name, attention] = export_artifact(checkpoints[name], heads, root / f"{name}-{attention}", config)
        return done[name, attention]

    return get


@pytest.mark.parametrize("name,attention,heads", EXPORTS, ids=[f"{n}-{a}" for n, a, _ in EXPORTS])
def test_onnx_export_equals_transformers(exported, references, name, attention, heads):
    artifact = exported(name, attention, heads)
    m = open_artifact(artifact)
    assert m.attention == attention and m.chat_template is False and m.heads.name == heads
    want = references[name]
    assert_outputs(Generator.load(artifact, "none", backend="ort"), want, f"{name} {attention} ort plain")
    assert_outputs(Generator.load(artifact, backend="ort"), want, f"{name} {attention} ort {heads} {m.tree.name}")
    if attention == "fused":  # prompt lookup's chains verified on the fused base
        assert_outputs(Generator.load(artifact, "lookup", backend="ort"), want, f"{name} fused ort lookup")


def test_fused_attention_refuses_what_it_cannot_write_at_once(checkpoints, tmp_path, monkeypatch):
    """Mistral's sliding window (and heads whose size GroupQueryAttention does not run): one error naming
    --attention portable, from the config alone, before the weights are loaded or a file is written."""
    import clover.models.loading

    monkeypatch.setattr(clover.models.loading, "load_base", lambda *a: pytest.fail("loaded the weights"))
    with pytest.raises(CloverError, match=r"sliding window.*8-token.*export it with --attention portable"):
        export_artifact(checkpoints["mistral"], "none", tmp_path / "out", ExportConfig(attention="fused"))
    assert not list(tmp_path.iterdir())
    narrow = BaseConfig.from_hf({**FAMILIES["llama"].hf_config().to_dict(), "head_dim": 8})
    with pytest.raises(CloverError, match="multiples of 16.*8 wide.*--attention portable"):
        ExportConfig(attention="fused").check_base(narrow)
    ExportConfig(attention="portable").check_base(narrow)


def test_clover_export_of_base_models(checkpoints, references, tmp_path, capsys):
    """Through clover-export: a base model (no chat template) exports, its trees timed on plain-text prompts;
    --chat-template stores a template; Mistral's default attention is the portable graph, said in one line."""
    from clover.tools.export import default_attention
    from clover.tools.export import main as export_main

    out = tmp_path / "llama"
    assert export_main(["--base", str(checkpoints["llama"]), "--heads", "random:medusa", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no chat template (a base model)" in err and "on plain-text prompts" in err
    m = open_artifact(out)
    assert m.attention == "fused" and m.chat_template is False and m.tree_timing is not None
    assert_outputs(Generator.load(out, backend="ort"), references["llama"], f"llama clover-export {m.drafts}")

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5")
    args = ["--base", checkpoints["llama"], "--out", out, "--chat-template", template, "--no-verify"]
    assert export_main([str(a) for a in args]) == 0
    assert "with the chat template given" in capsys.readouterr().err and open_artifact(out).chat_template is True
    chat = Generator.load(out, backend="ort").generate("w10 w11", GenerationParams(max_new_tokens=4), chat=True)
    assert chat.prompt_tokens == 5  # w3 w10 w11 w4 w5

    assert default_attention("onnx", "float32", str(checkpoints["mistral"])) == "portable"
    assert "--attention portable: the fused graph cannot write this base" in capsys.readouterr().err
    assert default_attention("onnx", "float32", str(checkpoints["qwen2"])) == "fused"
    assert default_attention("onnx", "float32", str(checkpoints["olmo2"])) == "portable"  # post-norm layers
    assert "norms its sublayers' outputs" in capsys.readouterr().err
    assert default_attention("onnx", "float32", str(checkpoints["phi4mini"])) == "portable"  # partial rotary
    assert "rotates 12 of each head's 16 dims" in capsys.readouterr().err
    code = export_main(["--base", str(checkpoints["mistral"]), "--out", str(tmp_path / "no"), "--attention", "fused"])
    assert code == 2 and "export it with --attention portable" in capsys.readouterr().err


@pytest.mark.parametrize("weights", ["int4"])
def test_qwen3_quantized_exports_are_lossless_against_their_own_plain(checkpoints, tmp_path, weights):
    """Qwen3's q/k norms survive weight quantization: speculative output equals the quantized graph's own plain."""
    config = ExportConfig(attention="fused", weights=weights, tree="chain-2", max_batch=2, verify=False)
    artifact = export_artifact(checkpoints["qwen3"], "random:clover2", tmp_path / weights, config)
    assert open_artifact(artifact).weights.scheme == weights
    want = outputs(Generator.load(artifact, "none", backend="ort"))
    assert_outputs(Generator.load(artifact, backend="ort"), want, f"qwen3 {weights} ort random:clover2")


# the families whose decoders differ from Llama's in more than their config: each trains heads and serves
TRAINED = ("qwen3", "olmo2", "phi4mini", "gemma2", "gemma3")


@pytest.mark.parametrize("name", TRAINED)
def test_each_family_trains_heads_and_serves_them(checkpoints, references, name, tmp_path):
    """clover-train self-distills Clover-2 heads on the family's own answers (a few hundred tokens), and clover-serve's
    app on the torch backend with those heads answers transformers' greedy output, plain and speculative."""
    import shutil

    import httpx
    from helpers import Server

    from clover.runtime.engine import Engine
    from clover.tools.train import main as train_main

    folder, data = checkpoints[name], tmp_path / "chats.jsonl"
    chat = shutil.copytree(folder, tmp_path / "instruct")  # the same weights with a chat template, to answer chats
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"w{6 + i} w{40 + 3 * i}"},
                        {"role": "assistant", "content": "w9"},
                    ]
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    heads = tmp_path / "heads"
    args = ["--base", str(chat), "--data", str(data), "--out", str(heads), "--cache-dir", str(tmp_path / "f")]
    args += ["--max-tokens", "240", "--max-new-tokens", "12", "--max-length", "32", "--gen-batch", "8"]
    assert train_main([*args, "--batch-tokens", "256", "--topk", "8", "--num-heads", "2", "--epochs", "1"]) == 0
    assert json.loads((heads / "training.json").read_text())["epochs"]
    for tree in ("plain", "chain-2"):
        spec = "none" if tree == "plain" else str(heads)
        engine = Engine.load(folder, spec, backend="torch", tree=tree, log=None)
        server = Server(engine, name)
        try:
            for prompt, want in zip(PROMPTS, references[name]):
                body = {"model": name, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
                got = httpx.post(server.url + "/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
                assert_identical(got, want, f"{name} served {tree}, prompt {prompt}")
        finally:
            server.close()
            engine.close()
