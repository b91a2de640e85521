"""ONNX Runtime backend on tiny exported artifacts: in-place KV compaction, cache growth, the heads' catch-up,
options and errors, fp16, and running with torch blocked. Token identity and PyTorch's logits and drafts on
every runner: tests/runtime/test_runners.py."""

import json

import numpy as np
import pytest
from helpers import OracleDraft, assert_identical, run_python, run_tokens
from numerics import assert_close_paths, chain_reduction
from ort_helpers import PROMPTS, tiny_artifact, tiny_modules

from clover.artifact import read_manifest
from clover.errors import CloverError
from clover.runtime.backend import RunnerInfo, backend_module
from clover.runtime.backends.ort import OrtOptions, OrtRunner, load_runner
from clover.runtime.backends.torch_runner import TorchRunner
from clover.runtime.generator import Generator
from clover.runtime.loop import chain, speculative_steps
from clover.runtime.params import GenerationParams
from clover.runtime.tree import resolve_tree

N = 40
ARCHS = ("medusa", "clover", "clover2")


@pytest.fixture(scope="module")
def base():
    return tiny_modules("none")[0]


@pytest.fixture(scope="module")
def torch_plain(base):
    return {tuple(p): run_tokens(TorchRunner(base), p, resolve_tree("plain"), N)[0] for p in PROMPTS}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {arch: tiny_artifact(root, arch) for arch in ARCHS}


class OracleOrtRunner(OracleDraft, OrtRunner):
    """Drafts the known greedy continuation at rank 0 (as helpers.OracleRunner): long accepted paths."""

    def __init__(self, root, reference):
        from clover.artifact import open_artifact

        super().__init__(root, open_artifact(root), use_heads=False)
        self.reference = reference
        self.rng = np.random.default_rng(0)
        self.info = RunnerInfo("ort", self.vocab_size, self.info.max_context, "oracle", None, "oracle")


def test_kv_compaction_in_place_matches_plain_cache(base, torch_plain, artifacts):
    """Long non-contiguous accepted paths: the compacted cache equals the cache of plain decoding,
    written into the same buffers the graph reads (never reallocated during a sequence)."""
    prompt = PROMPTS[1]
    want = torch_plain[tuple(prompt)]
    oracle = OracleOrtRunner(artifacts["clover2"], prompt + want)
    t = resolve_tree("mc26")
    oracle.reset(len(prompt) + N + t.num_nodes)
    buffers = [id(b) for b in oracle.cache.buffers]
    got, steps = run_tokens(oracle, prompt, t, N)
    assert_identical(got, want, "oracle drafts, mc26")
    assert np.mean(steps) > 3 and steps[0] == t.max_depth + 1
    assert [id(b) for b in oracle.cache.buffers] == buffers  # same capacity: buffers reused, bound once
    torch_runner = TorchRunner(base)
    run_tokens(torch_runner, prompt, resolve_tree("plain"), N)
    n = min(oracle.past_length, torch_runner.past_length)
    assert n > len(prompt) + 20
    theirs = [c.numpy() for c in torch_runner.cache[0] + torch_runner.cache[1]]
    ours = oracle.cache.buffers[0::2] + oracle.cache.buffers[1::2]  # bound in key, value order per layer
    for a, b in zip(ours, theirs):
        # the layer's K/V projections over the chain of the layers before it
        assert_close_paths(a[:, :, :n], b[:, :, :n], reduction=chain_reduction(base.config, context=n))


def test_cache_grows_by_doubling_and_stays_exact(artifacts, torch_plain):
    """Buffers start at cache_block slots and double (capped at the capacity) without changing a token."""
    for heads, block in (("artifact", 4), ("none", 1)):
        runner = load_runner(artifacts["clover2"], heads=heads, options=OrtOptions(cache_block=block))
        for p in PROMPTS:
            got, _ = run_tokens(runner, p, resolve_tree("mc26" if heads == "artifact" else "plain"), N)
            assert_identical(got, torch_plain[tuple(p)], f"cache_block {block}")
            assert runner.past_length <= runner.cache.slots <= runner.capacity
            assert runner.cache.slots < 2 * runner.past_length + 26
        if heads == "artifact":
            assert runner.head_cache.slots >= runner.past_length


