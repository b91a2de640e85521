"""clover.Engine: batched, thread-safe generation. Every request's greedy tokens equal its own solo plain
decoding, at any concurrency, with requests joining and leaving mid-batch."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import threading
import time

import numpy as np
import pytest
from helpers import POISON, Faulty, assert_identical, rss_bytes, tiny_config
from numerics import assert_close_paths, chain_reduction
from ort_helpers import tiny_artifact, tiny_modules

from clover.errors import CloverError
from clover.runtime.backends.ort import OrtOptions, load_runner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.engine import Cancelled, Engine, EngineStream, EngineUnavailable, QueueFull
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer

ARCHS = ("medusa", "clover", "clover2")
# 16 prompts of different lengths, each with its own length budget: requests end at different steps
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(6, 90, 3 + (5 * i) % 17)] for i in range(16)]
BUDGETS = [8 + (7 * i) % 23 for i in range(16)]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {arch: tiny_artifact(root, arch) for arch in ARCHS}


def solo_plain(runner, tokenizer) -> list[list[int]]:
    gen = Generator(runner, tokenizer, "plain")
    return [
        gen.generate(p, GenerationParams(max_new_tokens=n, ignore_eos=True)).token_ids for p, n in zip(PROMPTS, BUDGETS)
    ]


def run_concurrently(engine: Engine, concurrency: int) -> list[list[int]]:
    """`concurrency` threads, each submitting its share of the prompts one after another."""
    out: list[list[int] | None] = [None] * len(PROMPTS)

    def worker(k: int) -> None:
        for i in range(k, len(PROMPTS), concurrency):
            out[i] = engine.generate(PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True)).token_ids

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads), "deadlock: a caller never got its result"
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_ort_engine_equals_solo_plain_at_any_concurrency(artifacts, arch):
    tok = Tokenizer.from_dir(artifacts[arch] / "tokenizer")
    want = solo_plain(load_runner(artifacts[arch], heads="none"), tok)
    trees = ("plain", "chain-2", "small", "auto", "dynamic-6") if arch == "clover2" else ("plain", "chain-2", "auto")
    for tree in trees:
        with Engine(load_runner(artifacts[arch]), tok, tree, log=None, options=EngineOptions(max_batch=4)) as engine:
            for concurrency in (1, 4, 16):
                got = run_concurrently(engine, concurrency)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert_identical(g, w, f"ort {arch} {tree} concurrency {concurrency} prompt {i}")
            assert engine.runner.open_slots == 0  # every slot freed


@pytest.mark.parametrize("weights", [None, "int4"])
def test_fused_batched_graph_engine_equals_solo_plain(tmp_path_factory, weights):
    """The batched base graph (one forward for every running sequence) gives each sequence the solo graph's
    tokens: fp32 with branching trees, int4 (int8 compute) with chains."""
    root = tmp_path_factory.getbasetemp()
    path = tiny_artifact(root, "clover2", tree="chain-3" if weights else None, weights=weights, attention="fused")
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)
    runner = load_runner(path, batch=True)
    assert runner.batch_slots == 8 and runner.info.batch_slots == 8
    calls = []
    run = runner.batch.run
    runner.batch.run = lambda inputs, sizes, into: (
        calls.append(sizes["new"]) or run(inputs, sizes, into)
    )  # rows per call
    for tree in ("plain", "chain-3", "auto") if weights else ("plain", "small", "mc26", "auto"):
        with Engine(runner, tok, tree, log=None, options=EngineOptions(max_batch=8)) as engine:
            for concurrency in (1, 4, 16):
                got = run_concurrently(engine, concurrency)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert_identical(g, w, f"fused {weights} {tree} concurrency {concurrency} prompt {i}")
        engine._thread.join()
        runner = load_runner(path, batch=True)
        run = runner.batch.run
        runner.batch.run = lambda inputs, sizes, into: calls.append(sizes["new"]) or run(inputs, sizes, into)
    assert calls and max(calls) > 8, "the batched graph never ran several sequences at once"


@pytest.mark.parametrize("attention,weights", [("portable", None), ("fused", None), ("fused", "int4")])
def test_chunked_prefill_equals_solo_plain(tmp_path_factory, attention, weights):
    """Prompts prefilled 5 rows per step, beside other sequences' decoding steps, give the same tokens as one
    solo prefill: each row's logits do not depend on how the prompt was split."""
    root = tmp_path_factory.getbasetemp()
    path = tiny_artifact(root, "clover2", tree="chain-3" if weights else None, weights=weights, attention=attention)
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)
    with Engine(
        load_runner(path, batch=True), tok, "chain-2", log=None, options=EngineOptions(max_batch=4, prefill_chunk=5)
    ) as engine:
        got = run_concurrently(engine, 6)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_identical(g, w, f"{attention} {weights} chunked prefill prompt {i}")


