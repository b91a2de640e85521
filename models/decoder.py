"""Export-friendly Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, OLMo-2, Phi-3, Gemma 2 and 3).

One forward serves prefill and tree verification. Everything that changes per step travels through
its arguments (docs/design.md, Conventions 4): the new tokens, their positions, the tree mask among them, the past
length of each sequence and the past KV tensors. It is a pure function of those: it returns the new
tokens' K/V and the caller owns the cache (writes, compaction), which keeps the graph exportable and
lets a backend keep its cache wherever it likes.

Attention is computed in two parts (past keys, new keys) joined by one softmax, so the past cache is
never concatenated (copied) per step: cost is O(past) reads, not O(past) copies.

Two attention variants with the same inputs and outputs (docs/design.md): `portable` builds an additive
mask from standard ops; `plugin` packs the tree mask into int32 bit rows once and calls the
tree-attention op (clover.plugins), one custom ONNX node per layer when exported. `with_attention`
gives a decoder sharing all weights that uses the other variant.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from clover.errors import CloverError
from clover.models.config import BaseConfig, RopeConfig
from clover.plugins.onnx_node import tree_attention_node

ATTENTION_VARIANTS = ("portable", "plugin")


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies [D/2] (float32), with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "longrope":  # transformers' order: 1 / (factor * theta^(2i/d))
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**shape)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, D] for positions [B, T] (computed in float32 like transformers), times `scale` (LongRoPE's
    attention factor)."""
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by RoPE; where cos and sin cover fewer dims than x (partial rotary), the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_mask(
    tree_mask: torch.Tensor,
    past_lengths: torch.Tensor,
    past_len: int,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive mask [B, 1, 1, T, P + T] over (past keys, new keys): 0 = attend, -inf = masked.

    Past slot j of sequence b is valid iff j < past_lengths[b]. The cache is compacted, so slot j holds
    position j; the sliding-window rule (q_pos - k_pos < window, as transformers' Mistral) uses that.
    """
    slots = torch.arange(past_len, device=tree_mask.device)
    past = (slots[None, None, :] < past_lengths[:, None, None]).expand(-1, tree_mask.shape[1], -1)  # [B, T, P]
    mask = torch.cat((past, tree_mask), dim=-1)  # [B, T, P + T]
    if sliding_window is not None:
        key_pos = torch.cat((slots[None].expand(position_ids.shape[0], -1), position_ids), dim=-1)  # [B, P + T]
        mask = mask & (position_ids[:, :, None] - key_pos[:, None, :] < sliding_window)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf"))[:, None, None]


class PluginMask(NamedTuple):
    """The tree and cache masks in the form the tree-attention op takes (built once per forward)."""

    packed: torch.Tensor  # [B, T, ceil(T/32)] int32 packed tree mask
    past_lengths: torch.Tensor  # [B] int32


def plugin_mask(tree_mask: torch.Tensor, past_lengths: torch.Tensor) -> PluginMask:
    from clover.plugins.tree_attention import pack_tree_mask

    return PluginMask(pack_tree_mask(tree_mask), past_lengths.to(torch.int32))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: bool = False):
        """offset: Gemma's norm, which scales by 1 + weight in float32 (its weight starts at zero)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.offset:  # Gemma: (x * (1 + w)).to(dtype)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in fp32, scale in the input dtype (transformers' order); one fused op for fp32.
        return self.weight * normed.to(x.dtype)


def norm_for(cfg: BaseConfig, size: int | None = None) -> RMSNorm:
    """The family's RMSNorm over `size` features (default: the hidden size)."""
    return RMSNorm(cfg.hidden_size if size is None else size, cfg.rms_norm_eps, cfg.norm_offset)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's attention and logit soft-capping); x itself for None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    """GQA self-attention; q, k, v come from one fused projection (one matmul, one RoPE call)."""

    def __init__(self, cfg: BaseConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5 if cfg.query_scale is None else cfg.query_scale
        self.softcap = cfg.attn_softcap
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_out_bias)
        if cfg.qk_norm:  # queries and keys normalised before RoPE: per head (Qwen3) or whole projections (OLMo-2)
            whole = cfg.qk_norm == "projection"
            self.q_norm = norm_for(cfg, cfg.head_dim * (cfg.num_heads if whole else 1))
            self.k_norm = norm_for(cfg, cfg.head_dim * (cfg.num_kv_heads if whole else 1))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | PluginMask,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = H // Hkv
        qkv = self.qkv_proj(x)
        if self.qk_norm == "projection":
            q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qkv = qkv.view(B, T, H + 2 * Hkv, D).transpose(1, 2)  # [B, H + 2Hkv, T, D]
        qk = qkv[:, : H + Hkv]
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])), dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]  # [B, H, T, D], [B, Hkv, T, D] x 2
        if isinstance(mask, PluginMask):
            out = tree_attention_node(q, k, v, past_k, past_v, mask.past_lengths, mask.packed, self.scale)  # [B,H,T,D]
            return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D)), k, v

        # GQA without repeating K/V: query heads h*G..h*G+G-1 share kv head h (transformers' repeat_kv order).
        qg = q.reshape(B, Hkv, G * T, D) * self.scale
        scores = torch.cat((qg @ past_k.transpose(-1, -2), qg @ k.transpose(-1, -2)), dim=-1)  # [B, Hkv, G*T, P+T]
        scores = softcap(scores, self.softcap).view(B, Hkv, G, T, -1) + mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, Hkv, G * T, -1)
        P = past_k.shape[2]
        out = probs[..., :P] @ past_v + probs[..., P:] @ v  # [B, Hkv, G*T, D]
        out = out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    """SwiGLU (GeGLU with tanh GELU for Gemma) with gate and up projections fused into one matmul."""

    def __init__(self, cfg: BaseConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.mlp_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: BaseConfig):
        super().__init__()
        self.post_norms, self.sandwich = cfg.post_norms, cfg.sandwich_norms
        if not cfg.post_norms:
            self.input_layernorm = norm_for(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm_for(cfg)
        self.mlp = MLP(cfg)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm_for(cfg)
        if cfg.post_norms or cfg.sandwich_norms:
            self.post_feedforward_layernorm = norm_for(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sandwich:  # Gemma: each sublayer's input and output normed
            attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), k, v
        if self.post_norms:  # OLMo-2: the sublayers' outputs are normed before they join the residual
            attn, k, v = self.self_attn(x, cos, sin, mask, past_k, past_v)
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(x)), k, v
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class DecoderOutput(NamedTuple):
    logits: torch.Tensor  # [B, R, V] for the requested rows (all T rows by default)
    hidden_states: torch.Tensor  # [B, T, H] last decoder layer output, before the final norm
    new_keys: list[torch.Tensor]  # per layer [B, Hkv, T, D], RoPE applied
    new_values: list[torch.Tensor]  # per layer [B, Hkv, T, D]


