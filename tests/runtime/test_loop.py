"""Greedy identity: speculative output equals plain output token for token (tiny random models).

Every head type, several trees, and an oracle draft (the base's own greedy continuation) that makes
long accepted paths and so exercises KV compaction. A mismatch names the first diverging index and
the top-2 logit margin of the plain run there.
"""

import dataclasses

import numpy as np
import pytest
from helpers import OracleRunner, assert_identical, run_tokens, tiny_base, tiny_tokenizer_dir
from numerics import assert_close_paths, chain_reduction

from clover.errors import CloverError
from clover.models.head_io import random_heads
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import resolve_tree

PROMPTS = [[7, 8, 9, 10, 11], [40, 41, 3, 90, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def base():
    return tiny_base(seed=3)


@pytest.fixture(scope="module")
def plain(base):
    return {tuple(p): run_tokens(TorchRunner(base), p, resolve_tree("plain"), 40)[0] for p in PROMPTS}


@pytest.mark.parametrize(
    "arch,trees",
    [
        ("medusa", ["chain-1", "chain-4", "small", "mc26-d4"]),
        ("clover", ["chain-3", "mc26-d3", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"]),
        ("clover2", ["chain-1", "chain-6", "small", "mc26"]),
    ],
)
def test_greedy_identity_every_head_and_tree(base, plain, arch, trees):
    for seed in (0, 1):
        runner = TorchRunner(base, random_heads(base, arch, seed))
        for spec in trees:
            tree = prune(spec, runner.info.heads_max_depth)
            for p in PROMPTS:
                got, _ = run_tokens(runner, p, tree, 40)
                assert_identical(got, plain[tuple(p)], f"{arch} heads {seed} {spec}", TorchRunner(base), p)


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_dynamic_trees_are_identical_and_within_budget(base, plain, arch):
    """EAGLE-2-style trees drafted anew each step (loop.draft_dynamic): identical output, at most `budget` drafted
    nodes per step, and the verify-cost curve decides how many of them are worth their rows."""
    from clover.runtime.loop import Decoding, step
    from clover.runtime.sampling import SamplingParams
    from clover.runtime.tree import dynamic_tree

    runner = TorchRunner(base, random_heads(base, arch, 0))
    for spec in ("dynamic", "dynamic-5", "dynamic-8-w4", "dynamic-3-w1"):
        tree = dynamic_tree(spec, runner.info.heads_max_depth)
        for p in PROMPTS:
            got, steps = run_tokens(runner, p, tree, 40)
            assert_identical(got, plain[tuple(p)], f"{arch} {spec}", TorchRunner(base), p)
            assert max(steps) <= tree.max_depth + 1
    # The budget bounds the verified nodes; a dear cost curve verifies none of them (a plain step), a cheap one all.
    tree = dynamic_tree("dynamic-6", runner.info.heads_max_depth)
    for cost, nodes in (
        (None, {7}),
        (lambda rows: 1.0 if rows == 1 else 100.0 * rows, {1}),
        (lambda rows: 1.0, set(range(2, 8))),
    ):  # free rows: every node of non-zero probability
        slot = runner.open_slot(64)
        d = Decoding(
            slot=slot,
            prompt=np.array(PROMPTS[1]),
            tree=dataclasses.replace(tree, cost=cost),
            sampling=SamplingParams(),
            rng=np.random.default_rng(0),
        )
        step(runner, [d])  # the prefill
        st = step(runner, [d])[0]
        runner.release(slot)
        assert st.tree.num_nodes in nodes and st.tree.name == "dynamic-6", (cost, st.tree.num_nodes)


def prune(spec, depth):
    from clover.runtime.tree import compile_tree

    if spec.startswith("mc26-d"):
        d = int(spec.split("-d")[1])
        return compile_tree([c for c in resolve_tree("mc26").choices if len(c) <= d], spec)
    return resolve_tree(spec)


@pytest.mark.parametrize("tree", ["chain-4", "mc26", "small"])
def test_oracle_draft_accepts_long_paths_and_stays_identical(base, plain, tree):
    t = resolve_tree(tree)
    for p in PROMPTS:
        want = plain[tuple(p)]
        runner = OracleRunner(base, p + want)
        got, steps = run_tokens(runner, p, t, 40)
        assert_identical(got, want, f"oracle {tree}", TorchRunner(base), p)
        # every step but the last accepts the whole rank-0 chain: depth + bonus
        assert np.mean(steps) > 3, steps
        assert steps[0] == t.max_depth + 1


def test_kv_compaction_matches_sequential_cache(base):
    """After a step that accepts a non-contiguous path, the cache equals a plain run's cache."""
    prompt = PROMPTS[1]
    plain_runner = TorchRunner(base)
    want, _ = run_tokens(plain_runner, prompt, resolve_tree("plain"), 12)
    oracle = OracleRunner(base, prompt + want)
    run_tokens(oracle, prompt, resolve_tree("mc26"), 12)
    n = min(oracle.past_length, plain_runner.past_length)
    assert n > len(prompt) + 5
    for a, b in zip(oracle.cache[0] + oracle.cache[1], plain_runner.cache[0] + plain_runner.cache[1]):
        assert_close_paths(a[:, :, :n], b[:, :, :n], reduction=chain_reduction(base.config, context=n))


def test_sequence_near_context_end_falls_back_to_plain_steps():
    base = tiny_base(seed=3, max_context=40)
    runner = TorchRunner(base, random_heads(base, "clover2"))
    prompt = list(range(10, 30))
    out, _ = run_tokens(runner, prompt, resolve_tree("mc26"), 100)
    assert runner.past_length <= 40
    plain, _ = run_tokens(TorchRunner(base), prompt, resolve_tree("plain"), 100)
    # positions 0..39 fit the context; the token predicted at position 39 is the last one
    assert_identical(out, plain, "near the context end", TorchRunner(base), prompt)
    assert len(out) == 40 - len(prompt) + 1


# -- Generator-level behaviour ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def test_generator_rejects_bad_inputs(base, tokenizer):
    gen = Generator(TorchRunner(base), tokenizer)
    with pytest.raises(CloverError, match="prompt is empty"):
        gen.generate("   ")
    with pytest.raises(CloverError, match="prompt has 300 tokens but the model's context is 256"):
        gen.generate(" ".join(["w9"] * 300))
    with pytest.raises(CloverError, match="needs draft heads"):
        Generator(TorchRunner(base), tokenizer, tree="mc26")
    with pytest.raises(CloverError, match="tree mc26 has depth 5 but medusa heads draft at most 4"):
        Generator(TorchRunner(base, random_heads(base, "medusa")), tokenizer, tree="mc26")
    with pytest.raises(CloverError, match="malformed|parent|rank|prefix"):
        Generator(TorchRunner(base, random_heads(base, "clover2")), tokenizer, tree="[[1]]")


def test_max_new_tokens_is_exact_and_stats_are_consistent(base, tokenizer):
    gen = Generator(OracleRunner(base, []), tokenizer, tree="chain-4")
    plain = Generator(TorchRunner(base), tokenizer).generate(
        "w7 w8 w9", GenerationParams(max_new_tokens=200, ignore_eos=True)
    )
    for n in (1, 2, 5, 13):
        gen.runner.reference = tokenizer.encode("w7 w8 w9") + plain.token_ids
        r = gen.generate("w7 w8 w9", GenerationParams(max_new_tokens=n, ignore_eos=True))
        assert r.new_tokens == n and r.token_ids == plain.token_ids[:n] and r.finish_reason == "length"
        assert r.steps == len(r.accepted_per_step)


def test_eos_ends_generation_exactly(base, tokenizer, tmp_path):
    plain = Generator(TorchRunner(base), tokenizer).generate(
        "w7 w8 w9", GenerationParams(max_new_tokens=30, ignore_eos=True)
    )
    eos_at = 6
    eos = plain.token_ids[eos_at]
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path / "t", eos=eos))
    ref = tok.encode("w7 w8 w9") + plain.token_ids
    first = plain.token_ids.index(eos)
    for runner in (TorchRunner(base), OracleRunner(base, ref)):
        r = Generator(runner, tok, tree="chain-4" if runner.info.heads else None).generate(
            "w7 w8 w9", GenerationParams(max_new_tokens=30)
        )
        assert r.finish_reason == "stop"
        assert r.token_ids == plain.token_ids[: first + 1]
        assert f"w{eos}" not in r.text.split()


def test_stop_string_cuts_text_and_stream_never_shows_it(base, tokenizer):
    plain = Generator(TorchRunner(base), tokenizer).generate(
        "w7 w8 w9", GenerationParams(max_new_tokens=30, ignore_eos=True)
    )
    words = plain.text.split()
    stop = " ".join(words[4:6])
    ref = tokenizer.encode("w7 w8 w9") + plain.token_ids
    gen = Generator(OracleRunner(base, ref), tokenizer, tree="mc26")
    stream = gen.stream("w7 w8 w9", GenerationParams(max_new_tokens=30, stop=[stop], ignore_eos=True))
    deltas = list(stream)
    r = stream.result
    assert r.finish_reason == "stop"
    assert "".join(deltas) == r.text
    assert stop not in r.text and plain.text.startswith(r.text)
    assert r.text == plain.text[: plain.text.index(stop)]


# -- logits processors and log-probabilities ---------------------------------------------------------------------

# Strong enough that the tiny base's repeated token changes every few tokens (a switch inside a verified path is
# where a row's own-path history matters), for prompts whose plain greedy output is one repeated token.
PENALTIES = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)


@pytest.fixture(scope="module")
def penalised(base, tokenizer):
    """Plain greedy decoding with PENALTIES (and log-probabilities, 5 alternatives) of each prompt."""
    gen = Generator(TorchRunner(base), tokenizer, "plain")
    return {
        tuple(p): gen.generate(p, GenerationParams(max_new_tokens=40, sampling=PENALTIES, ignore_eos=True, logprobs=5))
        for p in PROMPTS
    }


def assert_logprobs_close(got, want, base, what):
    """Same tokens, log-probabilities and alternatives within the paths' tolerance (tests/numerics.py)."""
    assert [e.token_id for e in got] == [e.token_id for e in want], what
    reduction = chain_reduction(base.config, context=len(PROMPTS[1]) + len(want))
    assert_close_paths([e.logprob for e in got], [e.logprob for e in want], reduction=reduction, msg=what)
    assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want], what
    assert_close_paths([[v for _, v in e.top] for e in got], [[v for _, v in e.top] for e in want], reduction=reduction)