def test_torch_engine_equals_solo_plain(tmp_path):
    base, heads = tiny_modules("clover2")
    from helpers import tiny_tokenizer_dir

    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path / "tok"))
    want = solo_plain(TorchRunner(base), tok)
    with Engine(
        TorchRunner(base, heads, "random:clover2"), tok, "chain-3", log=None, options=EngineOptions(max_batch=4)
    ) as engine:
        got = run_concurrently(engine, 16)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_identical(g, w, f"torch clover2 chain-3 prompt {i}")


@pytest.mark.parametrize("tree", ["chain-3", "auto"])
def test_lookup_drafts_in_the_engine(artifacts, tree):
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    want = solo_plain(load_runner(artifacts["clover2"], heads="none"), tok)
    with Engine(
        load_runner(artifacts["clover2"], heads="none"),
        tok,
        tree,
        drafts="lookup",
        log=None,
        options=EngineOptions(max_batch=4),
    ) as engine:
        got = run_concurrently(engine, 8)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_identical(g, w, f"lookup {tree} prompt {i}")


def test_sampling_requests_are_reproducible_per_seed_at_any_batch(artifacts):
    """A seeded sampled request gives the same tokens alone and among others (its RNG is its own)."""
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    with Engine(
        load_runner(artifacts["clover2"]), tok, "chain-2", log=None, options=EngineOptions(max_batch=4)
    ) as engine:
        alone = engine.generate(
            PROMPTS[3], GenerationParams(max_new_tokens=20, sampling=sampling, ignore_eos=True)
        ).token_ids
        streams = [
            engine.stream(
                p, GenerationParams(max_new_tokens=20, sampling=SamplingParams(0.8, 0.95, seed=i), ignore_eos=True)
            )
            for i, p in enumerate(PROMPTS[:3])
        ]
        mixed = engine.stream(PROMPTS[3], GenerationParams(max_new_tokens=20, sampling=sampling, ignore_eos=True))
        assert mixed.wait().token_ids == alone
        for s in streams:
            s.wait()


def test_stream_sync_and_async_deltas_add_up(artifacts):
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    with Engine(
        load_runner(artifacts["clover2"]), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)
    ) as engine:
        want = engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=16, ignore_eos=True))
        stream = engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=16, ignore_eos=True))
        deltas = list(stream)
        assert "".join(d.text for d in deltas) == want.text == stream.result.text
        assert [t for d in deltas for t in d.token_ids] == want.token_ids

        async def main():
            outs = await asyncio.gather(
                *(engine.agenerate(p, GenerationParams(max_new_tokens=12, ignore_eos=True)) for p in PROMPTS[:6])
            )
            s = engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=16, ignore_eos=True))
            ids = [t async for d in s for t in d.token_ids]
            return outs, ids

        outs, ids = asyncio.run(main())
        assert ids == want.token_ids
        assert all(o.new_tokens == 12 for o in outs)


def test_cancel_frees_the_slot_and_the_engine_keeps_serving(artifacts):
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    with Engine(
        load_runner(artifacts["clover2"]), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)
    ) as engine:
        s = engine.stream(PROMPTS[1], GenerationParams(max_new_tokens=100, ignore_eos=True))
        next(iter(s))
        s.cancel()
        with pytest.raises(Cancelled):
            s.wait()
        assert engine.generate(PROMPTS[2], GenerationParams(max_new_tokens=5, ignore_eos=True)).new_tokens == 5
        assert engine.runner.open_slots == 0


