"""Verification of a drafted tree: which drafted nodes the base model accepts (numpy only).

Node 0 (the root) holds the last emitted token, not yet in the KV cache; the other nodes hold drafted
tokens. The base's verify pass gives target logits [T, V]: row i is the base's next-token distribution
after the path root..i. A step emits the accepted non-root nodes plus one bonus token taken from the
target at the last accepted node, so it always emits len(path) >= 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from clover.errors import CloverError
from clover.runtime.sampling import sample_token
from clover.runtime.tree import Tree

# A rejection at a sibling happens with probability sum(max(p - q, 0)) (see verify_node), so when that
# residual mass is below this the branch is numerically unreachable and its continuation is a fallback.
_RESIDUAL_EPS = 1e-12


@dataclass(frozen=True, eq=False)
class Acceptance:
    """Outcome of verifying one tree.

    path: [m + 1] int64 node ids from the root (0) to the last accepted node (read-only).
    bonus_token: token drawn from (or the argmax of) the target at the last accepted node.
    """

    path: np.ndarray  # [m + 1] int64
    bonus_token: int

    @property
    def accepted_nodes(self) -> np.ndarray:
        """[m] accepted non-root node ids, root excluded."""
        return self.path[1:]

    @property
    def num_emitted(self) -> int:
        """Tokens emitted by this step: accepted nodes plus the bonus token (the acceptance length)."""
        return int(self.path.size)


def _acceptance(path: list[int], bonus: int) -> Acceptance:
    arr = np.asarray(path, dtype=np.int64)
    arr.setflags(write=False)
    return Acceptance(path=arr, bonus_token=int(bonus))


def _check_rows(tree: Tree, node_tokens: np.ndarray, rows: np.ndarray, what: str) -> None:
    t = tree.num_nodes
    if node_tokens.shape != (t,):
        raise CloverError(f"expected node_tokens of shape [{t}] for tree '{tree.name}', got {node_tokens.shape}")
    if rows.ndim != 2 or rows.shape[0] != t:
        raise CloverError(f"expected {what} of shape [{t}, V] for tree '{tree.name}', got {rows.shape}")


class RowMasks(Protocol):
    """What a grammar allows at each verified node (runtime/grammar.MaskRows)."""

    def permits(self, node: int, token: int) -> bool:
        """Whether the grammar allows `token` after the node's path."""

    def best(self, node: int, logits: np.ndarray) -> int:
        """The allowed token of highest logit after the node's path (ties: the lowest id)."""


def accept_greedy(
    tree: Tree,
    node_tokens: np.ndarray,
    target_logits: np.ndarray,
    allowed: RowMasks | None = None,
) -> Acceptance:
    """Longest root-to-node path whose drafted tokens equal the base argmax at their parents.

    Args:
        tree: the compiled tree (T nodes).
        node_tokens: [T] int64, node_tokens[0] is the root token.
        target_logits: [T, V] base logits at each node.
        allowed: the tokens a grammar allows at each node (None: all). Asked only for the nodes the walk
            reaches, first whether it allows the row's argmax; a row is masked only when its argmax is forbidden
            (the argmax over the allowed tokens is then the same token, ties included, as masking every row
            would give).

    Returns:
        The accepted path and bonus = argmax at the last accepted node (ties: lowest id).
    """
    _check_rows(tree, node_tokens, target_logits, "target_logits")
    target = np.argmax(target_logits, axis=1)  # [T]
    node = 0
    path = [0]
    while True:
        if allowed is not None and not allowed.permits(node, int(target[node])):
            target[node] = allowed.best(node, target_logits[node])
        # Children are distinct tokens when drafted greedily; otherwise the first in rank order wins.
        match = [int(c) for c in tree.children[node] if node_tokens[c] == target[node]]
        if not match:
            return _acceptance(path, int(target[node]))
        node = match[0]
        path.append(node)


