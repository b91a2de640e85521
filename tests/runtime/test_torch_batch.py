"""The stacked torch runner's device-side step (runtime/backends/torch_batch.py), on CPU tensors: its acceptance against the
numpy reference, and whole batches decoded through the loop (runtime/loop.step, which hands greedy fixed-tree
steps to `decode`) emitting each sequence's plain greedy tokens and the host path's drafts. The Runner suite
(test_runners.py, kind torch-batch) covers the rest of its interface."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import assert_identical, run_tokens, tiny_base
from numerics import assert_close_paths, chain_reduction
from ort_helpers import HEADS_SEED, PROMPTS

from clover.models.head_io import random_heads
from clover.runtime.acceptance import accept_greedy
from clover.runtime.backends.torch_batch import BatchedTorchRunner, DeviceTree, accept_paths
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.loop import Decoding, step
from clover.runtime.processors import LogitsProcessors
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import prune_tree, resolve_tree

N = 24
ARCHS = ("medusa", "clover", "clover2")
# three sequences of different lengths: a batch's rows hold different past lengths
BATCH = [*PROMPTS, [3, 4, 5, 6, 7, 8, 9, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


@pytest.mark.parametrize("spec", ["plain", "chain-4", "small", "mc26"])
def test_accept_paths_matches_the_numpy_reference(spec):
    """Tokens and targets over 3 values: matches, misses and equal siblings (the first in rank order wins) abound."""
    tree = resolve_tree(spec)
    rng = np.random.default_rng(0)
    B, T = 64, tree.num_nodes
    tokens, target = rng.integers(0, 3, (B, T)), rng.integers(0, 3, (B, T))
    path, count = accept_paths(DeviceTree.of(tree, torch.device("cpu")), torch.tensor(tokens), torch.tensor(target))
    for b in range(B):
        ref = accept_greedy(tree, tokens[b], np.eye(3, dtype=np.float32)[target[b]])
        c = int(count[b])
        assert path[b, :c].tolist() == ref.path.tolist(), b
        assert int(target[b, path[b, c - 1]]) == ref.bonus_token
        assert (path[b, c:] == path[b, c - 1]).all()  # past the count: the last node repeated


@pytest.fixture(scope="module")
def models():
    """A tiny base whose greedy continuations vary (larger weights than tiny_base's, which repeats one token), so
    random heads' drafts are accepted in part: paths of every length are committed."""
    base = tiny_base(3)
    for name, p in base.named_parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=1.0 if "embed" in name else 0.2)
    return {arch: (base, random_heads(base, arch, HEADS_SEED)) for arch in ARCHS}


def plain_tokens(base, prompt) -> list[int]:
    return run_tokens(TorchRunner(base), prompt, resolve_tree("plain"), N)[0]