def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(artifacts):
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    with pytest.raises(CloverError, match="max_batch"):
        Engine(load_runner(path), tok, log=None, options=EngineOptions(max_batch=0))
    with pytest.raises(CloverError, match="unknown tree|tree"):
        Engine(load_runner(path), tok, "no-such-tree", log=None)
    with Engine(
        load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=2, max_waiting=1)
    ) as engine:
        with pytest.raises(CloverError, match="context"):
            engine.generate(list(range(5, 90)) * 4, GenerationParams(max_new_tokens=4))
        with pytest.raises(CloverError, match="temperature"):
            engine.generate(PROMPTS[0], GenerationParams(sampling=SamplingParams(temperature=-1.0)))
        with pytest.raises(CloverError, match="max_new_tokens"):
            engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=0))
        streams = [engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=30, ignore_eos=True))]
        with pytest.raises(QueueFull):
            for _ in range(8):
                streams.append(engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=30, ignore_eos=True)))
        for s in streams:
            s.wait()
        assert engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=3, ignore_eos=True)).new_tokens == 3


def test_bad_token_ids_and_lengths_fail_alone_in_the_callers_thread(artifacts):
    """Checked before the engine sees them: ids outside [0, V), non-int ids, prompt + max_new_tokens past the
    context. A request decoding meanwhile emits its solo tokens; None asks for the rest of the context."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)[1]
    with Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)) as engine:
        V, context = engine.runner.info.vocab_size, engine.runner.info.max_context
        canary = engine.stream(PROMPTS[1], GenerationParams(max_new_tokens=BUDGETS[1], ignore_eos=True))
        for ids in ([1, 2, V], [-1, 3], [2**63], [1, 2.5], [True, 3], [99999999]):
            with pytest.raises(CloverError, match="not in the vocabulary") as e:
                engine.stream(ids, GenerationParams(max_new_tokens=4))
            assert e.value.param == "prompt"
        with pytest.raises(CloverError, match="exceed the model's context") as e:
            engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=10**30))
        assert e.value.param == "max_new_tokens" and f"at most {context - len(PROMPTS[0])}" in str(e.value)
        assert_identical(canary.wait().token_ids, want, "a request decoding beside the bad ones")
        rest = engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=None, ignore_eos=True))
        assert rest.finish_reason == "length" and rest.prompt_tokens + rest.new_tokens == context
        assert engine.alive


def test_a_failed_step_fails_its_requests_alone_and_says_no_internals(artifacts):
    """A step that raises ends the requests in it with a message naming only the error's type; the engine keeps
    serving, and the next request emits its solo tokens."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)[2]
    with Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)) as engine:
        forward_batch, calls = engine.runner.forward_batch, []

        def broken_once(batch):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("/secret/path node_embedding Gather index out of bounds")
            return forward_batch(batch)

        engine.runner.forward_batch = broken_once
        with pytest.raises(CloverError) as e:
            engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=4))
        assert "RuntimeError" in str(e.value) and "/secret" not in str(e.value) and "Gather" not in str(e.value)
        assert engine.alive
        assert_identical(
            engine.generate(PROMPTS[2], GenerationParams(max_new_tokens=BUDGETS[2], ignore_eos=True)).token_ids,
            want,
            "after a failed step",
        )


