"""PyTorch backend: the base Decoder and DraftHeads modules, eager or with the base's forward in CUDA graphs.

The KV caches are preallocated per sequence (slot: [1, Hkv, capacity, D] per layer) and written in place;
the decoder reads views of their valid prefix, so no step copies the whole cache. Commit copies only
the accepted rows of the last forward into the next slots.

On CUDA a small model's step is bound by kernel launches, not by the GPU (hundreds of launches of a few
microseconds each). `cuda_graphs=True` records the base's forward once per row bucket (1, 2, 4, ... rows) and
slot, over the slot's whole cache buffers with the Triton tree-attention kernel (it reads only each sequence's
valid prefix, so the buffers' addresses and shapes stay fixed), and replays it: one host-to-device copy of the
step's tokens, positions and mask, one replay, one copy of the logits back. Padding rows attend to themselves
only and are never committed. Prompts longer than the largest bucket run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from clover.errors import CloverError
from clover.models.decoder import Decoder, DecoderOutput, with_attention
from clover.models.heads import DraftHeads
from clover.runtime.backend import EngineClock, Prefix, Runner, RunnerInfo, Slot
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
    graphs: dict[int, ForwardGraph] = field(default_factory=dict)  # row bucket -> the base's forward (cuda_graphs)


def row_bucket(rows: int) -> int:
    """The CUDA graph a forward of `rows` new tokens replays: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


class ForwardGraph:
    """The base's forward over one slot's whole cache buffers for `rows` new tokens, recorded as one CUDA graph.

    Its inputs live in one static int64 buffer (one host-to-device copy a step): tokens [R], positions [R], the
    valid cache length [1] and the tree mask [R, R] flattened. Its outputs (a DecoderOutput with R rows) stay valid
    until the next replay of this graph."""

    def __init__(self, base: Decoder, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int) -> None:
        self.rows = R = rows
        device = keys[0].device
        self.inputs = torch.zeros(2 * R + 1 + R * R, dtype=torch.int64, device=device)
        self.host = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=True)

        def forward() -> DecoderOutput:
            i = self.inputs
            return base(
                i[:R][None], i[R : 2 * R][None], i[2 * R + 1 :].view(1, R, R).bool(), i[2 * R : 2 * R + 1], keys, values
            )

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = forward()

    def __call__(self, past: int, tokens: np.ndarray, depths: np.ndarray, mask: np.ndarray) -> DecoderOutput:
        R, T = self.rows, tokens.shape[0]
        host = self.host.numpy()
        host[:] = 0
        host[:T], host[R : R + T], host[2 * R] = tokens, past + depths, past
        square = host[2 * R + 1 :].reshape(R, R)
        square[:T, :T] = mask
        square[np.arange(T, R), np.arange(T, R)] = 1  # padding rows see themselves only
        self.inputs.copy_(self.host, non_blocking=True)
        self.graph.replay()
        return self.out


def torch_info(
    base: Decoder,
    heads: DraftHeads | None,
    heads_name: str,
    draft_vocab: np.ndarray | None,
    ngram_store: NgramStore | None,
    batch_slots: int = 1,
) -> RunnerInfo:
    """What a runner over these torch modules tells the loop (both torch runners)."""
    cfg = base.config
    layers = cfg.num_layers + (heads.num_cache_layers if heads is not None else 0)
    return RunnerInfo(
        backend="torch",
        vocab_size=cfg.vocab_size,
        max_context=cfg.max_position_embeddings,
        heads=heads.config.arch if heads is not None else None,
        heads_max_depth=heads.config.max_depth if heads is not None else None,
        heads_name=heads_name if heads is not None else "none",
        kv_bytes_per_token=2 * cfg.num_kv_heads * cfg.head_dim * base.lm_head.weight.element_size() * layers,
        draft_vocab=None if draft_vocab is None or heads is None else np.asarray(draft_vocab, dtype=np.int64),
        ngram_store=ngram_store,
        batch_slots=batch_slots,
    )


