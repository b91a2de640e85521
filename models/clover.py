"""Clover heads (arXiv 2405.00263): Regressive Connection, Attention Decoder, Augmenting Block.

- Augmenting Block: one decoder layer over the base's last hidden states (own KV cache of accepted
  tokens), initialised from the base's last layer, then the base's final norm: h_0 = a_t.
- Regressive Connection + Attention Decoder, shared by all heads: head i consumes the embedding e of
  the token drafted at the previous depth (the bonus token for head 0), embedding = row of the
  L2-normalised LM-head weight; h_{i+1} = h_i + Attn(Q = norm(h_i), K = V = e).
  With a single key per query the softmax weight is exactly 1, so Attn reduces to W_o W_v e and the
  query/key projections would have no effect; they are left out. (Clover-2 replaces the softmax by a
  cosine gate, which does depend on the query; see clover2.py.)
- Per head: a Medusa-style ResBlock, then the LM head shared with the base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.models.decoder import Decoder
from clover.models.heads import AugmentingBlock, BeginOutput, DraftHeads, HeadConfig, ResBlock, root_rows, shifted


class CloverHeads(DraftHeads):
    def __init__(self, config: HeadConfig, base: Decoder):
        super().__init__(config, base)
        H = base.config.hidden_size
        self.augment = AugmentingBlock(base.config, config.num_layers)
        self.attn_v = nn.Linear(H, H, bias=False)
        self.attn_o = nn.Linear(H, H, bias=False)
        self.heads = nn.ModuleList(ResBlock(H) for _ in range(config.num_heads))

    @property
    def num_cache_layers(self) -> int:
        return len(self.augment.layers)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.lm_weight[tokens], dim=-1)

    def _advance(self, depth: int, h: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + self.attn_o(self.attn_v(self._embed(tokens)))
        return h, self.lm(self.heads[depth](h))

    def begin(self, hidden, next_tokens, position_ids, past_lengths, past_keys, past_values, last=None) -> BeginOutput:
        a, new_k, new_v = self.augment(hidden, position_ids, past_lengths, past_keys, past_values)
        state, logits = self._advance(0, root_rows(a, last), root_rows(next_tokens, last))
        return BeginOutput(state, logits, new_k, new_v)

    def step(self, depth, parent_state, tokens):
        return self._advance(depth, parent_state, tokens)

    def teacher_forced(self, hidden, tokens, depths):
        h = self.augment.over_sequence(hidden)
        outs = []
        for d in range(1, depths + 1):
            h = h + self.attn_o(self.attn_v(self._embed(shifted(tokens, d))))
            outs.append(self.heads[d - 1](h))
        return outs

    def init_weights(self, base: Decoder, generator: torch.Generator) -> None:
        self.augment.init_from_base(base)
        for lin in (self.attn_v, self.attn_o):
            nn.init.normal_(lin.weight, std=0.02, generator=generator)
        for block in self.heads:
            nn.init.zeros_(block.linear.weight)
            nn.init.zeros_(block.linear.bias)
