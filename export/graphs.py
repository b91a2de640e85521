"""The exported graphs as torch modules with flat tensor signatures, plus example inputs for each.

`torch.onnx.export(dynamo=True)` wants tensors in and tensors out; these wrappers unpack flat inputs
into the models' forward arguments and flatten their outputs, so every graph input and output is one
named tensor. Graphs and their I/O (dims named; see docs/design.md for the names):

base          input_ids [batch, new] int64, position_ids [batch, new] int64, tree_mask [batch, new, new]
              bool, past_lengths [batch] int64, logit_rows [rows] int64,
              past_key_values.{i}.key / .value [batch, Hkv, past, D]
          ->  logits [batch, rows, V], hidden_states [batch, new, H] (pre-norm: what the heads consume),
              present.{i}.key / .value [batch, Hkv, new, D] (the new tokens' K/V only)
draft_begin   hidden_states [batch, accepted, H], next_tokens [batch, accepted], position_ids,
              past_lengths [batch], past_key_values.{i}.* of the heads' augmenting block
(clover,  ->  state [batch, H], logits [batch, V], present.{i}.* [batch, Hkv, accepted, D]
 clover2)
draft_step    [depth [] int64: clover only], parent_state [candidates, H], tokens [candidates]
          ->  state [candidates, H], logits [candidates, V]
medusa_heads  hidden_states [batch, accepted, H] -> logits [batch, heads, V] (every depth at once:
              Medusa heads do not depend on the drafted tokens)

`logit_rows` selects the rows the LM head runs on: the prefill needs only the last one, which saves
rows x V x H multiply-adds and a [prompt, V] output. Past entries at or beyond `past_lengths` are
masked, so a runtime can bind a preallocated cache buffer of any capacity as the past.

Clover's depth-dependent ResBlocks are stacked into one [K, H, H] weight gathered by the `depth`
input: one draft_step graph serves every depth, so the shared LM-head weight (V x H, the largest
tensor of the heads) is stored and loaded once rather than once per depth.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clover.models.clover import CloverHeads
from clover.models.clover2 import Clover2Heads
from clover.models.decoder import Decoder, causal_mask, with_attention
from clover.models.heads import DraftHeads
from clover.models.medusa import MedusaHeads

Sizes = dict[str, int]
# Sizes used to trace: all > 1 and distinct, so torch.export neither specialises a dim to 0/1 nor
# merges two dims that happen to be equal. Edge sizes (past 0, one new token) are tested at run time.
EXPORT_SIZES: Sizes = {"batch": 2, "new": 5, "past": 7, "rows": 3, "accepted": 4, "candidates": 6}


@dataclass(frozen=True)
class GraphDef:
    """A module whose forward(*inputs) takes and returns flat tensors, with the names and dynamic dims
    of its I/O and a maker of valid example inputs for given dim sizes."""

    name: str  # manifest key and file stem
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dims: tuple[dict[int, str], ...]  # per input: axis -> dynamic dim name
    example: Callable[[Sizes, torch.Generator], tuple[torch.Tensor, ...]]

    def dynamic_shapes(self) -> dict[str, tuple[dict[int, str], ...]]:
        return {"inputs": self.dims}  # forward(self, *inputs)


def kv_names(prefix: str, layers: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}.{kv}" for i in range(layers) for kv in ("key", "value"))


def interleave(keys: list[torch.Tensor], values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for kv in zip(keys, values) for t in kv]


# -- example inputs ------------------------------------------------------------------------------------


def _float_dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def random_tree(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random token tree of n nodes (node 0 the root, parents before children): depth [n], mask [n, n]."""
    depth = torch.zeros(n, dtype=torch.int64)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
    return depth, mask


def random_past_lengths(batch: int, past: int, g: torch.Generator) -> torch.Tensor:
    """[batch] valid cache lengths: the first sequence uses the whole past, the others a random prefix."""
    lengths = torch.randint(0, past + 1, (batch,), generator=g)
    lengths[0] = past
    return lengths


def random_cache(
    n: int, batch: int, kv_heads: int, past: int, head_dim: int, dtype: torch.dtype, g: torch.Generator
) -> list[torch.Tensor]:
    return [torch.randn(batch, kv_heads, past, head_dim, generator=g).to(dtype) for _ in range(n)]


def model_cache(base: Decoder, batch: int, past: int, g: torch.Generator) -> list[torch.Tensor]:
    """The base's own K/V for `past` random tokens, interleaved per layer: a realistic past (random
    K/V of unit scale miss the large, structured channels of real caches and exaggerate errors)."""
    if past == 0:
        return interleave(*base.empty_cache(batch, 0))
    tokens = torch.randint(0, base.config.vocab_size, (batch, past), generator=g)
    with torch.inference_mode():
        out = base(
            tokens,
            torch.arange(past).expand(batch, -1),
            causal_mask(past, batch),
            torch.zeros(batch, dtype=torch.int64),
            *base.empty_cache(batch, 0),
        )
    return [t.clone() for t in interleave(out.new_keys, out.new_values)]


