"""PyTorch reference backend: the base Decoder and DraftHeads modules in eager mode.

The KV caches are preallocated per sequence ([1, Hkv, capacity, D] per layer) and written in place;
the decoder reads views of their valid prefix, so no step copies the whole cache. Commit copies only
the accepted rows of the last forward into the next slots.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from clover.models.decoder import Decoder
from clover.models.heads import DraftHeads
from clover.runtime.backend import EngineClock, Runner, RunnerInfo


class TorchRunner(Runner):
    def __init__(self, base: Decoder, heads: DraftHeads | None = None, heads_name: str = "none"):
        super().__init__()
        self.base, self.heads = base, heads
        self.engine_clock = EngineClock()
        cfg = base.config
        self.device = base.lm_head.weight.device
        self.info = RunnerInfo(
            backend="torch", vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings,
            heads=heads.config.arch if heads is not None else None,
            heads_max_depth=heads.config.max_depth if heads is not None else None,
            heads_name=heads_name if heads is not None else "none",
        )

    def _reset(self, capacity: int) -> None:
        self.cache = self.base.empty_cache(1, capacity)
        self.head_cache = self.base.empty_cache(1, capacity, self.heads.num_cache_layers if self.heads else 0)
        self._states = torch.zeros(0, self.base.config.hidden_size, dtype=self.base.lm_head.weight.dtype)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, device=self.device)  # small index arrays; copies, so read-only inputs are fine

    @torch.inference_mode()
    def _forward(self, tokens, depths, mask, last_only):
        P, T = self._past, tokens.shape[0]
        keys, values = self.cache
        with self.engine_clock:
            out = self.base(
                self._t(tokens)[None], (P + self._t(depths).long())[None], self._t(mask)[None],
                torch.tensor([P], device=self.device), [k[:, :, :P] for k in keys], [v[:, :, :P] for v in values],
                logit_rows=torch.tensor([T - 1], device=self.device) if last_only else None,
            )
        self._last = out
        return out.logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def _commit(self, path, next_tokens):
        P, m = self._past, len(path)
        rows = self._t(path)
        contiguous = bool(path[0] == 0 and path[-1] == m - 1)  # prefill / plain step: no gather needed
        for store, new in zip(self.cache[0] + self.cache[1], self._last.new_keys + self._last.new_values):
            store[:, :, P:P + m] = new[:, :, :m] if contiguous else new.index_select(2, rows)
        if self.heads is None:
            return
        keys, values = self.head_cache
        hidden = self._last.hidden_states.index_select(1, rows)  # [1, m, H]
        positions = torch.arange(P, P + m, device=self.device)[None]
        with self.engine_clock:
            out = self.heads.begin(hidden, self._t(next_tokens)[None], positions, torch.tensor([P], device=self.device),
                                   [k[:, :, :P] for k in keys], [v[:, :, :P] for v in values])
        for store, new in zip(keys + values, out.new_keys + out.new_values):
            store[:, :, P:P + m] = new
        self._root_state, self._root_logits = out.state, out.logits

    @torch.inference_mode()
    def _draft_begin(self):
        self._states = self._root_state.clone()  # row i = state of tree node i (grown as drafted)
        return self._root_logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def _draft_step(self, depth, nodes, parents, tokens):
        need = int(nodes.max()) + 1
        if self._states.shape[0] < need:
            grown = self._states.new_zeros(need, self._states.shape[1])
            grown[: self._states.shape[0]] = self._states
            self._states = grown
        with self.engine_clock:
            state, logits = self.heads.step(depth, self._states[self._t(parents)], self._t(tokens))
        self._states[self._t(nodes)] = state
        return logits.float().cpu().numpy()


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
