"""Clover-2 heads (arXiv 2408.00264; official code github.com/XiaoBin1992/clover, clover2.py).

Order of operations, per the paper and its code:
1. Attention Decoder first: fuse each accepted token's pre-norm hidden state h_t with the embedding
   of the token that followed it, e_{t+1}: x = h + v(e) * g, g = per-attention-head cosine similarity
   of q(norm(h)) and k(e) (a gate, no softmax).
2. Augmenting Block: `num_layers` (2) full decoder layers over x, initialised from the base's last
   layer, with their own KV cache holding only accepted tokens; then a norm (init: base final norm).
3. Depth 1: logits = LM(norm(FC_0(a))), FC_0: H -> H.
   Depth >= 1, one recurrent head shared by every depth (so depth is free):
   h' = RNN(h, e(token)) (same gated block as 1, own weights); logits = LM(norm(FC([h'; e]))),
   FC: 2H -> H.
Embeddings are rows of the (frozen) LM-head weight, as in the official code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.models.config import BaseConfig
from clover.models.decoder import Decoder
from clover.models.heads import AugmentingBlock, BeginOutput, DraftHeads, HeadConfig, new_norm, root_rows, shifted


class GatedAttentionDecoder(nn.Module):
    """x + v(y) * cos(q(norm(x)), k(y)) per attention head: one query, one key, cosine gate."""

    def __init__(self, cfg: BaseConfig):
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.eps = cfg.rms_norm_eps
        self.norm = new_norm(cfg)
        self.q = nn.Linear(H, H)
        self.k = nn.Linear(H, H)
        self.v = nn.Linear(H, H)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.num_heads, -1)
        q = self.q(self.norm(x)).view(shape)  # [..., nh, H/nh]
        k = self.k(y).view(shape)
        gate = F.cosine_similarity(q, k, dim=-1, eps=self.eps)[..., None]  # [..., nh, 1]
        return x + (self.v(y).view(shape) * gate).flatten(-2)

    def init_weights(self, generator: torch.Generator) -> None:
        for lin in (self.q, self.k):
            eye_plus_uniform(lin.weight, generator)
        nn.init.uniform_(self.v.weight, 0.0, 0.01, generator=generator)
        for lin in (self.q, self.k, self.v):
            nn.init.zeros_(lin.bias)


def eye_plus_uniform(w: torch.Tensor, generator: torch.Generator) -> None:
    """U(0, 0.01) plus the identity on the first square block (the official initialisation)."""
    with torch.no_grad():
        nn.init.uniform_(w, 0.0, 0.01, generator=generator)
        n = w.shape[0]
        w[:, :n] += torch.eye(n, dtype=w.dtype)


class Clover2Heads(DraftHeads):
    def __init__(self, config: HeadConfig, base: Decoder):
        super().__init__(config, base)
        cfg = base.config
        H = cfg.hidden_size
        self.fuse = GatedAttentionDecoder(cfg)
        self.augment = AugmentingBlock(cfg, config.num_layers)
        self.head_norm = new_norm(cfg)
        self.fc0 = nn.Linear(H, H)
        self.fc = nn.Linear(2 * H, H)
        self.rnn = GatedAttentionDecoder(cfg)

    @property
    def num_cache_layers(self) -> int:
        return len(self.augment.layers)

    def begin(self, hidden, next_tokens, position_ids, past_lengths, past_keys, past_values, last=None) -> BeginOutput:
        x = self.fuse(hidden, self.lm_weight[next_tokens])  # [B, N, H]
        a, new_k, new_v = self.augment(x, position_ids, past_lengths, past_keys, past_values)
        state = root_rows(a, last)  # [B, H]
        return BeginOutput(state, self.lm(self.head_norm(self.fc0(state))), new_k, new_v)

    def step(self, depth, parent_state, tokens):
        e = self.lm_weight[tokens]  # [n, H]
        h = self.rnn(parent_state, e)
        return h, self.lm(self.head_norm(self.fc(torch.cat((h, e), dim=-1))))

    def teacher_forced(self, hidden, tokens, depths):
        state = self.augment.over_sequence(self.fuse(hidden, self.lm_weight[shifted(tokens, 1)]))
        outs = [self.head_norm(self.fc0(state))]
        for d in range(2, depths + 1):
            e = self.lm_weight[shifted(tokens, d)]
            state = self.rnn(state, e)
            outs.append(self.head_norm(self.fc(torch.cat((state, e), dim=-1))))
        return outs

    def init_weights(self, base: Decoder, generator: torch.Generator) -> None:
        self.augment.init_from_base(base)
        self.head_norm.load_state_dict(base.norm.state_dict())
        self.fuse.init_weights(generator)
        self.rnn.init_weights(generator)
        for lin in (self.fc0, self.fc):
            eye_plus_uniform(lin.weight, generator)
            nn.init.zeros_(lin.bias)