@pytest.mark.parametrize(
    "where,tree", [("forward", "chain-2"), ("forward", "auto"), ("commit", "small"), ("draft", "chain-2")]
)
def test_a_fault_in_one_requests_part_of_the_step_fails_that_request_alone(artifacts, where, tree):
    """One request whose forward rows, commit or drafting raise at every step, among 5 others decoding in the same
    batched steps: it ends with an error naming only the error's type and its request id (the log has the whole
    error), every other request emits its solo tokens, and the engine keeps serving."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)
    log = io.StringIO()
    with Engine(load_runner(path), tok, tree, log=log, options=EngineOptions(max_batch=6)) as engine:
        fault = Faulty(engine.runner, where)
        streams = [
            engine.stream(PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True)) for i in range(3)
        ]
        bad = engine.stream(POISON, GenerationParams(max_new_tokens=20, ignore_eos=True), request_id="cmpl-poisoned")
        streams += [
            engine.stream(PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True)) for i in range(3, 5)
        ]
        with pytest.raises(CloverError) as e:
            bad.wait()
        message = str(e.value)
        assert "RuntimeError" in message and "cmpl-poisoned" in message and "/secret" not in message, message
        for i, s in enumerate(streams):
            assert_identical(s.wait().token_ids, want[i], f"{where} fault, {tree}: the request beside it, prompt {i}")
        assert fault.raised >= 1 and engine.alive
        assert "cmpl-poisoned" in log.getvalue() and "/secret/path" in log.getvalue()  # the log has it whole
        assert engine.runner.open_slots == 0
        assert_identical(
            engine.generate(PROMPTS[5], GenerationParams(max_new_tokens=BUDGETS[5], ignore_eos=True)).token_ids,
            want[5],
            "after the fault",
        )


def test_a_caller_whose_event_loop_closes_mid_stream_does_not_disturb_the_others(artifacts):
    """An asyncio caller reads one delta and its loop closes without cancelling: the engine cancels that request
    at its next delivery, and the requests beside it emit their solo tokens."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)
    with Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=4)) as engine:
        streams = [
            engine.stream(PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True)) for i in range(3)
        ]

        async def read_one():
            s = engine.stream(PROMPTS[7], GenerationParams(max_new_tokens=200, ignore_eos=True))
            await s.__aiter__().__anext__()
            return s

        loop = asyncio.new_event_loop()
        abandoned = loop.run_until_complete(read_one())
        loop.close()
        for i, s in enumerate(streams):
            assert_identical(s.wait().token_ids, want[i], f"beside a closed caller loop, prompt {i}")
        deadline = time.monotonic() + 10
        while engine.runner.open_slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert abandoned._request.cancelled.is_set() and engine.runner.open_slots == 0 and engine.alive


def test_a_dead_loop_fails_every_caller_at_once_and_refuses_new_ones(artifacts):
    """If the loop itself dies, the running and the waiting requests get EngineUnavailable within a second (no
    caller hangs), new requests are refused with it, and close() returns."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    engine = Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=1))
    gate = threading.Event()

    def dying():
        gate.wait(5)
        raise SystemExit("the loop breaks")  # not an Exception: _serve does not catch it

    engine._iteration = dying
    streams = [engine.stream(p, GenerationParams(max_new_tokens=8)) for p in PROMPTS[:3]]  # one running, two waiting
    gate.set()
    errors = []

    def read(s):
        try:
            s.wait()
        except EngineUnavailable as e:
            errors.append(e)

    readers = [threading.Thread(target=read, args=(s,)) for s in streams]
    for r in readers:
        r.start()
    for r in readers:
        r.join(timeout=1.0)
    assert not any(r.is_alive() for r in readers) and len(errors) == 3, errors
    assert not engine.alive and isinstance(engine.error, SystemExit)
    with pytest.raises(EngineUnavailable, match="stopped"):
        engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=2))
    engine.close(timeout=5)
    with pytest.raises(EngineUnavailable):
        engine.stream(PROMPTS[0], GenerationParams(max_new_tokens=2))


def test_a_caller_whose_event_loop_closed_cancels_its_stream_instead_of_breaking_the_step():
    stream = EngineStream()
    loop = asyncio.new_event_loop()
    stream._loop, stream._event = loop, asyncio.Event()
    loop.close()
    cancelled = threading.Event()
    stream._request = type("R", (), {"cancelled": cancelled})()
    stream._deliver(Cancelled("x"))  # would raise RuntimeError('Event loop is closed') inside the engine's step
    assert cancelled.is_set()


def test_closing_refuses_new_requests_under_the_schedulers_lock(artifacts):
    path = artifacts["clover2"]
    engine = Engine(load_runner(path), Tokenizer.from_dir(path / "tokenizer"), "chain-2", log=None)
    engine.close()
    assert not engine.alive
    with pytest.raises(EngineUnavailable, match="closed"):
        engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=2))


def test_threads_and_asyncio_callers_together_and_rss_flat_over_500_requests(artifacts):
    """4 threads and an asyncio task on one engine at once: every output its own (no cross-talk), nothing
    hangs, and 500 requests leave the process's memory where it was."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain(load_runner(path, heads="none"), tok)
    with Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=4)) as engine:
        got: dict[int, list[int]] = {}

        def worker(k: int) -> None:
            for i in range(k, 12, 4):
                got[i] = engine.generate(
                    PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True)
                ).token_ids

        async def main():
            outs = await asyncio.gather(
                *(
                    engine.agenerate(PROMPTS[i], GenerationParams(max_new_tokens=BUDGETS[i], ignore_eos=True))
                    for i in range(12, 16)
                )
            )
            for i, o in zip(range(12, 16), outs):
                got[i] = o.token_ids

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        asyncio.run(main())
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        for i in range(16):
            assert_identical(got[i], want[i], f"mixed callers prompt {i}")

        def burst(n: int) -> None:
            streams = []
            for i in range(n):
                streams.append(engine.stream(PROMPTS[i % 16], GenerationParams(max_new_tokens=3, ignore_eos=True)))
                if len(streams) == 8:
                    for s in streams:
                        s.wait()
                    streams = []
            for s in streams:
                s.wait()

        burst(100)  # warm: caches, allocator pools
        before = rss_bytes()
        burst(500)
        assert rss_bytes() - before < 8 * 2**20, "memory grew over 500 requests"
        assert engine.runner.open_slots == 0


