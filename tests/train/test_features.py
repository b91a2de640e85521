"""The feature cache holds exactly what the base computes, and generated answers are its greedy ones."""

import os

import numpy as np
import pytest
from helpers import reference_features, tiny_base, tiny_tokenizer_dir
from numerics import assert_stored

from clover.errors import CloverError
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.train.features import (
    FeatureCache,
    FeatureSpec,
    FeatureWriter,
    features_from_dataset,
    features_from_generation,
)


def _spec(**kw):
    args = dict(
        base_sha256="x",
        data="test",
        responses="base",
        max_tokens=10_000,
        seed=0,
        max_length=60,
        max_new_tokens=20,
        topk=4,
    )
    args.update(kw)
    return FeatureSpec(**args)


def test_continuous_batch_generation_is_greedy_and_features_match_a_full_pass(tmp_path):
    base = tiny_base(seed=3, scale=4.0)  # peaked laws: greedy answers with some structure
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 96, size=n))) for n in (5, 9, 3, 12, 7, 4, 6)]
    spec = _spec()
    writer = FeatureWriter(tmp_path / "cache", spec, base.config.hidden_size)
    # batch 3 < 7 prompts: rows are refilled as sequences finish; EOS ids chosen so some stop early
    features_from_generation(
        base, iter([(p, i == 0) for i, p in enumerate(prompts)]), writer, (10_000, 10_000), eos_ids=(1, 7), batch_size=3
    )
    cache = writer.finish({})
    assert not (tmp_path / "cache").with_name("cache.partial").exists()
    assert cache.meta["num_sequences"] == len(prompts)
    tok_dir = tiny_tokenizer_dir(tmp_path / "tok")
    gen = Generator(TorchRunner(base), Tokenizer.from_dir(tok_dir))
    found = 0
    for i in range(len(prompts)):
        s, e = cache.offsets[i], cache.offsets[i + 1]
        ids = cache.arrays["tokens"][s:e].tolist()
        prompt = next(p for p in prompts if ids[: len(p)] == p)
        found += 1
        answer = ids[len(prompt) :]
        ref = gen.generate(prompt, GenerationParams(max_new_tokens=spec.max_new_tokens, ignore_eos=True)).token_ids
        stop = next((j + 1 for j, t in enumerate(ref) if t in (1, 7)), len(ref))
        assert answer == ref[:stop]  # greedy, cut at the first EOS or the length cap
        hidden, top, p = reference_features(base, ids, spec.topk)
        n = len(ids) - 1  # the final token is never fed: its row is zero
        assert_stored(cache.arrays["hidden"][s : s + n], hidden[:n])
        # distributions from the prompt's last position on (earlier prompt rows carry no loss: zeros)
        a = len(prompt) - 1
        assert not cache.arrays["topk_probs"][s : s + a].any()
        assert (cache.arrays["topk_ids"][s + a : s + n] == top[a:n].numpy()).mean() > 0.99  # near-ties may swap
        assert_stored(cache.arrays["topk_probs"][s + a : s + n], p[a:n])
        mask = cache.arrays["loss_mask"][s:e]
        assert mask.tolist() == [False] * (len(prompt) - 1) + [True] * len(answer) + [False]
        assert bool(cache.validation[i]) == (prompt == prompts[0])
    assert found == len(prompts)


def test_dataset_features_align_loss_mask_with_next_token(tmp_path):
    base = tiny_base()
    spec = _spec(responses="dataset")
    writer = FeatureWriter(tmp_path / "c", spec, base.config.hidden_size)
    ids = [3, 10, 11, 4, 5, 20, 21, 4]
    assistant = [False] * 5 + [True] * 3
    features_from_dataset(base, iter([(ids, assistant, False), (ids, assistant, True)]), writer, (100, 100))
    cache = writer.finish({})
    b = cache.batch(cache.sequences(validation=False))
    assert b["loss_mask"][0].tolist() == [False] * 4 + [True] * 3 + [False]  # p_t predicts an assistant token
    hidden, top, _ = reference_features(base, ids, spec.topk)
    assert_stored(b["hidden"][0, :-1], hidden[:-1])


def test_a_killed_writers_partial_folder_is_swept_and_a_live_ones_kept(tmp_path):
    import subprocess

    from clover.train.features import sweep_partials

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = tmp_path / f"c.partial-{dead.pid}", tmp_path / f"c.partial-{os.getpid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "hidden.bin").write_bytes(b"x" * 10)
    assert sweep_partials(tmp_path / "c") == [stale]
    assert not stale.exists() and live.exists()
    writer = FeatureWriter(tmp_path / "d", _spec(), 64)  # a new writer sweeps its own name's leftovers too
    writer.abort()


def test_unfinished_build_is_never_a_cache(tmp_path):
    base = tiny_base()
    writer = FeatureWriter(tmp_path / "c", _spec(), base.config.hidden_size)
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CloverError, match="not a feature cache"):
        FeatureCache(tmp_path / "c")


def test_the_faster_feature_dtype_is_timed_once_per_machine(tmp_path, monkeypatch):
    """fastest_feature_dtype times a forward in float32 and bfloat16 on this CPU and keeps the winner in the user
    cache: the next call reads it without loading the base, so later runs and --resume build the same features."""
    import json

    import torch

    from clover.train.features import FEATURE_DTYPES, fastest_feature_dtype

    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    loaded = []

    def load(path, dtype):
        loaded.append(dtype)
        return tiny_base().to(getattr(torch, dtype))

    first = fastest_feature_dtype(tmp_path / "base", load, rows=32)
    assert first in FEATURE_DTYPES and loaded == list(FEATURE_DTYPES)
    assert list(json.loads((tmp_path / "feature_dtype.json").read_text()).values()) == [first]

    def refuse(path, dtype):
        raise AssertionError("timed again")

    assert fastest_feature_dtype(tmp_path / "base", refuse) == first
