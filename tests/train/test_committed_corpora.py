"""The corpora committed under data/: each opens with its provenance, every shard passes its checksum, and the
totals the provenance records are what the shards hold."""

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
    convs = list(corpus.conversations())  # checks every shard's sha256
    assert len(convs) == prov.totals["conversations"]
    assert sum(len(c.response) for c in convs) == prov.totals["response_tokens"]
    assert sum(len(c.prompt) for c in convs) == prov.totals["prompt_tokens"]
    assert all(len(c.response) <= prov.generator.max_new_tokens for c in convs)
