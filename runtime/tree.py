"""Token trees: Medusa/EAGLE `choices` compiled to the buffers a verify step needs.

A tree is a list of top-k rank paths with the root implicit: `[[0], [1], [0, 0]]` means the root has
children of rank 0 and 1, and the rank-0 child has one child of rank 0. Node 0 is the root (the last
emitted token); the other nodes are the paths sorted by `(len(path), path)`, so every ancestor has a
smaller index than its descendants and each depth is a contiguous block.

Pure, CPU-only numpy; the caller moves buffers to a device (docs/design.md, Conventions 8).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clover.artifact import TreeSpec
from clover.errors import CloverError

DEFAULT_TREE = "mc26"
MAX_TREE_NODES = 1024  # root included; bounds the [T, T] mask and the engines' tree profiles

RankPath = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Tree:
    """A compiled token tree with T nodes (root included). All arrays are read-only numpy arrays.

    Fields:
        name: label for logs and manifests.
        choices: the rank paths (root excluded) in node order, i.e. sorted by (len(path), path);
            node i >= 1 is choices[i - 1].
        num_nodes: T, root included.
        max_depth: depth of the deepest node; 0 for the root-only tree.
        depth: [T] int32, root 0; the verify position of node i is past_len + depth[i].
        parent: [T] int32, parent node id; -1 for the root.
        rank: [T] int32, top-k rank of the node among its siblings (last element of its path); -1 for
            the root.
        ancestor_mask: [T, T] bool, [i, j] True iff j == i or j is an ancestor of i (root included).
        packed_mask: [T, ceil(T / 32)] int32, bit (j % 32) of word (j // 32) in row i equals
            ancestor_mask[i, j]; words are uint32 bit patterns viewed as int32 (bit 31 set -> negative);
            bits for j >= T are 0.
        leaf_paths: [L, max_depth + 1] int32, one row per leaf (node without children) in node order:
            node ids from the root (0) to the leaf, padded with -1.
        children: T int32 arrays; children[i] = child node ids of i in rank order (empty for leaves).
        levels: max_depth + 1 int32 arrays; levels[d] = node ids at depth d (contiguous, ascending).
        max_children: largest number of children of any node; 0 for the root-only tree.
    """

    name: str
    choices: tuple[RankPath, ...]
    num_nodes: int
    max_depth: int
    depth: np.ndarray  # [T] int32
    parent: np.ndarray  # [T] int32
    rank: np.ndarray  # [T] int32
    ancestor_mask: np.ndarray  # [T, T] bool
    packed_mask: np.ndarray  # [T, W] int32
    leaf_paths: np.ndarray  # [L, max_depth + 1] int32
    children: tuple[np.ndarray, ...]
    levels: tuple[np.ndarray, ...]
    max_children: int

    @property
    def is_chain(self) -> bool:
        """No node has two children (plain decoding included): every node's ancestors precede it contiguously."""
        return self.max_children <= 1


@dataclass(frozen=True)
class DynamicTree:
    """A tree drafted anew each step (EAGLE-2, arXiv 2406.16858), compiled then as a `Tree`
    (clover.runtime.loop.draft_dynamic). Depth by depth, the `width` drafted nodes of highest cumulative draft
    probability (the product of the draft probabilities along the path) are expanded, each with its `width`
    most likely children (sampling: drawn without replacement). Greedy then verifies the drafted nodes of
    highest cumulative probability: as many as maximise expected tokens per verify millisecond on `cost`
    (rows -> ms, clover.runtime.cost.VerifyCost), at most `budget`; sampling verifies every drafted node, the
    drafting stopping at `budget` (a node's siblings must all be verified for rejection sampling to stay exact).

    num_nodes, max_depth, max_children and is_chain bound the trees it compiles to, as Tree's fields do."""

    budget: int  # drafted nodes verified at most (the root excluded)
    width: int  # nodes expanded per depth, children per expanded node
    depth: int  # deepest drafted node
    cost: Any = None  # callable rows -> ms; None: always verify `budget` nodes
    name: str = "dynamic"
    confidence: Any = None  # clover.runtime.policy.DraftConfidence (learned online); None: the raw probabilities

    def __post_init__(self) -> None:
        if not (1 <= self.budget < MAX_TREE_NODES and 1 <= self.width and 1 <= self.depth):
            raise CloverError(
                f"a dynamic tree needs 1 <= budget < {MAX_TREE_NODES}, width >= 1 and depth >= 1, got "
                f"budget {self.budget}, width {self.width}, depth {self.depth}"
            )

    @property
    def num_nodes(self) -> int:
        return self.budget + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_children(self) -> int:
        return self.width

    @property
    def is_chain(self) -> bool:
        return self.width == 1

    @property
    def choices(self) -> tuple[RankPath, ...]:
        raise CloverError(f"tree {self.name} is drafted anew each step and has no fixed paths: record a static tree")


DYNAMIC_BUDGET, DYNAMIC_WIDTH = 12, 3  # 'dynamic': EAGLE-2 uses 60 nodes and width 10 on GPUs; CPUs verify fewer
_DYNAMIC = re.compile(r"dynamic(?:-(\d+))?(?:-w(\d+))?")


def dynamic_tree(spec: str, max_depth: int | None = None) -> DynamicTree | None:
    """'dynamic[-N][-wW]' (N: node budget, W: width) as a DynamicTree as deep as `max_depth` (default 5), else None."""
    m = _DYNAMIC.fullmatch(spec)
    if m is None:
        return None
    budget = int(m.group(1)) if m.group(1) else DYNAMIC_BUDGET
    width = int(m.group(2)) if m.group(2) else min(DYNAMIC_WIDTH, budget)
    return DynamicTree(budget, width, max_depth or 5, name=spec)


def _fmt(path: Sequence[Any]) -> str:
    return "[" + ", ".join(str(x) for x in path) + "]"


def _normalize_choices(choices: Any) -> list[RankPath]:
    """Type-check the raw spec and convert each path to a tuple of python ints."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise CloverError(
            f"a tree must be a list of paths (lists of top-k ranks), got {type(choices).__name__}: "
            "pass e.g. [[0], [1], [0, 0]], or [] for plain decoding"
        )
    paths: list[RankPath] = []
    for raw in choices:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise CloverError(
                f"a tree must be a list of paths (lists of top-k ranks), found element {raw!r} "
                f"of type {type(raw).__name__}: write each path as a list like [0, 1]"
            )
        if len(raw) == 0:
            raise CloverError("tree path [] is empty: the root is implicit, list only non-root nodes such as [0]")
        for x in raw:
            # bool is an int subclass but never a meaningful rank
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
                raise CloverError(
                    f"tree path {_fmt(raw)} has element {x!r}: path elements must be top-k ranks, "
                    "i.e. non-negative ints"
                )
        paths.append(tuple(int(x) for x in raw))
    return paths


def _validate_structure(paths: list[RankPath]) -> None:
    """Duplicates, node count, missing parents, non-contiguous sibling ranks."""
    if len(paths) + 1 > MAX_TREE_NODES:
        raise CloverError(
            f"tree has {len(paths) + 1} nodes (root included), the limit is {MAX_TREE_NODES}: use a smaller tree"
        )
    seen: set[RankPath] = set()
    for p in paths:
        if p in seen:
            raise CloverError(f"tree path {_fmt(p)} appears more than once: list each path once")
        seen.add(p)
    for p in sorted(paths, key=lambda q: (len(q), q)):
        if len(p) > 1 and p[:-1] not in seen:
            raise CloverError(
                f"tree path {_fmt(p)} has no parent {_fmt(p[:-1])}: every prefix of a path must also be in the tree"
            )
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            sib = p[:-1] + (p[-1] - 1,)
            raise CloverError(
                f"tree path {_fmt(p)} is present without its sibling {_fmt(sib)}: sibling ranks "
                f"must be contiguous from 0 (top-k ranks), add {_fmt(sib)} or renumber"
            )


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """Pack a [T, S] bool mask into [T, ceil(S / 32)] int32 words, bit (j % 32) of word j // 32."""
    t, s = mask.shape
    words = (s + 31) // 32
    padded = np.zeros((t, words * 32), dtype=np.uint32)
    padded[:, :s] = mask
    bits = padded.reshape(t, words, 32) << np.arange(32, dtype=np.uint32)  # [T, W, 32]
    return np.bitwise_or.reduce(bits, axis=2).astype(np.uint32).view(np.int32)  # [T, W]


def compile_tree(choices: Sequence[Sequence[int]], name: str = "custom") -> Tree:
    """Validate `choices` and compile them into a `Tree`.

    Args:
        choices: rank paths with the root implicit, e.g. [[0], [1], [0, 0]]; [] is the root-only tree.
        name: label stored on the tree.

    Returns:
        The compiled, read-only `Tree`.

    Raises:
        CloverError: the spec is malformed (message names the offending path and the fix).
    """
    paths = _normalize_choices(choices)
    _validate_structure(paths)
    paths.sort(key=lambda p: (len(p), p))

    t = len(paths) + 1
    index: dict[RankPath, int] = {(): 0}
    for i, p in enumerate(paths, start=1):
        index[p] = i

    depth = np.zeros(t, dtype=np.int32)
    parent = np.full(t, -1, dtype=np.int32)
    rank = np.full(t, -1, dtype=np.int32)
    child_lists: list[list[int]] = [[] for _ in range(t)]
    for i, p in enumerate(paths, start=1):
        depth[i] = len(p)
        parent[i] = index[p[:-1]]
        rank[i] = p[-1]
        child_lists[parent[i]].append(i)  # node order within a parent is rank order

    # Parents precede children, so each row extends its parent's row.
    anc = np.zeros((t, t), dtype=bool)
    anc[0, 0] = True
    for i in range(1, t):
        anc[i] = anc[parent[i]]
        anc[i, i] = True

    max_depth = int(depth.max())
    leaves = [i for i in range(t) if not child_lists[i]]
    leaf_paths = np.full((len(leaves), max_depth + 1), -1, dtype=np.int32)
    for row, leaf in enumerate(leaves):
        chain = [leaf]
        while chain[-1] != 0:
            chain.append(int(parent[chain[-1]]))
        leaf_paths[row, : len(chain)] = chain[::-1]

    return Tree(
        name=name,
        choices=tuple(paths),
        num_nodes=t,
        max_depth=max_depth,
        depth=_readonly(depth),
        parent=_readonly(parent),
        rank=_readonly(rank),
        ancestor_mask=_readonly(anc),
        packed_mask=_readonly(pack_mask(anc)),
        leaf_paths=_readonly(leaf_paths),
        children=tuple(_readonly(np.asarray(c, dtype=np.int32)) for c in child_lists),
        levels=tuple(_readonly(np.flatnonzero(depth == d).astype(np.int32)) for d in range(max_depth + 1)),
        max_children=max(len(c) for c in child_lists),
    )


def prune_tree(tree: Tree, depth: int) -> Tree:
    """`tree` without its nodes deeper than `depth` (itself when none are; 0: the root-only tree)."""
    if depth >= tree.max_depth:
        return tree
    return compile_tree(
        [c for c in tree.choices if len(c) <= depth], name=f"{tree.name}-d{depth}" if depth else "plain"
    )


NAMED_TREES: dict[str, tuple[RankPath, ...]] = {
    # Root only: plain decoding, one token per step.
    "plain": (),
    # 10 nodes, depth 4: three guesses at depth 1, narrowing along the rank-0 spine where a draft head
    # is most often right.
    "small": ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)),
    # 26 nodes, depth 5, in the style of EAGLE's mc_sim_7b_63.
    "mc26": (
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
        (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
    ),
}  # fmt: skip

