"""The served-answers store (runtime/served_store.py): prompt lookup drafts from the answers an engine has served,
within a byte budget, per scope, optionally persisted; the output is the same with the store on and off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from helpers import char_tokenizer_dir, tiny_tokenizer_dir
from ort_helpers import tiny_artifact

from clover.errors import CloverError
from clover.runtime.backends.ort import load_runner
from clover.runtime.engine import Engine
from clover.runtime.grammar import Grammar
from clover.runtime.lookup import PromptLookup
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.served_store import ServedStore
from clover.runtime.tokenizer import Tokenizer

VOCAB = 96
rng = np.random.default_rng(5)
ANSWERS = [[int(t) for t in rng.integers(6, 90, 40)] for _ in range(6)]


def test_a_served_answer_drafts_the_next_one():
    store = ServedStore(VOCAB, 1 << 20)
    try:
        prompt, answer = [3, 4, 5, 6], ANSWERS[0]
        store.add(prompt, answer)
        store.flush()
        lookup = PromptLookup([9, 9, 4, 5, 6] + answer[:3], served=store.store())
        draft = lookup.propose(8)
        assert lookup.from_served and lookup.match < 0
        assert draft.tolist() == answer[3:11]  # a match of the prompt tail and 3 tokens (6) drafts up to 12
        plain = PromptLookup([9, 9, 4, 5, 6] + answer[:3])
        assert plain.propose(8).tolist() == [] and not plain.from_served
    finally:
        store.close()


def test_the_budget_drops_the_oldest_answers_first():
    per = (len(ANSWERS[0]) + 3 + 1) * ServedStore(VOCAB, 1).itemsize
    store = ServedStore(VOCAB, 3 * per)
    try:
        for a in ANSWERS:
            store.add([1, 2, 3], a)
            assert store.bytes <= 3 * per
        store.flush()
        assert PromptLookup([1, 2, 3] + ANSWERS[-1][:4], served=store.store()).propose(4).tolist() == ANSWERS[-1][4:8]
        old = PromptLookup([1, 2, 3] + ANSWERS[0][:4], served=store.store())
        assert not old.from_served or old.propose(4).tolist() != ANSWERS[0][4:8]
    finally:
        store.close()


def test_scopes_do_not_see_each_other():
    store = ServedStore(VOCAB, 1 << 20)
    shared = ServedStore(VOCAB, 1 << 20, shared=True)
    try:
        for s in (store, shared):
            s.add([1, 2, 3], ANSWERS[0], key="tenant-a")
            s.flush()
        assert store.store("tenant-a") is not None
        assert store.store("tenant-b") is None and store.store(None) is None
        assert shared.store("tenant-b") is shared.store("tenant-a") is not None
    finally:
        store.close()
        shared.close()


def test_a_persisted_store_comes_back_and_a_damaged_one_is_refused(tmp_path):
    store = ServedStore(VOCAB, 1 << 20, directory=tmp_path)
    for a in ANSWERS[:3]:
        store.add([1, 2, 3], a, key="k")
    store.close()
    again = ServedStore(VOCAB, 1 << 20, directory=tmp_path)
    try:
        again.flush()
        got = PromptLookup([1, 2, 3] + ANSWERS[1][:4], served=again.store("k")).propose(4)
        assert got.tolist() == ANSWERS[1][4:8]
    finally:
        again.close()
    (f,) = tmp_path.glob("answers-*.npz")
    whole = f.read_bytes()
    with np.load(f) as z:  # an answer changed under the file's checksum
        arrays = {k: z[k] for k in z.files}
    arrays["tokens"] = arrays["tokens"].copy()
    arrays["tokens"][5] = 7 if arrays["tokens"][5] != 7 else 8
    with open(f, "wb") as out:
        np.savez(out, **arrays)
    with pytest.raises(CloverError, match="fails its checksum: delete it"):
        ServedStore(VOCAB, 1 << 20, directory=tmp_path)
    f.write_bytes(whole[: len(whole) // 2])  # a file cut short
    with pytest.raises(CloverError, match="cannot be read"):
        ServedStore(VOCAB, 1 << 20, directory=tmp_path)


WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np
    from clover.runtime.served_store import ServedStore
    store = ServedStore(96, 1 << 20, directory=sys.argv[1])
    rng = np.random.default_rng(int(sys.argv[2]))
    print("ready", flush=True)
    while True:  # each add is rewritten to disk by the background thread within a moment
        store.add([1, 2, 3], rng.integers(6, 90, 400).tolist())
        time.sleep(0.002)
    """
)


