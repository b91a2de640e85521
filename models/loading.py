"""Load a base decoder from a Hugging Face checkpoint folder (config.json + safetensors, sharded too)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from clover.errors import CloverError
from clover.models.config import BaseConfig
from clover.models.decoder import Decoder

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CloverError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CloverError(
                f"{path} is missing checkpoint shards {missing} listed in {index.name}: download them again"
            )
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CloverError(
        f"no safetensors weights in {path}: expected model.safetensors or model.safetensors.index.json "
        "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
    )


def _our_name(hf_name: str) -> str | None:
    if hf_name.startswith("model."):
        return hf_name[len("model.") :]
    if hf_name == "lm_head.weight":
        return hf_name
    return None


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """HF's separate q/k/v and gate/up projections -> our fused qkv_proj and gate_up_proj (in place)."""
    for i in range(num_layers):
        for fused, parts in (
            (f"layers.{i}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            (f"layers.{i}.mlp.gate_up_proj", ("gate_proj", "up_proj")),
        ):
            prefix = fused.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                names = [f"{prefix}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


def load_base(path: str | Path, dtype: str | torch.dtype = "float32") -> Decoder:
    """Build a Decoder from an HF folder; every weight must be present and used."""
    path = Path(path)
    if not path.is_dir():
        raise CloverError(f"base model folder {path} does not exist: pass a Hugging Face model folder or 'smollm2'")
    cfg = BaseConfig.from_dir(path)
    torch_dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = {n for n, _ in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                ours = _our_name(name)
                if ours is None or "rotary_emb" in name:
                    continue
                state[ours] = f.get_tensor(name).to(torch_dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    fuse_projections(state, cfg.num_layers)
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise CloverError(
            f"checkpoint {path} does not match its config.json ({cfg.architecture}): "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Built on the meta device, the RoPE buffer has no data yet.
    model.set_rope()
    return model.eval().requires_grad_(False)