class TorchRunner(Runner):
    def __init__(
        self,
        base: Decoder,
        heads: DraftHeads | None = None,
        heads_name: str = "none",
        draft_vocab: np.ndarray | None = None,
        ngram_store: NgramStore | None = None,
        cuda_graphs: bool = False,
        max_graph_rows: int = 64,
    ):
        """draft_vocab: int64 [K] token ids the heads draft over (their logits' columns); None: all V.
        ngram_store: what prompt lookup drafts from when the sequence has no match (runtime/lookup.py).
        cuda_graphs: replay the base's forward from CUDA graphs (module doc) for forwards of up to
        `max_graph_rows` rows; needs the model on a CUDA device and Triton (the plugin attention variant)."""
        super().__init__()
        self.device = base.lm_head.weight.device
        self.max_graph_rows = max_graph_rows if cuda_graphs else 0
        self._spares: list[TorchSequence] = []  # released slots' buffers and graphs (cuda_graphs)
        if cuda_graphs:
            if self.device.type != "cuda":
                raise CloverError(f"cuda_graphs needs the model on a CUDA device, but it is on {self.device}")
            if base.config.sliding_window is not None:
                raise CloverError(
                    "cuda_graphs reads whole cache buffers through the tree-attention kernel, which has no "
                    f"sliding window; this model has a {base.config.sliding_window}-token window"
                )
            base = with_attention(base, "plugin")
        self._vocab = None if draft_vocab is None or heads is None else self._t(np.asarray(draft_vocab, dtype=np.int64))
        # with a draft vocabulary the heads compute only its columns (a K/V share of their LM head's work)
        self.base, self.heads = base, heads if self._vocab is None else heads.over_vocab(self._vocab)
        self.engine_clock = EngineClock()
        self.info = torch_info(base, heads, heads_name, draft_vocab, ngram_store)

    @property
    def cache(self):
        return self._solo.state.cache if self._solo else None  # the solo sequence's (tests, tools)

    def _open_slot(self, slot: Slot) -> TorchSequence:
        c = slot.capacity
        spare = next((s for s in self._spares if s.cache[0][0].shape[2] >= c), None)
        if spare is not None:  # its recorded graphs stay valid: same buffers, and only the valid prefix is read
            self._spares.remove(spare)
            spare.states, spare.last, spare.root_state, spare.root_logits = spare.states[:0], None, None, None
            return spare
        return TorchSequence(
            self.base.empty_cache(1, c),
            self.base.empty_cache(1, c, self.heads.num_cache_layers if self.heads else 0),
            torch.zeros(0, self.base.config.hidden_size, dtype=self.base.lm_head.weight.dtype),
        )

    @torch.inference_mode()
    def _fork(self, src: Slot, dst: Slot) -> None:
        s, d, P = src.state, dst.state, src.past
        for caches in ((s.cache, d.cache), (s.head_cache, d.head_cache)):
            for old, new in zip(caches[0][0] + caches[0][1], caches[1][0] + caches[1][1]):
                new[:, :, :P] = old[:, :, :P]
        d.root_state = None if s.root_state is None else s.root_state.clone()
        d.root_logits = None if s.root_logits is None else s.root_logits.clone()

    @torch.inference_mode()
    def _snapshot(self, slot: Slot, rows: int, heads: bool) -> Prefix:
        s = slot.state  # the heads take in each row as it is committed: they have seen them all
        saved = [b[:, :, :rows].clone() for b in s.cache[0] + s.cache[1] + s.head_cache[0] + s.head_cache[1]]
        return Prefix(rows, sum(t.nbytes for t in saved), saved)

    @torch.inference_mode()
    def _restore(self, slot: Slot, prefix: Prefix, rows: int) -> None:
        s = slot.state
        for new, old in zip(s.cache[0] + s.cache[1] + s.head_cache[0] + s.head_cache[1], prefix.data):
            new[:, :, :rows] = old[:, :, :rows]
        s.root_state = s.root_logits = None  # the next committed rows set them

    def _release(self, slot: Slot) -> None:
        if self.max_graph_rows:  # kept with its graphs for the next sequence, which then records none
            self._spares.append(slot.state)

    def close(self) -> None:
        self._spares.clear()

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, device=self.device)  # small index arrays; copies, so read-only inputs are fine

    @torch.inference_mode()
    def _forward(self, slot, tokens, depths, mask, last_only):
        seq, P, T = slot.state, slot.past, tokens.shape[0]
        keys, values = seq.cache
        if T <= self.max_graph_rows:
            R = row_bucket(T)
            graph = seq.graphs.get(R)
            if graph is None:
                graph = seq.graphs[R] = ForwardGraph(self.base, keys, values, R)
            with self.engine_clock:
                seq.last = out = graph(P, tokens, depths, mask)
                logits = out.logits[0, T - 1 : T] if last_only else out.logits[0, :T]
                return logits.float().cpu().numpy()
        with self.engine_clock:
            out = self.base(
                self._t(tokens)[None],
                (P + self._t(depths).long())[None],
                self._t(mask)[None],
                torch.tensor([P], device=self.device),
                [k[:, :, :P] for k in keys],
                [v[:, :, :P] for v in values],
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
            store[:, :, P : P + m] = new[:, :, :m] if contiguous else new.index_select(2, rows)
        if self.heads is None:
            return
        keys, values = seq.head_cache
        hidden = seq.last.hidden_states.index_select(1, rows)  # [1, m, H]
        positions = torch.arange(P, P + m, device=self.device)[None]
        with self.engine_clock:
            out = self.heads.begin(
                hidden,
                self._t(next_tokens)[None],
                positions,
                torch.tensor([P], device=self.device),
                [k[:, :, :P] for k in keys],
                [v[:, :, :P] for v in values],
            )
        for store, new in zip(keys + values, out.new_keys + out.new_values):
            store[:, :, P : P + m] = new
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
        return logits.float().cpu().numpy()  # over the draft vocabulary's columns already (over_vocab)
