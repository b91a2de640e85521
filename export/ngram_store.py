"""The n-gram store an artifact carries for prompt lookup (clover-export --ngram-store): a suffix array over a
corpus of the base's own answers, from which the longest match of a sequence's tail gives its most frequent
continuation (clover.runtime.lookup.NgramStore, which also reads it). Drafting from it costs no model call; only what is
proposed changes, so output stays lossless."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover.artifact import NGRAM_STORE_FILE, Manifest, NgramStoreSpec, check_corpus_base
from clover.errors import CloverError
from clover.runtime.lookup import NgramStore


@dataclass(frozen=True)
class StoreSource:
    """A store and what it was counted over."""

    store: NgramStore
    source: str  # the corpus and its answer tokens, for the manifest
    base_fingerprint: dict[str, Any]  # the base that wrote the answers (BaseFingerprint, as a dict)


def add_ngram_store(folder: Path, source: StoreSource, base_fingerprint: dict[str, Any]) -> NgramStoreSpec:
    """Write the store into `folder` (an artifact being built for the base `base_fingerprint`)."""
    check_corpus_base(source.base_fingerprint, base_fingerprint, f"the n-gram store ({source.source})")
    if source.store.vocab_size != base_fingerprint.get("vocab_size"):
        raise CloverError(
            f"the n-gram store counts a {source.store.vocab_size}-token vocabulary, the base has "
            f"{base_fingerprint.get('vocab_size')}: build it from this base's corpus"
        )
    source.store.save(folder / NGRAM_STORE_FILE)
    return NgramStoreSpec(NGRAM_STORE_FILE, source.source, len(source.store))


def with_ngram_store(src: Path, out: Path, source: StoreSource | None) -> Path:
    """A copy of the artifact `src` at `out` with the n-gram store of `source` (None: without one), no re-export."""
    from clover.export.artifact import derived_artifact

    def change(tmp: Path, manifest: Manifest) -> Manifest:
        spec = add_ngram_store(tmp, source, manifest.base_fingerprint) if source is not None else None
        return dataclasses.replace(manifest, ngram_store=spec)

    return derived_artifact(src, out, {NGRAM_STORE_FILE}, change)
