"""The decoder against transformers: prefill, decoding over a past cache, and tree verification.

Small random-init configs of each supported family (and the RoPE scaling variants), plus SmolLM2.
Tolerance: fp32 max abs logit difference < 1e-4 (the bound an export must keep).
"""

import pytest
import torch

from clover.errors import CloverError
from clover.models.config import BaseConfig
from clover.models.decoder import causal_mask
from clover.models.loading import load_base

transformers = pytest.importorskip("transformers")

TOL = 1e-4

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-tied-bias": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
            rope_theta=500000.0,
        ),
    ),
    "linear-rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "mistral-window": lambda: transformers.MistralConfig(**COMMON, sliding_window=6),
}


def save_random(hf_cfg, path, seed=0):
    torch.manual_seed(seed)
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    for p in model.parameters():  # random-init biases are zero; make them count
        if p.ndim == 1:
            p.data.normal_(0, 0.5 if "norm" not in str(p) else 0.1).add_(
                1.0 if p.shape[0] == hf_cfg.hidden_size else 0.0
            )
    model.save_pretrained(path)
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def ours_step(model, ids, past_len, cache, tree_mask=None, depth=None):
    T = len(ids)
    depth = torch.arange(T) if depth is None else depth
    tree_mask = causal_mask(T) if tree_mask is None else tree_mask[None]
    out = model(
        torch.tensor([ids]),
        (past_len + depth)[None],
        tree_mask,
        torch.tensor([past_len]),
        [k[:, :, :past_len] for k in cache[0]],
        [v[:, :, :past_len] for v in cache[1]],
    )
    for store, new in zip(cache[0] + cache[1], out.new_keys + out.new_values):
        store[:, :, past_len : past_len + T] = new
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(FAMILIES[request.param](), path)
    return hf, load_base(path)


def test_prefill_then_decode_matches_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    cache = ours.empty_cache(1, 32)
    with torch.no_grad():
        a = ours_step(ours, ids[:12], 0, cache).logits[0]
        rest = [ours_step(ours, [t], 12 + i, cache).logits[0, 0] for i, t in enumerate(ids[12:])]
    got = torch.cat([a, torch.stack(rest)])
    assert (got - ref).abs().max().item() < TOL


def test_tree_verification_matches_per_path_forward(pair):
    hf, ours = pair
    prompt = [5, 17, 99, 3, 42, 7, 8]
    # tree over 6 new tokens: root r; children a, b of r; c child of a; d child of c; e child of b
    tokens = [11, 21, 31, 41, 51, 61]
    parent = [-1, 0, 0, 1, 3, 2]
    T = len(tokens)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = torch.zeros(T, dtype=torch.long)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = mask[i].sum() - 1
    cache = ours.empty_cache(1, 32)
    with torch.no_grad():
        ours_step(ours, prompt, 0, cache)
        got = ours_step(ours, tokens, len(prompt), cache, mask, depth).logits[0]
    for i in range(T):
        path = [tokens[j] for j in range(T) if mask[i, j]]
        ref = hf_logits(hf, prompt + path)[-1]
        assert (got[i] - ref).abs().max().item() < TOL, f"node {i}"


def test_batch_with_different_past_lengths(pair):
    """Two sequences in one batch, each with its own past length, equal their single-sequence runs."""
    hf, ours = pair
    seqs = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24]]
    P = max(len(s) for s in seqs) - 1
    cfg = ours.config
    keys = [torch.zeros(2, cfg.num_kv_heads, P, cfg.head_dim) for _ in range(cfg.num_layers)]
    values = [torch.zeros_like(k) for k in keys]
    with torch.no_grad():
        for b, s in enumerate(seqs):
            cache = ours.empty_cache(1, P)
            ours_step(ours, s[:-1], 0, cache)
            for layer in range(cfg.num_layers):
                keys[layer][b] = cache[0][layer][0]
                values[layer][b] = cache[1][layer][0]
        lengths = torch.tensor([len(s) - 1 for s in seqs])
        out = ours(torch.tensor([[s[-1]] for s in seqs]), lengths[:, None], causal_mask(1, 2), lengths, keys, values)
    for b, s in enumerate(seqs):
        assert (out.logits[b, 0] - hf_logits(hf, s)[-1]).abs().max().item() < TOL


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(CloverError, match="unsupported model architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        load_base(tmp_path)


def test_missing_folder_and_weights_are_clear_errors(tmp_path):
    with pytest.raises(CloverError, match="does not exist"):
        load_base(tmp_path / "nope")
    FAMILIES["llama"]().save_pretrained(tmp_path)
    with pytest.raises(CloverError, match="no safetensors weights"):
        load_base(tmp_path)


def test_unsupported_rope_type_is_a_clear_error():
    cfg = FAMILIES["llama"]().to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    cfg["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(CloverError, match="unsupported RoPE scaling type 'yarn'"):
        BaseConfig.from_hf(cfg)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ours = load_base(smollm2_path)
    ids = list(range(1000, 1040))
    ref = hf_logits(hf, ids)
    cache = ours.empty_cache(1, 64)
    with torch.no_grad():
        a = ours_step(ours, ids[:30], 0, cache).logits[0]
        b = ours_step(ours, ids[30:], 30, cache).logits[0]
    assert (torch.cat([a, b]) - ref).abs().max().item() < TOL


def test_sharded_checkpoint_loads(tmp_path):
    """A checkpoint saved in several safetensors shards (with its index) loads and matches."""
    hf = save_random(FAMILIES["llama"](), tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = [1, 2, 3, 4, 5]
    ours = load_base(tmp_path / "sharded")
    with torch.no_grad():
        got = ours_step(ours, ids, 0, ours.empty_cache(1, 8)).logits[0]
    assert (got - hf_logits(hf, ids)).abs().max().item() < TOL
    next(p for p in (tmp_path / "sharded").glob("model-0000*.safetensors")).unlink()
    with pytest.raises(CloverError, match="missing checkpoint shards"):
        load_base(tmp_path / "sharded")