@pytest.mark.parametrize(
    "arch,trees",
    [("medusa", ["chain-4", "small"]), ("clover", ["mc26-d3"]), ("clover2", ["chain-6", "mc26", "dynamic-6"])],
)
def test_greedy_identity_with_penalties_every_head_and_tree(base, tokenizer, penalised, arch, trees):
    """Each row of a verified tree is penalised with its own path's history, so speculative greedy equals plain
    greedy with the same penalties, token for token; and the log-probabilities are plain decoding's."""
    from clover.runtime.tree import dynamic_tree

    runner = TorchRunner(base, random_heads(base, arch, 0))
    for spec in trees:
        tree = dynamic_tree(spec, runner.info.heads_max_depth) if spec.startswith("dynamic") else prune(spec, 5)
        gen = Generator(runner, tokenizer, tree)
        for p in PROMPTS:
            want = penalised[tuple(p)]
            got = gen.generate(p, GenerationParams(max_new_tokens=40, sampling=PENALTIES, ignore_eos=True, logprobs=5))
            assert_identical(got.token_ids, want.token_ids, f"{arch} {spec} with penalties")
            assert_logprobs_close(got.logprobs, want.logprobs, base, f"{arch} {spec}")
            if not spec.startswith("dynamic"):  # a dynamic tree's size follows measured timings
                assert got.tokens_per_step > 1.2, (arch, spec, got.accepted_per_step)  # speculation did its part