_CHAIN = re.compile(r"chain-(\d+)")
_FORMS = (
    "'chain-N' (N >= 1 draft tokens in a line), a path to a JSON file holding a list of paths, "
    "or an inline JSON list such as '[[0], [1], [0, 0]]'"
)


def resolve_tree(spec: str) -> Tree:
    """Build a tree from a name, 'chain-N', a JSON file path, or an inline JSON list.

    Args:
        spec: one of NAMED_TREES ('plain', 'small', 'mc26'), 'chain-N' with N >= 1, a path to a JSON
            file holding a list of paths, or an inline JSON list string starting with '['.

    Returns:
        The compiled `Tree`.

    Raises:
        CloverError: unknown name, unreadable file, invalid JSON, or a malformed tree.
    """
    if spec in NAMED_TREES:
        return compile_tree(NAMED_TREES[spec], name=spec)
    m = _CHAIN.fullmatch(spec)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise CloverError(f"tree '{spec}' has no draft tokens: use chain-N with N >= 1, or 'plain'")
        if n + 1 > MAX_TREE_NODES:
            raise CloverError(f"tree '{spec}' has {n + 1} nodes, the limit is {MAX_TREE_NODES}: use a shorter chain")
        return compile_tree([[0] * d for d in range(1, n + 1)], name=spec)
    if spec.lstrip().startswith("["):
        choices = _parse_json(spec, "inline tree spec")
        # Named by its paths: two inline trees in one clover-bench run are two rows.
        return compile_tree(choices, name=json.dumps(choices, separators=(",", ":")))
    path = Path(spec)
    if path.is_file():
        try:
            text = path.read_text()
        except OSError as e:
            raise CloverError(f"cannot read tree file {spec}: {e}") from e
        return compile_tree(_parse_json(text, f"tree file {spec}"), name=path.stem)
    if spec.endswith(".json") or "/" in spec:
        raise CloverError(f"tree file {spec} not found: pass an existing JSON file or a tree name")
    raise CloverError(
        f"unknown tree '{spec}': available names are {', '.join(sorted(NAMED_TREES))}; also accepted: {_FORMS}"
    )


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CloverError(f"{what} is not valid JSON ({e}): expected a list of paths like [[0], [1], [0, 0]]") from e


def tree_spec(tree: Tree) -> TreeSpec:
    """What a manifest stores of a tree; `compile_spec` rebuilds the same tree."""
    return TreeSpec(tree.name, tuple(tree.choices))


def compile_spec(spec: TreeSpec) -> Tree:
    return compile_tree(spec.choices, spec.name)


def default_tree(max_depth: int | None) -> Tree:
    """The tree used when none is asked for and the artifact records none: mc26, pruned to the heads'
    depth when they cannot draft that deep (Medusa, Clover). The one place the default is chosen."""
    tree = resolve_tree(DEFAULT_TREE)
    return tree if max_depth is None else prune_tree(tree, max_depth)