# -- logits processors and log-probabilities through the engine ---------------------------------------------------

PENALTIES = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)
# each request its own options, mixed in one batch: none, strong penalties, repetition with a bias, a stop id
# forced by logit_bias but masked by min_tokens until 5 tokens are out, allowed tokens with bad words
OPTIONS = [
    {},
    {"sampling": PENALTIES},
    {"sampling": SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={50: 3.0})},
    {"sampling": SamplingParams(min_tokens=5, logit_bias={60: 100.0}), "stop_token_ids": [60]},
    # allowed tokens, and bad words (the longer ones keep a sequence on the host path)
    {"sampling": SamplingParams(allowed_token_ids=tuple(range(10, 90)), bad_words=((30,), (41, 42), (55, 56, 57)))},
]
N_OPTIONS = 8  # the prompts these tests run


def options(i: int) -> GenerationParams:
    return GenerationParams(**OPTIONS[i % len(OPTIONS)], logprobs=3, ignore_eos=True, max_new_tokens=BUDGETS[i])


def solo_plain_with_options(runner, tokenizer):
    gen = Generator(runner, tokenizer, "plain")
    return [gen.generate(PROMPTS[i], options(i)) for i in range(N_OPTIONS)]


def run_with_options(engine: Engine, concurrency: int):
    out = [None] * N_OPTIONS

    def worker(k: int) -> None:
        for i in range(k, N_OPTIONS, concurrency):
            out[i] = engine.generate(PROMPTS[i], options(i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads), "deadlock: a caller never got its result"
    return out


def assert_same_generation(got, want, what: str) -> None:
    """Token identity, and log-probabilities within the paths' tolerance (tests/numerics.py)."""
    assert_identical(got.token_ids, want.token_ids, what)
    assert got.finish_reason == want.finish_reason, what
    assert [e.token_id for e in got.logprobs] == got.token_ids, what
    reduction = chain_reduction(tiny_config(), context=256)
    assert_close_paths([e.logprob for e in got.logprobs], [e.logprob for e in want.logprobs], reduction=reduction)
    assert [[t for t, _ in e.top] for e in got.logprobs] == [[t for t, _ in e.top] for e in want.logprobs], what


def test_engine_with_penalties_and_logprobs_equals_solo_plain(artifacts):
    """Requests with different penalties, logit biases, min_tokens and stop ids in one batch: each one's greedy
    tokens equal its own solo plain decoding with the same options, on chains, branching and dynamic trees, tree
    auto and prompt lookup, at concurrency 1 and 8; their log-probabilities are plain decoding's."""
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    want = solo_plain_with_options(load_runner(path, heads="none"), tok)
    assert want[1].token_ids != solo_plain(load_runner(path, heads="none"), tok)[1][: len(want[1].token_ids)]
    assert len(want[3].token_ids) == 6 and want[3].token_ids[-1] == 60 and want[3].finish_reason == "stop"
    for tree, heads, drafts in (
        ("chain-2", "artifact", "heads"),
        ("small", "artifact", "heads"),
        ("dynamic-6", "artifact", "heads"),
        ("auto", "artifact", "heads"),
        ("chain-3", "none", "lookup"),
    ):
        with Engine(
            load_runner(path, heads=heads), tok, tree, drafts=drafts, log=None, options=EngineOptions(max_batch=8)
        ) as engine:
            for concurrency in (1, 8):
                got = run_with_options(engine, concurrency)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert_same_generation(g, w, f"ort {drafts} {tree} concurrency {concurrency} prompt {i}")
                if tree in ("chain-2", "small"):  # fixed trees (auto and dynamic ones follow measured timings)
                    assert got[1].accepted_tokens > 0, (tree, got[1].accepted_per_step)  # the penalised one speculated
            assert engine.runner.open_slots == 0


def test_torch_engine_with_penalties_equals_solo_plain(tmp_path):
    from helpers import tiny_tokenizer_dir

    base, heads = tiny_modules("clover2")
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path / "tok"))
    want = solo_plain_with_options(TorchRunner(base), tok)
    with Engine(
        TorchRunner(base, heads, "random:clover2"), tok, "mc26", log=None, options=EngineOptions(max_batch=8)
    ) as engine:
        for concurrency in (1, 8):
            for i, (g, w) in enumerate(zip(run_with_options(engine, concurrency), want)):
                assert_same_generation(g, w, f"torch clover2 mc26 concurrency {concurrency} prompt {i}")