def test_forward_outputs_and_edge_sizes(base, artifacts):
    """Logits of one new token after an empty cache and of a full tree match PyTorch; returned arrays
    belong to the caller (a later step does not overwrite them)."""
    runner = load_runner(artifacts["clover"], heads="none")
    ref = TorchRunner(base)
    t = resolve_tree("mc26")
    for r in (runner, ref):
        r.reset(64)
    first = runner.forward(np.array([5]), np.array([0]), np.ones((1, 1), bool))
    first_copy = first.copy()
    K = chain_reduction(base.config, context=t.num_nodes + 1)
    assert_close_paths(first, ref.forward(np.array([5]), np.array([0]), np.ones((1, 1), bool)), reduction=K)
    for r in (runner, ref):
        r.commit(np.array([0]), np.array([9]))
    tokens = np.arange(t.num_nodes) % 90 + 3
    got = runner.forward(tokens, t.depth, t.ancestor_mask)
    assert got.shape == (t.num_nodes, 96) and got.dtype == np.float32
    assert_close_paths(got, ref.forward(tokens, t.depth, t.ancestor_mask), reduction=K)
    np.testing.assert_array_equal(first, first_copy)


def test_heads_catch_up_after_plain_steps(artifacts):
    """Plain steps leave the heads' begin graph alone; the next draft_begin runs it over every accepted row at
    once, with the same result as the torch runner, which runs it at every commit."""
    for arch in ("clover", "clover2"):
        b, h = tiny_modules(arch)
        ort_runner, torch_runner = load_runner(artifacts[arch]), TorchRunner(b, h)
        prompt = np.array(PROMPTS[1])
        calls = []
        begin = ort_runner.drafter.begin_graph
        begin.run = (lambda run: lambda *a: calls.append(1) or run(*a))(begin.run)
        for r in (ort_runner, torch_runner):
            r.reset(64)
            r.forward(prompt, np.arange(len(prompt)), np.tri(len(prompt), dtype=bool))
            r.commit(np.arange(len(prompt)), np.append(prompt[1:], 7))
            for token, following in ((7, 8), (8, 9), (9, 10)):  # three plain steps
                r.forward(np.array([token]), np.array([0]), np.ones((1, 1), bool))
                r.commit(np.array([0]), np.array([following]))
        assert calls == []  # nothing drafted yet: the heads have not run
        assert_close_paths(
            ort_runner.draft_begin(),
            torch_runner.draft_begin(),
            reduction=chain_reduction(b.config, context=16),
            msg=arch,
        )
        assert calls == [1]  # one run over the prompt and the three steps


def test_the_heads_read_the_prompt_in_the_prefill(artifacts):
    """A sequence that drafts with the heads has them read its prompt in the prefill step (its first token's
    wait, like the base's prompt pass), so the first speculative step drafts without reading anything more; one
    that does not draft with them (plain, lookup) leaves them alone."""
    runner = load_runner(artifacts["clover2"])
    calls = []
    begin = runner.drafter.begin_graph
    begin.run = (lambda run: lambda inputs, *a: calls.append(inputs["next_tokens"].shape[1]) or run(inputs, *a))(
        begin.run
    )
    prompt = np.array(PROMPTS[1])
    for tree, prefill in (("mc26", [len(prompt)]), ("plain", [])):
        calls.clear()
        steps = speculative_steps(runner, prompt, resolve_tree(tree), GenerationParams(), "heads", capacity=64)
        next(steps)  # the prefill: the first token
        assert calls == prefill, tree
        next(steps)
        assert calls == prefill, tree
    calls.clear()
    lookup = speculative_steps(runner, prompt, chain(4), GenerationParams(), "lookup", capacity=64)
    next(lookup), next(lookup)
    assert calls == []


def test_load_runner_options_and_errors(artifacts):
    path = artifacts["clover2"]
    assert backend_module("ort").load_runner is load_runner
    runner = load_runner(
        path, heads="random:clover2:0", dtype="float32", threads=1, options=OrtOptions(checksums=False)
    )
    assert runner.info.backend == "ort" and runner.info.heads_name == "random:clover2:0"
    assert runner.info.default_tree.name == read_manifest(path).tree.name and runner.info.max_context == 256
    with runner:
        pass
    assert runner.base is None  # closed
    with pytest.raises(CloverError, match="holds float32 graphs, not float16"):
        load_runner(path, dtype="float16")
    with pytest.raises(CloverError, match="carries clover2 heads from random:clover2:0; --heads random:medusa cannot"):
        load_runner(path, heads="random:medusa")
    with pytest.raises(CloverError, match="threads must be >= 0"):
        load_runner(path, threads=-1)
    with pytest.raises(CloverError, match="exceed the sequence capacity"):
        r = load_runner(path)
        r.reset(4)
        r.forward(np.arange(5), np.arange(5), np.tri(5, dtype=bool))