def verify_node(
    p: np.ndarray,
    q: np.ndarray,
    candidates: Sequence[int] | np.ndarray,
    rng: np.random.Generator,
    point: int | None = None,
) -> tuple[int, int]:
    """Recursive rejection sampling over one node's siblings; the emitted token has law p exactly.

    Args:
        p: [V] target distribution at the node.
        q: [V] draft distribution the candidates were drawn from, sequentially without replacement.
        candidates: distinct token ids in draw (rank) order; may be empty.
        rng: numpy generator.
        point: a last candidate proposed with a point-mass law (prompt lookup), verified after the
            sampled ones: accepted with probability p_j(point), else removed from the residual (the same
            rule with q_j = its point mass). Index len(candidates) when accepted.

    Returns:
        (index into candidates of the accepted one, its token), or (-1, bonus token drawn from the
        final residual) when every candidate is rejected.

    Why this is exact: for any proposal law q, speculative sampling (draw x ~ q, accept with
    probability min(1, p(x)/q(x)), else draw from r = normalize(max(p - q, 0))) emits a token with law
    exactly p. Here stage j has target p_j and proposal q_j = q with x_1..x_{j-1} removed and
    renormalized, which is exactly the conditional law of x_j given the earlier draws (and the
    rejection coins, which are independent of x_j). Instead of drawing from r_j directly on rejection,
    we run stage j + 1 with target p_{j+1} = r_j and proposal q_{j+1}; by induction (base case: no
    candidates left, draw from p_j directly) stage j + 1 emits a token with law r_j whatever x_j was,
    so stage j emits law p_j, and stage 1 emits law p. The rejected x_j is never emitted later:
    rejection implies p_j(x_j) < q_j(x_j), so r_j(x_j) = 0.

    Degenerate residual: given x_j ~ q_j, P(reject) = sum_x max(q_j - p_j, 0) = sum_x max(p_j - q_j, 0)
    = mass(r_j) for normalized p_j, q_j. So a residual with (near-)zero mass, p_j == q_j up to
    rounding, means the rejection branch has (near-)zero probability, and any continuation keeps the
    law exact up to that mass. We continue with p_j with x_j removed (renormalized), which then equals
    q_{j+1} so the next candidate is almost surely accepted, or with p_j itself if x_j was all its mass.
    """
    p_j = np.array(p, dtype=np.float64)  # [V] private copy
    p_j /= p_j.sum()
    if len(candidates) == 0:
        return _verify_point(p_j, point, 0, rng)
    q_j = np.array(q, dtype=np.float64)  # [V] private copy: updated in place below
    q_j /= q_j.sum()
    for j, x in enumerate(candidates):
        x = int(x)
        qx, px = q_j[x], p_j[x]
        if not qx > 0:
            raise CloverError(
                f"candidate token {x} has zero draft probability at its stage: siblings must be "
                "distinct tokens drawn from their parent's draft row in rank order"
            )
        # One uniform per stage; accept with probability min(1, px / qx).
        if rng.random() * qx < px:
            return j, x
        residual = np.maximum(p_j - q_j, 0.0)
        mass = residual.sum()
        if mass > _RESIDUAL_EPS:
            p_j = residual / mass
        else:
            dropped = p_j.copy()
            dropped[x] = 0.0
            rest = dropped.sum()
            if rest > 0:  # else x held all of p_j's mass: keep p_j
                p_j = dropped / rest
        q_j[x] = 0.0
        q_rest = q_j.sum()
        if q_rest > 0:
            q_j /= q_rest
    return _verify_point(p_j, point, len(candidates), rng)


def _verify_point(p_j: np.ndarray, point: int | None, index: int, rng: np.random.Generator) -> tuple[int, int]:
    """The last stage of verify_node: a point-mass candidate (accept with probability p_j(x), else the residual
    is p_j without x), then the bonus token from what is left."""
    if point is not None:
        x = int(point)
        if rng.random() < p_j[x]:
            return index, x
        rest = p_j.sum() - p_j[x]
        if rest > 0:  # else x held all the mass and was accepted with probability 1
            p_j = p_j.copy()
            p_j[x] = 0.0
            p_j /= rest
    return -1, sample_token(p_j, rng)


def accept_sampling(
    tree: Tree,
    node_tokens: np.ndarray,
    node_valid: np.ndarray,
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    rng: np.random.Generator,
    point: np.ndarray | None = None,
) -> Acceptance:
    """Lossless acceptance for sampled drafts: the emitted tokens have the base model's sampling law.

    Args:
        tree: the compiled tree (T nodes).
        node_tokens: [T] int64, node_tokens[0] is the root token.
        node_valid: [T] bool; invalid nodes (the draft had fewer support tokens than the tree has
            children) and their subtrees are never accepted.
        target_probs: [T, V] float64 target distributions (temperature / top-p already applied).
        draft_probs: [T, V] row i is the law node i's children were drawn from, sequentially without
            replacement in rank order; rows of childless nodes are ignored (a broadcast view is fine).
        rng: numpy generator.
        point: [T] bool or None; point nodes were proposed with a point-mass law (prompt lookup), at most
            one per parent, verified after their sampled siblings (verify_node's `point`).

    Returns:
        The accepted path and the bonus token drawn from the residual at the last accepted node.
    """
    _check_rows(tree, node_tokens, target_probs, "target_probs")
    if node_valid.shape != (tree.num_nodes,):
        raise CloverError(
            f"expected node_valid of shape [{tree.num_nodes}] for tree '{tree.name}', got {node_valid.shape}"
        )
    if draft_probs.shape != target_probs.shape:
        raise CloverError(
            f"expected draft_probs of shape {target_probs.shape} like target_probs, got {draft_probs.shape}"
        )
    node = 0
    path = [0]
    while True:
        kids = [int(c) for c in tree.children[node] if node_valid[c]]
        sampled = [c for c in kids if point is None or not point[c]]
        points = [] if point is None else [c for c in kids if point[c]]  # at most one, verified last
        idx, token = verify_node(
            target_probs[node],
            draft_probs[node],
            node_tokens[sampled],
            rng,
            int(node_tokens[points[0]]) if points else None,
        )
        if idx < 0:
            return _acceptance(path, token)
        node = (sampled + points)[idx]
        path.append(node)
