"""The corpora committed under data/: each opens with its provenance, every shard reads back (checksum and counts),
and the runs its provenance records account for every stored answer."""

from pathlib import Path

import pytest

from clover.train.corpus import Corpus, is_corpus

DATA = Path(__file__).resolve().parents[2] / "data"
CORPORA = sorted(p for p in DATA.iterdir() if is_corpus(p)) if DATA.is_dir() else []


def test_the_shipped_corpora_are_found():
    assert {"smollm2-sharegpt", "smollm2-sharegpt-fp32", "smollm2-magpie"} <= {p.name for p in CORPORA}


@pytest.mark.parametrize("path", CORPORA, ids=lambda p: p.name)
def test_committed_corpus_loads_with_provenance(path: Path):
    corpus = Corpus.open(path)
    prov = corpus.provenance
    assert prov.generator.base == "smollm2" and prov.generator.weights in ("int4", "int8", "float32")
    assert prov.runs and all(r.command.startswith("clover-data grow") for r in prov.runs)
    # every shard is read: Corpus.read_shard checks its sha256 and its counts against its provenance entry
    convs = list(corpus.conversations())
    assert all(len(c.response) <= prov.generator.max_new_tokens for c in convs)
    # and every stored answer was written by a recorded run (no shard added or dropped by hand)
    assert sum(r.conversations for r in prov.runs) == prov.totals["conversations"] == len(convs)
    assert sum(r.response_tokens for r in prov.runs) == prov.totals["response_tokens"]