def test_generator_uses_the_artifact_tree_and_tokenizer(artifacts, base):
    m = read_manifest(artifacts["clover"])
    gen = Generator.load(artifacts["clover"], backend="ort")
    assert gen.drafts == m.drafts  # the draft source timed fastest at export
    gen = Generator.load(artifacts["clover"], heads="artifact", backend="ort")
    assert gen.tree.name == m.tree.name and gen.runner.info.heads == "clover"
    plain = Generator.load(artifacts["clover"], heads="none", backend="ort")
    assert plain.tree.num_nodes == 1
    a = gen.generate("w7 w8 w9 w40", GenerationParams(max_new_tokens=16, ignore_eos=True))
    b = plain.generate("w7 w8 w9 w40", GenerationParams(max_new_tokens=16, ignore_eos=True))
    assert a.token_ids == b.token_ids and a.backend == "ort" and a.heads == "random:clover:0"


def test_runs_without_torch(artifacts, torch_plain):
    """The ORT backend, the loop and the Generator with torch (and transformers) impossible to import."""
    prompt = PROMPTS[0]
    code = (
        "import json, sys\n"
        "for name in ('torch', 'transformers', 'tensorrt'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from clover.runtime.generator import Generator\n"
        "from clover.runtime.params import GenerationParams\n"
        "out = {}\n"
        "for heads in ('artifact', 'none'):\n"
        f"    gen = Generator.load({str(artifacts['clover2'])!r}, heads=heads, backend='ort')\n"
        f"    out[heads] = gen.generate({prompt!r}, GenerationParams(max_new_tokens={N}, ignore_eos=True)).token_ids\n"
        "bad = [m for m in sys.modules if m.startswith(('clover.models', 'clover.export'))]\n"
        "assert not bad, bad\n"
        "print(json.dumps(out))\n"
    )
    out = json.loads(run_python(code))
    assert out["artifact"] == out["none"] == torch_plain[tuple(prompt)]


def test_fp16_artifact_speculative_equals_plain(tmp_path_factory):
    """docs/design.md "Ground truth" holds per backend and precision: ORT fp16 speculative == ORT fp16 plain."""
    path = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", "float16")
    plain, spec = load_runner(path, heads="none"), load_runner(path)
    assert plain.cache is None and spec.info.default_tree.name == read_manifest(path).tree.name
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), N)
        assert plain.cache.buffers[0].dtype == np.float16
        for t in ("mc26", "chain-6"):
            got, _ = run_tokens(spec, p, resolve_tree(t), N)
            assert_identical(got, want, f"ORT fp16 clover2 {t}")


def test_every_session_spins_while_its_run_lasts_and_stops_after_it():
    from clover.runtime.backends.ort import OrtOptions, session_options

    entry = lambda so, key: so.get_session_config_entry(key)  # noqa: E731
    so = session_options(OrtOptions(threads=2))
    assert entry(so, "session.intra_op.allow_spinning") == "1" and so.intra_op_num_threads == 2
    # the base, LM-head and draft sessions run one after the other: each stops spinning when its run returns
    assert entry(so, "session.force_spinning_stop") == "1"
    quiet = session_options(OrtOptions(threads=2, spin=False))  # nothing spins: threads sleep between ops
    assert entry(quiet, "session.intra_op.allow_spinning") == "0" and quiet.intra_op_num_threads == 2


def test_threads_zero_takes_omp_num_threads_where_it_is_set(monkeypatch):
    from clover.runtime.backends.ort import OrtOptions, session_options

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert session_options(OrtOptions()).intra_op_num_threads == 3
    assert session_options(OrtOptions(threads=2)).intra_op_num_threads == 2  # an explicit count wins
    for unset in ("", "zero", "0", "-2"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert session_options(OrtOptions()).intra_op_num_threads == 0  # onnxruntime's default
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert session_options(OrtOptions()).intra_op_num_threads == 0
