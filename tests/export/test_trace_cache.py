"""The trace cache (export/trace_cache.py): a graph traced once is copied out byte for byte the next time, the key
moves with anything the trace reads, the copy is the caller's to rewrite, a failed trace keeps nothing, the cache
stays under its size limit, and CLOVER_TRACE_CACHE=0 turns it off. Real torch.onnx traces of the tiny base."""

import hashlib

import pytest
from helpers import tiny_base

from clover.errors import CloverError
from clover.export.graphs import base_graph, draft_graphs
from clover.export.onnx_graph import check_onnx, onnx_from_torch
from clover.export.trace_cache import TRACE_CACHE_ENV, TRACE_CACHE_GB_ENV, trace_key, traced
from clover.models.head_io import random_heads


class Counted:
    """onnx_from_torch, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph, out_dir, opset):
        self.calls += 1
        return onnx_from_torch(graph, out_dir, opset)


def medusa(seed: int):
    """A graph that traces in about a second (the tiny base's take about five)."""
    (graph,) = draft_graphs(random_heads(tiny_base(seed=seed), "medusa"))  # its LM head is the base's: seeded there
    return graph


def digests(folder) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_CACHE_ENV, str(tmp_path / "traces"))
    return tmp_path / "traces"


def test_a_second_trace_of_the_same_graph_is_the_first_copied(cache, tmp_path):
    trace = Counted()
    first = traced(base_graph(tiny_base(seed=1)), tmp_path / "a", 20, trace)
    again = traced(base_graph(tiny_base(seed=1)), tmp_path / "b", 20, trace)  # rebuilt: equal, not the same object
    assert trace.calls == 1
    assert first == again and digests(tmp_path / "a") == digests(tmp_path / "b")
    check_onnx(tmp_path / "b" / again.file)
    (tmp_path / "b" / again.file).write_bytes(b"rewritten")  # the caller's copy: quantized in place, say
    traced(base_graph(tiny_base(seed=1)), tmp_path / "c", 20, trace)
    assert trace.calls == 1 and digests(tmp_path / "c") == digests(tmp_path / "a")


def test_the_key_follows_weights_attributes_inputs_and_opset():
    base = tiny_base(seed=1)
    key = trace_key(base_graph(base), 20)
    assert key == trace_key(base_graph(tiny_base(seed=1)), 20)
    assert key != trace_key(base_graph(base), 19)
    assert key != trace_key(base_graph(base, attention="plugin"), 20)  # an attribute of the module
    assert key != trace_key(base_graph(base, chains=True), 20)  # the example inputs
    assert key != trace_key(base_graph(tiny_base(seed=1, num_layers=3)), 20)
    other = tiny_base(seed=1)
    next(other.parameters()).data[0, 0] += 1e-3
    assert key != trace_key(base_graph(other), 20)


def test_a_failed_trace_keeps_nothing_and_the_next_one_traces(cache, tmp_path):
    def failing(graph, out_dir, opset):
        (out_dir / f"{graph.name}.onnx").write_bytes(b"half")
        raise CloverError(f"torch.onnx.export failed for the {graph.name} graph: no")

    graph = medusa(2)
    with pytest.raises(CloverError, match="export failed"):
        traced(graph, tmp_path / "a", 20, failing)
    assert [e for e in cache.iterdir() if not e.name.endswith(".lock")] == []
    trace = Counted()
    traced(graph, tmp_path / "b", 20, trace)
    assert trace.calls == 1


def test_the_cache_stays_under_its_limit_least_recently_used_first(cache, tmp_path, monkeypatch):
    trace = Counted()
    spec = traced(medusa(3), tmp_path / "a", 20, trace)
    one = sum(f.stat().st_size for f in (tmp_path / "a").iterdir())
    monkeypatch.setenv(TRACE_CACHE_GB_ENV, str(2.5 * one / 2**30))  # room for two of these
    traced(medusa(4), tmp_path / "b", 20, trace)
    traced(medusa(3), tmp_path / "c", 20, trace)  # used again: seed 4 is now the oldest
    traced(medusa(5), tmp_path / "d", 20, trace)
    assert trace.calls == 3
    kept = {e.name for e in cache.iterdir() if not e.name.startswith(".")}
    assert kept == {trace_key(medusa(s), 20) for s in (3, 5)}
    monkeypatch.setenv(TRACE_CACHE_GB_ENV, str(1.5 * one / 2**30))  # a trace over half the limit is not kept
    traced(medusa(6), tmp_path / "e", 20, trace)
    assert trace_key(medusa(6), 20) not in {e.name for e in cache.iterdir()}
    assert (tmp_path / "e" / spec.file).is_file()


def test_off_traces_every_time_and_writes_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_CACHE_ENV, "0")
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    trace = Counted()
    for out in ("a", "b"):
        traced(medusa(1), tmp_path / out, 20, trace)
    assert trace.calls == 2 and not (tmp_path / "cache").exists()


def test_a_cache_that_cannot_be_written_costs_a_trace_not_the_export(tmp_path, monkeypatch):
    """The cache is best-effort: a CLOVER_TRACE_CACHE that is a file (no folder can be made there) traces every
    time and the export's files are whole; a trace that leaves no room in the cache still lands in out_dir."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv(TRACE_CACHE_ENV, str(blocked / "traces"))
    trace = Counted()
    for out in ("a", "b"):
        spec = traced(medusa(1), tmp_path / out, 20, trace)
        check_onnx(tmp_path / out / spec.file)
    assert trace.calls == 2 and digests(tmp_path / "a") == digests(tmp_path / "b")
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".trace-")]  # no staging left behind