class Decoder(nn.Module):
    """Llama-family causal LM whose forward verifies a token tree against an explicit KV cache."""

    def __init__(self, cfg: BaseConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = norm_for(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.set_rope()
        self.attention = "portable"  # see with_attention

    def set_rope(self) -> None:
        """The RoPE frequency buffers (not saved with the weights): `inv_freq`, and Gemma 3's sliding layers'
        `local_inv_freq`."""
        cfg = self.config
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rope_dim), persistent=False)
        if cfg.local_rope is not None:
            self.register_buffer("local_inv_freq", rope_inv_freq(cfg.local_rope, cfg.rope_dim), persistent=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over the last layer's hidden states: the final norm, the projection, Gemma 2's soft-cap."""
        return softcap(self.lm_head(self.norm(hidden)), self.config.final_softcap)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        position_ids: torch.Tensor,  # [B, T] int64: past_length + depth in the tree
        tree_mask: torch.Tensor,  # [B, T, T] bool: token i attends to new token j (itself and its ancestors)
        past_lengths: torch.Tensor,  # [B] int64: valid cache slots per sequence
        past_keys: list[torch.Tensor],  # per layer [B, Hkv, P, D]
        past_values: list[torch.Tensor],  # per layer [B, Hkv, P, D]
        logit_rows: torch.Tensor | None = None,  # [R] int64: rows to compute logits for (default: all)
    ) -> DecoderOutput:
        cfg = self.config
        x = self.embed_tokens(input_ids)
        if cfg.embed_scale:  # Gemma: sqrt(hidden) in the embedding's dtype
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        rope = {cfg.rope: rope_cos_sin(self.inv_freq, position_ids, x.dtype, cfg.rope.attention_factor)}
        if cfg.local_rope is not None:
            rope[cfg.local_rope] = rope_cos_sin(
                self.local_inv_freq, position_ids, x.dtype, cfg.local_rope.attention_factor
            )
        masks: dict[int | None, torch.Tensor | PluginMask] = {}
        for window in {cfg.layer_window(i) for i in range(cfg.num_layers)}:
            if self.attention == "plugin":
                masks[window] = plugin_mask(tree_mask, past_lengths)
            else:
                masks[window] = attention_mask(
                    tree_mask, past_lengths, past_keys[0].shape[2], position_ids, window, x.dtype
                )
        new_keys, new_values = [], []
        for i, (layer, pk, pv) in enumerate(zip(self.layers, past_keys, past_values)):
            cos, sin = rope[cfg.layer_rope(i)]
            x, k, v = layer(x, cos, sin, masks[cfg.layer_window(i)], pk, pv)
            new_keys.append(k)
            new_values.append(v)
        out = x if logit_rows is None else x[:, logit_rows]
        return DecoderOutput(self.logits(out), x, new_keys, new_values)

    def empty_cache(
        self, batch: int = 1, length: int = 0, layers: int | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zero-filled per-layer K and V tensors [B, Hkv, length, D] on the model's device and dtype
        (`layers` defaults to this model's; draft heads' augmenting blocks use the same shapes)."""
        c = self.config
        w = self.embed_tokens.weight
        n = c.num_layers if layers is None else layers
        make = lambda: torch.zeros(batch, c.num_kv_heads, length, c.head_dim, dtype=w.dtype, device=w.device)
        return [make() for _ in range(n)], [make() for _ in range(n)]


def with_attention(base: Decoder, variant: str) -> Decoder:
    """`base` computing attention the `variant` way; all parameters and buffers are shared."""
    if variant not in ATTENTION_VARIANTS:
        raise CloverError(f"unknown attention variant {variant!r}: use one of {', '.join(ATTENTION_VARIANTS)}")
    if variant == "plugin" and base.config.sliding_window is not None:
        raise CloverError(
            f"the plugin attention variant has no sliding window, but this {base.config.architecture} uses a "
            f"{base.config.sliding_window}-token window: export it with --attention portable"
        )
    if variant == "plugin" and base.config.attn_softcap is not None:
        raise CloverError(
            f"the plugin attention variant has no soft-capping, but this {base.config.architecture} caps its attention "
            f"scores at {base.config.attn_softcap}: export it with --attention portable"
        )
    if variant == base.attention:
        return base
    clone = copy.copy(base)  # shallow: modules, parameters and buffers are shared
    clone.attention = variant
    return clone


def causal_mask(length: int, batch: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """[B, T, T] lower-triangular tree mask: a chain, as used for prefill."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None].expand(batch, -1, -1)