def test_seeded_sampling_with_penalties_is_reproducible_alone_and_in_a_batch(artifacts):
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    sampling = dataclasses.replace(PENALTIES, temperature=0.8, top_p=0.95, seed=7)
    with Engine(
        load_runner(artifacts["clover2"]), tok, "small", log=None, options=EngineOptions(max_batch=4)
    ) as engine:
        alone = engine.generate(
            PROMPTS[3], GenerationParams(max_new_tokens=20, sampling=sampling, ignore_eos=True)
        ).token_ids
        others = [
            engine.stream(
                p, GenerationParams(max_new_tokens=20, sampling=SamplingParams(0.8, 0.95, i, repetition_penalty=1.2))
            )
            for i, p in enumerate(PROMPTS[:3])
        ]
        mixed = engine.stream(PROMPTS[3], GenerationParams(max_new_tokens=20, sampling=sampling, ignore_eos=True))
        assert mixed.wait().token_ids == alone
        for s in others:
            s.wait()
        plain = dataclasses.replace(sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
        assert (
            engine.generate(PROMPTS[3], GenerationParams(max_new_tokens=20, sampling=plain, ignore_eos=True)).token_ids
            != alone
        )


def test_stream_logprobs_arrive_with_the_text_that_shows_their_tokens(artifacts):
    """A stream's deltas carry the log-probabilities of the tokens whose text they complete: text held back for a
    possible stop string holds back its tokens' log-probabilities; all of them add up to the result's."""
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    with Engine(
        load_runner(artifacts["clover2"]), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)
    ) as engine:
        want = engine.generate(PROMPTS[1], GenerationParams(max_new_tokens=30, ignore_eos=True, sampling=PENALTIES))
        words = want.text.split()
        stop = f"{words[3]} w95"  # never matched, but held back each time the text ends with words[3]
        stream = engine.stream(
            PROMPTS[1],
            GenerationParams(max_new_tokens=30, ignore_eos=True, sampling=PENALTIES, stop=[stop], logprobs=2),
        )
        shown, ids, with_logprobs, held = "", [], [], 0
        for delta in stream:
            shown += delta.text
            ids += delta.token_ids
            with_logprobs += [e.token_id for e in delta.logprobs]
            assert with_logprobs == ids[: len(with_logprobs)]
            assert shown.startswith(tok.decode(with_logprobs)), (shown, with_logprobs)
            held += len(with_logprobs) < len(ids)
        assert held, "no text was held back: the test proves nothing"
        assert with_logprobs == ids == stream.result.token_ids == want.token_ids
        assert [e.token_id for e in stream.result.logprobs] == ids and all(
            len(e.top) == 2 for e in stream.result.logprobs
        )
        offsets = [e.text_offset for e in stream.result.logprobs]
        assert all(want.text[o:].lstrip().startswith(tok.decode([t])) for o, t in zip(offsets, ids)), offsets


