"""Medusa heads (baseline): K independent heads on the base's last hidden state.

Head k predicts the token k+2 positions after the last accepted token (k+1 after the bonus token),
from the same (post-norm) hidden state, independently of the tokens drafted before it. Each head is
`num_layers` zero-initialised ResBlocks followed by an LM head: the base's, shared (default), or its
own copy initialised from the base's (`own_lm_head`, as in Medusa-1; costs V*H parameters per head).
"""

from __future__ import annotations

import torch
from torch import nn

from clover.models.decoder import Decoder
from clover.models.heads import BeginOutput, DraftHeads, HeadConfig, ResBlock, root_rows


class MedusaHeads(DraftHeads):
    def __init__(self, config: HeadConfig, base: Decoder):
        super().__init__(config, base)
        H, V = base.config.hidden_size, base.config.vocab_size
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(H) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads)) if config.own_lm_head else None
        )

    own_rows: list[torch.Tensor] | None = None  # over_vocab with own LM heads: each head's rows of the draft vocabulary

    def _logits(self, k: int, state: torch.Tensor) -> torch.Tensor:
        x = self.heads[k](state)
        if self.lm_heads is None:
            return self.lm(x)
        return self.lm_heads[k](x) if self.own_rows is None else x @ self.own_rows[k].T

    def over_vocab(self, ids: torch.Tensor) -> MedusaHeads:
        clone = super().over_vocab(ids)
        if self.lm_heads is not None:
            clone.own_rows = [head.weight[ids] for head in self.lm_heads]
        return clone

    def begin(self, hidden, next_tokens, position_ids, past_lengths, past_keys, past_values, last=None) -> BeginOutput:
        state = self.base_norm(root_rows(hidden, last))  # [B, H]
        return BeginOutput(state, self._logits(0, state), [], [])

    def step(self, depth, parent_state, tokens):
        # Every node at this depth sees the same root state: compute one row and broadcast it.
        logits = self._logits(depth, parent_state[:1]).expand(parent_state.shape[0], -1)
        return parent_state, logits

    def step_batch(self, depth, parent_state, tokens):
        logits = self._logits(depth, parent_state[:, :1]).expand(-1, parent_state.shape[1], -1)  # one row per sequence
        return parent_state, logits

    def teacher_forced(self, hidden, tokens, depths):
        state = self.base_norm(hidden)
        return [self.heads[d - 1](state) for d in range(1, depths + 1)]

    def head_logits(self, depth, x):
        return self.lm_heads[depth - 1](x) if self.lm_heads is not None else self.lm(x)

    def init_weights(self, base: Decoder, generator: torch.Generator) -> None:
        for block in self.modules():
            if isinstance(block, ResBlock):
                nn.init.zeros_(block.linear.weight)
                nn.init.zeros_(block.linear.bias)
        if self.lm_heads is not None:
            for head in self.lm_heads:
                head.weight.data.copy_(base.lm_head.weight)
