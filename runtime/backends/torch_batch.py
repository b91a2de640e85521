"""PyTorch backend for batches: every sequence's KV cache in one stacked buffer, one forward for the whole batch,
and the whole speculative step on the device.

Layout. Each layer's K and V (the base's, and the heads' augmenting block's) is one buffer [S, Hkv, C + scratch, D]:
row s is sequence slot s (a slot's index is the lowest free number, so a batch's rows stay dense), column j holds
position j. A forward runs rows 0..n-1 for the n = highest slot + 1 rows a batch spans, over views of the buffers
(no copy); rows of slots outside the batch get one padding token and are never committed. Buffers grow by doubling,
in rows and in columns.

Two ways to step. The Runner methods (forward_batch, commit, draft_*) serve the general loop (runtime/loop.py):
sampling, logits processors, grammars, prompt lookup, dynamic trees, prefill. `decode` runs a greedy step of a fixed
tree for many sequences without the host in the middle: the heads draft each level on the device (per-level top-k,
the draft vocabulary as an index), one forward verifies every sequence's tree, acceptance (`accept_paths`: the
longest path whose tokens are their parents' argmax) and the commit of each accepted path's K/V and of the heads'
state happen on the device, and one device-to-host copy brings back each sequence's accepted count, path and emitted
tokens (no logits; with log-probabilities, the emitted tokens' and the top 20 of each of their rows). Its state between steps (each row's cached length, its root token, the heads' root state and
draft logits) stays on the device. Rows of the batch that do not step (prefilling, or free) compute like the others
but commit nothing: their writes go to the scratch columns past C, their lengths and roots stay.

With `cuda_graphs=True` (a CUDA device and Triton: the base's attention is the plugin kernel, which reads each row's
own prefix of the whole buffers) `decode` records the whole step, draft -> verify -> accept -> commit, as one CUDA
graph per (row bucket, tree, greedy or sampled, with processors or not) and replays it: one host-to-device copy (which
rows step, their temperature, top-p, top-k and min-p) and one copy back per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from clover.errors import CloverError
from clover.models.decoder import Decoder, DecoderOutput, with_attention
from clover.models.heads import DraftHeads
from clover.runtime.backend import Decoded, EngineClock, Prefix, Runner, Slot, SlotStep, Verify
from clover.runtime.backends.torch_runner import row_bucket, torch_info
from clover.runtime.logprobs import MAX_LOGPROBS, StepLogprobs
from clover.runtime.lookup import NgramStore
from clover.runtime.processors import LogitsProcessors
from clover.runtime.tree import Tree

SCRATCH = 64  # columns past the capacity that rows not stepping in `decode` write to; bounds its trees' depth
LONG = 64  # rows past which a forward's tokens (a prompt chunk) run in a forward of their own
BLOCK = 256  # columns the buffers start with (doubled as sequences grow)


@dataclass(frozen=True, eq=False)
class Level:
    """One depth d >= 1 of a tree, as `decode` drafts it: nodes start..end-1; each node's parent as a row of the
    previous level's drafted rows and its rank among its siblings; the nodes of this level whose children are
    drafted next (`expand`, rows of this level)."""

    start: int
    end: int
    parent_row: torch.Tensor  # [m] int64
    rank: torch.Tensor  # [m] int64
    parent: torch.Tensor  # [m] int64 node ids
    k: int  # top-k taken per parent row
    expand: torch.Tensor  # [e] int64
    rows: torch.Tensor  # [r] int64 node ids of the previous level's drafted rows (the root for depth 1)


@dataclass(frozen=True, eq=False)
class DeviceTree:
    """A compiled Tree's buffers on a device."""

    tree: Tree
    depth: torch.Tensor  # [T] int64
    mask: torch.Tensor  # [T, T] bool
    levels: tuple[Level, ...]
    children: torch.Tensor  # [T, max(1, max_children)] int64 child ids in rank order, padded with -1

    @classmethod
    def of(cls, tree: Tree, device: torch.device) -> DeviceTree:
        t = lambda a: torch.tensor(np.asarray(a, dtype=np.int64), device=device)
        levels, expanded = [], np.zeros(1, dtype=np.int64)  # the root's children are drafted first
        for d in range(1, tree.max_depth + 1):
            nodes = tree.levels[d]
            parents = tree.parent[nodes].astype(np.int64)
            row_of = {int(n): r for r, n in enumerate(expanded)}
            kids = [r for r, n in enumerate(nodes) if len(tree.children[n])] if d < tree.max_depth else []
            levels.append(
                Level(
                    int(nodes[0]),
                    int(nodes[-1]) + 1,
                    t([row_of[int(p)] for p in parents]),
                    t(tree.rank[nodes]),
                    t(parents),
                    int(tree.rank[nodes].max()) + 1,
                    t(kids),
                    t(expanded),
                )
            )
            expanded = nodes[kids]
        children = np.full((tree.num_nodes, max(1, tree.max_children)), -1, dtype=np.int64)
        for node, kids in enumerate(tree.children):
            children[node, : len(kids)] = kids
        return cls(tree, t(tree.depth), torch.tensor(tree.ancestor_mask, device=device), tuple(levels), t(children))


