"""One suite for every runner (docs/design.md, Conventions 5, 9), parametrized over kinds x head architectures:

  torch       TorchRunner over the PyTorch modules the artifacts are exported from (ort_helpers.tiny_modules)
  torch-batch BatchedTorchRunner over the same modules: one stacked cache, one forward for every slot
  ort         OrtRunner over the tiny artifact as clover-export --backend onnx writes it (one shared LM head)
  trt-on-ort  TrtRunner's bookkeeping with ONNX Runtime in place of its engines (ort_helpers.cpu_runner)
  trt         TrtRunner over TensorRT engines built from the tiny artifact (a GPU with TensorRT only)

On every runner greedy speculative decoding emits its own plain greedy tokens. Across kinds (the same fp32
weights): ONNX Runtime's plain tokens, the same drafts (so the same tokens accepted at every step), and logits
within the path tolerance (numerics.py). Slots are independent: two sequences stepped in turn or together in one forward emit their
solo tokens, a batched forward gives each slot its own forward's logits, and a released slot is free again.
Token lists are compared by helpers.assert_identical, tested first.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from helpers import assert_identical, greedy_margin, run_tokens
from numerics import assert_close_paths, assert_exact, chain_reduction
from ort_helpers import HEADS_SEED, PROMPTS, cpu_runner, no_tensorrt_gpu, tiny_artifact, tiny_modules

from clover.models.decoder import causal_mask
from clover.runtime.backend import Runner, Verify
from clover.runtime.backends.torch_batch import BatchedTorchRunner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.loop import LOOKUP_DRAFTS, Decoding, step
from clover.runtime.sampling import SamplingParams
from clover.runtime.tree import Tree, prune_tree, resolve_tree

N = 24  # tokens per sequence
ARCHS = ("medusa", "clover", "clover2")
TREES = ("small", "chain-3")  # branching and chain, cut to the heads' depth (clover: 3)
TRT = pytest.param(
    "trt", marks=[pytest.mark.gpu, pytest.mark.skipif(no_tensorrt_gpu() is not None, reason=str(no_tensorrt_gpu()))]
)
KINDS = ("torch", "torch-batch", "ort", "trt-on-ort", TRT)
# fp32 logits. Across kinds (a kind against ONNX Runtime: other kernels, other summation orders; TensorRT on a
# GPU, TF32 off): numerics.assert_close_paths over the decoder's chain. Within one runner, the same rows in one
# batched forward or alone: bit for bit on the CPU (torch runs each slot alone; ONNX Runtime's batched graph is
# checked bit-exact against the solo one when exported), within the path tolerance on a GPU (TensorRT's kernels
# need not be deterministic) and for the stacked torch runner (several slots' rows in one matmul: other blocking).
EXACT_WITHIN = {"torch": True, "torch-batch": False, "ort": True, "trt-on-ort": True, "trt": False}


# -- the comparator -------------------------------------------------------------------------------------------


def test_assert_identical_names_the_first_difference_and_the_margin():
    base = tiny_modules("none")[0]
    runner, prompt = TorchRunner(base), PROMPTS[0]
    want, _ = run_tokens(runner, prompt, resolve_tree("plain"), 8)
    assert_identical(list(want), want)
    with pytest.raises(AssertionError) as e:
        assert_identical(want[:5], want, "short")
    assert str(e.value) == "short: tokens differ at index 5: one output is a prefix of the other, lengths 5 vs 8"
    got = want[:3] + [(want[3] + 1) % 96] + want[4:]
    with pytest.raises(AssertionError) as e:
        assert_identical(got, want)
    assert str(e.value) == f"tokens diverge at index 3: {got[3]} vs {want[3]}"
    # the margin: the plain logits at index 3, re-derived with one causal forward of the whole prefix
    with torch.no_grad():
        ids = torch.tensor([prompt + want[:3]])
        T = ids.shape[1]
        top2 = torch.topk(
            base(ids, torch.arange(T)[None], causal_mask(T), torch.tensor([0]), *base.empty_cache(1, 0)).logits[0, -1],
            2,
        ).values
    margin = float(top2[0] - top2[1])
    assert greedy_margin(runner, prompt, want[:3]) == pytest.approx(margin, abs=1e-4)
    with pytest.raises(AssertionError) as e:
        assert_identical(got, want, "spec", reference=runner, prompt=prompt)
    msg = str(e.value)
    assert (
        msg.startswith(
            f"spec: tokens diverge at index 3: {got[3]} vs {want[3]}; torch reference top-2 logit margin there "
        )
        and "\n" not in msg
    )
    assert float(msg.rsplit(" ", 1)[1]) == pytest.approx(margin, rel=1e-2)
    assert runner.open_slots == 1  # the margin's slot is released; the solo sequence is left alone


# -- the runners ----------------------------------------------------------------------------------------------


class Runners:
    """Each kind's runner of each head arch, plain (heads=False) or with its heads, built on first use; the plain
    greedy tokens of each (kind, arch, prompt), decoded once."""

    def __init__(self, root, tmp):
        self.root, self.tmp = root, tmp
        self.runners: dict[tuple[str, str, bool], Runner] = {}
        self.plain: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}

    def __call__(self, kind: str, arch: str, heads: bool = True) -> Runner:
        key = (kind, arch, heads)
        if key not in self.runners:
            self.runners[key] = self._load(kind, arch, heads)
        return self.runners[key]

    def _load(self, kind: str, arch: str, heads: bool) -> Runner:
        if kind == "torch":
            base, h = tiny_modules(arch)
            return TorchRunner(base, h, f"random:{arch}:{HEADS_SEED}") if heads else TorchRunner(base)
        if kind == "torch-batch":
            base, h = tiny_modules(arch)
            return BatchedTorchRunner(base, h, f"random:{arch}:{HEADS_SEED}") if heads else BatchedTorchRunner(base)
        if kind == "ort":
            from clover.runtime.backends.ort import load_runner

            return load_runner(tiny_artifact(self.root, arch), heads="artifact" if heads else "none")
        if kind == "trt-on-ort":  # the graphs of a TensorRT artifact: each keeps its LM head
            return cpu_runner(tiny_artifact(self.root, arch, shared_lm_head=False), use_heads=heads)[0]
        assert kind == "trt", kind
        from clover.runtime.backends.trt import load_runner

        return load_runner(self._engines(arch), heads="artifact" if heads else "none")

    def _engines(self, arch: str):
        """The tiny artifact with TensorRT engines built on this GPU (once per arch)."""
        from clover.artifact import file_entries, read_manifest, write_manifest
        from clover.export.engines import EngineLimits, build_engines

        root = self.tmp / arch
        if not root.exists():
            shutil.copytree(tiny_artifact(self.root, arch, shared_lm_head=False), root)
            m = read_manifest(root)
            limits = EngineLimits(
                max_prompt=32, max_tree=26, max_context=m.max_context, max_accepted=6, max_candidates=10
            )
            engines = build_engines(root, m.graphs, m.dtype, limits, self.tmp / "timing.cache", lambda _: None)
            write_manifest(root, dataclasses.replace(m, backend="trt", engines=engines, files=file_entries(root)))
        return root

    def plain_tokens(self, kind: str, arch: str, prompt: list[int]) -> list[int]:
        key = (kind, arch, tuple(prompt))
        if key not in self.plain:
            self.plain[key] = run_tokens(self(kind, arch, heads=False), prompt, resolve_tree("plain"), N)[0]
        return self.plain[key]

    def close(self) -> None:
        for r in self.runners.values():
            r.close()


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    r = Runners(tmp_path_factory.getbasetemp(), tmp_path_factory.mktemp("trt"))
    yield r
    r.close()


def tree_for(runner: Runner, spec: str) -> Tree:
    return prune_tree(resolve_tree(spec), runner.info.heads_max_depth or 99)


# -- greedy identity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain(runners, kind, arch, tree):
    spec, plain = runners(kind, arch), runners(kind, arch, heads=False)
    assert spec.info.backend == plain.info.backend == kind.removesuffix("-on-ort").removesuffix("-batch")
    assert spec.info.heads == arch and plain.info.heads is None
    t = tree_for(spec, tree)
    for p in PROMPTS:
        got, steps = run_tokens(spec, p, t, N)
        assert_identical(got, runners.plain_tokens(kind, arch, p), f"{kind} {arch} {t.name}", plain, p)
        assert all(1 <= s <= t.max_depth + 1 for s in steps), steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_heads_and_lookup_in_one_tree_equal_plain(runners, kind, arch):
    """drafts="heads+lookup": prompt-lookup paths merged into the heads' tree (new branches and rows on every
    backend) still emit plain decoding's tokens. The prompt repeats itself, so lookup proposes."""
    spec, plain = runners(kind, arch), runners(kind, arch, heads=False)
    t = tree_for(spec, "small")
    p = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    got, steps = run_tokens(spec, p, t, N, drafts="heads+lookup")
    assert_identical(got, runners.plain_tokens(kind, arch, p), f"{kind} {arch} {t.name}+lookup", plain, p)
    assert max(steps) <= t.max_depth + 1 + LOOKUP_DRAFTS, steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "ort"])