def test_bad_options_fail_alone_with_their_param(artifacts):
    path = artifacts["clover2"]
    tok = Tokenizer.from_dir(path / "tokenizer")
    with Engine(load_runner(path), tok, "chain-2", log=None, options=EngineOptions(max_batch=2)) as engine:
        for kwargs, param in (
            ({"stop_token_ids": [96]}, "stop_token_ids"),
            ({"stop_token_ids": "w1"}, "stop_token_ids"),
            ({"sampling": SamplingParams(logit_bias={10**6: 1.0})}, "logit_bias"),
            ({"sampling": SamplingParams(min_tokens=5), "max_new_tokens": 4}, "min_tokens"),
            ({"logprobs": 21}, "logprobs"),
            ({"logprobs": True}, "logprobs"),
        ):
            with pytest.raises(CloverError) as e:
                engine.stream(PROMPTS[0], GenerationParams(**{"max_new_tokens": 8, **kwargs}))
            assert e.value.param == param, (kwargs, str(e.value))
        assert engine.generate(PROMPTS[0], GenerationParams(max_new_tokens=3, ignore_eos=True)).new_tokens == 3


# -- several choices of one prompt: one prefill (Runner.fork) ------------------------------------------------------


def shared_prefill_runs(engine, prompt, n, **kw):
    """n requests of one prompt, the others sharing the first one's prefill; their results."""
    params = GenerationParams(**kw)
    first = engine.stream(prompt, params)
    others = [engine.stream(prompt, params, share_prefill=first) for _ in range(n - 1)]
    return [s.wait() for s in (first, *others)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["portable", "fused"])
def test_choices_share_one_prefill_and_each_equals_solo(tmp_path_factory, arch, attention):
    """The followers fork the leader's caches after all but the last prompt token and run that token themselves:
    every greedy choice equals solo plain decoding, a seeded follower equals a lone request with its seed, a long
    prompt (several chunks, past the first cache block: the follower's caches grow to hold the copy) is shared too,
    and the forks really happened."""
    art = tiny_artifact(tmp_path_factory.getbasetemp(), arch, attention=attention)
    tok = Tokenizer.from_dir(art / "tokenizer")
    plain = Generator(load_runner(art, heads="none"), tok, "plain")
    long_prompt = [int(t) for t in np.random.default_rng(9).integers(6, 90, 40)]
    with Engine(
        load_runner(art, options=OrtOptions(cache_block=16)),
        tok,
        "small" if arch != "clover" else "chain-3",
        log=None,
        options=EngineOptions(max_batch=4, prefill_chunk=16),
    ) as engine:
        for prompt in (PROMPTS[5], long_prompt):
            want = plain.generate(prompt, GenerationParams(max_new_tokens=20, ignore_eos=True)).token_ids
            got = shared_prefill_runs(engine, prompt, 4, max_new_tokens=20, ignore_eos=True)
            for i, r in enumerate(got):
                assert_identical(r.token_ids, want, f"{arch} {attention} choice {i} of {len(prompt)} prompt tokens")
        assert engine.prefills_shared == 6
        for seed in (3, 4):
            sampling = SamplingParams(0.9, 1.0, seed)
            alone = engine.generate(
                PROMPTS[6], GenerationParams(max_new_tokens=16, sampling=sampling, ignore_eos=True)
            ).token_ids
            first = engine.stream(
                PROMPTS[6], GenerationParams(max_new_tokens=16, sampling=SamplingParams(0.9, 1.0, 99), ignore_eos=True)
            )
            follower = engine.stream(
                PROMPTS[6], GenerationParams(max_new_tokens=16, sampling=sampling, ignore_eos=True), share_prefill=first
            )
            assert follower.wait().token_ids == alone
            first.wait()
        assert engine.prefills_shared == 8
        assert engine.runner.open_slots == 0


