"""Draft heads: the one interface the speculate -> verify loop drives, and the pieces heads share.

A head set turns the base model's outputs for the tokens accepted in a step into the next tree's
candidates, depth by depth:

- `begin(...)` consumes the accepted tokens' last-layer hidden states, each paired with the token that
  followed it (the next accepted token, or the bonus token for the last one). Heads with an
  augmenting block run it here over their own KV cache, which only ever holds accepted tokens.
  It returns the root state and the logits for depth-1 candidates (children of the root).
- `step(depth, parent_state, tokens)` runs for nodes at `depth` >= 1 given their parent's state and
  their own token, and returns their states and the logits for their children.

The LM head (and for some heads the base's final norm) is shared with the base model: it is
referenced, never saved with the heads.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from clover.errors import CloverError
from clover.models.config import BaseConfig
from clover.models.decoder import (
    Decoder,
    DecoderLayer,
    RMSNorm,
    attention_mask,
    causal_mask,
    norm_for,
    rope_cos_sin,
    rope_inv_freq,
)

ARCHITECTURES = ("medusa", "clover", "clover2")


@dataclass(frozen=True)
class BaseFingerprint:
    """What heads record of the base they were built for; loading them on another base is an error.

    The hash identifies the exact LM-head weights as loaded. The same checkpoint loaded in another
    precision hashes differently, so a probe (L2 norms of 16 evenly spaced rows) is kept too: it
    matches within a relative 5e-3 across fp32 / fp16 / bf16 and differs grossly between models.
    """

    architecture: str
    hidden_size: int
    vocab_size: int
    lm_head_sha256: str  # first 16 hex digits of sha256 over the LM-head weight, as fp32 bytes
    lm_head_probe: tuple[float, ...] = ()

    @classmethod
    def of(cls, base: Decoder) -> BaseFingerprint:
        w = base.lm_head.weight
        cached = getattr(base, "_clover_fingerprint", None)
        if cached is None or cached[0] != (w.dtype, w.data_ptr()):
            w32 = w.detach().to(torch.float32).contiguous().cpu()
            digest = hashlib.sha256(w32.numpy().tobytes()).hexdigest()[:16]
            rows = torch.linspace(0, w32.shape[0] - 1, 16).long()
            probe = tuple(round(float(x), 6) for x in w32[rows].norm(dim=-1))
            fp = cls(base.config.architecture, base.config.hidden_size, base.config.vocab_size, digest, probe)
            cached = ((w.dtype, w.data_ptr()), fp)
            base._clover_fingerprint = cached  # hashing ~100 MB once per loaded base
        return cached[1]

    def matches(self, other: BaseFingerprint) -> bool:
        same_shape = (self.architecture, self.hidden_size, self.vocab_size) == (
            other.architecture,
            other.hidden_size,
            other.vocab_size,
        )
        if not same_shape:
            return False
        if self.lm_head_sha256 == other.lm_head_sha256:
            return True
        a, b = np.array(self.lm_head_probe), np.array(other.lm_head_probe)
        return a.shape == b.shape and a.size > 0 and bool(np.allclose(a, b, rtol=5e-3, atol=0))

    def check(self, base: Decoder, heads_name: str) -> None:
        got = BaseFingerprint.of(base)
        if not self.matches(got):
            raise CloverError(
                f"heads {heads_name} were trained for another base model (theirs: {self.architecture}, hidden "
                f"{self.hidden_size}, vocab {self.vocab_size}, lm_head {self.lm_head_sha256}; this base: "
                f"{got.architecture}, hidden {got.hidden_size}, vocab {got.vocab_size}, lm_head "
                f"{got.lm_head_sha256}): use heads trained for this base, or train them with clover-train"
            )


@dataclass(frozen=True)
class HeadConfig:
    """Architecture and size of a head set; saved next to the weights as JSON.

    num_heads: number of draft heads (the largest tree depth) for medusa and clover; for clover2, whose
      recurrent head is shared by every depth >= 1, it is the depth trained for, not a limit.
    num_layers: ResBlocks per head (medusa) or augmenting-block decoder layers (clover, clover2).
    own_lm_head: medusa only: each head has its own LM head (Medusa-1) instead of sharing the base's.
    """

    arch: str
    base: BaseFingerprint
    base_config: BaseConfig
    num_heads: int = 3
    num_layers: int = 1
    own_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise CloverError(f"unknown head architecture {self.arch!r}: use one of {', '.join(ARCHITECTURES)}")
        if self.num_heads < 1 or self.num_layers < 1:
            raise CloverError(
                f"{self.arch} heads need num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}"
            )

    @property
    def max_depth(self) -> int | None:
        """Deepest tree these heads can draft (None: any depth)."""
        return None if self.arch == "clover2" else self.num_heads


class BeginOutput(NamedTuple):
    state: torch.Tensor  # [B, H] state of the root (the bonus token)
    logits: torch.Tensor  # [B, V] draft logits for depth-1 candidates
    new_keys: list[torch.Tensor]  # augmenting-block K per layer [B, Hkv, N, D] (empty if none)
    new_values: list[torch.Tensor]


class DraftHeads(nn.Module):
    """Base class of Medusa, Clover and Clover-2 head sets."""

    config: HeadConfig
    # over_vocab: the draft vocabulary's ids [K] and those rows of the LM weight (None: every token is a column)
    draft_ids: torch.Tensor | None = None
    draft_rows: torch.Tensor | None = None

    def __init__(self, config: HeadConfig, base: Decoder):
        super().__init__()
        self.config = config
        # Shared with the base, not saved: non-persistent buffers that alias the base's tensors.
        self.register_buffer("lm_weight", base.lm_head.weight, persistent=False)
        self.register_buffer("base_norm_weight", base.norm.weight, persistent=False)
        self.eps = base.config.rms_norm_eps

    @property
    def num_cache_layers(self) -> int:
        """Layers of the heads' own KV cache (their augmenting block); 0 when they keep none."""
        return 0

    def lm(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.lm_weight if self.draft_rows is None else self.draft_rows).T

    def over_vocab(self, ids: torch.Tensor) -> DraftHeads:
        """These heads drafting over the tokens `ids` [K] alone (a draft vocabulary): a shallow copy sharing every
        parameter whose draft logits have K columns, column j for token ids[j], computed from those rows of the LM
        weight only (a K/V share of the LM head's work; the embeddings of drafted tokens still read every row)."""
        clone = copy.copy(self)
        clone.draft_ids, clone.draft_rows = ids, self.lm_weight[ids]
        return clone

    def base_norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return self.base_norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)

    def begin(
        self,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        past_lengths: torch.Tensor,
        past_keys: list[torch.Tensor],
        past_values: list[torch.Tensor],
        last: torch.Tensor | None = None,
    ) -> BeginOutput:
        """hidden [B, N, H] (pre-norm, accepted tokens), next_tokens [B, N], position_ids [B, N]; last [B]: the row
        of each sequence whose state is the root (rows after it are padding of a batch whose sequences accepted
        different counts); None: the last row."""
        raise NotImplementedError

    def step(self, depth: int, parent_state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """parent_state [n, H], tokens [n] at `depth` >= 1 -> (state [n, H], child logits [n, V])."""
        raise NotImplementedError

    def step_batch(
        self, depth: int, parent_state: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` for B sequences at once: parent_state [B, n, H], tokens [B, n] -> ([B, n, H], [B, n, V])."""
        B, n = tokens.shape
        state, logits = self.step(depth, parent_state.reshape(B * n, -1), tokens.reshape(B * n))
        return state.view(B, n, -1), logits.view(B, n, -1)

    def init_weights(self, base: Decoder, generator: torch.Generator) -> None:
        """Training-start initialisation (from the base where the method says so)."""
        raise NotImplementedError

    def teacher_forced(self, hidden: torch.Tensor, tokens: torch.Tensor, depths: int) -> list[torch.Tensor]:
        """Training: every position of whole sequences at once, drafting along the true continuation.

        hidden [B, L, H] (base, pre-norm) and tokens [B, L]. Returns, for depth d = 1..depths, the
        vectors [B, L, H] the LM head turns into draft logits (`head_logits(d, .)`): row t drafts token
        x_{t+1+d} having been fed x_{t+1} .. x_{t+d}, exactly as begin/step would after accepting x_<=t.
        Rows whose continuation runs past the sequence end see padding; the caller masks them.
        """
        raise NotImplementedError

    def head_logits(self, depth: int, x: torch.Tensor) -> torch.Tensor:
        """Draft logits of the vectors `teacher_forced` returns for `depth` (1-based)."""
        return self.lm(x)


def root_rows(x: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """x [B, N, ...] at each sequence's root row `last` [B] (None: row N - 1): [B, ...]."""
    return x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]


def shifted(tokens: torch.Tensor, j: int) -> torch.Tensor:
    """tokens[:, t + j] at row t, zero-padded past the end: [B, L]."""
    return torch.nn.functional.pad(tokens[:, j:], (0, j)) if j else tokens


class ResBlock(nn.Module):
    """Medusa's residual block: x + SiLU(W x + b), zero-initialised so a new head starts as the identity."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


def copy_layer(dst: nn.Module, src: nn.Module) -> None:
    dst.load_state_dict(src.state_dict())


def new_norm(cfg: BaseConfig) -> RMSNorm:
    return norm_for(cfg)


class AugmentingBlock(nn.Module):
    """Decoder layers over the sequence of accepted tokens with their own small KV cache, then a norm.

    Initialised from the base's last layer and final norm (both Clover papers do this).
    """

    def __init__(self, cfg: BaseConfig, num_layers: int):
        super().__init__()
        self.sliding_window, self.rope_scale = cfg.sliding_window, cfg.rope.attention_factor
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = new_norm(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rope_dim), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        past_lengths: torch.Tensor,
        past_keys: list[torch.Tensor],
        past_values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        B, N, _ = x.shape
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype, self.rope_scale)
        mask = attention_mask(
            causal_mask(N, B, x.device), past_lengths, past_keys[0].shape[2], position_ids, self.sliding_window, x.dtype
        )
        new_keys, new_values = [], []
        for layer, pk, pv in zip(self.layers, past_keys, past_values):
            x, k, v = layer(x, cos, sin, mask, pk, pv)
            new_keys.append(k)
            new_values.append(v)
        return self.norm(x), new_keys, new_values

    def over_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Causal pass over whole sequences [B, L, H] from position 0, no cache (training)."""
        B, L, _ = x.shape
        empty = [x.new_zeros(B, self.layers[0].self_attn.num_kv_heads, 0, self.layers[0].self_attn.head_dim)] * len(
            self.layers
        )
        positions = torch.arange(L, device=x.device).expand(B, L)
        return self.forward(x, positions, torch.zeros(B, dtype=torch.long, device=x.device), empty, empty)[0]

    def init_from_base(self, base: Decoder) -> None:
        for layer in self.layers:
            copy_layer(layer, base.layers[-1])
        copy_layer(self.norm, base.norm)