def decode_together(
    runner, tree, prompts, n=N, hold=(), sampling=SamplingParams(), stop_ids=(), logprobs=None, steps=None
) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt in a slot of its own, all stepped together by the loop; `hold`: sequences that wait (do not
    step) for the first 2 steps while the others go on; `sampling`'s logits processors (their min_tokens masking
    `stop_ids`) on every sequence; `logprobs[i]`: sequence i's log-probability alternatives (None: none); `steps`:
    a list per sequence that each of its Steps is appended to. Returns each one's first n tokens and tokens per
    step."""
    V = runner.info.vocab_size
    ds = [
        Decoding(
            slot=runner.open_slot(len(p) + n + tree.num_nodes),
            prompt=np.array(p),
            tree=tree,
            sampling=sampling,
            rng=np.random.default_rng(0),
            processors=LogitsProcessors.of(sampling, np.array(p), stop_ids, V),
            logprobs=logprobs[i] if logprobs is not None else None,
        )
        for i, p in enumerate(prompts)
    ]
    out, per_step = [[] for _ in ds], [[] for _ in ds]
    k = 0
    while live := [i for i, d in enumerate(ds) if len(out[i]) < n and not d.full and (k >= 2 or i not in hold)]:
        for i, st in zip(live, step(runner, [ds[i] for i in live])):
            if steps is not None:
                steps[i].append(st)
            if st.tree is not None:
                per_step[i].append(len(st.tokens))
            out[i] += st.tokens
        k += 1
    for d in ds:
        runner.release(d.slot)
    return [o[:n] for o in out], per_step


class Counting(BatchedTorchRunner):
    """Counts the sequences each device-side step served."""

    calls: list[int]

    def decode_async(self, slots, tree, *args):
        self.calls.append(len(slots))
        return super().decode_async(slots, tree, *args)


@pytest.mark.parametrize("spec", ["plain", "chain-3", "small"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_decoded_on_the_device_emits_plain_greedy_and_the_host_drafts(models, arch, spec):
    base, heads = models[arch]
    runner = Counting(base, heads, f"random:{arch}:{HEADS_SEED}")
    runner.calls = []
    tree = prune_tree(resolve_tree(spec), heads.config.max_depth or 99)
    got, per_step = decode_together(runner, tree, BATCH, hold=(1,))
    assert max(runner.calls) == len(BATCH), runner.calls  # the three sequences in one device step
    host = TorchRunner(base, heads, f"random:{arch}:{HEADS_SEED}")
    for i, p in enumerate(BATCH):
        assert_identical(got[i], plain_tokens(base, p), f"{arch} {tree.name} sequence {i}", TorchRunner(base), p)
        # the same drafts as the host loop's: the same tokens accepted at every step
        assert (
            per_step[i][: len(run_tokens(host, p, tree, N)[1])] == run_tokens(host, p, tree, N)[1][: len(per_step[i])]
        )
    if tree.max_depth:  # accepted paths of several lengths were committed
        assert len({n for s in per_step for n in s}) > 2, per_step


def test_a_prefilling_sequence_and_sampled_ones_step_beside_the_device_batch(models):
    """A batch mixing the device-side step with host-side ones: a prompt still prefilling and a seeded sampled
    sequence (its own generator) step on the host; an unseeded sampled sequence shares the device step with the
    greedy ones, whose rows stay exactly greedy there (point-mass targets). Each greedy sequence emits plain greedy,
    the seeded one its own host-path tokens."""
    base, heads = models["clover2"]
    runner = Counting(base, heads, f"random:clover2:{HEADS_SEED}")
    runner.calls = []
    tree = resolve_tree("small")
    seeded = SamplingParams(temperature=0.8, seed=3)
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.5)
    rng = np.random.default_rng
    ds = [
        Decoding(slot=runner.open_slot(64), prompt=np.array(BATCH[0]), tree=tree, sampling=greedy, rng=rng(0)),
        Decoding(
            slot=runner.open_slot(64),
            prompt=np.array(BATCH[2]),
            tree=tree,
            sampling=greedy,
            rng=rng(0),
            prefill_chunk=4,
        ),
        Decoding(slot=runner.open_slot(64), prompt=np.array(BATCH[1]), tree=tree, sampling=seeded, rng=rng(3)),
        Decoding(slot=runner.open_slot(64), prompt=np.array(BATCH[1]), tree=tree, sampling=hot, rng=rng(4)),
    ]
    out: list[list[int]] = [[] for _ in ds]
    while live := [i for i, d in enumerate(ds) if len(out[i]) < N and not d.full]:
        for i, st in zip(live, step(runner, [ds[i] for i in live])):
            out[i] += st.tokens
    assert max(runner.calls) == 3, runner.calls  # the greedy pair and the unseeded sampled one, together
    for i in (0, 1):
        p = BATCH[[0, 2][i]]
        assert_identical(out[i][:N], plain_tokens(base, p), f"greedy sequence {i}", TorchRunner(base), p)
    alone = BatchedTorchRunner(base, heads, f"random:clover2:{HEADS_SEED}")
    assert out[2][:N] == run_tokens(alone, BATCH[1], tree, N, sampling=seeded, seed=3)[0]
    assert len(out[3]) >= N and all(0 <= t < base.config.vocab_size for t in out[3])


def test_draft_vocabulary_on_the_device(models):
    """Heads drafting over a subset of the vocabulary (its columns mapped back to ids on the device): plain greedy."""
    base, heads = models["clover2"]
    vocab = np.arange(0, base.config.vocab_size, 2, dtype=np.int64)  # every other token
    runner = BatchedTorchRunner(base, heads, "random:clover2", draft_vocab=vocab)
    got, per_step = decode_together(runner, resolve_tree("small"), BATCH)
    for i, p in enumerate(BATCH):
        assert_identical(got[i], plain_tokens(base, p), f"draft vocabulary, sequence {i}", TorchRunner(base), p)


def test_decode_refuses_what_it_cannot_step(models):
    base, heads = models["clover2"]
    runner = BatchedTorchRunner(base)
    slot = runner.open_slot(8)
    runner.forward(np.array([5, 6]), np.arange(2), np.tri(2, dtype=bool), slot=slot)
    runner.commit(np.arange(2), np.array([6, 7]), slot=slot)
    with pytest.raises(Exception, match="no draft heads"):
        runner.decode([slot], resolve_tree("small"))
    assert runner.decode([slot], resolve_tree("plain"))[0][0].tolist() == [0]
    with_heads = BatchedTorchRunner(base, heads)
    full = with_heads.open_slot(8)
    with_heads.forward(np.array([5, 6]), np.arange(2), np.tri(2, dtype=bool), slot=full)
    with_heads.commit(np.arange(2), np.array([6, 7]), slot=full)
    with pytest.raises(Exception, match="exceed the capacity"):
        with_heads.decode([full], resolve_tree("chain-7"))


@pytest.mark.parametrize("stop_early", [False, True])
def test_generator_overlap_changes_no_token(models, tmp_path, stop_early):
    """The Generator launching each device-side step before taking in the last one: the same tokens and text as
    without, plain and speculative, also when a stop token ends the output while a step is in flight (its tokens
    dropped), and the runner serves the next request from a clean start."""
    from helpers import tiny_tokenizer_dir

    from clover.runtime.generator import Generator
    from clover.runtime.params import GenerationParams
    from clover.runtime.tokenizer import Tokenizer

    base, heads = models["clover2"]
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path, vocab=base.config.vocab_size))
    want = plain_tokens(base, BATCH[0])
    stop = (want[9],) if stop_early else ()
    params = GenerationParams(max_new_tokens=N, ignore_eos=True, stop_token_ids=stop)
    outputs, calls = {}, {}
    for spec in ("plain", "small"):
        for overlap in (False, True):
            runner = Counting(base, heads)
            runner.calls = []
            gen = Generator(runner, tok, spec, overlap=overlap)
            first = gen.generate(BATCH[0], params)
            again = gen.generate(BATCH[2], params)
            outputs[spec, overlap] = (tuple(first.token_ids), first.text, tuple(again.token_ids))
            calls[spec, overlap] = len(runner.calls)
        # overlapped: each request's last step launched one more, found finished when it was taken in
        assert calls[spec, True] == calls[spec, False] + 2, calls
    assert len(set(outputs.values())) == 1, outputs
    ids = list(outputs["plain", False][0])
    assert ids == (want[: want.index(stop[0]) + 1] if stop_early else want)


def test_engine_overlap_at_concurrency_changes_no_token(models, tmp_path):
    """clover.Engine on the stacked runner, 8 requests at once with 4 slots (requests join as others end, one is
    cut short by a stop token): every request's tokens are its plain greedy ones, overlap on and off, and every
    slot comes back."""
    from helpers import tiny_tokenizer_dir

    from clover.runtime.engine import Engine
    from clover.runtime.params import EngineOptions, GenerationParams
    from clover.runtime.tokenizer import Tokenizer

    base, heads = models["clover2"]
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path, vocab=base.config.vocab_size))
    prompts = [BATCH[i % 3][: 5 + i] for i in range(8)]
    want = [plain_tokens(base, p) for p in prompts]
    results, launched = {}, {}
    for overlap in (False, True):
        runner = Counting(base, heads)
        runner.calls = []
        with Engine(runner, tok, "small", log=None, options=EngineOptions(max_batch=4), overlap=overlap) as engine:
            streams = [
                engine.stream(p, GenerationParams(max_new_tokens=N, ignore_eos=True, stop_token_ids=stop))
                for p, stop in zip(prompts, [(), (want[1][6],)] + [()] * 6)
            ]
            results[overlap] = [s.wait().token_ids for s in streams]
        assert max(runner.calls) == 4 and runner.open_slots == 0, (runner.calls, runner.open_slots)
        launched[overlap] = len(runner.calls)
    assert launched[True] > launched[False], launched  # overlapped steps ran (the ended requests' extra ones)
    for i, p in enumerate(prompts):
        expect = want[i][: want[i].index(want[1][6]) + 1] if i == 1 else want[i]
        for overlap in (False, True):
            assert_identical(results[overlap][i], expect, f"request {i}, overlap {overlap}", TorchRunner(base), p)


@pytest.mark.parametrize("spec", ["plain", "small"])
def test_logits_processors_on_the_device_equal_the_host_path(models, spec):
    """Penalties (repetition, frequency, presence), logit bias and min_tokens applied on the device, each tree row
    with its own path's history: the device-side steps emit what plain greedy decoding with the same processors
    emits on the host path (TorchRunner), sequence by sequence in a batch."""
    base, heads = models["clover2"]
    plain = [plain_tokens(base, p) for p in BATCH]
    stop = (plain[0][2], plain[1][1])  # tokens greedy emits early: masked until min_tokens
    sampling = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        logit_bias={plain[2][0]: -3.0, 5: 2.5},
        min_tokens=6,
    )
    host, _ = decode_together(TorchRunner(base), resolve_tree("plain"), BATCH, sampling=sampling, stop_ids=stop)
    assert host != [p[:N] for p in plain]  # the processors change the output
    runner = Counting(base, heads)
    runner.calls = []
    got, _ = decode_together(runner, resolve_tree(spec), BATCH, hold=(1,), sampling=sampling, stop_ids=stop)
    assert max(runner.calls) == len(BATCH), runner.calls
    for i, p in enumerate(BATCH):
        assert_identical(got[i], host[i], f"{spec} sequence {i} with processors")


@pytest.mark.parametrize("spec", ["plain", "small"])
def test_allowed_tokens_and_bad_words_through_the_stacked_runner_equal_the_host_path(models, spec):
    """allowed_token_ids and one-token bad words masked on the device, longer bad words on the host path (their rows
    read the tokens themselves): what plain greedy decoding with the same masks emits, sequence by sequence."""
    base, heads = models["clover2"]
    plain = [plain_tokens(base, p) for p in BATCH]
    for sampling in (
        SamplingParams(allowed_token_ids=tuple(range(0, 96, 2)), bad_words=((plain[0][1],),)),
        SamplingParams(bad_words=((plain[0][1],), tuple(plain[1][2:4]))),
    ):
        host, _ = decode_together(TorchRunner(base), resolve_tree("plain"), BATCH, sampling=sampling)
        assert host != [p[:N] for p in plain]  # the masks change the output
        got, _ = decode_together(BatchedTorchRunner(base, heads), resolve_tree(spec), BATCH, sampling=sampling)
        for i in range(len(BATCH)):
            assert_identical(got[i], host[i], f"{spec} sequence {i} with {sampling}")


@pytest.mark.parametrize("spec", ["plain", "chain-4", "mc26"])
def test_device_processors_equal_the_numpy_ones_bit_for_bit(spec):
    """DeviceProcessors.apply against LogitsProcessors.apply (the reference) on random rows: drafted tokens from a
    small range (repeats along paths, and of the history), every processor on, min_tokens reached inside the tree;
    a row without processors unchanged. Bit equality: the same elementwise formula in the same precision."""
    from clover.runtime.backends.torch_batch import DeviceProcessors

    tree, V = resolve_tree(spec), 40
    rng = np.random.default_rng(1)
    dt = DeviceTree.of(tree, torch.device("cpu"))
    sampling = SamplingParams(
        repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4, logit_bias={3: 4.0, 7: -2.5}, min_tokens=7
    )
    allowed = dataclasses.replace(sampling, allowed_token_ids=tuple(range(0, V, 3)))
    rows = []
    for b in range(3):
        p = LogitsProcessors(allowed if b == 1 else sampling, rng.integers(0, V, 6), [1, 2], V)
        p.extend(rng.integers(0, 8, 3 + b).tolist())
        rows.append(p)
    device = DeviceProcessors(4, V, torch.device("cpu"))
    for b, p in enumerate(rows):
        device.sync(b, p)
    device.sync(3, None)
    logits = rng.standard_normal((4, tree.num_nodes, V)).astype(np.float32) * 3
    tokens = rng.integers(0, 8, (4, tree.num_nodes))
    got = device.apply(torch.tensor(logits), torch.tensor(tokens), dt).numpy()
    for b, p in enumerate(rows):
        want = p.apply(logits[b], tree, tokens[b])
        assert np.array_equal(got[b], want), (b, np.abs(got[b] - want).max())
    assert np.array_equal(got[3], logits[3])


def test_device_laws_equal_the_host_laws():
    """Law.probs (temperature, top-k, min-p, top-p per row, as torch ops) against runtime/sampling.probs_from_logits
    on the same rows: the same support (ties at the k-th place and in the nucleus by lower id), the same values."""
    from clover.runtime.backends.torch_batch import Law
    from clover.runtime.sampling import probs_from_logits

    rng = np.random.default_rng(4)
    logits = np.round(rng.normal(size=(6, 50)) * 2, 1).astype(np.float32)  # rounded: ties occur
    rows = [
        (0.8, 1.0, 0, 0.0),
        (1.2, 0.9, 0, 0.0),
        (0.7, 1.0, 5, 0.0),
        (1.0, 1.0, 0, 0.2),
        (0.9, 0.6, 8, 0.05),
        (1.0, 0.8, 1, 0.0),
    ]
    law = Law(*torch.tensor(np.array(rows, dtype=np.float32).T))
    got = law.probs(torch.tensor(logits)).numpy()
    for b, (t, top_p, top_k, min_p) in enumerate(rows):
        want = probs_from_logits(logits[b : b + 1], SamplingParams(t, top_p, top_k=top_k, min_p=min_p))[0]
        assert np.array_equal(got[b] > 0, want > 0), b
        np.testing.assert_allclose(got[b], want, atol=1e-6)


def logprobs_together(runner, tree, prompts, ks, sampling=SamplingParams()) -> list[list]:
    """decode_together with `ks[i]` log-probability alternatives for sequence i (None: none): each sequence's first
    N StepLogprobs entries as (token, value, top ids, top values)."""
    steps = [[] for _ in prompts]
    decode_together(runner, tree, prompts, sampling=sampling, logprobs=ks, steps=steps)
    out = [[] for _ in prompts]
    for i, k in enumerate(ks):
        for st in steps[i]:
            assert (st.logprobs is None) == (k is None or not st.tokens)
            for e in st.logprobs.entries(range(len(st.tokens))) if st.logprobs is not None else ():
                out[i].append((e.token_id, e.logprob, [t for t, _ in e.top], [v for _, v in e.top]))
    return [o[:N] for o in out]


@pytest.mark.parametrize("spec", ["plain", "small"])
def test_logprobs_on_the_device_equal_the_host_path(models, spec):
    """Log-probabilities computed on the device (the accepted path's raw rows, in the step's one copy back) for the
    sequences that ask, beside one that does not, with penalties on: the host path's tokens and top ids, its values
    within the paths' tolerance (tests/numerics.py: the stacked forward and the host's run different kernels; a
    float32 log-sum-exp here, float64 there)."""
    base, heads = models["clover2"]
    sampling = SamplingParams(repetition_penalty=1.3, logit_bias={5: 2.5})
    ks = [3, None, 20]
    host = logprobs_together(TorchRunner(base), resolve_tree("plain"), BATCH, ks, sampling)
    runner = Counting(base, heads)
    runner.calls = []
    got = logprobs_together(runner, resolve_tree(spec), BATCH, ks, sampling)
    assert max(runner.calls) == len(BATCH), runner.calls  # on the device, all three in one step
    reduction = chain_reduction(base.config, context=max(map(len, BATCH)) + N)
    for i, k in enumerate(ks):
        assert len(got[i]) == (N if k is not None else 0)
        for j, (g, h) in enumerate(zip(got[i], host[i])):
            assert g[0] == h[0] and g[2] == h[2] and len(g[2]) == k, (i, j, g, h)
            assert_close_paths([g[1], *g[3]], [h[1], *h[3]], reduction=reduction, msg=f"sequence {i} token {j}")


def test_engine_options_device_loads_the_stacked_runner(tmp_path):
    """EngineOptions.device (clover-generate --device): the torch backend runs the stacked runner there, with the
    same tokens as the per-sequence runner; other backends and unusable devices are refused with the fix."""
    from helpers import tiny_hf_folder

    from clover.errors import CloverError
    from clover.runtime.generator import Generator
    from clover.runtime.params import EngineOptions, GenerationParams

    folder = tiny_hf_folder(tmp_path / "base")
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    stacked = Generator.load(folder, "random:clover2", "torch", "small", EngineOptions(device="cpu"))
    alone = Generator.load(folder, "random:clover2", "torch", "small")
    assert isinstance(stacked.runner, BatchedTorchRunner) and isinstance(alone.runner, TorchRunner)
    assert stacked.generate([5, 6, 7], params).token_ids == alone.generate([5, 6, 7], params).token_ids
    with pytest.raises(CloverError, match="use it with --backend torch"):
        Generator.load(folder, None, "ort", None, EngineOptions(device="cpu"))
    with pytest.raises(CloverError, match="not usable here"):
        Generator.load(folder, None, "torch", None, EngineOptions(device="nodevice"))
    with pytest.raises(CloverError, match="device must be"):
        EngineOptions(device="")
