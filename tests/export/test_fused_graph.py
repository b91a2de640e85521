"""--attention fused: the base written as ONNX Runtime's fused CPU operators, with the KV cache updated in
place. Same I/O as the portable graph; speculative output must equal plain output of the same graph, bit
for bit for chains (also with int8-compute int4 weights), and branching trees are refused where the graph
cannot verify them exactly."""

import collections

import numpy as np
import onnx
import pytest
from helpers import assert_identical, run_tokens
from numerics import assert_close_paths, chain_reduction
from ort_helpers import PROMPTS, tiny_artifact

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.export.config import ExportConfig
from clover.models.config import BaseConfig
from clover.runtime.backends.ort import OrtOptions, load_runner
from clover.runtime.generator import Generator
from clover.runtime.tokenizer import Tokenizer
from clover.runtime.tree import compile_spec, resolve_tree

N = 40
ARCHS = ("medusa", "clover", "clover2")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp()


def ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_fused_base_is_a_few_fused_nodes_per_layer_and_matches_pytorch(root):
    art = tiny_artifact(root, "clover2", attention="fused")
    m = open_artifact(art)
    assert m.attention == "fused" and m.weights is None
    counts = ops(art / m.graphs["base"].file)
    layers = m.base_config["num_layers"]
    assert counts["GroupQueryAttention"] == layers
    assert counts["SkipSimplifiedLayerNormalization"] == 2 * layers
    assert "Softmax" not in counts  # attention is inside GroupQueryAttention
    names = [n.name for n in onnx.load(str(art / m.graphs["base"].file), load_external_data=False).graph.node]
    per_layer = collections.Counter(n.split(".")[1] for n in names if n.startswith("layers."))
    assert max(per_layer.values()) <= 14, per_layer  # the portable graph has ~30 nodes per layer
    assert m.parity["base"]["logits"] < 1e-3
    present = m.graphs["base"].output("present.0.key")
    assert present.shape[2] == "slots"  # the whole buffer, updated in place


def test_fused_draft_begin_is_fused_and_drafts_as_the_traced_one(root):
    """Clover-2's draft_begin in a fused artifact: GroupQueryAttention over the heads' own cache, written in
    place; fed the same accepted rows (one at a time, several at once, past a cache doubling) it drafts what
    the traced graph of a portable artifact drafts."""
    from clover.runtime.backend import Slot

    fused, traced = tiny_artifact(root, "clover2", attention="fused"), tiny_artifact(root, "clover2")
    m = open_artifact(fused)
    counts = ops(fused / m.graphs["draft_begin"].file)
    assert counts["GroupQueryAttention"] == m.heads.num_layers and "Softmax" not in counts
    assert sum(counts.values()) < 80, counts  # traced: ~190
    assert m.graphs["draft_begin"].output("present.0.key").shape[2] == "slots"
    assert m.parity["draft_begin"]["logits"] < 1e-3
    runners = [load_runner(a, options=OrtOptions(cache_block=4)) for a in (fused, traced)]
    assert runners[0].drafter.in_place and not runners[1].drafter.in_place
    rng = np.random.default_rng(0)
    H, V = runners[0].hidden_size, runners[0].vocab_size
    cfg = BaseConfig.from_dict(m.base_config)
    states = [r.drafter.open(4) for r in runners]
    slot = Slot(index=0, capacity=64)
    for rows in (3, 1, 1, 5, 2, 1, 7):  # the cache (4 slots at first) doubles twice
        hidden = rng.standard_normal((1, rows, H)).astype(np.float32)
        tokens = rng.integers(0, V, rows)
        slot.past += rows  # the runner counts accepted rows before the heads see them
        got = []
        for r, st in zip(runners, states):
            r.drafter.accept(st, hidden, tokens)
            got.append((r.drafter.begin(st, slot), np.asarray(st.root_state)))
        # fused and traced graphs: other kernels over the heads' chain (numerics.py), fp32
        reduction = chain_reduction(cfg, layers=m.heads.num_layers + 1, context=slot.past)
        assert_close_paths(got[0][0], got[1][0], reduction=reduction, msg="logits")
        assert_close_paths(got[0][1], got[1][1], reduction=reduction, msg="state")


