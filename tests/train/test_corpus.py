"""clover.train.corpus: shards and provenance written, read back and checked; the features clover-train
builds from a corpus (batched teacher-forced passes) against a full pass per sequence."""

import dataclasses
import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest
from helpers import reference_features, tiny_base
from numerics import assert_stored

from clover.errors import CloverError
from clover.train.corpus import Conversation, Corpus, GeneratorSpec, PromptSpec, bytes_per_million
from clover.train.data import prompt_order, split_indices
from clover.train.features import (
    FeatureSpec,
    FeatureWriter,
    corpus_sequences,
    corpus_shards_used,
    features_from_dataset,
)

PROMPTS = PromptSpec("file:chats.jsonl", "0123456789abcdef", 30, 0, 0.1, 16)
GENERATOR = GeneratorSpec("tiny", {"lm_head_sha256": "feedfacefeedface"}, "ort", "float32", 12, (1,), "cafe")


def conversations(indices, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Conversation(
            i,
            rng.integers(2, 96, rng.integers(2, 9)).astype(np.int32),
            rng.integers(2, 96, rng.integers(1, 13)).astype(np.int32),
            "length" if i % 3 else "stop",
        )
        for i in indices
    ]


def grown(path, shards=((0, 5), (5, 9))):
    """A corpus answering the prompt order's positions in `shards` (one shard each)."""
    order = [i for i, _ in prompt_order(PROMPTS.conversations, PROMPTS.seed, PROMPTS.validation_fraction)]
    corpus = Corpus.create(path, PROMPTS, GENERATOR)
    with corpus.writing():
        for a, b in shards:
            corpus.append(conversations(order[a:b], seed=a), b, 0)
    return corpus


def test_shards_load_with_provenance(tmp_path):
    corpus = grown(tmp_path / "c")
    again = Corpus.open(tmp_path / "c")
    got = list(again.conversations())
    order = [i for i, _ in prompt_order(30, 0, 0.1)]
    want = conversations(order[:5], seed=0) + conversations(order[5:9], seed=5)
    assert [c.index for c in got] == order[:9]
    for g, w in zip(got, want):
        assert g.prompt.tolist() == w.prompt.tolist() and g.response.tolist() == w.response.tolist()
        assert g.finish_reason == w.finish_reason and g.prompt.dtype == np.int32
    prov = json.loads((tmp_path / "c" / "provenance.json").read_text())
    assert prov["kind"] == "clover-corpus" and prov["format_version"] == 1
    assert prov["prompts"]["source"] == "file:chats.jsonl" and prov["prompts"]["seed"] == 0
    assert prov["generator"]["weights"] == "float32" and prov["generator"]["max_new_tokens"] == 12
    assert prov["next_position"] == 9 and [s["positions"] for s in prov["shards"]] == [[0, 5], [5, 9]]
    assert prov["totals"]["conversations"] == 9
    assert prov["totals"]["response_tokens"] == sum(len(w.response) for w in want)
    assert prov["totals"]["prompt_tokens"] == sum(len(w.prompt) for w in want)
    assert all(len(s["sha256"]) == 64 for s in prov["shards"])
    assert again.provenance == corpus.provenance and again.done_prompts() == {(i, 1, 1) for i in order[:9]}
    assert bytes_per_million(again.provenance) > 0
    counts = again.token_counts(96)  # what a draft vocabulary is ranked by (clover-export --draft-vocab)
    assert counts.sum() == prov["totals"]["response_tokens"]
    assert counts.tolist() == np.bincount(np.concatenate([w.response for w in want]), minlength=96).tolist()