def test_same_tokens_drafts_and_logits_as_onnx_runtime(runners, kind, arch):
    """The artifact holds the modules' weights: ORT's plain tokens, ORT's drafts (the same tokens accepted at
    every step), and ORT's logits of a prefill, a drafted tree's verify, draft_begin and draft_step."""
    ort_plain, ort_spec, spec = runners("ort", arch, heads=False), runners("ort", arch), runners(kind, arch)
    t = tree_for(spec, "small")
    for p in PROMPTS:
        assert_identical(
            runners.plain_tokens(kind, arch, p),
            runners.plain_tokens("ort", arch, p),
            f"{kind} plain vs ort plain",
            ort_plain,
            p,
        )
        assert run_tokens(spec, p, t, N)[1] == run_tokens(ort_spec, p, t, N)[1], f"{kind} {arch}: accepted per step"
    names = ("prefill", "draft_begin", "draft_step 1", "draft_step 2", "verify")
    reduction = logit_reduction()
    for name, got, want in zip(names, logit_trace(spec, t), logit_trace(ort_spec, t)):
        assert_close_paths(got, want, reduction=reduction, msg=f"{kind} {arch} {name}")


def logit_reduction() -> int:
    """The tiny base's chain (numerics.chain_reduction) over a 64-token context; the heads' chains are shorter."""
    return chain_reduction(tiny_modules("none")[0].config, context=64)


