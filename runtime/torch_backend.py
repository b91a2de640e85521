"""PyTorch reference backend: the base Decoder and DraftHeads modules in eager mode.

The KV caches are preallocated per sequence (slot: [1, Hkv, capacity, D] per layer) and written in place;
the decoder reads views of their valid prefix, so no step copies the whole cache. Commit copies only
the accepted rows of the last forward into the next slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clover.models.decoder import Decoder
from clover.models.heads import DraftHeads
from clover.runtime.backend import EngineClock, Runner, RunnerInfo, Slot
from clover.runtime.lookup import NgramStore


@dataclass(eq=False)
class TorchSequence:
    """A slot's state in a TorchRunner: preallocated caches ([1, Hkv, capacity, D] per layer), the last
    forward's output and the draft states."""

    cache: tuple[list[torch.Tensor], list[torch.Tensor]]
    head_cache: tuple[list[torch.Tensor], list[torch.Tensor]]
    states: torch.Tensor  # [n, H] draft state of tree node i (grown as drafted)
    last: Any = None  # DecoderOutput of the last forward
    root_state: torch.Tensor | None = None
    root_logits: torch.Tensor | None = None


class TorchRunner(Runner):
    def __init__(self, base: Decoder, heads: DraftHeads | None = None, heads_name: str = "none",
                 draft_vocab: np.ndarray | None = None, ngram_store: NgramStore | None = None):
        """draft_vocab: int64 [K] token ids the heads draft over (their logits' columns); None: all V.
        ngram_store: what prompt lookup drafts from when the sequence has no match (runtime/lookup.py)."""
        super().__init__()
        self.base, self.heads = base, heads
        self.device = base.lm_head.weight.device
        self._vocab = None if draft_vocab is None or heads is None else self._t(np.asarray(draft_vocab, dtype=np.int64))
        self.engine_clock = EngineClock()
        cfg = base.config
        self.info = RunnerInfo(
            backend="torch", vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
            heads=heads.config.arch if heads is not None else None,
            heads_max_depth=heads.config.max_depth if heads is not None else None,
            heads_name=heads_name if heads is not None else "none",
            kv_bytes_per_token=2 * cfg.num_kv_heads * cfg.head_dim * base.lm_head.weight.element_size()
            * (cfg.num_layers + (heads.num_cache_layers if heads is not None else 0)),
            draft_vocab=None if self._vocab is None else np.asarray(draft_vocab, dtype=np.int64),
            ngram_store=ngram_store,
        )

    @property
    def cache(self):
        return self._solo.state.cache if self._solo else None  # the solo sequence's (tests, tools)

    def _open_slot(self, slot: Slot) -> TorchSequence:
        c = slot.capacity
        return TorchSequence(self.base.empty_cache(1, c),
                             self.base.empty_cache(1, c, self.heads.num_cache_layers if self.heads else 0),
                             torch.zeros(0, self.base.config.hidden_size, dtype=self.base.lm_head.weight.dtype))

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, device=self.device)  # small index arrays; copies, so read-only inputs are fine

    @torch.inference_mode()
    def _forward(self, slot, tokens, depths, mask, last_only):
        seq, P, T = slot.state, slot.past, tokens.shape[0]
        keys, values = seq.cache
        with self.engine_clock:
            out = self.base(
                self._t(tokens)[None], (P + self._t(depths).long())[None], self._t(mask)[None],
                torch.tensor([P], device=self.device), [k[:, :, :P] for k in keys], [v[:, :, :P] for v in values],
                logit_rows=torch.tensor([T - 1], device=self.device) if last_only else None,
            )
        seq.last = out
        return out.logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def _commit(self, slot, path, next_tokens):
        seq, P, m = slot.state, slot.past, len(path)
        rows = self._t(path)
        contiguous = bool(path[0] == 0 and path[-1] == m - 1)  # prefill / plain step: no gather needed
        for store, new in zip(seq.cache[0] + seq.cache[1], seq.last.new_keys + seq.last.new_values):
            store[:, :, P:P + m] = new[:, :, :m] if contiguous else new.index_select(2, rows)
        if self.heads is None:
            return
        keys, values = seq.head_cache
        hidden = seq.last.hidden_states.index_select(1, rows)  # [1, m, H]
        positions = torch.arange(P, P + m, device=self.device)[None]
        with self.engine_clock:
            out = self.heads.begin(hidden, self._t(next_tokens)[None], positions, torch.tensor([P], device=self.device),
                                   [k[:, :, :P] for k in keys], [v[:, :, :P] for v in values])
        for store, new in zip(keys + values, out.new_keys + out.new_values):
            store[:, :, P:P + m] = new
        seq.root_state, seq.root_logits = out.state, out.logits

    @torch.inference_mode()
    def _draft_begin(self, slot):
        seq = slot.state
        seq.states = seq.root_state.clone()  # row i = state of tree node i (grown as drafted)
        return self._drafted(seq.root_logits[0])

    @torch.inference_mode()
    def _draft_step(self, slot, depth, nodes, parents, tokens):
        seq = slot.state
        need = int(nodes.max()) + 1
        if seq.states.shape[0] < need:
            grown = seq.states.new_zeros(need, seq.states.shape[1])
            grown[: seq.states.shape[0]] = seq.states
            seq.states = grown
        with self.engine_clock:
            state, logits = self.heads.step(depth, seq.states[self._t(parents)], self._t(tokens))
        seq.states[self._t(nodes)] = state
        return self._drafted(logits)

    def _drafted(self, logits: torch.Tensor) -> np.ndarray:
        """Draft logits as the loop takes them: [..., K] over the draft vocabulary's columns, if any."""
        return (logits if self._vocab is None else logits[..., self._vocab]).float().cpu().numpy()


def base_dir(base: str | Path) -> Path:
    """The HF folder a base spec names (tokenizer files live there)."""
    from clover.models.smollm2 import resolve_base

    return resolve_base(base)


def load_runner(base: str | Path, heads: str = "none", dtype: str = "float32", threads: int | None = None) -> TorchRunner:
    """Build a runner from CLI-style specs: base = folder or 'smollm2'; heads = folder, random:ARCH[:SEED] or none;
    threads: torch's intra-op threads (process-wide; None leaves torch's default)."""
    from clover.models.head_io import resolve_heads
    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base

    if threads is not None:
        torch.set_num_threads(threads)
    model = load_base(resolve_base(base), dtype)
    return TorchRunner(model, resolve_heads(heads, model), heads_name=heads)
