"""The scheduler's tree policy: expected tokens from acceptance by depth and rank, and the choice per step."""

from __future__ import annotations

import numpy as np
import pytest

from clover.errors import CloverError
from clover.runtime.cost import VerifyCost
from clover.runtime.loop import Decoding
from clover.runtime.params import EngineOptions
from clover.runtime.policy import AutoTrees, RankAcceptance
from clover.runtime.tree import prune_tree, resolve_tree


def decodings(n: int) -> list[Decoding]:
    """Sequences past their prompt (the policy reads only prefill progress and identity)."""
    out = []
    for _ in range(n):
        d = Decoding.__new__(Decoding)
        d.prompt, d.prefilled, d.prefill_chunk = np.zeros(2, np.int64), 2, 256
        out.append(d)
    return out


def with_acceptance(policy: AutoTrees, q: float, steps: int = 400) -> None:
    """Feed the engine-wide counts as if rank 0 were accepted with probability q at every depth."""
    full = policy.levels[-1]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        path = [0]
        for d in range(1, full.max_depth + 1):
            kids = full.children[path[-1]]
            if not len(kids) or rng.random() >= q:
                break
            path.append(int(kids[0]))
        policy.engine.observe(full, np.array(path))


def test_expected_tokens_of_a_chain_is_one_plus_the_products():
    policy = AutoTrees(resolve_tree("chain-3"), VerifyCost({1: 1.0}))
    q = np.full((4, 1), 0.5)
    assert np.allclose(policy.expected_tokens(q), [1, 1.5, 1.75, 1.875])


def test_rank_acceptance_counts_trials_and_hits_per_depth_and_rank():
    tree = resolve_tree("small")  # top-3 at depth 1, more below
    a = RankAcceptance(tree.max_depth, tree.max_children, prior=1e-12)
    second = int(tree.children[0][1])  # rank 1 at depth 1 accepted
    a.observe(tree, np.array([0, second]))
    a.observe(tree, np.array([0]))
    q = a.q()
    assert q[1, 1] == pytest.approx(0.5) and q[1, 0] == pytest.approx(0.0)
    assert a.trials[2].sum() == len(tree.children[second])  # depth 2 tried under the accepted node only


def test_rank_acceptance_ignores_depths_past_its_table():
    """A grammar's forced chain can run deeper than the policy's trees: the depths past its table are not counted."""
    a = RankAcceptance(3, 2, prior=1e-12)
    a.observe(resolve_tree("chain-8"), np.arange(9))  # accepted whole, 8 deep
    assert a.trials[1:].tolist() == [[1, 0]] * 3 and a.hits[1:].tolist() == [[1, 0]] * 3


def test_auto_speculates_where_rows_are_cheap_and_acceptance_high():
    cheap = VerifyCost({1: 10.0, 64: 11.0})  # bandwidth-bound: extra rows nearly free
    policy = AutoTrees(resolve_tree("chain-4"), cheap)
    with_acceptance(policy, 0.8)
    policy.draft_ms[:] = 0.0
    trees = policy.choose(decodings(4))
    assert all(t.max_depth == 4 for t in trees)


def test_auto_stays_plain_where_rows_cost_as_much_as_a_step():
    dear = VerifyCost({1: 10.0, 2: 20.0, 64: 640.0})  # every row costs a whole step
    policy = AutoTrees(resolve_tree("chain-4"), dear, explore=10**9)
    with_acceptance(policy, 0.6)
    assert all(t.max_depth == 0 for t in policy.choose(decodings(4)))


def test_auto_picks_a_middle_depth_when_that_rates_best():
    rows_cost = VerifyCost({1: 10.0, 2: 10.5, 3: 11.0, 4: 16.0, 5: 22.0})  # a knee after 3 rows
    policy = AutoTrees(resolve_tree("chain-4"), rows_cost, explore=10**9)
    with_acceptance(policy, 0.7)
    policy.draft_ms[:] = 0.0
    (tree,) = policy.choose(decodings(1))
    assert tree.max_depth == 2


def test_prune_keeps_the_nodes_up_to_a_depth():
    full = resolve_tree("mc26")
    assert prune_tree(full, 0).num_nodes == 1
    assert prune_tree(full, 1).max_depth == 1 and prune_tree(full, full.max_depth) is full


def test_verify_cost_interpolates_extrapolates_and_learns_a_correction():
    cost = VerifyCost({1: 5.0, 3: 7.0})
    assert cost(2, 1) == pytest.approx(6.0) and cost(5, 1) == pytest.approx(9.0)
    for _ in range(200):
        cost.observe(2, 4, 12.0)
    assert cost(2, 4) == pytest.approx(12.0, rel=1e-3) and cost(2, 1) == pytest.approx(6.0)


def test_engine_options_reject_bad_sizes():
    for bad, field in (({"max_batch": 0}, "max_batch"), ({"max_waiting": -1}, "max_waiting")):
        with pytest.raises(CloverError, match=field):
            EngineOptions(**bad)
    with pytest.raises(CloverError, match="prefill_chunk"):
        EngineOptions(prefill_chunk=0)


def test_a_prompt_in_the_step_does_not_sway_the_choice():
    """A long prompt chunk in the same forward would make drafting look cheap beside it: the policy decides
    as if the decoding sequences stepped alone (the prefilling one steps plain)."""
    rows_cost = VerifyCost({1: 10.0, 2: 14.0, 8: 40.0, 512: 600.0})
    policy = AutoTrees(resolve_tree("chain-4"), rows_cost, explore=10**9)
    with_acceptance(policy, 0.4)
    alone = [t.max_depth for t in policy.choose(decodings(3))]
    prompt = Decoding.__new__(Decoding)
    prompt.prompt, prompt.prefilled, prompt.prefill_chunk = np.zeros(400, np.int64), 0, 256
    mixed = [t.max_depth for t in policy.choose(decodings(3) + [prompt])]
    assert mixed == alone + [0] and alone == [0, 0, 0]