def logit_trace(runner: Runner, tree: Tree) -> list[np.ndarray]:
    """Logits of a prompt's every row [P, V], then the root's draft [V], depth 1's and depth 2's drafts [3, V] and
    the verify of `tree` [T, V] with tokens drafted for it."""
    prompt = np.array(PROMPTS[1])
    P = len(prompt)
    runner.reset(64)
    out = [runner.forward(prompt, np.arange(P), np.tri(P, dtype=bool))]
    runner.commit(np.arange(P), np.append(prompt[1:], 7))
    out.append(runner.draft_begin())
    out.append(runner.draft_step(1, np.array([1, 2, 3]), np.zeros(3, np.int64), np.array([7, 8, 9])))
    out.append(runner.draft_step(2, np.array([4, 5, 6]), np.array([1, 2, 3]), np.array([10, 11, 12])))
    tokens = np.concatenate(([7], np.arange(tree.num_nodes - 1) * 7 % 90 + 3))
    out.append(runner.forward(tokens, tree.depth, tree.ancestor_mask))
    return out


# -- slots --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_two_slots_in_turn_or_together_emit_their_solo_tokens(runners, kind, arch):
    runner = runners(kind, arch)
    t = tree_for(runner, "small")
    solo = [run_tokens(runner, p, t, N)[0] for p in PROMPTS]
    for together in (False, True):
        ds = [
            Decoding(
                slot=runner.open_slot(len(p) + N + t.num_nodes),
                prompt=np.array(p),
                tree=t,
                sampling=SamplingParams(),
                rng=np.random.default_rng(0),
            )
            for p in PROMPTS
        ]
        out: list[list[int]] = [[] for _ in ds]
        while live := [i for i, d in enumerate(ds) if len(out[i]) < N and not d.full]:
            for group in [live] if together else [[i] for i in live]:  # one forward_batch per group
                for i, st in zip(group, step(runner, [ds[i] for i in group])):
                    out[i] += st.tokens
        for i, (d, p) in enumerate(zip(ds, PROMPTS)):
            assert_identical(
                out[i][:N],
                solo[i],
                f"{kind} {arch} slot {d.slot.index} {'together' if together else 'in turn'}",
                runners(kind, arch, heads=False),
                p,
            )
            runner.release(d.slot)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_batch_equals_separate_forwards(runners, kind, arch):
    """One forward_batch over several slots (a prompt's last row, a prompt's every row; then a drafted tree and
    a plain step) gives each slot the logits of its own forward, and the same drafts after the commit."""
    runner = runners(kind, arch)
    t = tree_for(runner, "small")
    a, b = (np.array(p) for p in PROMPTS)
    tree_tokens = np.concatenate(([7], np.arange(t.num_nodes - 1) * 5 % 90 + 3))
    rounds = [
        lambda s: [
            Verify(s[0], a, np.arange(len(a)), np.tri(len(a), dtype=bool), last_only=True),
            Verify(s[1], b, np.arange(len(b)), np.tri(len(b), dtype=bool)),
        ],
        lambda s: [
            Verify(s[0], tree_tokens, t.depth, t.ancestor_mask),
            Verify(s[1], np.array([9]), np.zeros(1, np.int64), np.ones((1, 1), bool)),
        ],
    ]
    batched, separate = [runner.open_slot(64) for _ in range(2)], [runner.open_slot(64) for _ in range(2)]

    def same(g, w, msg):
        if EXACT_WITHIN[kind]:
            assert_exact(g, w, msg)
        else:
            assert_close_paths(g, w, reduction=logit_reduction(), msg=msg)

    for k, verifies in enumerate(rounds):
        got = runner.forward_batch(verifies(batched))
        want = [runner.forward(v.tokens, v.depths, v.mask, v.last_only, slot=v.slot) for v in verifies(separate)]
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{kind} {arch} round {k} slot {i}")
        for pair in (batched, separate):
            for v in verifies(pair):
                rows = len(v.tokens) if k == 0 else 1  # a prompt's rows; the tree's root (a plain step's row)
                runner.commit(np.arange(rows), np.append(v.tokens[1:rows], 11 + k), slot=v.slot)
        for i in range(2):
            same(
                runner.draft_begin(batched[i]),
                runner.draft_begin(separate[i]),
                f"{kind} {arch} draft_begin after round {k} slot {i}",
            )
    for s in batched + separate:
        runner.release(s)


@pytest.mark.parametrize("kind", KINDS)
def test_release_frees_the_slot(runners, kind):
    runner = runners(kind, "clover2")
    n = runner.open_slots
    first, second = runner.open_slot(32), runner.open_slot(32)
    assert runner.open_slots == n + 2 and first.index != second.index
    runner.forward(np.array([5, 6]), np.arange(2), np.tri(2, dtype=bool), slot=first)
    runner.release(first)
    runner.release(first)  # idempotent
    assert runner.open_slots == n + 1 and first.state is None
    with pytest.raises(AssertionError, match="slot is not open"):
        runner.forward(np.array([5]), np.zeros(1, np.int64), np.ones((1, 1), bool), slot=first)
    again = runner.open_slot(32)
    assert again.index == first.index and again.past == 0  # the lowest free number, a fresh sequence
    for s in (second, again):
        runner.release(s)
    assert runner.open_slots == n