def accept_paths(tree: DeviceTree, tokens: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of B drafted trees at once, on their device: tokens [B, T] (node 0 the root) and target
    [B, T] (the base's argmax at each node). A node is accepted when its parent is and its token is its parent's
    target; among accepted siblings the first in rank order wins (runtime/acceptance.accept_greedy, the reference).
    Returns path [B, D + 1] (node ids root first; past a sequence's count, its last node repeated) and count [B]."""
    B, T = tokens.shape
    accepted = torch.zeros(B, T, dtype=torch.bool, device=tokens.device)
    accepted[:, 0] = True
    path = torch.zeros(B, len(tree.levels) + 1, dtype=torch.int64, device=tokens.device)
    count = torch.ones(B, dtype=torch.int64, device=tokens.device)
    for d, lv in enumerate(tree.levels, start=1):
        ok = accepted[:, lv.parent] & (tokens[:, lv.start : lv.end] == target[:, lv.parent])
        ok &= ok.cumsum(1) == 1  # the first match only: one accepted node per depth
        accepted[:, lv.start : lv.end] = ok
        found = ok.any(1)
        path[:, d] = torch.where(found, lv.start + ok.int().argmax(1), path[:, d - 1])
        count += found
    return path, count


RESIDUAL_EPS = 1e-12  # as runtime/acceptance.py: a residual this light is an unreachable branch


@dataclass(frozen=True, eq=False)
class Law:
    """Per row of a decode batch, how tokens are chosen: temperature [n] (0: greedy), top_p [n], top_k [n] (0: off)
    and min_p [n] (0: off)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's law over logits [n, ..., V], float32, as runtime/sampling.probs_from_logits: temperature
        softmax, its top-k (ties by lower id) and the tokens at least min_p times as likely as the first, then
        the nucleus of what they keep (the smallest set of most likely tokens reaching top_p, ties by lower id);
        greedy rows: the temperature-1 softmax (drafts) or, by `target`, the argmax's point mass."""
        shape = (-1,) + (1,) * (logits.dim() - 1)
        t = torch.where(self.greedy, 1.0, self.temperature).view(shape)
        probs = torch.softmax(logits.float() / t, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        k = torch.where(self.top_k > 0, self.top_k, probs.shape[-1]).view(shape)
        kept = (rank < k) & (ordered >= self.min_p.view(shape) * ordered[..., :1])
        ordered = torch.where(kept, ordered, 0.0)
        ordered = ordered / ordered.sum(-1, keepdim=True)
        before = ordered.cumsum(-1) - ordered  # mass of the more likely tokens kept
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, kept & (before < self.top_p.view(shape)))
        probs = torch.where(keep, probs, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    def target(self, logits: torch.Tensor) -> torch.Tensor:
        point = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        shape = (-1,) + (1,) * (logits.dim() - 1)
        return torch.where(self.greedy.view(shape), point, self.probs(logits))


def accept_sampled(
    tree: DeviceTree,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    draft: torch.Tensor,
    target: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling of B drafted trees at once, on their device (runtime/acceptance.accept_sampling,
    the reference, with the same stages): tokens, valid [B, T]; draft [B, T, V] the law each node's children were
    drawn from, in rank order without replacement; target [B, T, V] the base's law at each node. The emitted tokens
    have the target's law exactly; a point-mass target row (greedy) accepts exactly its argmax.
    Returns path [B, D + 1], count [B] and the bonus token [B]."""
    B, T, V = target.shape
    rows = torch.arange(B, device=tokens.device)
    node = torch.zeros(B, dtype=torch.int64, device=tokens.device)
    alive = torch.ones(B, dtype=torch.bool, device=tokens.device)
    path = torch.zeros(B, len(tree.levels) + 1, dtype=torch.int64, device=tokens.device)
    count = torch.ones(B, dtype=torch.int64, device=tokens.device)
    bonus = torch.zeros(B, dtype=torch.int64, device=tokens.device)
    p = target[:, 0]
    for d in range(1, len(tree.levels) + 1):
        q = draft[rows, node]
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
        kids = tree.children[node]  # [B, K]
        moved, nxt = torch.zeros_like(alive), node.clone()
        for i in range(kids.shape[1]):
            child = kids[:, i].clamp(min=0)
            live = alive & ~moved & (kids[:, i] >= 0) & valid[rows, child]
            x = tokens[rows, child]
            qx, px = q[rows, x], p[rows, x]
            u = torch.rand(B, device=tokens.device, generator=generator)
            took = live & (u * qx < px)  # accepted with probability min(1, p(x) / q(x))
            nxt, moved = torch.where(took, child, nxt), moved | took
            rejected = (live & ~took)[:, None]
            residual = (p - q).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            dropped = p.scatter(1, x[:, None], 0.0)
            rest = dropped.sum(-1, keepdim=True)
            fallback = torch.where(rest > 0, dropped / rest.clamp_min(1e-30), p)
            p = torch.where(rejected, torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(1e-30), fallback), p)
            q_rest = q.scatter(1, x[:, None], 0.0)
            q = torch.where(rejected, q_rest / q_rest.sum(-1, keepdim=True).clamp_min(1e-30), q)
        stopped = alive & ~moved
        bonus = torch.where(stopped, gumbel_max(p, generator), bonus)
        alive &= moved
        node = torch.where(alive, nxt, node)
        path[:, d] = node
        count += alive
        p = torch.where(alive[:, None], target[rows, node], p)
    bonus = torch.where(alive, gumbel_max(p, generator), bonus)
    return path, count, bonus


def gumbel(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Standard Gumbel noise (elementwise ops only: it records in a CUDA graph, where multinomial may not)."""
    u = torch.rand(shape, device=device, generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def gumbel_max(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of p [B, V] drawn with law p exactly (Gumbel-max); never a zero-probability one."""
    return (p.log() + gumbel(p.shape, p.device, generator)).argmax(-1)


class DeviceProcessors:
    """The logits processors of every row (runtime/processors.py: logit bias, repetition, frequency and presence
    penalties, min_tokens) as tensors on the device, with each row's history (generated counts, tokens seen) kept
    there: `decode` updates it from the tokens it emits, and a row is uploaded again from its request's
    LogitsProcessors when the host has moved it on (a step on the host path) or it is a new request."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.bias = torch.zeros(rows, vocab, device=device)
        self.stop = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        self.banned = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # allowed_token_ids leaves them out
        self.repetition = torch.ones(rows, dtype=torch.float64, device=device)
        self.frequency = torch.zeros(rows, device=device)
        self.presence = torch.zeros(rows, device=device)
        self.min_tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.generated = torch.zeros(rows, dtype=torch.int64, device=device)
        self.on = torch.zeros(rows, dtype=torch.bool, device=device)
        self.synced: dict[int, tuple[LogitsProcessors, int]] = {}  # row -> the processors it holds, at `generated`

    @property
    def rows(self) -> int:
        return self.on.shape[0]

    def grown(self, rows: int) -> DeviceProcessors:
        if rows <= self.rows:
            return self
        new = DeviceProcessors(rows, self.counts.shape[1], self.counts.device)
        for name in (
            "counts",
            "seen",
            "bias",
            "stop",
            "banned",
            "repetition",
            "frequency",
            "presence",
            "min_tokens",
            "generated",
            "on",
        ):
            getattr(new, name)[: self.rows] = getattr(self, name)
        new.synced = self.synced
        return new

    def sync(self, row: int, p: LogitsProcessors | None) -> None:
        """Row `row` holds `p`'s state (or no processors) from now on."""
        if p is None:
            self.on[row] = False
            self.synced.pop(row, None)
            return
        held = self.synced.get(row)
        if held is not None and held[0] is p and held[1] == p.generated:
            return
        t = lambda a, dtype=None: torch.as_tensor(np.asarray(a), dtype=dtype, device=self.on.device)  # noqa: E731
        self.counts[row] = t(p.counts, torch.int32)
        self.seen[row] = t(p.seen)
        self.bias[row] = 0.0 if p.bias is None else t(p.bias, torch.float32)
        self.stop[row] = False
        if len(p.stop_ids):
            self.stop[row, t(p.stop_ids, torch.int64)] = True
        self.banned[row] = False if p.banned is None else t(p.banned)
        self.repetition[row], self.frequency[row], self.presence[row] = p.repetition, p.frequency, p.presence
        self.min_tokens[row], self.generated[row], self.on[row] = p.min_tokens, p.generated, True
        self.synced[row] = (p, p.generated)

    def advanced(self, row: int, p: LogitsProcessors, emitted: int) -> None:
        """The device moved row `row` on by `emitted` tokens (the host's `p` follows them)."""
        self.synced[row] = (p, p.generated + emitted)

    def apply(self, logits: torch.Tensor, tokens: torch.Tensor, tree: DeviceTree) -> torch.Tensor:
        """Rows [n, T, V] (float32) adjusted as LogitsProcessors.apply adjusts them, each tree row with its own path's
        history (the generated counts plus the drafted tokens from the root's child to the node), elementwise in the
        same order and precision; rows without processors unchanged."""
        n, T, V = logits.shape
        path = torch.zeros(n, T, V, dtype=torch.int32, device=logits.device)
        if T > 1:  # path[b, i, t]: times token t is drafted on node i's path (the root excluded)
            drafted = tokens[:, None, 1:].expand(n, T, T - 1)
            path.scatter_add_(2, drafted, tree.mask[None, :, 1:].expand(n, T, T - 1).to(torch.int32))
        counts = (self.counts[:n, None] + path).float()
        seen = self.seen[:n, None] | (path > 0)
        x = logits + self.bias[:n, None]
        rep = self.repetition[:n, None, None]
        wide, top = x.double(), torch.finfo(torch.float32).max
        scaled = torch.where(wide > 0, wide / rep, wide * rep).clamp(-top, top).float()
        x = torch.where(seen & (rep != 1), scaled, x)
        x = x - (self.frequency[:n, None, None] * counts + self.presence[:n, None, None] * (counts > 0).float())
        early = (self.generated[:n, None] + tree.depth) < self.min_tokens[:n, None]  # [n, T]
        x = torch.where(early[..., None] & self.stop[:n, None], -torch.inf, x)
        x = torch.where(self.banned[:n, None], -torch.inf, x)
        return torch.where(self.on[:n, None, None], x, logits)

    def commit(self, emitted: torch.Tensor, count: torch.Tensor) -> None:
        """The emitted tokens [n, L] (the first count[b] of each row) join the rows' histories."""
        n, L = emitted.shape
        took = (torch.arange(L, device=emitted.device) < count[:, None]) & self.on[:n, None]
        self.counts[:n].scatter_add_(1, emitted, took.to(torch.int32))
        self.seen[:n] |= self.counts[:n] > 0
        self.generated[:n] += torch.where(self.on[:n], count, 0)


@dataclass(frozen=True)
class StepKind:
    """What a device step computes beyond a greedy one (one recorded graph per kind): sampling, logits processors,
    log-probabilities, grammar masks (the step then goes to the host and back between drafting and the verify)."""

    sampled: bool = False
    procs: bool = False
    logprobs: bool = False
    grammar: bool = False


GREEDY = StepKind()


def grammar_words(
    tokens: np.ndarray, slots: Sequence[Slot], asks: Sequence[SlotStep], tree: Tree, vocab: int
) -> np.ndarray:
    """The packed masks [n, T, W] int32 of the drafted trees `tokens` [n, T] (rows: slot indices): for a sequence
    with a grammar, row i's is the tokens its grammar allows after the path root..i (runtime/grammar.PathMasks: the
    host path's masks); every token elsewhere (no grammar, or a path the grammar forbids: its node cannot be
    accepted, since its parent's row allows only what the grammar does)."""
    words = np.full((tokens.shape[0], tree.num_nodes, (vocab + 31) // 32), -1, dtype=np.int32)
    for s, a in zip(slots, asks):
        if a.grammar is None:
            continue
        masks, paths = a.grammar.paths(), [()]
        for node in range(1, tree.num_nodes):  # a parent comes before its children
            paths.append((*paths[tree.parent[node]], int(tokens[s.index, node])))
        for node, path in enumerate(paths):
            bits = masks.packed(path)  # None: the grammar forbids the path
            if bits is not None:
                words[s.index, node] = bits
    return words


@dataclass(eq=False)
class BatchSequence:
    """A slot's host-side state: its row in the last forward's output, and (drafting through the Runner methods)
    its tree nodes' draft states."""

    last: DecoderOutput | None = None
    row: int = 0  # this slot's row in `last`
    states: torch.Tensor | None = None  # [n, H] draft state of tree node i (grown as drafted)


@dataclass(eq=False)
class StackedCache:
    """Per-layer K and V buffers [S, Hkv, C + SCRATCH, D] for S slots of C tokens."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def columns(self) -> int:
        return self.keys[0].shape[2] - SCRATCH if self.keys else 0

    def view(self, rows: int, columns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[:rows, :, :columns] for k in self.keys], [v[:rows, :, :columns] for v in self.values]

    def grown(self, rows: int, columns: int) -> StackedCache:
        """Buffers of at least rows x columns, keeping what is cached (no copy when they already fit)."""
        if rows <= self.rows and columns <= self.columns or not self.keys:
            return self
        R, C = max(rows, self.rows), max(columns, self.columns)
        make = lambda old: old.new_zeros(R, old.shape[1], C + SCRATCH, old.shape[3])
        new = StackedCache([make(k) for k in self.keys], [make(v) for v in self.values])
        for dst, src in zip(new.keys + new.values, self.keys + self.values):
            dst[: src.shape[0], :, : self.columns] = src[:, :, : self.columns]
        return new

    def write(self, rows: torch.Tensor, start: torch.Tensor, new_keys, new_values) -> None:
        """Row rows[b] gets new_*[l][b] [Hkv, L, D] at columns start[b] .. start[b] + L - 1."""
        L = new_keys[0].shape[2] if new_keys else 0
        columns = start[:, None] + torch.arange(L, device=start.device)  # [B, L]
        for dst, src in zip(self.keys + self.values, list(new_keys) + list(new_values)):
            dst[rows[:, None], :, columns] = src.transpose(1, 2)  # advanced dims first: [B, L, Hkv, D]


class DecodedRow(NamedTuple):
    """One row of a device step, read back: tokens accepted, the path (tree nodes, root first), the tokens emitted
    (the last one the bonus) and, when asked for, their log-probabilities."""

    count: int
    path: np.ndarray
    emitted: np.ndarray
    logprobs: StepLogprobs | None


@dataclass(frozen=True)
class RowLayout:
    """The one tensor a device step returns (a recorded graph has one output, copied back once), int64 per row:
    count | path [L] | emitted [L], then with log-probabilities chosen [L] | top ids [L, K] | top values [L, K],
    the values as float32 bits. `pack` (on the device) and `unpack` (on the host) alone know these offsets."""

    depth: int  # L: the tree's depth + 1 (path nodes, root included)
    top: int  # K: alternatives kept per row (MAX_LOGPROBS, at most the vocabulary)

    @staticmethod
    def pack(
        count: torch.Tensor,
        path: torch.Tensor,
        emitted: torch.Tensor,
        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        parts = [count[:, None], path, emitted]
        if logprobs is not None:
            chosen, ids, values = logprobs
            bits = lambda x: x.contiguous().view(torch.int32).to(torch.int64).flatten(1)  # noqa: E731
            parts += [bits(chosen), ids.flatten(1), bits(values)]
        return torch.cat(parts, dim=1)

    def unpack(self, row: np.ndarray, alternatives: int | None) -> DecodedRow:
        """A row read back (`alternatives`: top tokens wanted per position, None: no log-probabilities)."""
        L, K = self.depth, self.top
        count = int(row[0])
        path, emitted = row[1 : 1 + L][:count].copy(), row[1 + L : 1 + 2 * L][:count].copy()
        if alternatives is None:
            return DecodedRow(count, path, emitted, None)
        floats = lambda a: a.astype(np.int32).view(np.float32).astype(np.float64)  # noqa: E731
        chosen, rest = row[1 + 2 * L : 1 + 3 * L], row[1 + 3 * L :]
        ids, values = rest[: L * K].reshape(L, K), rest[L * K :].reshape(L, K)
        k = alternatives
        step = StepLogprobs(emitted.copy(), floats(chosen[:count]), ids[:count, :k].copy(), floats(values[:count, :k]))
        return DecodedRow(count, path, emitted, step)


def _laws(slots: Sequence[Slot], asks: Sequence[SlotStep], rows: int) -> np.ndarray:
    """Each row's temperature, top-p, top-k and min-p [4, rows] (greedy rows: 0, 1, 0, 0)."""
    laws = np.zeros((4, rows), np.float32)
    laws[1] = 1.0
    for s, a in zip(slots, asks):
        if a.sampling is not None and not a.sampling.greedy:
            sp = a.sampling
            laws[:, s.index] = sp.temperature, sp.top_p, sp.top_k, sp.min_p
    return laws


class BatchedTorchRunner(Runner):
    def __init__(
        self,
        base: Decoder,
        heads: DraftHeads | None = None,
        heads_name: str = "none",
        draft_vocab: np.ndarray | None = None,
        ngram_store: NgramStore | None = None,
        cuda_graphs: bool = False,
    ):
        """As TorchRunner (runtime/backends/torch_runner.py), with every sequence in one stacked cache (module doc).
        cuda_graphs: `decode` replays the whole step from CUDA graphs; needs the model on a CUDA device."""
        super().__init__()
        self.device = base.lm_head.weight.device
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            if self.device.type != "cuda":
                raise CloverError(f"cuda_graphs needs the model on a CUDA device, but it is on {self.device}")
            base = with_attention(base, "plugin")  # reads each row's own prefix: whole buffers, fixed shapes
        self._vocab = None if draft_vocab is None or heads is None else self._t(np.asarray(draft_vocab, np.int64))
        # with a draft vocabulary the heads compute only its columns (a K/V share of their LM head's work)
        self.base, self.heads = base, heads if self._vocab is None else heads.over_vocab(self._vocab)
        self.engine_clock = EngineClock()
        cfg = base.config
        layers = heads.num_cache_layers if heads is not None else 0
        self.cache = StackedCache(*base.empty_cache(1, BLOCK + SCRATCH))
        self.head_cache = StackedCache(*base.empty_cache(1, BLOCK + SCRATCH, layers))
        dtype = base.lm_head.weight.dtype
        # what `decode` reads and writes per row, on the device
        self.lengths = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.roots = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.root_state = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=self.device)
        columns = cfg.vocab_size if self._vocab is None else len(self._vocab)  # the heads' draft logits
        self.root_logits = torch.zeros(1, columns, dtype=dtype, device=self.device)
        self._trees: dict[str, DeviceTree] = {}
        self.generator = torch.Generator(self.device)  # sampled steps' draws (seeded from fresh entropy)
        self.generator.seed()
        self._graphs: dict[tuple[int, str, bool, bool], DecodeGraph] = {}
        self.graphs_error: str | None = None  # why recording the step failed (it then runs eagerly)
        self.processors: DeviceProcessors | None = None  # made by the first step with logits processors
        # any number of sequences in one forward
        self.info = torch_info(base, heads, heads_name, draft_vocab, ngram_store, batch_slots=1 << 30)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.tensor(np.asarray(a), device=self.device)  # a copy: read-only inputs are fine

    # -- slots ------------------------------------------------------------------------------------------------
    def _open_slot(self, slot: Slot) -> BatchSequence:
        self._ensure(slot.index + 1, slot.capacity)
        self.lengths[slot.index] = 0
        return BatchSequence()

    def _ensure(self, rows: int, columns: int) -> None:
        old = self.cache
        R = max(rows, self.cache.rows) if rows <= self.cache.rows else max(rows, 2 * self.cache.rows)
        C = self.cache.columns if columns <= self.cache.columns else max(columns, 2 * self.cache.columns)
        self.cache, self.head_cache = self.cache.grown(R, C), self.head_cache.grown(R, C)
        if self.cache is not old:
            self._graphs.clear()  # recorded over the old buffers
        grow = R - self.lengths.shape[0]
        if grow > 0:
            pad = lambda t: torch.cat((t, t.new_zeros(grow, *t.shape[1:])))
            self.lengths, self.roots = pad(self.lengths), pad(self.roots)
            self.root_state, self.root_logits = pad(self.root_state), pad(self.root_logits)
            self._graphs.clear()

    @torch.inference_mode()
    def _fork(self, src: Slot, dst: Slot) -> None:
        s, d, P = src.index, dst.index, src.past
        for cache in (self.cache, self.head_cache):
            for buf in cache.keys + cache.values:
                buf[d, :, :P] = buf[s, :, :P]
        for t in (self.lengths, self.roots, self.root_state, self.root_logits):
            t[d] = t[s]

    @torch.inference_mode()
    def _snapshot(self, slot: Slot, rows: int, heads: bool) -> Prefix:
        r = slot.index  # the heads take in each row as it is committed: they have seen them all
        buffers = self.cache.keys + self.cache.values + self.head_cache.keys + self.head_cache.values
        saved = [b[r, :, :rows].clone() for b in buffers]
        return Prefix(rows, sum(t.nbytes for t in saved), saved)

    @torch.inference_mode()
    def _restore(self, slot: Slot, prefix: Prefix, rows: int) -> None:
        r = slot.index
        buffers = self.cache.keys + self.cache.values + self.head_cache.keys + self.head_cache.values
        for new, old in zip(buffers, prefix.data):
            new[r, :, :rows] = old[:, :rows]
        self.lengths[r] = rows

    # -- the Runner methods: the general loop ------------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's logits of hidden rows [..., H] (pre-norm), for every path alike: one matmul for a batch's rows."""
        return self.base.logits(hidden)

    def _forward_batch(self, batch: Sequence[Verify]) -> list[np.ndarray]:
        # a long prompt chunk runs alone: padding a batch's tree rows to its length would multiply their work
        alone = [v for v in batch if v.tokens.shape[0] > LONG]
        together = [v for v in batch if v.tokens.shape[0] <= LONG]
        logits = {}
        for group in [[v] for v in alone] + ([together] if together else []):
            logits.update(zip((id(v) for v in group), self._forward_rows(group)))
        return [logits[id(v)] for v in batch]

    @torch.inference_mode()
    def _forward_rows(self, batch: Sequence[Verify]) -> list[np.ndarray]:
        """One forward over the buffers' rows lo..hi-1 spanned by the batch's slots."""
        lo, hi = min(v.slot.index for v in batch), max(v.slot.index for v in batch) + 1
        rows, T = hi - lo, max(v.tokens.shape[0] for v in batch)
        tokens = np.zeros((rows, T), np.int64)
        positions = np.zeros((rows, T), np.int64)
        mask = np.broadcast_to(np.eye(T, dtype=bool), (rows, T, T)).copy()  # padding rows see themselves only
        past = np.zeros(rows, np.int64)
        for v in batch:
            r, n = v.slot.index - lo, v.tokens.shape[0]
            tokens[r, :n], positions[r, :n], mask[r, :n, :n] = v.tokens, v.slot.past + v.depths, v.mask
            past[r] = v.slot.past
        keys, values = self.cache.view(hi, int(past.max()))
        picked = [
            (v.slot.index - lo, [v.tokens.shape[0] - 1] if v.last_only else range(v.tokens.shape[0])) for v in batch
        ]
        index = self._t(np.array([r * T + i for r, rs in picked for i in rs], dtype=np.int64))
        with self.engine_clock:
            out = self.base(
                self._t(tokens),
                self._t(positions),
                self._t(mask),
                self._t(past),
                [k[lo:] for k in keys],
                [v[lo:] for v in values],
                logit_rows=torch.zeros(0, dtype=torch.int64, device=self.device),
            )
            logits = self._logits(out.hidden_states.reshape(rows * T, -1)[index]).float().cpu().numpy()
        for v in batch:
            v.slot.state.last, v.slot.state.row = out, v.slot.index - lo
        return np.split(logits, np.cumsum([len(rs) for _, rs in picked])[:-1])

    @torch.inference_mode()
    def _commit(self, slot: Slot, path: np.ndarray, next_tokens: np.ndarray) -> None:
        seq, r, P, m = slot.state, slot.index, slot.past, len(path)
        rows, i = self._t(path), seq.row
        row = torch.tensor([r], device=self.device)
        start = torch.tensor([P], device=self.device)
        self.cache.write(
            row,
            start,
            [k[i : i + 1, :, rows] for k in seq.last.new_keys],
            [v[i : i + 1, :, rows] for v in seq.last.new_values],
        )
        self.lengths[r], self.roots[r] = P + m, int(next_tokens[-1])
        if self.heads is None:
            return
        keys, values = self.head_cache.view(r + 1, P)
        with self.engine_clock:
            out = self.heads.begin(
                seq.last.hidden_states[i : i + 1, rows],
                self._t(next_tokens)[None],
                torch.arange(P, P + m, device=self.device)[None],
                start,
                [k[r : r + 1] for k in keys],
                [v[r : r + 1] for v in values],
            )
        self.head_cache.write(row, start, out.new_keys, out.new_values)
        self.root_state[r], self.root_logits[r] = out.state[0], out.logits[0]

    @torch.inference_mode()
    def _draft_begin(self, slot: Slot) -> np.ndarray:
        slot.state.states = self.root_state[slot.index : slot.index + 1].clone()  # row i: tree node i's state
        return self._drafted(self.root_logits[slot.index])

    @torch.inference_mode()
    def _draft_step(self, slot, depth, nodes, parents, tokens):
        seq = slot.state
        need = int(nodes.max()) + 1
        if seq.states.shape[0] < need:
            seq.states = torch.cat((seq.states, seq.states.new_zeros(need - seq.states.shape[0], seq.states.shape[1])))
        with self.engine_clock:
            state, logits = self.heads.step(depth, seq.states[self._t(parents)], self._t(tokens))
        seq.states[self._t(nodes)] = state
        return self._drafted(logits)

    def _drafted(self, logits: torch.Tensor) -> np.ndarray:
        return logits.float().cpu().numpy()  # over the draft vocabulary's columns already (over_vocab)

    # -- the step on the device ------------------------------------------------------------------------------
    def device_tree(self, tree: Tree) -> DeviceTree:
        if tree.name not in self._trees or self._trees[tree.name].tree is not tree:
            self._trees[tree.name] = DeviceTree.of(tree, self.device)
        return self._trees[tree.name]

    def decode_async(
        self, slots: Sequence[Slot], tree: Tree, asks: Sequence[SlotStep] | None = None
    ) -> Callable[[], list[Decoded]]:
        """Runner.decode_async for slots prefilled with nothing pending and room for the tree (module doc). Sampling
        (temperature, top-p) draws from the runner's `generator`. With CUDA graphs the call returns once the step is
        queued (with a grammar: once its masks are on the device); otherwise (eager) once it is done."""
        self._check_decodable(slots, tree)
        asks = list(asks) if asks is not None else [SlotStep()] * len(slots)
        rows = max(s.index for s in slots) + 1
        active = np.zeros(rows, dtype=bool)
        active[[s.index for s in slots]] = True
        dt = self.device_tree(tree)
        kind = StepKind(
            sampled=any(a.sampling is not None and not a.sampling.greedy for a in asks),
            procs=any(a.processors is not None for a in asks),
            logprobs=any(a.logprobs is not None for a in asks),
            grammar=any(a.grammar is not None for a in asks),
        )
        if kind.procs or self.processors is not None:
            self._sync_processors(slots, asks, rows)
        masks = (
            (lambda tokens: grammar_words(tokens, slots, asks, dt.tree, self.info.vocab_size)) if kind.grammar else None
        )
        wait = self._launch(slots, dt, active, _laws(slots, asks, rows), kind, masks)
        layout = RowLayout(tree.max_depth + 1, min(MAX_LOGPROBS, self.info.vocab_size))

        def results() -> list[Decoded]:
            with self.engine_clock:
                packed = wait()  # the step's one copy back
            return [self._absorbed(s, a, layout.unpack(packed[s.index], a.logprobs)) for s, a in zip(slots, asks)]

        return results

    def _check_decodable(self, slots: Sequence[Slot], tree: Tree) -> None:
        if tree.max_depth and self.heads is None:
            raise CloverError("this runner has no draft heads: use the plain tree")
        if tree.max_depth >= SCRATCH:
            raise CloverError(f"decode takes trees of depth < {SCRATCH}; this one is {tree.max_depth} deep")
        for s in slots:
            assert self._open.get(s.index) is s and not s.pending and s.past >= 1, "decode: a slot is not ready"
            if s.past + tree.num_nodes > s.capacity:
                raise CloverError(f"{tree.num_nodes} tree rows after {s.past} cached exceed the capacity {s.capacity}")

    def _sync_processors(self, slots: Sequence[Slot], asks: Sequence[SlotStep], rows: int) -> None:
        """The device's processor state (penalty counts, biases, banned tokens) for these rows, grown to the batch."""
        held = self.processors
        self.processors = (held or DeviceProcessors(rows, self.info.vocab_size, self.device)).grown(
            self.lengths.shape[0]
        )
        if held is not None and self.processors is not held:
            self._graphs.clear()  # recorded over the old tensors
        with torch.inference_mode():
            for s, a in zip(slots, asks):
                self.processors.sync(s.index, a.processors)

    def _launch(
        self,
        slots: Sequence[Slot],
        dt: DeviceTree,
        active: np.ndarray,
        laws: np.ndarray,
        kind: StepKind,
        masks: Callable[[np.ndarray], np.ndarray] | None,
    ) -> Callable[[], np.ndarray]:
        """The step queued as a recorded graph (eager where none can be recorded); a call that waits for its packed
        rows (RowLayout)."""
        with self.engine_clock, torch.inference_mode():
            graph = self._graph(dt, len(active), kind) if self.cuda_graphs else None
            if graph is not None:
                return graph.launch(active, laws, masks)
            law = Law(*self._t(laws)) if kind.sampled else None
            columns = int(max(s.past for s in slots))
            processors = self.processors if kind.procs else None
            on_device = None if masks is None else lambda tokens: self._t(masks(tokens.cpu().numpy()))
            packed = self._decode(dt, self._t(active), columns, law, processors, self.generator, kind, on_device)
            packed = packed.cpu().numpy()
            return lambda: packed

    def _absorbed(self, slot: Slot, ask: SlotStep, row: DecodedRow) -> Decoded:
        """One sequence's step taken in on the host: its slot advanced, its processors' counts too."""
        slot.past += row.count
        if ask.processors is not None:
            self.processors.advanced(slot.index, ask.processors, row.count)
        return Decoded(row.path, row.emitted, row.logprobs)

    def _graph(self, dt: DeviceTree, rows: int, kind: StepKind) -> DecodeGraph | None:
        """The recorded step of this kind for `rows` rows of this tree; None (eager from now on) if recording fails,
        with the reason in `graphs_error`: a step that cannot be recorded still runs."""
        bucket = row_bucket(rows)
        self._ensure(bucket, self.cache.columns)
        if kind.procs and self.processors.rows < bucket:
            self.processors = self.processors.grown(bucket)
            self._graphs.clear()
        key = (bucket, dt.tree.name, kind)
        if key not in self._graphs:
            try:
                self._graphs[key] = DecodeGraph(self, dt, bucket, kind)
            except Exception as e:  # an op that cannot be captured on this torch / GPU
                self.cuda_graphs, self.graphs_error = False, f"{type(e).__name__}: {e}"
                return None
        return self._graphs[key]

    def _decode(
        self,
        dt: DeviceTree,
        active: torch.Tensor,
        columns: int,
        law: Law | None = None,
        processors: DeviceProcessors | None = None,
        generator: torch.Generator | None = None,
        kind: StepKind = GREEDY,
        masks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The step for rows 0..n-1 (active [n] bool: which commit), over `columns` cache columns: drafted, then
        (`masks`: the grammar's words for the drafted tokens, a trip to the host) verified and committed
        (`_verified`)."""
        drafted = self._draft(dt, active.shape[0], law, generator)
        words = masks(drafted[0]) if masks is not None else None
        return self._verified(dt, active, columns, drafted, law, processors, generator, kind, words)

    def _verified(
        self,
        dt: DeviceTree,
        active: torch.Tensor,
        columns: int,
        drafted: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        law: Law | None,
        processors: DeviceProcessors | None,
        generator: torch.Generator | None,
        kind: StepKind,
        words: torch.Tensor | None,
    ) -> torch.Tensor:
        """Verify `_draft`'s trees greedy (law None) or by each row's law, each row adjusted by its processors, then
        masked by the grammar's packed `words` [n, T, W] int32 (bit t of word t // 32: token t allowed; None: no
        grammar), accept and commit; returns each row's count, path and emitted tokens (and with `kind.logprobs`
        their `_logprobs`) packed by RowLayout. Only tensors in and one tensor out: it records as one graph."""
        n, T = active.shape[0], dt.tree.num_nodes
        lengths = self.lengths[:n]
        tokens, valid, laws = drafted
        keys, values = self.cache.view(n, columns)
        out = self.base(
            tokens,
            lengths[:, None] + dt.depth,
            dt.mask.expand(n, T, T),
            lengths,
            keys,
            values,
            logit_rows=torch.zeros(0, dtype=torch.int64, device=self.device),
        )
        logits = raw = self._logits(out.hidden_states)  # [n, T, V]
        if processors is not None:
            logits = processors.apply(logits.float(), tokens, dt)
        if words is not None:  # after the processors, as on the host path
            bits = (words[..., None] >> torch.arange(32, dtype=torch.int32, device=self.device)) & 1
            allowed = bits.flatten(2)[..., : logits.shape[2]].bool()
            logits = logits.float().masked_fill(~allowed, -torch.inf)
        if law is None:
            target = logits.argmax(-1)
            path, count = accept_paths(dt, tokens, target)
            emitted = target.gather(1, path)  # [n, L]: what follows each path node; the last counted one is the bonus
        else:
            path, count, bonus = accept_sampled(dt, tokens, valid, laws, law.target(logits), generator)
            emitted = torch.cat((tokens.gather(1, path[:, 1:]), bonus[:, None]), dim=1)
            emitted.scatter_(1, (count - 1)[:, None], bonus[:, None])
        count = count * active
        if processors is not None:
            processors.commit(emitted, count)
        L = path.shape[1]
        # rows that do not step write into the scratch columns past every capacity
        start = torch.where(active, lengths, self.cache.columns)
        rows = torch.arange(n, device=self.device)
        pick = path[:, None, :, None]
        self.cache.write(
            rows,
            start,
            [k.gather(2, pick.expand(-1, k.shape[1], -1, k.shape[3])) for k in out.new_keys],
            [v.gather(2, pick.expand(-1, v.shape[1], -1, v.shape[3])) for v in out.new_values],
        )
        last = (count - 1).clamp(min=0)
        if self.heads is not None:
            hk, hv = self.head_cache.view(n, columns)
            begin = self.heads.begin(
                out.hidden_states.gather(1, path[:, :, None].expand(-1, -1, out.hidden_states.shape[2])),
                emitted,
                lengths[:, None] + torch.arange(L, device=self.device),
                lengths,
                hk,
                hv,
                last=last,
            )
            self.head_cache.write(rows, start, begin.new_keys, begin.new_values)
            keep = active[:, None]
            self.root_state[:n] = torch.where(keep, begin.state, self.root_state[:n])
            self.root_logits[:n] = torch.where(keep, begin.logits, self.root_logits[:n])
        self.roots[:n] = torch.where(active, emitted.gather(1, last[:, None])[:, 0], self.roots[:n])
        self.lengths[:n] += count
        return RowLayout.pack(count, path, emitted, self._logprobs(raw, path, emitted) if kind.logprobs else None)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, path: torch.Tensor, emitted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """runtime/logprobs.py's log-probabilities of each emitted token (the raw distribution of its path row, before
        any processor: [n, L] float32) and the K = MAX_LOGPROBS most likely tokens of that row (ties by lower id, as
        topk_tokens: ids [n, L, K], values [n, L, K]); the log-sum-exp is float32 here, float64 on the host."""
        rows = raw.gather(1, path[:, :, None].expand(-1, -1, raw.shape[2])).float()  # [n, L, V]
        lse = torch.logsumexp(rows, dim=-1, keepdim=True)
        chosen = rows.gather(2, emitted[:, :, None]) - lse  # [n, L, 1]
        values, ids = rows.sort(dim=-1, descending=True, stable=True)  # stable: equal values keep id order
        K = min(MAX_LOGPROBS, rows.shape[2])
        return chosen[..., 0], ids[..., :K], values[..., :K] - lse

    def _draft(self, dt: DeviceTree, n: int, law: Law | None = None, generator: torch.Generator | None = None):
        """Each row's tree tokens [n, T] from the heads, level by level. Greedy (law None): a node's token is the
        rank-th best of its parent's draft logits (over the draft vocabulary, if any). With a law: the children of a
        row are drawn from its law without replacement (Gumbel-top-k; greedy rows: its top-k), and the laws [n, T, V]
        and which nodes were drawn ([n, T] bool: a law with less support than children leaves some undrawn) come
        back too, for `accept_sampled`."""
        T, V = dt.tree.num_nodes, self.info.vocab_size
        tokens = self.roots[:n, None].expand(n, T).clone()
        valid = torch.ones(n, T, dtype=torch.bool, device=self.device)
        laws = torch.zeros(n, T if law is not None else 0, V, device=self.device)
        logits = self.root_logits[:n, None]  # [n, rows, V]: draft logits of the rows whose children come next
        states = self.root_state[:n, None]
        for depth, lv in enumerate(dt.levels, start=1):
            columns = logits  # over the draft vocabulary already, if any (over_vocab)
            if law is None:
                top = columns.topk(lv.k, dim=-1).indices  # [n, rows, k]
            else:
                q = law.probs(columns)  # [n, rows, K]
                noise = gumbel(q.shape, self.device, generator)
                keys = q.log() + torch.where(law.greedy[:, None, None], 0.0, noise)
                drawn, top = keys.topk(lv.k, dim=-1)
                valid[:, lv.start : lv.end] = (drawn[:, lv.parent_row, lv.rank] > -torch.inf) & valid[:, lv.parent]
                laws[:, lv.rows] = (
                    q if self._vocab is None else q.new_zeros(*q.shape[:2], V).index_copy(2, self._vocab, q)
                )
            picked = top[:, lv.parent_row, lv.rank]  # [n, m]
            picked = picked if self._vocab is None else self._vocab[picked]
            tokens[:, lv.start : lv.end] = picked
            if lv.expand.numel():
                parent_rows = lv.parent_row[lv.expand]
                states, logits = self.heads.step_batch(depth, states[:, parent_rows], picked[:, lv.expand])
        return tokens, valid, laws


class DecodeGraph:
    """`BatchedTorchRunner._decode` of one kind (StepKind) for `rows` rows and one tree, recorded as one CUDA graph
    over the whole buffers (with a grammar: two, drafting and the rest, with the host's masks between). Its inputs
    are which rows step and, sampled, each row's temperature, top-p, top-k and min-p (static buffers, one copy in);
    its output, the packed result, comes back through pinned memory. Sampled graphs draw from the default CUDA
    generator, whose state graphs advance safely."""

    def __init__(self, runner: BatchedTorchRunner, dt: DeviceTree, rows: int, kind: StepKind) -> None:
        device = runner.device
        self.inputs = torch.zeros(5, rows, device=device)  # active, temperature, top-p, top-k, min-p
        self.host_inputs = torch.zeros(5, rows, pin_memory=True)
        law = Law(*self.inputs[1:]) if kind.sampled else None
        processors = runner.processors if kind.procs else None
        columns, words = runner.cache.columns, None
        if kind.grammar:
            W = (runner.info.vocab_size + 31) // 32
            words = torch.full((rows, dt.tree.num_nodes, W), -1, dtype=torch.int32, device=device)
            self.host_words = torch.zeros(words.shape, dtype=torch.int32, pin_memory=True)
        self.words = words
        draft = lambda: runner._draft(dt, rows, law, None)  # noqa: E731
        rest = lambda d: runner._verified(dt, self.inputs[0] > 0, columns, d, law, processors, None, kind, words)  # noqa: E731

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up with no row stepping: it commits nothing (Triton compiles here)
            for _ in range(2):
                rest(draft())
        torch.cuda.current_stream(device).wait_stream(side)
        self.draft_graph = None
        if kind.grammar:  # drafting alone, its tokens to the host for the masks, then the rest
            self.draft_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.draft_graph):
                self.drafted = draft()
            self.host_tokens = torch.zeros(self.drafted[0].shape, dtype=torch.int64, pin_memory=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = rest(self.drafted if kind.grammar else draft())
        self.host = torch.zeros(self.out.shape, dtype=torch.int64, pin_memory=True)
        self.done = torch.cuda.Event()

    def launch(self, active: np.ndarray, laws: np.ndarray, masks: Callable[[np.ndarray], np.ndarray] | None = None):
        """Queue one replay for the rows `active` marks, `laws` [4, n] their temperature, top-p, top-k and min-p
        (with a grammar, `masks` gives the words of the drafted tokens: the draft is replayed and waited for first);
        returns a call that waits for it and gives the packed result (valid until the next launch)."""
        h = self.host_inputs.numpy()
        h[:] = 0.0
        n = len(active)
        h[0, :n], h[1:, :n] = active, laws
        h[2, n:] = 1.0
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        if self.draft_graph is not None:
            self.draft_graph.replay()
            self.host_tokens.copy_(self.drafted[0], non_blocking=True)
            self.done.record()
            self.done.synchronize()
            words = self.host_words.numpy()
            words[:] = -1
            words[:n] = masks(self.host_tokens.numpy()[:n])
            self.words.copy_(self.host_words, non_blocking=True)
        self.graph.replay()
        self.host.copy_(self.out, non_blocking=True)
        self.done.record()

        def wait() -> np.ndarray:
            self.done.synchronize()
            return self.host.numpy()

        return wait