def test_penalties_change_the_output_and_oracle_paths_stay_identical(base, tokenizer, plain, penalised):
    """The penalties do change the output (the test above is not vacuous), and drafts that are plain decoding's
    own penalised continuation are accepted whole: long paths whose rows each need their own path's counts."""
    for p in PROMPTS:
        want = penalised[tuple(p)].token_ids
        assert want != plain[tuple(p)] and len(set(want)) >= 4, want
        for tree in ("chain-4", "mc26"):
            runner = OracleRunner(base, p + want)
            got = Generator(runner, tokenizer, tree).generate(
                p, GenerationParams(max_new_tokens=40, sampling=PENALTIES, ignore_eos=True)
            )
            assert_identical(got.token_ids, want, f"oracle {tree} with penalties")
            assert got.tokens_per_step > 3, got.accepted_per_step


@pytest.mark.parametrize("tree", ["chain-4", "chain-12"])
def test_lookup_drafts_with_penalties_are_identical(base, tokenizer, penalised, tree):
    gen = Generator(TorchRunner(base), tokenizer, tree, drafts="lookup")
    for p in PROMPTS:
        got = gen.generate(p, GenerationParams(max_new_tokens=40, sampling=PENALTIES, ignore_eos=True, logprobs=5))
        assert_identical(got.token_ids, penalised[tuple(p)].token_ids, f"lookup {tree} with penalties")
        assert_logprobs_close(got.logprobs, penalised[tuple(p)].logprobs, base, f"lookup {tree}")