def test_a_kill_while_persisting_leaves_a_store_that_loads(tmp_path):
    """A writer adding answers (each add rewrites the file in the background) is killed at a random moment, three
    times: each time the folder loads, with whole answers only, and the next writer goes on from it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(round_)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("answers-*.npz")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.05 + 0.3 * np.random.default_rng(round_).random())  # then some moment of a rewrite
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        store = ServedStore(96, 1 << 22, directory=tmp_path)
        try:
            assert 0 < store.bytes <= 1 << 20 and store.bytes % store.itemsize == 0  # whole answers only
        finally:
            store.close()
    assert list(tmp_path.glob("answers-*.npz"))


def engine(root, kind: str, mb: int | None, tree: str = "chain-4", drafts: str = "lookup") -> Engine:
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(root / f"tok-served-{kind}"))
    runner = load_runner(tiny_artifact(root, "clover2"))
    return Engine(runner, tok, tree, drafts, log=None, options=EngineOptions(draft_store_mb=mb, prefix_cache_mb=0))


QUESTIONS = [[int(t) for t in np.random.default_rng(40 + i).integers(6, 90, 12)] for i in range(4)]


def passes(e: Engine, params: GenerationParams, n: int = 1) -> list:
    """Every question twice, the second pass after the first's answers are searchable; and once more four at a time."""
    out = []
    for _ in range(2):
        out += [e.generate(q, params) for q in QUESTIONS]
        if e.served is not None:
            e.served.flush()
    streams = [e.stream(q, params) for q in QUESTIONS]
    return out + [s.wait() for s in streams]


@pytest.mark.parametrize(
    "tree,drafts,law",
    [
        ("chain-4", "lookup", SamplingParams()),
        ("chain-4", "lookup", SamplingParams(temperature=0.8, seed=3)),
        ("small", "heads+lookup", SamplingParams()),
    ],
)
def test_the_same_tokens_with_the_store_on_and_off(tmp_path_factory, tree, drafts, law):
    root = tmp_path_factory.getbasetemp()
    params = GenerationParams(max_new_tokens=24, ignore_eos=True, sampling=law)
    got = {}
    for mb in (0, 4):
        with engine(root, f"{tree}-{drafts}", mb, tree, drafts) as e:
            assert (e.served is None) == (mb == 0)
            got[mb] = passes(e, params)
    assert [r.token_ids for r in got[4]] == [r.token_ids for r in got[0]]
    served = [r.drafts_by_source.get("served", (0, 0)) for r in got[4]]
    assert all(s == (0, 0) for s in served[: len(QUESTIONS)])  # nothing served yet
    if law.greedy:  # the second pass repeats the first's answers: their drafts are accepted
        assert sum(a for _, a in served[len(QUESTIONS) : 2 * len(QUESTIONS)]) >= 8 * len(QUESTIONS)


TOOL_CALL = Grammar.json_schema(  # what a required tool call's arguments decode under (serve/tool_calls.py)
    {
        "type": "object",
        "properties": {
            "name": {"const": "lookup"},
            "arguments": {
                "type": "object",
                "properties": {"q": {"type": "string"}},
                "required": ["q"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize("grammar", [Grammar.regex("[a-z ]{4,40}"), TOOL_CALL], ids=["regex", "tool-call"])
def test_grammars_and_several_choices_are_unchanged(tmp_path_factory, grammar):
    root = tmp_path_factory.getbasetemp()
    tok = Tokenizer.from_dir(char_tokenizer_dir(root / "tok-served-grammar"))  # grammars spell text
    got = {}
    for mb in (0, 4):
        runner = load_runner(tiny_artifact(root, "clover2"))
        with Engine(runner, tok, "chain-4", "lookup", log=None, options=EngineOptions(draft_store_mb=mb)) as e:
            params = GenerationParams(max_new_tokens=24, grammar=grammar)
            outs = []
            for _ in range(2):
                first = e.stream(QUESTIONS[0], params)
                outs += [first, e.stream(QUESTIONS[0], params, share_prefill=first)]
                [s.wait() for s in outs[-2:]]
                if e.served is not None:
                    e.served.flush()
            threads_out: list = [None] * 4

            def run(i: int) -> None:
                threads_out[i] = e.generate(QUESTIONS[i % 2], params).token_ids

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            got[mb] = [s.result.token_ids for s in outs] + threads_out
    assert got[4] == got[0]


def test_the_store_holds_its_budget_under_load(tmp_path_factory):
    """48 answers from 4 threads into a store with room for a few: its bytes stay within the budget throughout."""
    root = tmp_path_factory.getbasetemp()
    with engine(root, "load", 4) as e:
        budget = e.served.budget = 5 * (24 + 3 + 1) * e.served.itemsize
        peak, errors = [0], []

        def client(k: int) -> None:
            try:
                for i in range(12):
                    e.generate(
                        QUESTIONS[(k + i) % 4] + [6 + k, 7 + i], GenerationParams(max_new_tokens=24, ignore_eos=True)
                    )
                    peak[0] = max(peak[0], e.served.bytes)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and 0 < peak[0] <= budget
        e.served.flush()
        assert e.served.bytes <= budget and e.served.rebuilds > 0