def test_damaged_files_give_one_clear_error(tmp_path):
    grown(tmp_path / "c")
    shard = tmp_path / "c" / "shard-00001.npz"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    corpus = Corpus.open(tmp_path / "c")
    assert len(corpus.read_shard(corpus.provenance.shards[0])) == 5  # the good shard still reads
    with pytest.raises(CloverError, match=r"shard-00001.npz is damaged: .*git checkout -- .*shard-00001.npz"):
        list(corpus.conversations())
    shard.unlink()
    with pytest.raises(CloverError, match="shard-00001.npz is missing"):
        list(corpus.conversations())
    prov = tmp_path / "c" / "provenance.json"
    d = json.loads(prov.read_text())
    d["totals"]["response_tokens"] += 1
    prov.write_text(json.dumps(d))
    with pytest.raises(CloverError, match="do not add up"):
        Corpus.open(tmp_path / "c")
    prov.write_text("{")
    with pytest.raises(CloverError, match="provenance.json is damaged"):
        Corpus.open(tmp_path / "c")
    with pytest.raises(CloverError, match="is not a corpus"):
        Corpus.open(tmp_path)


def test_one_writer_stale_temporaries_and_mismatched_settings(tmp_path):
    corpus = grown(tmp_path / "c", shards=((0, 3),))
    (tmp_path / "c" / ".shard-00001.npz.x1.tmp").write_bytes(b"half")  # a killed run's
    with corpus.writing():
        assert not list((tmp_path / "c").glob(".*.tmp"))
        with pytest.raises(CloverError, match="another clover-data grow is writing"):
            with Corpus.open(tmp_path / "c").writing():
                pass
        corpus.append([], 5, 2)  # only skipped prompts: the position moves on, no shard
    prov = Corpus.open(tmp_path / "c").provenance
    assert (prov.next_position, prov.skipped, len(prov.shards)) == (5, 2, 1)
    corpus.check_matches(PROMPTS, GENERATOR)
    other = GeneratorSpec("tiny", {"lm_head_sha256": "0000"}, "ort", "int4", 20, (1,), "cafe")
    with pytest.raises(
        CloverError, match="grown with other generator: .*weights 'float32' there, 'int4' now.*max_new_tokens"
    ):
        corpus.check_matches(PROMPTS, other)
    with pytest.raises(CloverError, match="already holds a corpus"):
        Corpus.create(tmp_path / "c", PROMPTS, GENERATOR)


def test_corpora_of_first_turns_only_read_as_turn_1_and_may_take_more_turns(tmp_path):
    """Corpora grown before `turns` existed: their provenance has no `turns` and the old wording of the pick and
    order, their shards no `turn` array. They read as first turns, and a run may extend them to later turns
    (never back)."""
    import io

    before = [c.index for c in grown(tmp_path / "c").conversations()]
    file = tmp_path / "c" / "provenance.json"
    d = json.loads(file.read_text())
    del d["prompts"]["turns"]
    d["prompts"]["pick"] = "the turns before the first assistant turn (a user turn, after a system turn if any), ..."
    d["prompts"]["order"] = "clover.train.data.prompt_order(conversations, seed, validation_fraction)"
    for entry in d["shards"]:  # a shard as older versions wrote it
        shard = tmp_path / "c" / entry["file"]
        with np.load(shard) as z:
            arrays = {k: z[k] for k in z.files if k != "turn"}
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        shard.write_bytes(buf.getvalue())
        entry["sha256"], entry["bytes"] = hashlib.sha256(buf.getvalue()).hexdigest(), len(buf.getvalue())
    d["totals"]["bytes"] = sum(e["bytes"] for e in d["shards"])
    file.write_text(json.dumps(d))
    old = Corpus.open(tmp_path / "c")
    assert old.provenance.prompts.turns == 1 and {c.turn for c in old.conversations()} == {1}
    assert [c.index for c in old.conversations()] == before
    two = dataclasses.replace(PROMPTS, turns=2)
    old.check_matches(two, GENERATOR)  # the same first turns, then the second ones
    assert old.provenance.prompts.turns == 1  # a check only
    old.continue_with(two, GENERATOR)
    assert old.provenance.prompts == two
    with pytest.raises(
        CloverError, match="answers 2 turns per conversation; --turns 1 would shorten .*--turns 2 or more"
    ):
        old.check_matches(PROMPTS, GENERATOR)
    with old.writing():
        old.append([dataclasses.replace(c, turn=2) for c in conversations([3, 4], seed=9)], 32, 0)
    again = Corpus.open(tmp_path / "c")
    assert again.provenance.prompts.turns == 2 and [c.turn for c in again.conversations()][-3:] == [1, 2, 2]
    assert {(3, 2, 1), (4, 2, 1)} <= again.done_prompts()