def test_logprobs_are_the_raw_distribution_and_plain_decodings(base, tokenizer, penalised):
    """Without processors the greedy token is each row's top-1 and its log-probability the top-1's; alternatives
    are sorted. With penalties they stay the raw (unpenalised) distribution's: the chosen token is sometimes not
    the raw top-1. Speculative log-probabilities equal plain decoding's within the paths' tolerance."""
    plain_gen = Generator(TorchRunner(base), tokenizer, "plain")
    spec_gen = Generator(TorchRunner(base, random_heads(base, "clover2", 0)), tokenizer, "mc26")
    for p in PROMPTS:
        want = plain_gen.generate(p, GenerationParams(max_new_tokens=20, ignore_eos=True, logprobs=20))
        got = spec_gen.generate(p, GenerationParams(max_new_tokens=20, ignore_eos=True, logprobs=20))
        assert_identical(got.token_ids, want.token_ids, "logprobs run")
        assert_logprobs_close(got.logprobs, want.logprobs, base, "mc26 logprobs")
        for e in got.logprobs:
            values = [v for _, v in e.top]
            assert len(e.top) == 20 and values == sorted(values, reverse=True) and values[0] <= 0
            assert e.top[0] == (e.token_id, e.logprob)
        assert (
            Generator(TorchRunner(base), tokenizer, "plain").generate(p, GenerationParams(max_new_tokens=5)).logprobs
            is None
        )
    penalised_tokens = [e for r in penalised.values() for e in r.logprobs]
    assert any(e.top[0][0] != e.token_id for e in penalised_tokens)  # the raw top-1 was penalised away
    assert all(any(t == e.token_id for t, _ in e.top) or e.logprob <= e.top[-1][1] for e in penalised_tokens)


