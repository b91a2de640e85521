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
# over the whole projection), where the norms sit (OLMo-2: on the attention's and the MLP's outputs; Gemma: around
# both), partial rotary (Phi-3) and Gemma's scaled embedding, 1 + w norms, GELU MLP and soft-capping.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM"}  # model_type -> architecture where the two names differ
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
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
    # Gemma 2 and 3
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention" (empty: all alike)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE (None: `rope`)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    norm_offset: bool = False  # RMSNorm scales by 1 + weight, in float32
    sandwich_norms: bool = False  # norms before and after the attention and the MLP
    mlp_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # attention scores' scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores capped to cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits capped the same way
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CloverError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}); the checkpoint's config.json is inconsistent"
            )

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> RopeConfig:
        """Layer i's RoPE (Gemma 3's sliding layers have their own)."""
        sliding = self.layer_types and self.layer_types[i] == "sliding_attention"
        return self.local_rope if sliding and self.local_rope is not None else self.rope

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
        if d.get("local_rope") is not None:
            d["local_rope"] = RopeConfig(**{**d["local_rope"], "short_factor": tuple(d["local_rope"]["short_factor"])})
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BaseConfig:
        """Build from the dict of an HF `config.json`; unsupported models raise CloverError."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = ({f: a for a, f in SUPPORTED_ARCHITECTURES.items()} | MODEL_TYPES).get(hf.get("model_type", ""))
        if arch is None:
            found = archs or [hf.get("model_type", "<none>")]
            raise CloverError(
                f"unsupported model architecture {', '.join(map(str, found))}: clover-deploy supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        gemma = family in ("gemma2", "gemma3")
        act = (hf.get("hidden_activation") or hf.get("hidden_act") or "silu") if gemma else hf.get("hidden_act", "silu")
        if act not in (GEMMA_ACTIVATIONS if gemma else ("silu",)):
            want = "GELU-tanh (gelu_pytorch_tanh)" if gemma else "SwiGLU (silu)"
            raise CloverError(f"{arch} with activation {act!r} is not supported: its MLP must be {want}")
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
        sliding = hf.get("sliding_window") if family in ("mistral", "phi3", "gemma2", "gemma3") else None
        params = hf.get("rope_parameters") or {}
        local_rope = None
        if gemma and isinstance(params.get("full_attention"), dict):  # Gemma 3: RoPE per layer type
            rope = _rope_from_hf({"rope_parameters": params["full_attention"]})
            local_rope = _rope_from_hf({"rope_parameters": params.get("sliding_attention") or params["full_attention"]})
            params = params["full_attention"]
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
            qk_norm={"qwen3": "head", "olmo2": "projection", "gemma3": "head"}.get(family, ""),
            post_norms=family == "olmo2",
            rotary_dim=None if rotary == head_dim else rotary,
            **(_gemma(hf, family, local_rope) if gemma else {}),
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


def _gemma(hf: dict[str, Any], family: str, local_rope: RopeConfig | None) -> dict[str, Any]:
    """Gemma 2 and 3's BaseConfig fields beyond the Llama family's."""
    types = tuple(hf.get("layer_types") or ())
    if not types and family == "gemma2":  # older configs: sliding and full layers alternate, sliding first
        types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"]))
    scalar = hf.get("query_pre_attn_scalar")
    return {
        "layer_types": types,
        "local_rope": local_rope,
        "embed_scale": True,
        "norm_offset": True,
        "sandwich_norms": True,
        "mlp_act": "gelu_tanh",
        "query_scale": None if scalar is None else float(scalar) ** -0.5,
        "attn_softcap": hf.get("attn_logit_softcapping"),
        "final_softcap": hf.get("final_logit_softcapping"),
    }