def test_corpus_features_are_batched_teacher_forced_passes(tmp_path):
    corpus = grown(tmp_path / "c")
    base = tiny_base(seed=1)
    spec = FeatureSpec("feedfacefeedface", str(tmp_path / "c"), "corpus", 10_000, 0, 14, 12, 4, corpus=corpus.digest())
    writer = FeatureWriter(tmp_path / "f", spec, base.config.hidden_size)
    sequences = list(corpus_sequences(corpus, spec))
    features_from_dataset(base, iter(sequences), writer, (10_000, 10_000), batch_tokens=40)  # several batches
    cache = writer.finish({})
    validation = set(split_indices(30, 0, 0.1)[1])
    assert cache.meta["num_sequences"] == len(sequences) == 9
    stored = {tuple(c.prompt.tolist()): c for c in corpus.conversations()}
    for i in range(cache.meta["num_sequences"]):
        s, e = cache.offsets[i], cache.offsets[i + 1]
        ids = cache.arrays["tokens"][s:e].tolist()
        c = next(c for p, c in stored.items() if ids[: len(p)] == list(p))
        P = len(c.prompt)
        assert ids == (c.prompt.tolist() + c.response.tolist())[:14]  # truncated to max_length
        assert bool(cache.validation[i]) == (c.index in validation)  # the split is by prompt index
        mask = cache.arrays["loss_mask"][s:e]
        assert mask.tolist() == [False] * (P - 1) + [True] * (len(ids) - P) + [False]
        hidden, top, p = reference_features(base, ids, spec.topk)
        n = len(ids) - 1
        assert_stored(cache.arrays["hidden"][s : s + n], hidden[:n])
        assert not cache.arrays["hidden"][e - 1].any()
        rows = np.flatnonzero(mask)
        assert (cache.arrays["topk_ids"][s + rows] == top[rows].numpy()).mean() > 0.95  # near-ties may swap
        assert_stored(cache.arrays["topk_probs"][s + rows], p[rows])
        assert not cache.arrays["topk_probs"][s:e][~mask].any()  # distributions at loss rows only


def corpus_spec(path, max_tokens: int, max_length: int = 64, **kw) -> FeatureSpec:
    return FeatureSpec("feedfacefeedface", str(path), "corpus", max_tokens, 0, max_length, 12, 4, **kw)