# -- the base decoder -------------------------------------------------------------------------------------


class BaseGraph(nn.Module):
    def __init__(self, base: Decoder):
        super().__init__()
        self.base = base

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        input_ids, position_ids, tree_mask, past_lengths, logit_rows, *past = inputs
        out = self.base(
            input_ids, position_ids, tree_mask, past_lengths, list(past[0::2]), list(past[1::2]), logit_rows
        )
        return (out.logits, out.hidden_states, *interleave(out.new_keys, out.new_values))


def base_graph(base: Decoder, attention: str = "portable", chains: bool = False) -> GraphDef:
    """The base decoder's graph; `attention` "plugin": one tree-attention node per layer (same I/O).
    chains: example inputs are chains (causal masks), for graphs that verify only chains."""
    base = with_attention(base, attention)
    cfg = base.config
    L = cfg.num_layers

    def example(s: Sizes, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        B, T, P, R = s["batch"], s["new"], s["past"], s["rows"]
        depth, mask = (torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril()) if chains else random_tree(T, g)
        lengths = random_past_lengths(B, P, g)
        rows = torch.tensor([T - 1]) if R == 1 else torch.sort(torch.randperm(T, generator=g)[:R]).values
        return (
            torch.randint(0, cfg.vocab_size, (B, T), generator=g),
            lengths[:, None] + depth,
            mask[None].expand(B, -1, -1).contiguous(),
            lengths,
            rows,
            *model_cache(base, B, P, g),
        )

    bn = {0: "batch", 1: "new"}
    return GraphDef(
        name="base",
        module=BaseGraph(base),
        inputs=(
            "input_ids",
            "position_ids",
            "tree_mask",
            "past_lengths",
            "logit_rows",
            *kv_names("past_key_values", L),
        ),
        outputs=("logits", "hidden_states", *kv_names("present", L)),
        dims=(
            bn,
            bn,
            {0: "batch", 1: "new", 2: "new"},
            {0: "batch"},
            {0: "rows"},
            *[{0: "batch", 2: "past"}] * (2 * L),
        ),
        example=example,
    )


# -- draft heads ------------------------------------------------------------------------------------------


class BeginGraph(nn.Module):
    """heads.begin over the accepted tokens, with the augmenting block's own KV cache (clover, clover2)."""

    def __init__(self, heads: DraftHeads):
        super().__init__()
        self.heads = heads

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden, next_tokens, position_ids, past_lengths, *past = inputs
        out = self.heads.begin(hidden, next_tokens, position_ids, past_lengths, list(past[0::2]), list(past[1::2]))
        return (out.state, out.logits, *interleave(out.new_keys, out.new_values))


class Clover2StepGraph(nn.Module):
    """Clover-2's recurrent head is shared by every depth: no depth input."""

    def __init__(self, heads: Clover2Heads):
        super().__init__()
        self.heads = heads

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parent_state, tokens = inputs
        return self.heads.step(1, parent_state, tokens)


class CloverStepGraph(nn.Module):
    """CloverHeads.step with the per-depth ResBlocks stacked and gathered by a `depth` input.

    Same arithmetic as CloverHeads._advance (ResBlock: x + SiLU(W x + b)); the export parity tests
    compare it with heads.step at every depth.
    """

    def __init__(self, heads: CloverHeads):
        super().__init__()
        self.heads = heads
        stack = lambda ts: nn.Parameter(torch.stack(list(ts)), requires_grad=False)
        self.res_weight = stack(b.linear.weight for b in heads.heads)  # [K, H, H]
        self.res_bias = stack(b.linear.bias for b in heads.heads)  # [K, H]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        depth, parent_state, tokens = inputs
        h = self.heads
        state = parent_state + h.attn_o(h.attn_v(h._embed(tokens)))  # [n, H]
        x = state + F.silu(F.linear(state, self.res_weight[depth], self.res_bias[depth]))
        return state, h.lm(x)


class MedusaGraph(nn.Module):
    """Every Medusa head's logits from the last accepted hidden state: [batch, heads, V]."""

    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        (hidden,) = inputs
        state = self.heads.base_norm(hidden[:, -1])  # as MedusaHeads.begin
        return torch.stack([self.heads._logits(k, state) for k in range(self.heads.config.num_heads)], dim=1)


def exportable(heads: DraftHeads) -> DraftHeads:
    """A copy of `heads` whose buffers shared with the base (LM head, final norm) are plain tensors:
    torch.export rejects a Parameter registered as a buffer. The copy shares all storage."""
    clone = copy.copy(heads)  # shallow: submodules and tensors are shared
    clone._buffers = {k: (v.detach() if v is not None else None) for k, v in heads._buffers.items()}
    return clone


def draft_graphs(heads: DraftHeads) -> list[GraphDef]:
    """The graphs that replace `heads` at run time: medusa_heads, or draft_begin + draft_step."""
    heads = exportable(heads)
    cfg = heads.config.base_config
    H, V, dtype = cfg.hidden_size, cfg.vocab_size, _float_dtype(heads)
    L = heads.num_cache_layers

    def hidden_example(s: Sizes, g: torch.Generator) -> torch.Tensor:
        return torch.randn(s["batch"], s["accepted"], H, generator=g).to(dtype)

    if isinstance(heads, MedusaHeads):
        return [
            GraphDef(
                "medusa_heads",
                MedusaGraph(heads),
                ("hidden_states",),
                ("logits",),
                ({0: "batch", 1: "accepted"},),
                lambda s, g: (hidden_example(s, g),),
            )
        ]

    def begin_example(s: Sizes, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        B, N, P = s["batch"], s["accepted"], s["past"]
        lengths = random_past_lengths(B, P, g)
        return (
            hidden_example(s, g),
            torch.randint(0, V, (B, N), generator=g),
            lengths[:, None] + torch.arange(N),
            lengths,
            *random_cache(2 * L, B, cfg.num_kv_heads, P, cfg.head_dim, dtype, g),
        )

    bn = {0: "batch", 1: "accepted"}
    begin = GraphDef(
        "draft_begin",
        BeginGraph(heads),
        ("hidden_states", "next_tokens", "position_ids", "past_lengths", *kv_names("past_key_values", L)),
        ("state", "logits", *kv_names("present", L)),
        (bn, bn, bn, {0: "batch"}, *[{0: "batch", 2: "past"}] * (2 * L)),
        begin_example,
    )

    def step_inputs(s: Sizes, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = s["candidates"]
        return torch.randn(n, H, generator=g).to(dtype), torch.randint(0, V, (n,), generator=g)

    n = {0: "candidates"}
    if isinstance(heads, CloverHeads):
        depths = heads.config.num_heads
        step = GraphDef(
            "draft_step",
            CloverStepGraph(heads),
            ("depth", "parent_state", "tokens"),
            ("state", "logits"),
            ({}, n, n),
            lambda s, g: (torch.tensor(s.get("depth", depths - 1), dtype=torch.int64), *step_inputs(s, g)),
        )
    elif isinstance(heads, Clover2Heads):
        step = GraphDef(
            "draft_step", Clover2StepGraph(heads), ("parent_state", "tokens"), ("state", "logits"), (n, n), step_inputs
        )
    else:
        raise TypeError(f"no export graphs for {type(heads).__name__}")
    return [begin, step]


def float32_twin(graph: GraphDef) -> GraphDef:
    """The same graph computing in float32: the reference a float16 export is judged against (float16
    PyTorch on the CPU rounds at other places than ONNX Runtime, so neither is the truth)."""
    return dataclasses.replace(graph, module=copy.deepcopy(graph.module).float())


def reference_outputs(graph: GraphDef, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The PyTorch modules' outputs for `inputs`, computed the way the runtime uses them (not the wrapper):
    Decoder.forward / heads.begin / heads.step, so the parity check also covers the wrappers."""
    m = graph.module
    with torch.inference_mode():
        if isinstance(m, BaseGraph):
            ids, pos, mask, lengths, rows, *past = inputs
            out = m.base(ids, pos, mask, lengths, list(past[0::2]), list(past[1::2]), rows)
            return [out.logits, out.hidden_states, *interleave(out.new_keys, out.new_values)]
        if isinstance(m, BeginGraph):
            hidden, nxt, pos, lengths, *past = inputs
            out = m.heads.begin(hidden, nxt, pos, lengths, list(past[0::2]), list(past[1::2]))
            return [out.state, out.logits, *interleave(out.new_keys, out.new_values)]
        if isinstance(m, CloverStepGraph):
            depth, parent, tokens = inputs
            return list(m.heads.step(int(depth), parent, tokens))
        if isinstance(m, Clover2StepGraph):
            return list(m.heads.step(1, *inputs))
        if isinstance(m, MedusaGraph):
            (hidden,) = inputs
            h, per_sequence = m.heads, []
            for b in range(hidden.shape[0]):
                begin = h.begin(hidden[b : b + 1], None, None, None, [], [])
                token = torch.zeros(1, dtype=torch.int64)  # Medusa ignores the drafted token
                depths = [begin.logits] + [h.step(k, begin.state, token)[1] for k in range(1, h.config.num_heads)]
                per_sequence.append(torch.stack(depths, dim=1))  # [1, K, V]
            return [torch.cat(per_sequence)]
    raise TypeError(f"no reference for {type(m).__name__}")
