"""One LM head in memory (export/lm_head.py): in an ONNX Runtime artifact with heads, the base and the draft
graphs that share the base's LM head stop before it, lm_head.onnx holds it once, one session runs it for all
of them, and every logit is what the uncut graphs give."""

import numpy as np
import onnx
import pytest
from helpers import assert_identical, run_tokens
from ort_helpers import PROMPTS, tiny_artifact

from clover.artifact import open_artifact, read_manifest
from clover.export.lm_head import LM_INPUT, lm_head_nodes
from clover.runtime.backends.ort import load_runner
from clover.runtime.tree import resolve_tree

ARCHS = ("medusa", "clover", "clover2")
TREES = {"medusa": "chain-4", "clover": "chain-3", "clover2": "mc26"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return {arch: (tiny_artifact(root, arch), tiny_artifact(root, arch, shared_lm_head=False)) for arch in ARCHS}


def vocab_matmuls(path, vocab: int) -> int:
    """Matmul nodes of the graph at `path` with `vocab` output columns: LM heads."""
    model = onnx.load(str(path), load_external_data=False)
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    count = 0
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            count += next(a.i for a in n.attribute if a.name == "N") == vocab
        elif n.op_type == "MatMul":
            w = n.input[1]
            shape = dims.get(w) or (dims.get(producer[w].input[0], [])[::-1] if w in producer else [])
            count += bool(shape) and shape[-1] == vocab
    return count


@pytest.mark.parametrize("arch", ARCHS)
def test_the_lm_head_is_one_graph(pairs, arch):
    shared, own = pairs[arch]
    m, o = open_artifact(shared), read_manifest(own)
    V = m.base_config["vocab_size"]
    assert set(m.graphs) == set(o.graphs) | {"lm_head"}
    assert vocab_matmuls(shared / m.graphs["lm_head"].file, V) == 1
    for name, spec in m.graphs.items():
        if name == "lm_head":
            continue
        outputs = {t.name for t in spec.outputs}
        assert LM_INPUT in outputs and "logits" not in outputs, name
        assert spec.output(LM_INPUT).shape[-1] == m.base_config["hidden_size"]
        assert vocab_matmuls(shared / spec.file, V) == 0, f"{name} still holds an LM head"
        assert vocab_matmuls(own / o.graphs[name].file, V) >= 1, f"{name} of the uncut artifact"
        assert lm_head_nodes(onnx.load(str(shared / spec.file), load_external_data=False)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_tokens_are_those_of_the_uncut_graphs(pairs, arch):
    shared, own = pairs[arch]
    a, b = load_runner(shared), load_runner(own)
    # One session for the LM head, used after the base and every draft graph.
    drafts = a.drafter.graphs
    assert a.lm_head is not None and a.base.lm_head is a.lm_head and all(g.lm_head is a.lm_head for g in drafts)
    assert b.lm_head is None
    prompt = np.array(PROMPTS[1])
    T = len(prompt)
    for r in (a, b):
        r.reset(64)
    mask = np.tri(T, dtype=bool)
    la, lb = (r.forward(prompt, np.arange(T), mask) for r in (a, b))
    np.testing.assert_array_equal(la, lb)  # every row, bit for bit
    for r in (a, b):
        r.commit(np.arange(T), prompt)
    np.testing.assert_array_equal(a.draft_begin(), b.draft_begin())
    tree = resolve_tree(TREES[arch])
    for p in PROMPTS:
        got, steps = run_tokens(a, p, tree, 30)
        want, want_steps = run_tokens(b, p, tree, 30)
        assert_identical(got, want, f"{arch} shared vs own LM head")
        assert steps == want_steps  # the same drafts, so the same acceptance


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_quantized_base_keeps_its_own_lm_head_and_the_drafts_share_one(tmp_path_factory, weights):
    """--weights: the base (and its batched twin) computes its logits itself, one session call a step; the draft
    graphs still share lm_head.onnx; speculative greedy output is plain's."""
    root = tmp_path_factory.getbasetemp()
    art = tiny_artifact(root, "clover2", tree="chain-3", weights=weights, attention="fused")
    m = open_artifact(art)
    V = m.base_config["vocab_size"]
    for name in ("base", "base_batch"):
        outputs = {t.name for t in m.graphs[name].outputs}
        assert "logits" in outputs and LM_INPUT not in outputs, name
    assert vocab_matmuls(art / m.graphs["base"].file, V) == 1
    for name in ("draft_begin", "draft_step"):
        assert m.graphs[name].has_output(LM_INPUT), name
        assert vocab_matmuls(art / m.graphs[name].file, V) == 0, f"{name} still holds an LM head"
    runner = load_runner(art)
    assert runner.base.lm_head is None and all(g.lm_head is runner.lm_head for g in runner.drafter.graphs)
    for p in PROMPTS:
        got, _ = run_tokens(runner, p, resolve_tree("chain-3"), 24)
        want, _ = run_tokens(runner, p, resolve_tree("plain"), 24)
        assert_identical(got, want, f"{weights} {p}")