def test_shards_used_follow_the_budget_so_growth_keeps_features(tmp_path):
    corpus = grown(tmp_path / "c", shards=((0, 5), (5, 9), (9, 14)))
    first = sum(
        min(len(c.prompt) + len(c.response), 64) - len(c.prompt) for c in corpus.read_shard(corpus.provenance.shards[0])
    )
    spec = corpus_spec(tmp_path / "c", first + 1)
    assert corpus_shards_used(corpus, corpus_spec(tmp_path / "c", 1)) == 1
    assert corpus_shards_used(corpus, spec) >= 2
    assert corpus_shards_used(corpus, corpus_spec(tmp_path / "c", 10**9)) == 3
    # --answer-tokens: each answer's first N tokens only, so the same budget spans more conversations
    cut = list(corpus_sequences(corpus, corpus_spec(tmp_path / "c", 1, answer_tokens=2)))
    assert [len(ids) for ids, _, _ in cut] == [
        min(len(c.prompt) + min(len(c.response), 2), 64) for c in corpus.conversations() if len(c.prompt) + 1 < 64
    ]
    assert all(sum(mask) <= 2 for _, mask, _ in cut)
    assert corpus_shards_used(corpus, dataclasses.replace(spec, answer_tokens=1)) > corpus_shards_used(corpus, spec)
    assert corpus.digest(1) != corpus.digest(2) and corpus.digest(1) == Corpus.open(tmp_path / "c").digest(1)
    # a FeatureSpec without a corpus or an artifact teacher keeps the cache name it had before either existed
    plain = FeatureSpec("x", "sharegpt", "base", 10, 0, 64, 8, 4)
    before = {k: v for k, v in asdict(plain).items() if k not in ("corpus", "teacher", "answer_tokens", "skip_tokens")}
    assert plain.key() == hashlib.sha256(json.dumps({"format": 1, **before}, sort_keys=True).encode()).hexdigest()[:16]
    for other in (dict(corpus="ab"), dict(answer_tokens=2), dict(skip_tokens=5)):
        assert plain.key() != dataclasses.replace(plain, **other).key()


def test_skip_tokens_leave_out_the_first_training_answers_and_keep_the_validation_split(tmp_path):
    """clover-train --skip-tokens: a run from earlier heads learns the answers the corpus gained since."""
    corpus = grown(tmp_path / "c", shards=((0, 5), (5, 9), (9, 14)))
    whole = list(corpus_sequences(corpus, corpus_spec(tmp_path / "c", 10**9)))
    train = [s for s in whole if not s[2]]
    two, first = (sum(sum(mask) for _, mask, _ in train[:k]) for k in (2, 3))
    # a conversation is left out while the loss tokens left out before it are fewer than N
    for skip, left_out in ((0, 0), (1, 1), (two, 2), (two + 1, 3), (first, 3), (first + 1, 4)):
        rest = list(corpus_sequences(corpus, corpus_spec(tmp_path / "c", 10**9, skip_tokens=skip)))
        assert [s for s in rest if not s[2]] == train[left_out:]  # whole conversations, in corpus order
        assert [s for s in rest if s[2]] == [s for s in whole if s[2]]  # validation unchanged
    # the budget counts from the first conversation kept: a skip reads further into the corpus
    later = train[3:]
    spec = corpus_spec(tmp_path / "c", sum(sum(m) for _, m, _ in later[:2]), skip_tokens=first)
    assert corpus_shards_used(corpus, spec) >= corpus_shards_used(corpus, dataclasses.replace(spec, skip_tokens=0))
    writer = FeatureWriter(tmp_path / "f", spec, tiny_base(seed=1).config.hidden_size)
    features_from_dataset(tiny_base(seed=1), corpus_sequences(corpus, spec), writer, spec.budgets)
    cache = writer.finish({})
    kept = [
        cache.arrays["tokens"][cache.offsets[i] : cache.offsets[i + 1]].tolist()
        for i in cache.sequences(validation=False)
    ]
    assert sorted(kept) == sorted(ids for ids, _, _ in later[:2])


