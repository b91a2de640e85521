"""Structured output (clover.runtime.grammar): speculative decoding under a grammar equals plain constrained
decoding token for token, for every head type, tree, draft source and concurrency; outputs match their grammar;
drafts the grammar forbids are pruned before the verify; bad grammars fail alone with a clear error.

The reference is computed here, independently of the loop: plain base forwards one token at a time, each row
masked with llguidance's own bitmask of a matcher fed the tokens so far, argmax. The tiny model runs with a
character tokenizer (tests/helpers.py): grammars need a vocabulary that can spell any text."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest
from helpers import OracleRunner, assert_identical, char_tokenizer_dir, tiny_base

from clover.errors import CloverError
from clover.models.head_io import random_heads
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.grammar import Grammar, GrammarCompiler, GrammarState, PathMasks
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import dynamic_tree, resolve_tree

pytest.importorskip("llguidance")

N = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ab", "cd", "efg"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-e]{2,4}( [a-e]{1,3}){1,4}\."
GRAMMARS = {
    "json_schema": Grammar.json_schema(SCHEMA),
    "json_object": Grammar.json_object(),
    "regex": Grammar.regex(REGEX),
    "choice": Grammar.choice(["alpha", "beta", "gamma delta"]),
    "lark": Grammar.lark('start: item ("," item)* "!"\nitem: "ab" | "c" | /[0-9]/'),
}
PROMPTS = ["hi there", "say {json}: "]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(char_tokenizer_dir(tmp_path_factory.mktemp("chars")))


@pytest.fixture(scope="module")
def base():
    return tiny_base(seed=3)


def constrained_reference(runner, compiler, tok, grammar: Grammar, prompt: str, n: int) -> list[int]:
    """Plain constrained greedy decoding, step by step: llguidance's bitmask of the tokens so far, argmax."""
    matcher = compiler.state(grammar).matcher
    ids = np.array(tok.encode(prompt), dtype=np.int64)
    slot = runner.open_slot(len(ids) + n + 1)
    out: list[int] = []
    try:
        logits = runner.forward(ids, np.arange(len(ids)), np.tri(len(ids), dtype=bool), last_only=True, slot=slot)[-1]
        for _ in range(n):
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: runner.info.vocab_size].astype(bool)
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            out.append(token)
            if token in tok.eos_token_ids:
                break
            assert matcher.consume_token(token)
            seq = np.append(ids, out)  # each pending row's next token
            runner.commit(np.arange(slot.pending), seq[len(seq) - slot.pending :], slot=slot)
            logits = runner.forward(np.array([token]), np.zeros(1, np.int64), np.ones((1, 1), bool), slot=slot)[0]
    finally:
        runner.release(slot)
    return out


@pytest.fixture(scope="module")
def reference(base, tok):
    compiler = GrammarCompiler(tok, base.config.vocab_size)
    return {
        (name, p): constrained_reference(TorchRunner(base), compiler, tok, g, p, N)
        for name, g in GRAMMARS.items()
        for p in PROMPTS
    }


def check_output(name: str, text: str, finish: str) -> None:
    """A finished output matches its grammar whole (one cut by max_tokens is a prefix of one that does)."""
    if finish != "stop":
        return
    if name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in ("alpha", "beta", "gamma delta"), text
    elif name == "lark":
        assert re.fullmatch(r"(ab|c|[0-9])(,(ab|c|[0-9]))*!", text), text


def test_plain_constrained_decoding_equals_the_reference_and_matches_the_grammar(base, tok, reference):
    gen = Generator(TorchRunner(base), tok, "plain")
    finished = 0
    for name, g in GRAMMARS.items():
        for p in PROMPTS:
            r = gen.generate(p, GenerationParams(max_new_tokens=N, grammar=g))
            want = reference[(name, p)]
            assert_identical(r.token_ids, want, f"plain {name} {p!r}")
            check_output(name, r.text, r.finish_reason)
            finished += r.finish_reason == "stop"
    assert finished >= 6, "too few outputs finished: the validity checks prove little"


