"""The prefix cache across requests (runtime/prefix_cache.py): a conversation's later turns and a shared system
prompt reuse the rows ended requests computed, and every request's tokens equal those with the cache off, greedy
and seeded sampling, with speculation, on every runner that keeps caches (ONNX Runtime's portable and fused graphs,
the TensorRT runner's graph code on ONNX Runtime, PyTorch's per-sequence and stacked runners)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from helpers import tiny_tokenizer_dir
from ort_helpers import TRT_LIMITS, cpu_runner, tiny_artifact, tiny_modules

from clover.runtime.backends.ort import load_runner
from clover.runtime.backends.torch_batch import BatchedTorchRunner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.engine import Engine
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.prefix_cache import MIN_REUSE, PrefixCache, common_prefix
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer

rng = np.random.default_rng(7)
SYSTEM = [int(t) for t in rng.integers(6, 90, 40)]  # a system prompt every conversation begins with
QUESTIONS = [[int(t) for t in rng.integers(6, 90, 6 + i)] for i in range(4)]
NEW = 10


def runner_of(kind: str, root):
    """A fresh runner of each kind with Clover-2 heads (medusa-ort: Medusa's)."""
    if kind in ("ort", "medusa-ort"):
        return load_runner(tiny_artifact(root, "clover2" if kind == "ort" else "medusa"))
    if kind == "fused-ort":
        return load_runner(tiny_artifact(root, "clover2", attention="fused"), batch=True)
    if kind == "trt-graphs":  # profiles that hold a whole turn's prompt (the heads take it in at once)
        limits = dataclasses.replace(TRT_LIMITS, max_prompt=128, max_context=160)
        return cpu_runner(tiny_artifact(root, "clover2", shared_lm_head=False), limits=limits)[0]
    base, heads = tiny_modules("clover2")
    return (TorchRunner if kind == "torch" else BatchedTorchRunner)(base, heads, "random:clover2:0")


def conversations(engine: Engine, params: GenerationParams) -> list[tuple[list[int], int]]:
    """Two turns of one chat, then another chat on the same system prompt, then two chats at once: each turn's
    tokens and cached prompt tokens."""
    out = []
    first = SYSTEM + QUESTIONS[0]
    r1 = engine.generate(first, params)
    second = first + r1.token_ids + QUESTIONS[1]
    r2 = engine.generate(second, params)
    r3 = engine.generate(SYSTEM + QUESTIONS[2], params)
    streams = [engine.stream(second + r2.token_ids + q, params) for q in QUESTIONS[2:]]
    for r in (r1, r2, r3, *(s.wait() for s in streams)):
        out.append((r.token_ids, r.cached_tokens))
    return out


# each runner kind with a tree and the laws it runs: seeded sampling where the tree's drafts are sampled too
KINDS = {
    "ort": ("small", True),
    "medusa-ort": ("chain-3", False),
    "fused-ort": ("chain-3", False),  # chains only (int8 compute); greedy
    "trt-graphs": ("small", False),
    "torch": ("small", True),
    "torch-batch": ("chain-3", True),
}


@pytest.mark.parametrize("kind", KINDS)
def test_cached_turns_equal_uncached_ones(kind, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(root / f"tok-{kind}"))
    tree, sampled = KINDS[kind]
    laws = [SamplingParams()] + ([SamplingParams(temperature=0.9, seed=11)] if sampled else [])
    for law in laws:
        params = GenerationParams(max_new_tokens=NEW, ignore_eos=True, sampling=law)
        got = {}
        for mb in (0, 64):
            with Engine(
                runner_of(kind, root),
                tok,
                tree,
                log=None,
                options=EngineOptions(prefix_cache_mb=mb, prefill_chunk=32),
            ) as e:
                assert (e.prefix_cache is None) == (mb == 0)
                got[mb] = conversations(e, params)
        what = f"{kind} {tree} temperature {law.temperature}"
        assert [t for t, _ in got[64]] == [t for t, _ in got[0]], what
        assert all(c == 0 for _, c in got[0]), what
        cached = [c for _, c in got[64]]
        first = len(SYSTEM) + len(QUESTIONS[0])
        assert cached[0] == 0, what
        # the whole first turn and its answer but the last tokens: the root (not in the cache), the one before it
        # (the heads' last row), and the rows of the last step the heads had not taken in yet (at most a path)
        assert cached[1] >= first + NEW - 8, what
        assert cached[2] >= len(SYSTEM) - 1, what  # the system prompt
        assert min(cached[3:]) >= first + 2 * NEW + len(QUESTIONS[1]) - 8, what


def test_the_budget_holds_and_the_oldest_goes_first(tmp_path_factory):
    base, heads = tiny_modules("clover2")
    runner = TorchRunner(base, heads, "random:clover2:0")
    rows = 60
    budget = int(2.5 * rows * runner.info.kv_bytes_per_token)  # room for two sequences of 60 rows, not three
    cache = PrefixCache(runner, budget)
    seqs = [[int(t) for t in np.random.default_rng(i).integers(6, 90, rows + 1)] for i in range(4)]
    for s in seqs:
        slot = runner.open_slot(rows + 8)
        n = np.arange(rows)
        runner.forward(np.array(s[:rows]), n, np.tri(rows, dtype=bool), slot=slot)
        runner.commit(n, np.array(s[1 : rows + 1]), slot=slot)
        cache.store(slot, np.array(s))
        runner.release(slot)
        assert 0 < cache.bytes <= budget and len(cache) <= 2
    assert cache.match(np.array(seqs[0] + [5]))[0] is None  # evicted
    assert cache.match(np.array(seqs[3] + [5]))[1] == rows
    # a prefix of a held entry adds nothing; an entry that holds a held one replaces it
    held, before = len(cache), cache.bytes
    slot = runner.open_slot(rows + 8)
    s = seqs[3][: rows // 2 + 1]
    n = np.arange(rows // 2)
    runner.forward(np.array(s[:-1]), n, np.tri(rows // 2, dtype=bool), slot=slot)
    runner.commit(n, np.array(s[1:]), slot=slot)
    cache.store(slot, np.array(s))
    assert (len(cache), cache.bytes) == (held, before)


def test_a_short_or_unrelated_prompt_prefills_in_full():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    base, heads = tiny_modules("clover2")
    runner = TorchRunner(base, heads, "random:clover2:0")
    cache = PrefixCache(runner, 1 << 30)
    assert cache.match(np.arange(40))[0] is None
    slot = runner.open_slot(64)
    s = np.arange(6, 6 + 41)
    runner.forward(s[:40], np.arange(40), np.tri(40, dtype=bool), slot=slot)
    runner.commit(np.arange(40), s[1:41], slot=slot)
    cache.store(slot, s)
    assert cache.match(s[:MIN_REUSE])[0] is None  # all but the last token would be fewer than the minimum
    assert cache.match(s[: MIN_REUSE + 2])[1] == MIN_REUSE + 1
    assert cache.match(np.append(s[:30], 5))[1] == 29  # the heads' row 29 was made with token 30
    assert cache.match(s[::-1].copy())[0] is None


def test_the_cache_stays_in_budget_under_concurrent_chats(tmp_path_factory):
    """16 chats of 3 turns from 4 threads, all on one system prompt, against a budget of a few sequences."""
    root = tmp_path_factory.getbasetemp()
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(root / "tok-load"))
    runner = load_runner(tiny_artifact(root, "clover2"))
    params = GenerationParams(max_new_tokens=8, ignore_eos=True)
    with Engine(runner, tok, "chain-3", log=None, options=EngineOptions(max_batch=4)) as e:
        budget = e.prefix_cache.budget = 6 * 70 * runner.info.kv_bytes_per_token  # a few chats' turns, not 16
        peak, cached, errors = [0], [], []

        def chat(k: int) -> None:
            try:
                prompt = SYSTEM + [6 + k]
                for turn in range(3):
                    r = e.generate(prompt, params)
                    cached.append(r.cached_tokens)
                    peak[0] = max(peak[0], e.prefix_cache.bytes)
                    prompt = prompt + r.token_ids + [7 + turn]
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=lambda k=k: [chat(4 * k + j) for j in range(4)]) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(cached) == 48
        assert 0 < peak[0] <= budget
        assert e.prefix_cache.hit_tokens > 0 and sum(c > 0 for c in cached) >= 24