def test_features_from_an_artifacts_graph(tmp_path, tmp_path_factory):
    """clover-train --features-from: an artifact's base graph on ONNX Runtime computes the features (the graph that
    will serve: int4 there); an fp32 graph gives the torch base's features."""
    from ort_helpers import BASE_SEED, tiny_artifact, tiny_modules

    from clover.runtime.backends.ort import load_runner

    corpus = grown(tmp_path / "c")
    base = tiny_modules("clover2")[0]
    assert tiny_base(seed=BASE_SEED).config == base.config
    runner = load_runner(tiny_artifact(tmp_path_factory.getbasetemp(), "clover2"), heads="none")
    spec = FeatureSpec(
        "feedfacefeedface",
        str(tmp_path / "c"),
        "corpus",
        10_000,
        0,
        14,
        12,
        4,
        corpus=corpus.digest(),
        teacher="ort:0123456789abcdef",
    )
    assert spec.key() != dataclasses.replace(spec, teacher="").key()  # another teacher, another cache
    writer = FeatureWriter(tmp_path / "f", spec, base.config.hidden_size)
    features_from_dataset(runner, corpus_sequences(corpus, spec), writer, (10_000, 10_000))
    cache = writer.finish({})
    assert cache.meta["num_sequences"] == 9
    for i in range(cache.meta["num_sequences"]):
        s, e = cache.offsets[i], cache.offsets[i + 1]
        ids = cache.arrays["tokens"][s:e].tolist()
        hidden, top, p = reference_features(base, ids, spec.topk)
        n = len(ids) - 1
        assert_stored(cache.arrays["hidden"][s : s + n], hidden[:n])
        assert not cache.arrays["hidden"][e - 1].any()
        rows = np.flatnonzero(cache.arrays["loss_mask"][s:e])
        assert (cache.arrays["topk_ids"][s + rows] == top[rows].numpy()).mean() > 0.95
        assert_stored(cache.arrays["topk_probs"][s + rows], p[rows])
    assert runner.open_slots == 0  # every teacher-forced slot released


def test_features_from_an_artifact_need_teacher_forced_data(tmp_path):
    from clover.train.features import prepare_features

    spec = FeatureSpec("feedfacefeedface", "sharegpt", "base", 100, 0, 14, 12, 4, teacher="ort:0123456789abcdef")
    with pytest.raises(CloverError, match="need teacher-forced data"):
        prepare_features(tiny_base(seed=1), None, spec, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_features_in_memory_equal_the_disk_caches_and_batch_alike(tmp_path):
    import torch

    from clover.train.features import FeatureStore, MemoryWriter

    corpus = grown(tmp_path / "c")
    base = tiny_base(seed=1)
    spec = FeatureSpec("feedfacefeedface", str(tmp_path / "c"), "corpus", 10_000, 0, 14, 12, 4, corpus=corpus.digest())
    writer = FeatureWriter(tmp_path / "f", spec, base.config.hidden_size)
    features_from_dataset(base, corpus_sequences(corpus, spec), writer, (10_000, 10_000), batch_tokens=40)
    cache = writer.finish({})
    memory = MemoryWriter(spec, base.config.hidden_size, torch.device("cpu"))
    features_from_dataset(base, corpus_sequences(corpus, spec), memory, (10_000, 10_000), batch_tokens=40)
    store = memory.finish({})
    assert store.meta["num_tokens"] == cache.meta["num_tokens"] and list(store.offsets) == list(cache.offsets)
    for name, arr in cache.arrays.items():
        assert np.array_equal(store.arrays[name].numpy(), np.asarray(arr)), name
    loaded = FeatureStore.from_cache(cache, torch.device("cpu"))
    ids = [3, 0, 7, 5]
    for a, b in ((cache.batch(ids), store.batch(ids)), (cache.batch(ids), loaded.batch(ids))):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    both = FeatureStore.concat([store, loaded])  # two sources trained together: the second's ids follow
    n = store.meta["num_sequences"]
    assert both.meta["num_sequences"] == 2 * n and len(both.sequences(False)) == 2 * len(store.sequences(False))
    assert all(torch.equal(both.batch([n + i])[k], store.batch([i])[k]) for i in range(n) for k in ("tokens", "hidden"))
    top, mask = np.asarray(cache.arrays["topk_ids"])[:, 0], np.asarray(cache.arrays["loss_mask"])
    first = np.concatenate(
        [top[cache.offsets[i] : cache.offsets[i + 1]][mask[cache.offsets[i] : cache.offsets[i + 1]]] for i in ids]
    )
    assert sorted(store.first_ranked(ids).tolist()) == sorted(first.tolist())