def token_checks_equal_masks(compiler: GrammarCompiler, grammar: Grammar, tokens: list[int], eos: list[int]) -> int:
    """At every state along `tokens`, PathMasks.permits_token agrees with the mask for every token of the
    vocabulary, and PathMasks.best is the masked argmax; returns the states checked."""
    state = compiler.state(grammar)
    state.ends = frozenset(eos)
    masks = PathMasks(state)
    # the end tokens last: a check that needs the mask keeps it, and every later check would read it
    order = np.concatenate([np.setdiff1d(np.arange(state.vocab_size), eos), eos])
    rng = np.random.default_rng(0)
    states = 0
    for k in range(len(tokens) + 1):
        path = tuple(tokens[:k])
        if path and path[-1] in eos:
            break
        want = masks.allowed(path)[order]
        checks = PathMasks(state)  # apart from `masks`, whose mask a check would read
        got = np.array([checks.permits_token(path, int(t)) for t in order])
        assert (got == want).all(), (path, order[got != want][:10])
        for logits in rng.integers(0, 3, (2, state.vocab_size)).astype(np.float32):  # ties: the lowest id
            best = PathMasks(state).best(path, logits)
            assert best == np.argmax(np.where(masks.allowed(path), logits, -np.inf)), path
        states += 1
    return states


def test_a_token_check_equals_the_mask(base, tok, reference):
    """A greedy verify asks the grammar whether it allows a row's argmax, mostly without its mask (one token
    checked by the parser): the answer must be the mask's, for every token, in every state plain constrained
    decoding goes through (end tokens and accepting states included)."""
    compiler = GrammarCompiler(tok, base.config.vocab_size)
    states = sum(
        token_checks_equal_masks(compiler, GRAMMARS[name], out, tok.eos_token_ids)
        for (name, _), out in reference.items()
    )
    assert states > 100


def test_a_token_check_equals_the_mask_on_smollm2s_vocabulary(smollm2_path):
    """The same on a real vocabulary (49,152 tokens with multi-character and space-led ones), along answers to a
    JSON schema and a regex."""
    real = Tokenizer.from_dir(smollm2_path)
    compiler = GrammarCompiler(real, 49152)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "year": {"type": "integer"}, "tags": {"type": "array"}},
        "required": ["name", "year"],
    }
    nested = {  # keys forced in turn (additionalProperties false, all required), as in benchmarks/structured.py
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "occupations": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "occupations"],
                "additionalProperties": False,
            },
            "field": {"enum": ["mathematics", "physics"]},
            "famous": {"type": "boolean"},
        },
        "required": ["person", "field", "famous"],
        "additionalProperties": False,
    }
    cases = [
        (Grammar.json_schema(schema), '{"name": "Ada Lovelace", "year": 1815, "tags": ["math", 2]}'),
        # forced keys ("occupations" is forced as "occup" + "ations": the mask allows only that spelling)
        (
            Grammar.json_schema(nested),
            '{"person": {"name": "Ada", "occupations": ["poet", "analyst"]}, "field": "mathematics", "famous": true}',
        ),
        (Grammar.regex(r"(yes|no), because [a-z ]+\."), "yes, because it is."),
    ]
    eos = real.eos_token_ids
    assert sum(token_checks_equal_masks(compiler, g, [*real.encode(text), eos[0]], list(eos)) for g, text in cases) > 20


