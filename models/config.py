"""Base-model configuration, read from a Hugging Face `config.json`.

Only what the decoder needs is kept, in one frozen dataclass, so the exporters and the runtime can
rebuild the model from it (docs/design.md, Conventions 1, 2). Both the transformers-4 (`rope_scaling`, top-level
`rope_theta`) and transformers-5 (`rope_parameters`) spellings are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover.errors import CloverError

# HF architecture name -> family. The same decoder up to biases, sliding windows, q/k norms (Qwen3 per head, OLMo-2
# over the whole projection) and where the norms sit (OLMo-2: on the attention's and the MLP's outputs).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, longrope
    # longrope (Phi-3.5, Phi-4-mini) within its original context: each frequency divided by its short factor, cos
    # and sin scaled by attention_factor
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class BaseConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always, Llama optionally)
    attention_out_bias: bool = False  # bias on o_proj (Llama attention_bias covers o too)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral; None = full attention
    # RMSNorm of the queries and keys before RoPE: "" none, "head" over each head (Qwen3), "projection" over the
    # whole q and k projections (OLMo-2)
    qk_norm: str = ""
    post_norms: bool = False  # OLMo-2: each layer norms its attention's and MLP's outputs, not their inputs
    rotary_dim: int | None = None  # the leading dims of each head RoPE rotates (Phi-3's partial rotary); None: all
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CloverError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}); the checkpoint's config.json is inconsistent"
            )

    @property
    def rope_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaseConfig:
        d = dict(d)
        d["rope"] = RopeConfig(**{**d["rope"], "short_factor": tuple(d["rope"].get("short_factor", ()))})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BaseConfig:
        """Build from the dict of an HF `config.json`; unsupported models raise CloverError."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {f: a for a, f in SUPPORTED_ARCHITECTURES.items()}.get(hf.get("model_type", ""))
        if arch is None:
            found = archs or [hf.get("model_type", "<none>")]
            raise CloverError(
                f"unsupported model architecture {', '.join(map(str, found))}: clover-deploy supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if hf.get("hidden_act", "silu") != "silu":
            raise CloverError(
                f"{arch} with hidden_act {hf['hidden_act']!r} is not supported: its MLP must be SwiGLU (silu)"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        rope = _rope_from_hf(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

        if family in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
            raise CloverError(
                f"{arch} checkpoints with use_sliding_window=true are not supported: set it to false in "
                "config.json (the released Qwen2 and Qwen3 models do not use it)"
            )
        sliding = hf.get("sliding_window") if family in ("mistral", "phi3") else None
        params = hf.get("rope_parameters") or {}
        partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        rotary = int(head_dim * partial)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise CloverError(
                f"partial_rotary_factor {partial} gives {rotary} rotary dims of {head_dim}: not supported"
            )
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=_context(hf, rope),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attn_bias or family == "qwen2",
            attention_out_bias=attn_bias and family != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            qk_norm={"qwen3": "head", "olmo2": "projection"}.get(family, ""),
            post_norms=family == "olmo2",
            rotary_dim=None if rotary == head_dim else rotary,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> BaseConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise CloverError(f"{path} is not a Hugging Face model folder: no config.json in it")
        return cls.from_hf(json.loads(cfg.read_text()))


def _context(hf: dict[str, Any], rope: RopeConfig) -> int:
    """The longest sequence served: the checkpoint's, or LongRoPE's original context (see _longrope)."""
    longest = int(hf.get("max_position_embeddings", 2048))
    return min(longest, rope.original_max_position_embeddings) if rope.type == "longrope" else longest


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if not params.get("rope_type") and scaling:
        params.update(scaling)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CloverError(
            f"unsupported RoPE scaling type {rope_type!r}: supported types are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "longrope":
        return _longrope(hf, params, theta)
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _longrope(hf: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """LongRoPE as transformers computes it for positions within original_max_position_embeddings (its short
    factors); the context is capped there (BaseConfig.from_hf), since past it transformers switches every position,
    the cached ones included, to the long factors."""
    original = int(params.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    factor = params.get("factor") or int(hf.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=theta,
        type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        attention_factor=float(attention),
    )