def test_a_follower_whose_leader_is_gone_prefills_on_its_own(artifacts):
    tok = Tokenizer.from_dir(artifacts["clover2"] / "tokenizer")
    plain = Generator(load_runner(artifacts["clover2"], heads="none"), tok, "plain")
    want = plain.generate(PROMPTS[7], GenerationParams(max_new_tokens=12, ignore_eos=True)).token_ids
    with Engine(
        load_runner(artifacts["clover2"]), tok, "small", log=None, options=EngineOptions(max_batch=4)
    ) as engine:
        first = engine.stream(PROMPTS[7], GenerationParams(max_new_tokens=12, ignore_eos=True))
        first.cancel()
        follower = engine.stream(PROMPTS[7], GenerationParams(max_new_tokens=12, ignore_eos=True), share_prefill=first)
        assert follower.wait().token_ids == want
        other = engine.stream(
            PROMPTS[8], GenerationParams(max_new_tokens=12, ignore_eos=True)
        )  # another prompt: no sharing
        late = engine.stream(PROMPTS[7], GenerationParams(max_new_tokens=12, ignore_eos=True), share_prefill=other)
        assert late.wait().token_ids == want
        other.wait()
        assert engine.runner.open_slots == 0


def test_torch_engine_choices_share_one_prefill(tmp_path):
    from helpers import tiny_tokenizer_dir

    base, heads = tiny_modules("clover2")
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path / "tok"))
    want = Generator(TorchRunner(base), tok, "plain").generate(
        PROMPTS[9], GenerationParams(max_new_tokens=20, ignore_eos=True)
    )
    with Engine(
        TorchRunner(base, heads, "random:clover2"), tok, "mc26", log=None, options=EngineOptions(max_batch=4)
    ) as engine:
        for i, r in enumerate(shared_prefill_runs(engine, PROMPTS[9], 3, max_new_tokens=20, ignore_eos=True)):
            assert_identical(r.token_ids, want.token_ids, f"torch choice {i}")
        assert engine.prefills_shared == 2


# -- the prompt's log-probabilities (completions' echo) --------------------------------------------------------------


@pytest.mark.parametrize("attention", ["portable", "fused"])
def test_prompt_logprobs_are_the_prefills_rows_in_every_chunk(tmp_path_factory, attention):
    """Each prompt token but the first gets its log-probability from the prefill's row before it (no extra
    forward), through every prompt chunk: equal to a teacher-forced pass of the whole prompt within fp tolerance,
    alternatives sorted, the same from the Generator and the Engine; generation is unchanged."""
    art = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention=attention)
    tok = Tokenizer.from_dir(art / "tokenizer")
    prompt = [int(t) for t in np.random.default_rng(11).integers(6, 90, 30)]
    _, logits = load_runner(art, heads="none").teacher_forced(np.array(prompt), np.arange(len(prompt) - 1))
    x = logits.astype(np.float64)
    want = x[np.arange(len(prompt) - 1), prompt[1:]] - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) - x.max(1)
    plain = (
        Generator(load_runner(art, heads="none"), tok, "plain")
        .generate(prompt, GenerationParams(max_new_tokens=10))
        .token_ids
    )
    gen = Generator(load_runner(art), tok, "small")
    with Engine(
        load_runner(art), tok, "small", log=None, options=EngineOptions(max_batch=2, prefill_chunk=7)
    ) as engine:
        for r in (
            gen.generate(prompt, GenerationParams(max_new_tokens=10, prompt_logprobs=3)),
            engine.generate(prompt, GenerationParams(max_new_tokens=10, prompt_logprobs=3)),
        ):
            assert r.token_ids == plain and r.logprobs is None
            got = r.prompt_logprobs
            assert [e.token_id for e in got] == prompt[1:]
            np.testing.assert_allclose([e.logprob for e in got], want, atol=1e-3)
            for e in got:
                assert len(e.top) == 3 and [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
                assert e.top[0][1] >= e.logprob - 1e-9
            assert [e.text_offset for e in got] == sorted(e.text_offset for e in got)
        with pytest.raises(CloverError, match="prompt_logprobs") as err:
            engine.stream(prompt, GenerationParams(prompt_logprobs=21))
        assert err.value.param == "prompt_logprobs"