class Finished:
    """A matcher whose mask allows nothing (llguidance stops so where a grammar ends without an end token)."""

    def unsafe_compute_mask_ptr(self, address: int, size: int) -> None:
        pass  # the mask stays all zeros

    def is_accepting(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return False

    def compute_ff_bytes(self) -> bytes:
        return b""

    def validate_tokens(self, tokens: list[int]) -> int:
        return 0


def test_a_state_that_allows_nothing_allows_the_end():
    """An empty mask lets the request end: the end-of-sequence tokens are allowed there, by the mask and by the
    token check."""
    masks = PathMasks(GrammarState(Finished(), 70, "json_object", [3, 65]))
    assert np.flatnonzero(masks.allowed(())).tolist() == [3, 65]
    assert [t for t in range(70) if masks.permits_token((), t)] == [3, 65]
    fresh = PathMasks(GrammarState(Finished(), 70, "json_object", [3, 65]))  # the check before any mask
    assert [fresh.permits_token((), t) for t in (5, 3, 64, 65)] == [False, True, False, True]


def test_an_end_the_grammar_allows_alone_is_emitted_without_a_forward(base, tok):
    """After "ab" the grammar allows only the end: plain constrained decoding would run one more forward to pick
    it from a one-token mask, the loop emits it at once (not with logprobs, which want that forward's row)."""
    runner = TorchRunner(base)
    forwards = []
    real = runner.forward_batch
    runner.forward_batch = lambda *a, **k: forwards.append(1) or real(*a, **k)
    gen = Generator(runner, tok, "plain")
    grammar = Grammar.choice(["ab"])
    r = gen.generate("hi there", GenerationParams(max_new_tokens=N, grammar=grammar))
    assert (r.text, r.finish_reason, r.token_ids[-1]) == ("ab", "stop", tok.eos_token_ids[0])
    assert (len(forwards), r.steps, r.tokens_per_step) == (2, 1, 1.0)  # the prefill and "b"'s step
    forwards.clear()
    with_logprobs = gen.generate("hi there", GenerationParams(max_new_tokens=N, grammar=grammar, logprobs=0))
    assert (with_logprobs.token_ids, len(forwards)) == (r.token_ids, 3)
    forwards.clear()
    ignored = gen.generate("hi there", GenerationParams(max_new_tokens=5, grammar=grammar, ignore_eos=True))
    assert (ignored.token_ids[2:], ignored.finish_reason, len(forwards)) == ([tok.eos_token_ids[0]] * 3, "length", 5)


@pytest.mark.parametrize(
    "arch,trees",
    [
        ("medusa", ["chain-4", "small"]),
        ("clover", ["[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]", "chain-3"]),
        ("clover2", ["chain-6", "mc26", "dynamic-8"]),
    ],
)
def test_greedy_identity_with_a_grammar_every_head_and_tree(base, tok, reference, arch, trees):
    """Drafts come from the heads' logits masked by each node's grammar state, every verify row is masked by its
    own path's state: speculative output is plain constrained decoding's, token for token."""
    runner = TorchRunner(base, random_heads(base, arch, 0))
    for spec in trees:
        tree = dynamic_tree(spec, runner.info.heads_max_depth) if spec.startswith("dynamic") else resolve_tree(spec)
        gen = Generator(runner, tok, tree)
        for name, g in GRAMMARS.items():
            for p in PROMPTS:
                r = gen.generate(p, GenerationParams(max_new_tokens=N, grammar=g))
                want = reference[(name, p)]
                assert_identical(r.token_ids, want, f"{arch} {spec} {name} {p!r}")
                check_output(name, r.text, r.finish_reason)


def test_a_forced_chain_deeper_than_the_trees_under_tree_auto(base, tok):
    """A schema whose forced text (a long key) is drafted as a chain deeper than any tree the auto policy chooses:
    its statistics count only the depths they hold, and the output is plain constrained decoding's."""
    schema = {
        "type": "object",
        "properties": {"a_rather_long_key_name_here": {"type": "boolean"}},
        "required": ["a_rather_long_key_name_here"],
        "additionalProperties": False,
    }
    grammar = Grammar.json_schema(schema)
    want = constrained_reference(
        TorchRunner(base), GrammarCompiler(tok, base.config.vocab_size), tok, grammar, PROMPTS[0], N
    )
    for drafts in ("heads", "lookup"):
        runner = TorchRunner(base, random_heads(base, "clover2", 0) if drafts == "heads" else None)
        gen = Generator(runner, tok, "auto", drafts=drafts)
        r = gen.generate(PROMPTS[0], GenerationParams(max_new_tokens=N, grammar=grammar))
        assert_identical(r.token_ids, want, f"{drafts} auto")
        assert max(r.accepted_per_step) > 10, r.accepted_per_step  # the forced chain, accepted whole


@pytest.mark.parametrize("drafts,tree", [("lookup", "chain-8"), ("heads+lookup", "small")])
def test_lookup_drafts_the_grammar_forbids_are_pruned(base, tok, reference, drafts, tree):
    """Prompt-lookup proposals are not masked when drafted: the ones the grammar forbids leave the tree before the
    verify (counted), and the output stays plain constrained decoding's."""
    runner = TorchRunner(base, random_heads(base, "clover2", 0) if drafts != "lookup" else None)
    gen = Generator(runner, tok, tree, drafts=drafts)
    pruned = 0
    for name, g in GRAMMARS.items():
        for p in PROMPTS:
            r = gen.generate(p, GenerationParams(max_new_tokens=N, grammar=g))
            assert_identical(r.token_ids, reference[(name, p)], name)
            pruned += r.pruned_tokens
    assert pruned > 0, "no lookup draft was pruned: the test proves nothing"


def test_oracle_drafts_are_accepted_whole_under_a_grammar(base, tok, reference):
    """Drafts that are plain constrained decoding's own continuation pass every mask on their paths and are
    accepted whole: long paths whose rows each need their own path's grammar state."""
    for name in ("json_schema", "regex"):
        p = PROMPTS[1]
        want = reference[(name, p)]
        runner = OracleRunner(base, tok.encode(p) + want)
        r = Generator(runner, tok, "mc26").generate(p, GenerationParams(max_new_tokens=N, grammar=GRAMMARS[name]))
        assert_identical(r.token_ids, want, f"oracle {name}")
        assert r.tokens_per_step > 3, r.accepted_per_step


def test_grammar_with_penalties_and_logprobs_equals_plain(base, tok):
    """A grammar after penalties and a logit bias: still plain's tokens; log-probabilities stay the raw base
    distribution (the same for both)."""
    sampling = SamplingParams(presence_penalty=1.0, repetition_penalty=1.3, logit_bias={70: 3.0})
    plain = Generator(TorchRunner(base), tok, "plain")
    spec = Generator(TorchRunner(base, random_heads(base, "clover2", 1)), tok, "mc26")
    for name in ("json_object", "regex"):
        want = plain.generate(
            PROMPTS[0], GenerationParams(max_new_tokens=N, grammar=GRAMMARS[name], sampling=sampling, logprobs=2)
        )
        got = spec.generate(
            PROMPTS[0], GenerationParams(max_new_tokens=N, grammar=GRAMMARS[name], sampling=sampling, logprobs=2)
        )
        assert_identical(got.token_ids, want.token_ids, name)
        assert [e.token_id for e in got.logprobs] == got.token_ids
        np.testing.assert_allclose([e.logprob for e in got.logprobs], [e.logprob for e in want.logprobs], atol=1e-4)


def test_seeded_sampling_under_a_grammar_is_reproducible_and_matches(base, tok):
    runner = TorchRunner(base, random_heads(base, "clover2", 0))
    gen = Generator(runner, tok, "mc26")
    for name in ("json_schema", "regex", "lark"):
        outs = [
            gen.generate(
                PROMPTS[0],
                GenerationParams(max_new_tokens=N, grammar=GRAMMARS[name], sampling=SamplingParams(0.9, 0.95, 7)),
            )
            for _ in range(2)
        ]
        assert outs[0].token_ids == outs[1].token_ids
        check_output(name, outs[0].text, outs[0].finish_reason)


@pytest.mark.parametrize(
    "grammar,says",
    [
        (Grammar.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "not valid"),
        (Grammar.json_schema([1, 2]), "must be an object"),
        (Grammar.regex("(unclosed"), "not valid"),
        (Grammar.lark("start: missing_rule"), "not valid"),
        (Grammar.choice([]), "non-empty list"),
        (Grammar("xml"), "unknown grammar kind"),
    ],
)
def test_a_bad_grammar_fails_at_submission_naming_its_param(base, tok, grammar, says):
    gen = Generator(TorchRunner(base), tok, "plain")
    with pytest.raises(CloverError, match=says) as err:
        gen.stream("hi", GenerationParams(grammar=grammar))
    assert err.value.param == "grammar"


def test_min_tokens_with_a_grammar_is_refused(base, tok):
    with pytest.raises(CloverError, match="min_tokens cannot be combined") as err:
        Generator(TorchRunner(base), tok).stream(
            "hi", GenerationParams(grammar=Grammar.json_object(), sampling=SamplingParams(min_tokens=3))
        )
    assert err.value.param == "min_tokens"


def test_without_llguidance_the_error_names_the_extra(base, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    gen = Generator(TorchRunner(base), tok, "plain")
    with pytest.raises(CloverError, match=r"clover-deploy\[structured\]"):
        gen.stream("hi", GenerationParams(grammar=Grammar.regex("a+")))
    assert (
        gen.generate("hi", GenerationParams(max_new_tokens=3)).new_tokens == 3
    )  # requests without a grammar need nothing


# -- the stacked runner: each tree row masked on the device ----------------------------------------------------


def counting(runner):
    """The runner, with the sequences of each of its device-side steps counted in runner.calls."""
    runner.calls, decode = [], runner.decode_async
    runner.decode_async = lambda slots, tree, *args: runner.calls.append(len(slots)) or decode(slots, tree, *args)
    return runner


@pytest.mark.parametrize("arch,spec", [("clover2", "mc26"), ("medusa", "small"), ("clover", "chain-3")])
def test_greedy_identity_with_a_grammar_on_the_device(base, tok, reference, arch, spec):
    """The stacked runner's device step under a grammar: drafted on the device, the drafted paths' masks computed on
    the host (the same PathMasks) and packed, every row masked on the device after its processors, accepted and
    committed there. Plain constrained decoding's tokens, with overlap on and off; the engine at concurrency 4
    with grammars mixed with none, and with one asking for log-probabilities."""
    from clover.runtime.backends.torch_batch import BatchedTorchRunner
    from clover.runtime.engine import Engine

    runner = counting(BatchedTorchRunner(base, random_heads(base, arch, 0)))
    for overlap in (False, True):
        gen = Generator(runner, tok, spec, overlap=overlap)
        for name, g in GRAMMARS.items():
            for p in PROMPTS:
                r = gen.generate(p, GenerationParams(max_new_tokens=N, grammar=g))
                assert_identical(r.token_ids, reference[(name, p)], f"{arch} {spec} {name} {p!r} overlap {overlap}")
                check_output(name, r.text, r.finish_reason)
    assert runner.calls, "no step ran on the device"
    runner.calls.clear()
    mixed = [(name, p) for name in ["json_schema", "regex", None, "lark"] for p in PROMPTS]
    with Engine(runner, tok, spec, log=None, options=EngineOptions(max_batch=4)) as engine:
        streams = [
            engine.stream(
                p,
                GenerationParams(
                    max_new_tokens=N, grammar=GRAMMARS.get(name) if name else None, logprobs=2 if k == 1 else None
                ),
            )
            for k, (name, p) in enumerate(mixed)
        ]
        for (name, p), s in zip(mixed, streams):
            r = s.wait()
            if name is not None:
                assert_identical(r.token_ids, reference[(name, p)], f"engine {arch} {spec} {name} {p!r}")
    assert max(runner.calls) > 1, runner.calls  # grammars and none in one device step


def test_unseeded_sampling_with_a_grammar_on_the_device_matches_it(base, tok):
    """Sampling on the device under a grammar (rejection sampling against each row's masked, tempered law): every
    finished output matches its grammar."""
    from clover.runtime.backends.torch_batch import BatchedTorchRunner

    runner = counting(BatchedTorchRunner(base, random_heads(base, "clover2", 0)))
    runner.generator.manual_seed(5)
    gen = Generator(runner, tok, "mc26")
    finished = 0
    for name, g in GRAMMARS.items():
        for i in range(3):
            r = gen.generate(
                PROMPTS[i % 2], GenerationParams(max_new_tokens=N, grammar=g, sampling=SamplingParams(0.9, 0.95))
            )
            check_output(name, r.text, r.finish_reason)
            finished += r.finish_reason == "stop"
    assert runner.calls and finished >= 5, (runner.calls, finished)


# -- the engine: concurrent requests, each with its own grammar or none -------------------------------------------

# (grammar name or None, prompt): requests of one batch, mixed
MIXED = [(name, p) for name in [*GRAMMARS, None] for p in PROMPTS]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    from ort_helpers import tiny_artifact

    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")


@pytest.mark.parametrize("tree", ["mc26", "auto"])
def test_engine_concurrent_requests_with_mixed_grammars_equal_solo_plain(fused, tok, tree):
    """The serving path (ONNX Runtime, fused attention, batched steps): requests with different grammars and
    without one, at concurrency 1 and 8, each equal solo plain constrained decoding on the same graphs."""
    from clover.runtime.backends.ort import load_runner
    from clover.runtime.engine import Engine

    plain = Generator(load_runner(fused), tok, "plain")
    want = [
        plain.generate(p, GenerationParams(max_new_tokens=N, grammar=GRAMMARS.get(name))).token_ids if name else None
        for name, p in MIXED
    ]
    with Engine(load_runner(fused), tok, tree, log=None, options=EngineOptions(max_batch=8)) as engine:
        for concurrency in (1, 8):
            for start in range(0, len(MIXED), concurrency):
                chunk = MIXED[start : start + concurrency]
                streams = [
                    engine.stream(p, GenerationParams(max_new_tokens=N, grammar=GRAMMARS.get(name) if name else None))
                    for name, p in chunk
                ]
                for k, s in enumerate(streams):
                    r = s.wait()
                    name, p = chunk[k]
                    if name is None:
                        assert r.pruned_tokens == 0
                        continue
                    assert_identical(r.token_ids, want[start + k], f"{tree} concurrency {concurrency} {name} {p!r}")
                    check_output(name, r.text, r.finish_reason)


def test_engine_seeded_sampling_with_a_grammar_is_reproducible_alone_and_in_a_batch(fused, tok):
    from clover.runtime.backends.ort import load_runner
    from clover.runtime.engine import Engine

    sampling = SamplingParams(0.8, 0.95, 11)
    with Engine(load_runner(fused), tok, "mc26", log=None, options=EngineOptions(max_batch=4)) as engine:
        alone = engine.generate(
            PROMPTS[1], GenerationParams(max_new_tokens=N, sampling=sampling, grammar=GRAMMARS["json_schema"])
        )
        others = [
            engine.stream(
                PROMPTS[0],
                GenerationParams(max_new_tokens=N, sampling=SamplingParams(0.9, 1.0, i), grammar=GRAMMARS[name]),
            )
            for i, name in enumerate(("regex", "lark", "json_object"))
        ]
        mixed = engine.stream(
            PROMPTS[1], GenerationParams(max_new_tokens=N, sampling=sampling, grammar=GRAMMARS["json_schema"])
        )
        assert mixed.wait().token_ids == alone.token_ids
        for s, name in zip(others, ("regex", "lark", "json_object")):
            r = s.wait()
            check_output(name, r.text, r.finish_reason)
        check_output("json_schema", alone.text, alone.finish_reason)


def test_engine_refuses_a_bad_grammar_alone(fused, tok):
    from clover.runtime.backends.ort import load_runner
    from clover.runtime.engine import Engine

    with Engine(load_runner(fused), tok, "mc26", log=None, options=EngineOptions(max_batch=4)) as engine:
        good = engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=N, grammar=GRAMMARS["regex"]))
        with pytest.raises(CloverError, match="not valid") as err:
            engine.stream(PROMPTS[0], GenerationParams(grammar=Grammar.regex("(unclosed")))
        assert err.value.param == "grammar"
        check_output("regex", good.wait().text, "stop")
        assert engine.alive