def test_min_tokens_logit_bias_and_stop_token_ids_are_exact_under_speculation(base, tokenizer, penalised):
    """logit_bias 100 on EOS (token 1) forces it as soon as min_tokens allows; stop_token_ids end the output at
    their first occurrence (kept in token_ids, like EOS); speculative equals plain in each case."""
    spec = Generator(TorchRunner(base, random_heads(base, "clover2", 0)), tokenizer, "mc26")
    plain_gen = Generator(TorchRunner(base), tokenizer, "plain")
    p = PROMPTS[1]
    for min_tokens in (0, 1, 7):
        sp = SamplingParams(logit_bias={1: 100.0}, min_tokens=min_tokens)
        for gen in (plain_gen, spec):
            r = gen.generate(p, GenerationParams(max_new_tokens=30, sampling=sp))
            assert r.token_ids[-1] == 1 and len(r.token_ids) == min_tokens + 1 and r.finish_reason == "stop"
    want = penalised[tuple(p)].token_ids
    stop_at = next(i for i, t in enumerate(want) if t != want[0])  # the first token that differs from the first
    for sp, end in ((PENALTIES, stop_at + 1), (dataclasses.replace(PENALTIES, min_tokens=stop_at + 3), None)):
        got = [
            g.generate(
                p, GenerationParams(max_new_tokens=40, sampling=sp, ignore_eos=True, stop_token_ids=[want[stop_at]])
            )
            for g in (plain_gen, spec)
        ]
        assert_identical(got[1].token_ids, got[0].token_ids, "stop_token_ids")
        if end is not None:
            assert got[0].token_ids == want[:end] and got[0].finish_reason == "stop"
        else:  # min_tokens masked the stop id past its first place: a different continuation, ended later
            assert len(got[0].token_ids) > stop_at + 2 and got[0].token_ids[: stop_at + 3].count(want[stop_at]) == 0


def test_allowed_token_ids_are_exact_under_speculation(base, tokenizer):
    """Only the allowed tokens come out, greedy speculative equal to greedy plain, with the heads drafting others."""
    allowed = tuple(range(10, 60, 2))
    sp = SamplingParams(allowed_token_ids=allowed)
    plain = Generator(TorchRunner(base), tokenizer, "plain")
    spec = Generator(TorchRunner(base, random_heads(base, "clover2", 0)), tokenizer, "mc26")
    for p in PROMPTS[:2]:
        got = [g.generate(p, GenerationParams(max_new_tokens=24, sampling=sp)) for g in (plain, spec)]
        assert_identical(got[1].token_ids, got[0].token_ids, "allowed_token_ids")
        assert set(got[0].token_ids) <= set(allowed) and len(got[0].token_ids) == 24


def test_bad_words_are_exact_under_speculation(base, tokenizer):
    """bad_words (token sequences): greedy speculative equals greedy plain, and no banned sequence is generated;
    the words are taken from the plain answer, so each one changes it."""
    plain = Generator(TorchRunner(base), tokenizer, "plain")
    spec = Generator(TorchRunner(base, random_heads(base, "clover2", 0)), tokenizer, "mc26")
    params = GenerationParams(max_new_tokens=24, ignore_eos=True)
    free = plain.generate(PROMPTS[0], params).token_ids
    words = ((free[2],), tuple(free[5:7]), tuple(free[9:12]))
    sp = SamplingParams(bad_words=words)
    got = [g.generate(PROMPTS[0], dataclasses.replace(params, sampling=sp)) for g in (plain, spec)]
    assert_identical(got[1].token_ids, got[0].token_ids, "bad_words")
    out = got[0].token_ids
    assert out != free
    for w in words:
        assert not any(tuple(out[i : i + len(w)]) == w for i in range(len(out))), (w, out)


def test_seeded_sampling_with_penalties_is_reproducible(base, tokenizer):
    gen = Generator(TorchRunner(base, random_heads(base, "clover2", 0)), tokenizer, "mc26")
    sp = dataclasses.replace(PENALTIES, temperature=0.9, top_p=0.95, seed=11, logit_bias={5: 3.0})
    runs = [
        gen.generate(PROMPTS[0], GenerationParams(max_new_tokens=24, sampling=sp, ignore_eos=True)).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_bad_options_name_their_param(base, tokenizer):
    gen = Generator(TorchRunner(base), tokenizer, "plain")
    for kwargs, param in (
        ({"stop_token_ids": [96]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"sampling": SamplingParams(logit_bias={96: 1.0})}, "logit_bias"),
        ({"sampling": SamplingParams(min_tokens=9)}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ):
        with pytest.raises(CloverError) as e:
            gen.generate(PROMPTS[0], GenerationParams(max_new_tokens=8, **kwargs))
        assert e.value.param == param, (kwargs, str(e.value))
