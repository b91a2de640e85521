"""Tree verification: greedy walks on hand-built cases, exactness of lossless rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from clover.errors import CloverError
from clover.runtime.acceptance import Acceptance, accept_greedy, accept_sampling, verify_node
from clover.runtime.sampling import sample_without_replacement
from clover.runtime.tree import compile_tree, resolve_tree

ALPHA = 1e-3


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to probs; cells with probability 0 must be empty."""
    assert counts[probs == 0].sum() == 0, "emitted a zero-probability token"
    support = probs > 0
    if support.sum() < 2:
        return 1.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def logits_with_argmax(argmax: list[int], v: int = 16) -> np.ndarray:
    rows = np.random.default_rng(0).normal(size=(len(argmax), v))  # [T, V]
    rows[np.arange(len(argmax)), argmax] = 10.0
    return rows


# ---- greedy -------------------------------------------------------------------------------------


def test_greedy_full_accept_down_a_chain() -> None:
    tree = resolve_tree("chain-3")
    tokens = np.array([10, 1, 2, 3], dtype=np.int64)
    acc = accept_greedy(tree, tokens, logits_with_argmax([1, 2, 3, 4]))
    assert acc.path.tolist() == [0, 1, 2, 3] and acc.bonus_token == 4
    assert acc.accepted_nodes.tolist() == [1, 2, 3] and acc.num_emitted == 4
    assert acc.path.dtype == np.int64 and not acc.path.flags.writeable


def test_greedy_mismatch_at_depth_one() -> None:
    tree = resolve_tree("chain-3")
    tokens = np.array([10, 1, 2, 3], dtype=np.int64)
    acc = accept_greedy(tree, tokens, logits_with_argmax([7, 2, 3, 4]))
    assert acc.path.tolist() == [0] and acc.bonus_token == 7
    assert acc.accepted_nodes.size == 0 and acc.num_emitted == 1


def test_greedy_second_sibling_matches() -> None:
    # nodes: 0 root, 1=[0], 2=[1], 3=[0,0], 4=[1,0]
    tree = compile_tree([[0], [1], [0, 0], [1, 0]])
    tokens = np.array([9, 5, 6, 7, 8], dtype=np.int64)
    acc = accept_greedy(tree, tokens, logits_with_argmax([6, 7, 8, 0, 3]))
    assert acc.path.tolist() == [0, 2, 4] and acc.bonus_token == 3


def test_greedy_ties_take_lowest_id_and_duplicate_siblings_first_rank() -> None:
    tree = compile_tree([[0], [1]])
    tokens = np.array([0, 4, 2], dtype=np.int64)
    logits = np.zeros((3, 8))
    logits[0, [2, 4]] = 1.0  # tie between tokens 2 and 4: argmax is 2 -> node 2
    acc = accept_greedy(tree, tokens, logits)
    assert acc.path.tolist() == [0, 2] and acc.bonus_token == 0
    dup = np.array([0, 3, 3], dtype=np.int64)
    logits[0, 3] = 5.0
    assert accept_greedy(tree, dup, logits).path.tolist() == [0, 1]


def test_greedy_plain_tree_emits_bonus_only() -> None:
    acc = accept_greedy(resolve_tree("plain"), np.array([5]), logits_with_argmax([11]))
    assert acc.path.tolist() == [0] and acc.bonus_token == 11


def test_greedy_with_masks_asked_on_the_walk_equals_masking_every_row() -> None:
    """A grammar's masks, asked only for the nodes the walk reaches, give the walk of every row masked (ties
    included: logits are small integers), and no row past the first rejection is asked for; a row's whole mask
    is asked for only where its argmax is forbidden."""
    rng = np.random.default_rng(5)
    tree = resolve_tree("mc26")
    for _ in range(300):
        v = 8
        tokens = rng.integers(0, v, tree.num_nodes)
        logits = rng.integers(0, 4, (tree.num_nodes, v)).astype(np.float64)
        masks = rng.random((tree.num_nodes, v)) < 0.5
        masks[np.arange(tree.num_nodes), rng.integers(0, v, tree.num_nodes)] = True  # each allows one at least
        rows = Rows(masks)
        lazy = accept_greedy(tree, tokens, logits.copy(), rows)
        dense = accept_greedy(tree, tokens, np.where(masks, logits, -np.inf))
        assert lazy.path.tolist() == dense.path.tolist() and lazy.bonus_token == dense.bonus_token
        assert rows.asked == lazy.path.tolist()
        # a whole row only where its argmax is forbidden
        argmax = logits.argmax(axis=1)
        assert rows.masked == [n for n in rows.asked if not masks[n, argmax[n]]]


