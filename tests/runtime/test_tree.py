"""Tree compilation: differential test against a plain re-derivation, packing, validation, resolve."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clover.artifact import TreeSpec
from clover.errors import CloverError
from clover.runtime.tree import (
    NAMED_TREES,
    Tree,
    compile_spec,
    compile_tree,
    default_tree,
    resolve_tree,
    tree_spec,
)

# ---- plain, slow reference: everything from the prefix relation between paths -------------------


def reference(choices: list[list[int]]) -> dict:
    paths = [()] + sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))
    t = len(paths)

    def is_prefix(a: tuple, b: tuple) -> bool:
        return len(a) <= len(b) and b[: len(a)] == a

    mask = [[is_prefix(paths[j], paths[i]) for j in range(t)] for i in range(t)]
    parent = [-1] + [paths.index(p[:-1]) for p in paths[1:]]
    children = [[j for j in range(t) if parent[j] == i] for i in range(t)]
    children = [sorted(c, key=lambda j: paths[j][-1]) for c in children]
    max_depth = max(len(p) for p in paths)
    leaves = [i for i in range(t) if not children[i]]
    leaf_paths = [
        [paths.index(paths[i][:d]) for d in range(len(paths[i]) + 1)] + [-1] * (max_depth - len(paths[i]))
        for i in leaves
    ]
    words = (t + 31) // 32
    packed = []
    for i in range(t):
        row = []
        for w in range(words):
            value = sum(1 << b for b in range(32) if w * 32 + b < t and mask[i][w * 32 + b])
            row.append(value - (1 << 32) if value >= 1 << 31 else value)
        packed.append(row)
    return {
        "choices": tuple(paths[1:]),
        "num_nodes": t,
        "max_depth": max_depth,
        "depth": [len(p) for p in paths],
        "parent": parent,
        "rank": [-1] + [p[-1] for p in paths[1:]],
        "ancestor_mask": mask,
        "packed_mask": packed,
        "leaf_paths": leaf_paths,
        "children": children,
        "levels": [[i for i in range(t) if len(paths[i]) == d] for d in range(max_depth + 1)],
        "max_children": max(len(c) for c in children),
    }


def random_choices(rng: np.random.Generator, max_nodes: int, max_depth: int) -> list[list[int]]:
    """A random valid tree: every node gets 0..3 children (contiguous ranks) up to the limits."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while frontier and len(paths) < max_nodes:
        node = frontier.pop(int(rng.integers(len(frontier))))
        if len(node) >= max_depth:
            continue
        for r in range(int(rng.integers(0, 4))):
            if len(paths) >= max_nodes:
                break
            paths.append(node + (r,))
            frontier.append(node + (r,))
    order = rng.permutation(len(paths))  # compile_tree must not depend on input order
    return [list(paths[i]) for i in order]


