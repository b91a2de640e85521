"""clover.runtime.processors and clover.runtime.logprobs: every tree row is adjusted exactly as plain decoding
adjusts it once the row's path is generated (bit for bit), the formulas are OpenAI's and vLLM's, nothing runs when
no processor is set, and log-probabilities are the raw rows' log_softmax."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from numerics import assert_close_paths

from clover.errors import CloverError
from clover.runtime.logprobs import check_logprobs, token_logprobs
from clover.runtime.loop import PLAIN
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import resolve_tree

V = 50
STOP = (1, 7)
SETTINGS = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "frequency+presence": SamplingParams(frequency_penalty=0.9, presence_penalty=-0.6),
    "logit_bias": SamplingParams(logit_bias={3: 5.0, 4: -100.0, 7: 2.5}),
    "min_tokens": SamplingParams(min_tokens=6),
    "allowed_token_ids": SamplingParams(allowed_token_ids=(2, 3, 5, 8, 11, 40)),
    "bad_words": SamplingParams(bad_words=((3,), (5, 7), (2, 4, 6), (9, 9), (1, 1, 1, 1, 1, 8))),
    "all": SamplingParams(
        presence_penalty=1.5,
        frequency_penalty=2.0,
        repetition_penalty=0.8,
        logit_bias={3: 5.0, 9: -3.0},
        min_tokens=4,
    ),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("tree", ["chain-5", "mc26", "small"])
def test_tree_rows_equal_plain_rows_with_their_path_generated(name, tree):
    """Row i of a tree, adjusted with the history + the path to i, is bit-identical to the one row plain decoding
    adjusts after generating that path: what makes greedy speculative decoding with processors equal plain."""
    rng = np.random.default_rng(0)
    t = resolve_tree(tree)
    prompt = rng.integers(0, V, 12)
    generated = [int(x) for x in rng.integers(0, 12, 3)]  # few distinct tokens: paths repeat history
    tokens = rng.integers(0, 12, t.num_nodes)
    tokens[0] = generated[-1]  # the root: the last emitted token
    logits = (rng.standard_normal((t.num_nodes, V)) * 4).astype(np.float32)
    proc = LogitsProcessors.of(SETTINGS[name], prompt, STOP, V)
    proc.extend(generated)
    before = logits.copy()
    got = proc.apply(logits, t, tokens)
    assert np.array_equal(logits, before), "apply must not modify the raw rows (log-probabilities read them)"
    assert got.dtype == np.float32 and got.shape == logits.shape
    changed = 0
    for i in range(t.num_nodes):
        path = [int(tokens[j]) for j in np.flatnonzero(t.ancestor_mask[i]) if j != 0]  # root excluded
        plain = copy.deepcopy(proc)
        plain.extend(path)
        want = plain.apply(logits[i : i + 1], PLAIN, tokens[i : i + 1])[0]
        assert np.array_equal(got[i], want), f"{name} {tree} node {i} (path {path})"
        changed += not np.array_equal(got[i], logits[i])
    assert changed, "the processors changed nothing: the test proves nothing"


def test_formulas_are_openai_and_vllm():
    """logit_bias added first, repetition (prompt + generated) divides positive logits and multiplies negative
    ones, frequency x count + presence over generated tokens only, EOS and stop ids -inf before min_tokens."""
    logits = np.array([[2.0, -2.0, 1.0, 3.0, 0.5, -1.0]], dtype=np.float32)
    sp = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={4: 1.0, 5: 4.0}, min_tokens=3
    )
    proc = LogitsProcessors(sp, np.array([0, 1]), stop_ids=(2,), vocab_size=6)  # prompt: tokens 0 and 1
    proc.extend([3, 3])  # generated: token 3 twice
    got = proc.apply(logits, PLAIN, np.array([3]))[0]
    want = [
        2.0 / 2,  # prompt token, positive: divided
        -2.0 * 2,  # prompt token, negative: multiplied
        -np.inf,  # a stop id, 2 tokens generated < min_tokens 3
        3.0 / 2 - (0.25 * 2 + 0.5),  # generated twice: repetition, then frequency and presence
        0.5 + 1.0,  # biased only
        -1.0 + 4.0,  # biased to positive, never seen: no repetition penalty
    ]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))
    proc.extend([5])  # 3 generated: the stop id is allowed again, and 5 is now seen and counted
    got = proc.apply(logits, PLAIN, np.array([5]))[0]
    assert got[2] == 1.0 and got[5] == np.float32((-1.0 + 4.0) / 2 - (0.25 + 0.5))


def test_nothing_runs_without_a_processor():
    prompt = np.arange(5)
    assert LogitsProcessors.of(SamplingParams(), prompt, STOP, V) is None
    assert LogitsProcessors.of(SamplingParams(temperature=0.7, top_p=0.9), prompt, STOP, V) is None
    assert LogitsProcessors.of(SamplingParams(min_tokens=4), prompt, (), V) is None  # nothing to mask
    assert LogitsProcessors.of(SamplingParams(min_tokens=4), prompt, STOP, V) is not None
    assert LogitsProcessors.of(SamplingParams(repetition_penalty=1.1), prompt, (), V) is not None


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.0}, "min_tokens"),
        ({"allowed_token_ids": (3, -1)}, "allowed_token_ids"),
        ({"allowed_token_ids": (True,)}, "allowed_token_ids"),
        ({"bad_words": ((),)}, "bad_words"),
        ({"bad_words": ((4, -1),)}, "bad_words"),
    ],
)
def test_bad_values_name_their_param(kwargs, param):
    with pytest.raises(CloverError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param, str(e.value)


def test_logit_bias_is_kept_as_sorted_pairs_and_params_stay_hashable():
    sp = SamplingParams(logit_bias={9: 1, 2: -2.5})
    assert sp.logit_bias == ((2, -2.5), (9, 1.0)) and sp == SamplingParams(logit_bias=[(2, -2.5), (9, 1.0)])
    assert hash(sp) == hash(SamplingParams(logit_bias=((2, -2.5), (9, 1))))
    assert sp.processes_logits and not SamplingParams(temperature=0.5).processes_logits


def test_token_logprobs_are_the_raw_rows_log_softmax_with_sorted_alternatives():
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((4, V)) * 3).astype(np.float32)
    rows[2, [5, 6]] = rows[2].max() + 1.0  # a tie at the top: the lower id first
    tokens = [int(rows[0].argmax()), 3, 6, 11]
    lp = token_logprobs(rows, tokens, 5)
    x = rows.astype(np.float64)
    want = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    # the exp runs in the rows' float32, summed in float64: a float32 reduction over V terms (tests/numerics.py)
    assert_close_paths(lp.logprobs, want[np.arange(4), tokens], reduction=V, dtype=torch.float32)
    assert lp.top_ids.shape == (4, 5) and np.all(np.diff(lp.top_logprobs, axis=1) <= 0)
    assert_close_paths(lp.top_logprobs, np.take_along_axis(want, lp.top_ids, 1), reduction=V, dtype=torch.float32)
    assert lp.top_ids[2, 0] == 5 and lp.top_ids[2, 1] == 6
    assert lp.top_ids[0, 0] == tokens[0] and lp.logprobs[0] == lp.top_logprobs[0, 0]  # greedy: the top-1
    entries = lp.entries([0, 4, 9])  # only the tokens the output kept
    assert [e.token_id for e in entries] == tokens[:3] and [e.text_offset for e in entries] == [0, 4, 9]
    assert entries[1].top[0] == (int(lp.top_ids[1, 0]), float(lp.top_logprobs[1, 0]))
    assert token_logprobs(rows, tokens, 0).top_ids.shape == (4, 0)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(CloverError) as e:
            check_logprobs(bad)
        assert e.value.param == "logprobs"