class Rows:
    """A grammar's masks as the verify asks for them: each node's argmax checked, then its row if forbidden."""

    def __init__(self, masks: np.ndarray) -> None:
        self.masks, self.asked, self.masked = masks, [], []

    def permits(self, node: int, token: int) -> bool:
        self.asked.append(node)
        return bool(self.masks[node, token])

    def best(self, node: int, logits: np.ndarray) -> int:
        self.masked.append(node)
        return int(np.argmax(np.where(self.masks[node], logits, -np.inf)))


def test_greedy_shape_errors() -> None:
    tree = resolve_tree("chain-2")
    with pytest.raises(CloverError, match=r"expected node_tokens of shape \[3\]"):
        accept_greedy(tree, np.zeros(4, dtype=np.int64), np.zeros((3, 8)))
    with pytest.raises(CloverError, match=r"expected target_logits of shape \[3, V\]"):
        accept_greedy(tree, np.zeros(3, dtype=np.int64), np.zeros((2, 8)))


# ---- sampling: one node -------------------------------------------------------------------------

V = 6


def _cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    p_rand, q_rand = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    q_holes = np.array([0.5, 0.0, 0.3, 0.0, 0.2, 0.0])  # zeros where p > 0
    one_hot = np.eye(V)[4]
    q_small = np.array([0.0, 0.7, 0.0, 0.3, 0.0, 0.0])  # support 2 < 3 candidates
    p_sparse = np.array([0.0, 0.0, 0.6, 0.0, 0.4, 0.0])  # zeros where q > 0
    return {
        "random": (p_rand, q_rand),
        "q_zeros_where_p_positive": (p_rand, q_holes),
        "p_one_hot": (one_hot, q_rand),
        "p_equals_q": (q_rand, q_rand.copy()),
        "q_support_below_k": (p_rand, q_small),
        "p_zeros_where_q_positive": (p_sparse, q_rand),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_node_emits_target_law(case: str) -> None:
    """Token emitted by verify_node over 3 drafted candidates has law p (chi-square, alpha=1e-3)."""
    p, q = CASES[case]
    rng = np.random.default_rng(12)
    n = 20_000
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(n):
        cands = sample_without_replacement(q, 3, rng)
        idx, token = verify_node(p, q, cands, rng)
        assert idx == -1 or token == cands[idx]
        counts[token] += 1
    assert chi2_pvalue(counts, p) > ALPHA


def test_verify_node_p_equals_q_accepts_first() -> None:
    rng = np.random.default_rng(13)
    q = CASES["random"][1]
    for _ in range(500):
        cands = sample_without_replacement(q, 3, rng)
        assert verify_node(q, q, cands, rng) == (0, int(cands[0]))


def test_verify_node_without_candidates_samples_p() -> None:
    """No candidates: the token is drawn from p (chi-square, alpha=1e-3)."""
    rng = np.random.default_rng(14)
    p = CASES["random"][0]
    zeros = np.zeros(V)  # childless rows are ignored, even all-zero ones
    counts = np.bincount([verify_node(p, zeros, [], rng)[1] for _ in range(20_000)], minlength=V)
    assert chi2_pvalue(counts, p) > ALPHA


def test_verify_node_rejects_candidate_outside_draft_support() -> None:
    q = np.array([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    with pytest.raises(CloverError, match=r"candidate token 3 has zero draft probability"):
        verify_node(np.full(V, 1 / V), q, [3], np.random.default_rng(0))
    with pytest.raises(CloverError, match=r"candidate token 1 has zero draft probability"):
        # duplicate siblings: the second copy was removed from q by the first
        verify_node(np.eye(V)[5], q, [1, 1], np.random.default_rng(0))


class ScriptedRng:
    """Stands in for np.random.Generator.random(): returns scripted uniforms, then 0.0."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0) if self.values else 0.0


def test_verify_node_degenerate_residual_falls_back_to_p_without_rejected() -> None:
    # p == q up to rounding: the residual max(p - q, 0) has mass ~1e-15, all on token 2. A rejection
    # there has probability ~1e-15; force it, and check the continuation is p with token 0 removed
    # (then candidate 1 is accepted), not the normalized rounding noise (one-hot on token 2).
    q = np.array([0.3, 0.3, 0.4, 0.0, 0.0, 0.0])
    p = q + np.array([-1e-15, 0.0, 1e-15, 0.0, 0.0, 0.0])
    assert verify_node(p, q, [0, 1], ScriptedRng([1.0 - 2**-53])) == (1, 1)  # type: ignore[arg-type]
    # One-hot p == q: rejecting the only token leaves nothing else; it stays the bonus token.
    one = np.eye(V)[2]
    assert verify_node(one, one, [2], ScriptedRng([1.0])) == (-1, 2)  # type: ignore[arg-type]


# ---- sampling: a two-level tree -----------------------------------------------------------------


def test_accept_sampling_first_and_second_token_laws() -> None:
    """First emitted token ~ p_root; given node 1 accepted, the next ~ p_1 (chi-square, alpha=1e-3)."""
    # nodes: 0 root, 1=[0], 2=[1], 3=[0,0], 4=[0,1], 5=[1,0]
    tree = compile_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
    t, v = tree.num_nodes, 5
    rng = np.random.default_rng(15)
    target = rng.dirichlet(np.ones(v), size=t)  # [T, V]
    draft = rng.dirichlet(np.ones(v), size=t)
    draft[1] = [0.0, 1.0, 0.0, 0.0, 0.0]  # support 1 < 2 children: node 4 is invalid
    target[0, 3] = 0.0  # a token the root target never emits
    target[0] /= target[0].sum()

    n = 12_000
    first = np.zeros(v, dtype=np.int64)
    second_after_1 = np.zeros(v, dtype=np.int64)
    lengths = np.zeros(tree.max_depth + 2, dtype=np.int64)
    for _ in range(n):
        tokens = np.zeros(t, dtype=np.int64)
        valid = np.zeros(t, dtype=bool)
        valid[0] = True
        for node in range(t):
            kids = tree.children[node]
            if kids.size == 0 or not valid[node]:
                continue
            drawn = sample_without_replacement(draft[node], kids.size, rng)
            tokens[kids[: drawn.size]] = drawn
            valid[kids[: drawn.size]] = True
        acc = accept_sampling(tree, tokens, valid, target, draft, rng)
        assert isinstance(acc, Acceptance) and acc.path[0] == 0
        assert np.all(valid[acc.path]) and np.all(tree.parent[acc.path[1:]] == acc.path[:-1])
        emitted = np.append(tokens[acc.accepted_nodes], acc.bonus_token)
        lengths[acc.num_emitted] += 1
        first[emitted[0]] += 1
        if acc.path.size > 1 and acc.path[1] == 1:
            second_after_1[emitted[1]] += 1
    assert chi2_pvalue(first, target[0]) > ALPHA
    assert second_after_1.sum() > 1000
    assert chi2_pvalue(second_after_1, target[1]) > ALPHA
    assert lengths[3] > 0  # depth-2 acceptances happen


def test_accept_sampling_one_hot_target_follows_matching_path() -> None:
    tree = resolve_tree("chain-2")
    tokens = np.array([0, 2, 3], dtype=np.int64)
    target = np.eye(5)[[2, 3, 4]]  # [T, V]
    draft = np.broadcast_to(np.full(5, 0.2), (3, 5))  # broadcast view is fine
    acc = accept_sampling(tree, tokens, np.ones(3, dtype=bool), target, draft, np.random.default_rng(0))
    assert acc.path.tolist() == [0, 1, 2] and acc.bonus_token == 4


def test_accept_sampling_invalid_nodes_are_never_accepted() -> None:
    tree = resolve_tree("chain-2")
    tokens = np.array([0, 2, 3], dtype=np.int64)
    target = np.eye(5)[[2, 3, 4]]
    draft = np.full((3, 5), 0.2)
    valid = np.array([True, False, False])
    acc = accept_sampling(tree, tokens, valid, target, draft, np.random.default_rng(0))
    assert acc.path.tolist() == [0] and acc.bonus_token == 2


def test_accept_sampling_shape_errors() -> None:
    tree = resolve_tree("chain-2")
    ok = np.full((3, 5), 0.2)
    with pytest.raises(CloverError, match=r"expected node_valid of shape \[3\]"):
        accept_sampling(tree, np.zeros(3, np.int64), np.ones(2, bool), ok, ok, np.random.default_rng(0))
    with pytest.raises(CloverError, match=r"expected draft_probs of shape \(3, 5\)"):
        accept_sampling(tree, np.zeros(3, np.int64), np.ones(3, bool), ok, ok[:, :4], np.random.default_rng(0))