def assert_matches_reference(tree: Tree, choices: list[list[int]]) -> None:
    ref = reference(choices)
    t = ref["num_nodes"]
    assert tree.choices == ref["choices"]
    assert tree.num_nodes == t
    assert tree.max_depth == ref["max_depth"]
    assert tree.max_children == ref["max_children"]
    for field, dtype in [
        ("depth", np.int32), ("parent", np.int32), ("rank", np.int32), ("ancestor_mask", np.bool_),
        ("packed_mask", np.int32), ("leaf_paths", np.int32),
    ]:  # fmt: skip
        arr = getattr(tree, field)
        assert arr.dtype == dtype, field
        assert not arr.flags.writeable, field
        np.testing.assert_array_equal(arr, np.asarray(ref[field], dtype=dtype), err_msg=field)
    assert tree.packed_mask.shape == (t, (t + 31) // 32)
    assert tree.leaf_paths.shape[1] == tree.max_depth + 1
    assert len(tree.children) == t and len(tree.levels) == tree.max_depth + 1
    for got, want in zip(tree.children, ref["children"], strict=True):
        assert got.dtype == np.int32 and got.tolist() == want
    for got, want in zip(tree.levels, ref["levels"], strict=True):
        assert got.dtype == np.int32 and got.tolist() == want


@pytest.mark.parametrize("name", sorted(NAMED_TREES))
def test_named_trees_match_reference(name: str) -> None:
    choices = [list(p) for p in NAMED_TREES[name]]
    assert_matches_reference(resolve_tree(name), choices)


def test_named_tree_sizes() -> None:
    assert resolve_tree("plain").num_nodes == 1
    assert resolve_tree("mc26").num_nodes == 26
    assert resolve_tree("mc26").max_depth == 5
    small = resolve_tree("small")
    assert 8 <= small.num_nodes <= 12 and small.max_depth == 4


@pytest.mark.parametrize("seed", range(20))
def test_random_trees_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    choices = random_choices(rng, max_nodes=int(rng.integers(1, 120)), max_depth=6)
    assert_matches_reference(compile_tree(choices), choices)


def test_node_order_invariants() -> None:
    tree = compile_tree(random_choices(np.random.default_rng(7), 200, 8))
    assert np.all(tree.parent[1:] < np.arange(1, tree.num_nodes))  # ancestors come first
    assert np.all(np.diff(tree.depth) >= 0)  # each depth is contiguous


def unpack(packed: np.ndarray, t: int) -> np.ndarray:
    words = packed.view(np.uint32)  # [T, W]
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1  # [T, W, 32]
    return bits.reshape(packed.shape[0], -1)[:, :t].astype(bool)


@pytest.mark.parametrize("spec", ["chain-40", "chain-70", "mc26", "plain"])
def test_packed_mask_unpacks_to_ancestor_mask(spec: str) -> None:
    tree = resolve_tree(spec)
    np.testing.assert_array_equal(unpack(tree.packed_mask, tree.num_nodes), tree.ancestor_mask)


def test_packed_mask_wide_tree_and_bit31() -> None:
    # 100 nodes over 4 words, every node's ancestors spread across words.
    choices = random_choices(np.random.default_rng(3), 99, 12)
    tree = compile_tree(choices)
    assert tree.num_nodes > 64 and tree.packed_mask.shape[1] == (tree.num_nodes + 31) // 32
    np.testing.assert_array_equal(unpack(tree.packed_mask, tree.num_nodes), tree.ancestor_mask)

    chain = resolve_tree("chain-40")
    assert chain.packed_mask[31, 0] == -1 and chain.packed_mask[31, 1] == 0  # bits 0..31 set
    assert chain.packed_mask[30, 0] == 2**31 - 1  # bit 31 clear: positive
    assert chain.packed_mask[39, 1] == 0xFF  # nodes 32..39


def test_leaf_paths_are_root_to_leaf_paths() -> None:
    tree = resolve_tree("mc26")
    has_child = np.zeros(tree.num_nodes, dtype=bool)
    has_child[tree.parent[1:]] = True
    leaves = np.flatnonzero(~has_child)
    assert tree.leaf_paths.shape == (leaves.size, tree.max_depth + 1)
    for row, leaf in zip(tree.leaf_paths, leaves, strict=True):
        ids = row[row >= 0]
        assert ids[0] == 0 and ids[-1] == leaf
        assert np.all(tree.parent[ids[1:]] == ids[:-1])
        assert np.all(row[ids.size :] == -1)


def test_plain_tree() -> None:
    tree = compile_tree([])
    assert tree.num_nodes == 1 and tree.max_depth == 0 and tree.max_children == 0
    assert tree.leaf_paths.tolist() == [[0]]
    assert tree.packed_mask.tolist() == [[1]]
    assert [c.tolist() for c in tree.children] == [[]]


def test_tree_spec_round_trips_through_the_manifest_json() -> None:
    tree = resolve_tree("small")
    spec = TreeSpec.from_dict(json.loads(json.dumps(tree_spec(tree).to_dict())))
    assert spec.name == "small"
    again = compile_spec(spec)
    assert again.choices == tree.choices
    np.testing.assert_array_equal(again.packed_mask, tree.packed_mask)


@pytest.mark.parametrize(
    "bad",
    [{"name": "x"}, {"name": "x", "choices": [[0, -1]]}, {"choices": [[0]]}, [[0]], {"name": "x", "choices": [["0"]]}],
)
def test_a_malformed_manifest_tree_is_a_clear_error(bad) -> None:
    with pytest.raises(CloverError, match="manifest's tree is malformed"):
        TreeSpec.from_dict(bad)


def test_the_default_tree_is_mc26_pruned_to_the_heads_depth() -> None:
    assert default_tree(None).name == "mc26" and default_tree(None).num_nodes == 26
    assert default_tree(2).max_depth == 2 and set(default_tree(2).choices) <= set(default_tree(None).choices)


@pytest.mark.parametrize(
    "choices, match",
    [
        ("[[0]]", r"must be a list of paths"),
        (7, r"must be a list of paths"),
        ([0, 1], r"found element 0"),
        ([[0], "ab"], r"found element 'ab'"),
        ([[0], []], r"tree path \[\] is empty"),
        ([[0], [-1]], r"tree path \[-1\] has element -1"),
        ([[0], [0.5]], r"has element 0.5"),
        ([[True]], r"has element True"),
        ([[0], [0]], r"tree path \[0\] appears more than once"),
        ([[0], [1], [0, 0, 0]], r"tree path \[0, 0, 0\] has no parent \[0, 0\]"),
        ([[0], [0, 1]], r"tree path \[0, 1\] is present without its sibling \[0, 0\]"),
        ([[0], [0, 0], [0, 2]], r"tree path \[0, 2\] is present without its sibling \[0, 1\]"),
        ([[1]], r"tree path \[1\] is present without its sibling \[0\]"),
        ([[0] * d for d in range(1, 1025)], r"1025 nodes .* limit is 1024"),
    ],
)
def test_malformed_specs(choices: object, match: str) -> None:
    with pytest.raises(CloverError, match=match):
        compile_tree(choices)  # type: ignore[arg-type]


def test_missing_parent_message_says_fix() -> None:
    with pytest.raises(CloverError, match=r"every prefix of a path must also be in the tree"):
        compile_tree([[0], [1, 0], [0, 0]])


def test_max_size_tree_is_accepted() -> None:
    assert compile_tree([[0] * d for d in range(1, 1024)]).num_nodes == 1024


def test_resolve_chain() -> None:
    tree = resolve_tree("chain-3")
    assert tree.name == "chain-3"
    assert tree.choices == ((0,), (0, 0), (0, 0, 0))
    assert tree.parent.tolist() == [-1, 0, 1, 2]
    with pytest.raises(CloverError, match=r"N >= 1"):
        resolve_tree("chain-0")


def test_resolve_json_file(tmp_path) -> None:
    f = tmp_path / "mytree.json"
    f.write_text(json.dumps([[0], [1], [0, 0]]))
    tree = resolve_tree(str(f))
    assert tree.name == "mytree"
    assert tree.choices == ((0,), (1,), (0, 0))

    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1")
    with pytest.raises(CloverError, match=r"not valid JSON"):
        resolve_tree(str(bad))
    with pytest.raises(CloverError, match=r"not found"):
        resolve_tree(str(tmp_path / "missing.json"))


def test_resolve_inline_json() -> None:
    tree = resolve_tree("[[0], [1], [0, 0]]")
    assert tree.num_nodes == 4 and tree.name == "[[0],[1],[0,0]]"
    assert resolve_tree("[]").num_nodes == 1
    with pytest.raises(CloverError, match=r"has no parent"):
        resolve_tree("[[0, 0]]")


def test_resolve_unknown_name_lists_names() -> None:
    with pytest.raises(CloverError, match=r"unknown tree 'mc63'") as info:
        resolve_tree("mc63")
    msg = str(info.value)
    for name in NAMED_TREES:
        assert name in msg
    assert "chain-N" in msg and "JSON" in msg