@pytest.mark.parametrize("tree", ["chain-3", "mc26"])
def test_fp32_fused_speculative_equals_plain(root, tree):
    art = tiny_artifact(root, "clover2", attention="fused")
    plain, speculative = load_runner(art, heads="none"), load_runner(art)
    assert not speculative.info.chains_only  # fp32 compute: every tree runs
    accepted = 0
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), N)
        got, steps = run_tokens(speculative, p, resolve_tree(tree), N)
        assert_identical(got, want, f"fused fp32, {tree}")
        accepted += sum(steps) - len(steps)
    assert accepted > 0, "no drafted token was accepted: the tree's KV compaction went untested"


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_fused_chains_equal_plain(root, arch):
    art = tiny_artifact(root, arch, tree="chain-3", weights="int4", attention="fused")
    m = open_artifact(art)
    assert m.weights.accuracy_level == 4  # int8 compute: exact for chains thanks to the padded 1-token steps
    plain, speculative = load_runner(art, heads="none"), load_runner(art)
    assert speculative.info.chains_only
    for tree in ("chain-1", "chain-3"):
        for p in PROMPTS:
            want, _ = run_tokens(plain, p, resolve_tree("plain"), N)
            got, _ = run_tokens(speculative, p, resolve_tree(tree), N)
            assert_identical(got, want, f"fused int4 {arch}, {tree}")


@pytest.mark.parametrize("two_rows", [None, True])
def test_a_chain_verify_is_bitwise_a_run_of_plain_steps(root, two_rows):
    """As this machine's kernels need (None: the runner's own probe), and with every forward on >= 2 rows
    (GraphRunner.two_rows, which AVX2 CPUs need: MatMulNBits has a 1-row kernel of its own there) forced on."""
    art = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    runner = load_runner(art, heads="none")
    runner.two_rows = runner.two_rows if two_rows is None else two_rows
    prompt, chain = np.array(PROMPTS[1]), np.array([5, 17, 30, 9])

    def prefilled():
        runner.reset(64)
        runner.forward(prompt, np.arange(len(prompt)), np.tri(len(prompt), dtype=bool), last_only=True)
        runner.commit(np.arange(len(prompt)), np.append(prompt[1:], chain[0]))

    prefilled()
    verify = runner.forward(chain, np.arange(len(chain)), np.tri(len(chain), dtype=bool)).copy()
    prefilled()
    for i, token in enumerate(chain):  # the same tokens, one plain step each
        step = runner.forward(chain[i : i + 1], np.zeros(1, np.int64), np.ones((1, 1), bool))
        runner.commit(np.zeros(1, np.int64), chain[i + 1 : i + 2] if i + 1 < len(chain) else np.array([0]))
        np.testing.assert_array_equal(step[0], verify[i], err_msg=f"row {i} of a chain verify vs a plain step")


def test_a_1_row_kernel_is_seen_at_load(root):
    """lone_row_differs compares a 1-token step with the first row of a 2-token chain, logits and hidden state:
    a difference in the last bit of a 1-row product (here made up) turns two_rows on."""
    art = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    runner = load_runner(art, heads="none")
    machine, run = runner.lone_row_differs(), runner.base.run
    assert runner.two_rows == machine

    def skewed(inputs, sizes, into=None):
        out = run(inputs, sizes, into)
        if sizes["new"] == 1:
            out["hidden_states"] = np.nextafter(out["hidden_states"], np.inf)
        return out

    runner.base.run = skewed
    assert runner.lone_row_differs()
    runner.base.run = run
    assert runner.lone_row_differs() == machine


def test_branching_trees_are_refused_where_only_chains_are_exact(root):
    art = tiny_artifact(root, "clover2", tree="chain-3", weights="int4", attention="fused")
    runner = load_runner(art)
    tokenizer = Tokenizer.from_dir(art / open_artifact(art).tokenizer)
    with pytest.raises(CloverError, match=r"tree mc26 branches.*only chains exactly: use plain or chain-N"):
        Generator(runner, tokenizer, "mc26")
    Generator(runner, tokenizer, "chain-2")  # chains are fine
    runner.reset(32)
    mask = resolve_tree("small").ancestor_mask
    with pytest.raises(CloverError, match="only chains exactly"):
        runner.forward(np.arange(len(mask)), resolve_tree("small").depth, mask)


def test_export_time_tree_timing_keeps_to_chains(root):
    art = tiny_artifact(root, "clover2", weights="int4", attention="fused")  # no --tree: timed at export
    m = open_artifact(art)
    timed = set(m.tree_timing["tokens_per_second"])
    assert timed == {"plain", "chain-1", "chain-2", "chain-3"}
    assert compile_spec(m.tree).is_chain


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "trt"}, "--attention fused writes ONNX Runtime's CPU operators"),
        ({"dtype": "float16"}, "--attention fused writes ONNX Runtime's CPU operators"),
    ],
)
def test_fused_config_errors(kwargs, message):
    with pytest.raises(CloverError, match=message):
        ExportConfig(attention="fused", **kwargs)
