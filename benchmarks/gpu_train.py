"""Head training at scale in one short GPU run: features for every corpus, then Clover-2, Clover and Medusa.

  python benchmarks/gpu_train.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --out "$OUT" --minutes 8

One process loads the base once and builds the features of all the corpora on the device (bfloat16, batched
teacher-forced passes, kept in the GPU's memory), then trains each architecture in turn for its share of the
minutes left (clover-train's library with --max-minutes: each stops cleanly at its share with a checkpoint). Epochs
come from the data and a timed probe of a few steps, so each schedule's cosine decay ends inside its share.

Written under --out (few files, each under 16 MiB, so that an offline GPU host can hand them back): `report.json` (the plan, feature
and training speeds, per-epoch validation metrics per architecture; rewritten after every epoch, so a run cut by
its time limit keeps what it measured), `heads.tar.part-NN` (the heads folders with their training.json, a tar
split in 15 MiB parts, rewritten after every epoch; `cat heads.tar.part-* | tar x` puts them back together).
Checkpoints stay under --work: the same command with --resume goes on from them on the same machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPORA = ("data/smollm2-sharegpt", "data/smollm2-sharegpt-fp32", "data/smollm2-magpie")
ARCHS = ("clover2", "clover", "medusa")
# Share of the training minutes, and peak learning rate at --batch-tokens 16384 (the shipped Clover-2 heads
# trained at 1e-3; a larger batch takes a learning rate at least as large). Choices, not measured optima.
SHARES = {"clover2": 0.6, "clover": 0.25, "medusa": 0.15}
LRS = {"clover2": 1e-3, "clover": 1e-3, "medusa": 2e-3}
PART_BYTES = 15 * 2**20  # under the 16 MiB a returned file may hold
PROBE_STEPS = 6  # timed steps (after two untimed) that size each schedule


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="what comes back: report.json and heads.tar.part-NN")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-train", help="heads folders and checkpoints")
    p.add_argument("--base", default="smollm2", help="a Hugging Face folder, or smollm2 (see --gguf)")
    p.add_argument("--gguf", type=Path, default=None, help="SmolLM2's GGUF file (sets CLOVER_SMOLLM2_GGUF)")
    p.add_argument("--data", nargs="+", default=[str(ROOT / c) for c in CORPORA], help="corpus folders")
    p.add_argument("--archs", default=",".join(ARCHS), help="architectures, in the order trained")
    p.add_argument("--minutes", type=float, default=8.0, help="the whole budget: features and every training")
    p.add_argument("--max-epochs", type=float, default=4.0, help="no schedule longer than this")
    p.add_argument("--max-tokens", type=int, default=20_000_000, help="training loss tokens (all by default)")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--max-length", type=int, default=704)
    p.add_argument("--device", default="cuda")
    p.add_argument("--features", choices=("memory", "cache"), default="memory")
    p.add_argument("--cache-dir", type=Path, default=None, help="--features cache: where (default: under --work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="go on from the checkpoints under --work")
    p.add_argument("--extra", default="", help="more clover-train options for every run (e.g. '--topk 8')")
    return p.parse_args(argv)


class Report:
    """report.json under --out, rewritten whole on every change (a cut run keeps the last one)."""

    def __init__(self, out: Path, doc: dict):
        self.path, self.doc = out / "report.json", doc

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.path)


def pack(work: Path, out: Path) -> int:
    """The heads folders under `work` (checkpoints left out) as heads.tar.part-NN under `out`; returns the parts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for folder in sorted(p for p in work.iterdir() if p.is_dir()):
            for f in sorted(folder.iterdir()):
                if f.is_file():
                    tar.add(f, arcname=f"{folder.name}/{f.name}")
    data = buf.getvalue()
    count = max(1, math.ceil(len(data) / PART_BYTES))
    for i in range(count):
        part = out / f"heads.tar.part-{i:02d}"
        tmp = part.with_name(part.name + ".tmp")
        tmp.write_bytes(data[i * PART_BYTES : (i + 1) * PART_BYTES])
        os.replace(tmp, part)
    for stale in out.glob("heads.tar.part-*"):
        if not stale.name.endswith(".tmp") and int(stale.name.rsplit("-", 1)[1]) >= count:
            stale.unlink()
    return count


def train_argv(args: argparse.Namespace, arch: str, out: Path, epochs: float, minutes: float) -> list[str]:
    argv = ["--base", args.base, "--data", *args.data, "--arch", arch, "--out", str(out), "--device", args.device]
    argv += ["--max-tokens", str(args.max_tokens), "--max-length", str(args.max_length), "--seed", str(args.seed)]
    argv += ["--batch-tokens", str(args.batch_tokens), "--lr", str(LRS[arch]), "--features", args.features]
    argv += ["--epochs", f"{epochs:g}", "--max-minutes", f"{minutes:.2f}", "--checkpoint-minutes", "2"]
    argv += ["--cache-dir", str(args.cache_dir or args.work / "features"), *args.extra.split()]
    return argv + (["--resume"] if args.resume and (out / "checkpoints").is_dir() else [])


def probe_seconds(arch: str, reuse: dict, args: argparse.Namespace) -> tuple[float, int]:
    """(seconds per optimiser step, steps per epoch) of `arch` on the features in `reuse`: a few steps of a
    throwaway copy of fresh heads, timed after two warm-up steps."""
    from random import Random

    import torch

    from clover.models.head_io import build_heads
    from clover.train.trainer import EpochSums, TrainConfig, Trainer, make_batches

    base, cache, device = reuse["base"], reuse["features"], torch.device(args.device)
    heads = build_heads(base, arch).to(device=device, dtype=torch.float32)
    heads.init_weights(base, torch.Generator().manual_seed(0))
    cfg = TrainConfig(arch=arch, depths=heads.config.num_heads, batch_tokens=args.batch_tokens, lr=LRS[arch])
    trainer = Trainer(base, heads, cache, cfg, args.work / ".probe", device)
    ids = trainer.train_ids
    sums = EpochSums(correct=[0.0] * cfg.depths, count=[0] * cfg.depths)
    batches = make_batches(cache, ids, cfg.batch_tokens, Random(0))[: PROBE_STEPS + 2]
    for i, b in enumerate(batches):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.time()
        trainer.step(i, b, sums)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if len(batches) <= 2:  # too little data to time: one step's worth of a second is plenty
        return 1.0, trainer.steps_per_epoch
    return (time.time() - t0) / (len(batches) - 2), trainer.steps_per_epoch


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.time()
    deadline = started + args.minutes * 60
    if args.gguf is not None:
        os.environ["CLOVER_SMOLLM2_GGUF"] = str(args.gguf.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "heads").mkdir(exist_ok=True)
    archs = [a for a in args.archs.split(",") if a]

    import torch

    from clover.tools.cli import run_cli
    from clover.tools.train import build_parser, run

    report = Report(args.out, {"argv": sys.argv[1:] if argv is None else argv, "minutes": args.minutes, "runs": {}})
    report.doc["device"] = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    report.write()
    reuse: dict = {}

    # features first, once, for every architecture (a --prepare-only run of the first)
    t0 = time.time()
    code = run_cli(
        "clover-train",
        build_parser(),
        functools.partial(run, reuse=reuse),
        [*train_argv(args, archs[0], args.work / "heads" / archs[0], 1, args.minutes), "--prepare-only"],
    )
    if code != 0:
        return code
    meta = reuse["features"].meta
    report.doc["features"] = {
        "seconds": round(time.time() - t0, 1),  # base loading and (once) its conversion included
        "build_seconds": meta["build_seconds"],
        "tokens": meta["num_tokens"],
        "train_loss_tokens": meta["train_loss_tokens"],
        "validation_loss_tokens": meta["validation_loss_tokens"],
        "sequences": meta["num_sequences"],
        "tokens_per_second": round(meta["num_tokens"] / max(meta["build_seconds"], 1e-3)),
    }
    if args.device.startswith("cuda"):
        report.doc["features"]["gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report.write()
    print(f"gpu_train: features {report.doc['features']}", file=sys.stderr, flush=True)

    for n, arch in enumerate(archs):
        share = SHARES.get(arch, 1.0) / sum(SHARES.get(a, 1.0) for a in archs[n:])
        arch_deadline = time.time() + (deadline - time.time()) * share
        minutes = (arch_deadline - time.time()) / 60
        out = args.work / "heads" / arch
        done = out / "training.json"
        if args.resume and done.is_file() and json.loads(done.read_text()).get("complete"):
            print(f"gpu_train: {arch} is complete in {out}: skipped", file=sys.stderr)
            continue
        if minutes < 0.2:
            print(f"gpu_train: no time left for {arch}", file=sys.stderr)
            break
        step_s, steps = probe_seconds(arch, reuse, args)
        minutes = (arch_deadline - time.time()) / 60  # the probe's time is the share's
        # the schedule that fits the share: validation and saving take the rest (about a tenth)
        epochs = max(0.05, min(args.max_epochs, round(0.9 * minutes * 60 / (step_s * steps), 2)))
        from clover.train.trainer import checkpoints

        if args.resume and checkpoints(out):  # a resumed schedule keeps its length (and so its lr curve)
            epochs = torch.load(checkpoints(out)[-1], weights_only=True)["config"]["epochs"]
        record = {"minutes": round(minutes, 2), "step_seconds": round(step_s, 4), "steps_per_epoch": steps}
        record.update(epochs=epochs, lr=LRS[arch], batch_tokens=args.batch_tokens, epoch_metrics=[])
        report.doc["runs"][arch] = record
        report.write()
        print(f"gpu_train: {arch}: {epochs} epochs in {minutes:.1f} min ({step_s * 1000:.1f} ms/step)", file=sys.stderr)

        def on_epoch(m, heads, arch=arch, record=record, out=out):
            from clover.models.head_io import save_heads

            record["epoch_metrics"].append(dataclasses.asdict(m))
            record["elapsed_seconds"] = round(time.time() - started, 1)
            report.write()
            save_heads(heads, out)  # the heads so far come back even if the call is cut
            record["parts"] = pack(args.work / "heads", args.out)
            report.write()
            print(
                f"gpu_train: {arch} epoch {m.epoch}: val_chain_accept {m.val_chain_accept:.3f}, val top-1 per depth "
                + " ".join(f"{x:.3f}" for x in m.val_top1),
                file=sys.stderr,
                flush=True,
            )

        t1 = time.time()
        code = run_cli(
            "clover-train",
            build_parser(),
            functools.partial(run, on_epoch=on_epoch, reuse=reuse),
            train_argv(args, arch, out, epochs, minutes),
        )
        record["seconds"] = round(time.time() - t1, 1)
        record["exit_code"] = code
        if done.is_file():
            prov = json.loads(done.read_text())
            record.update(complete=prov["complete"], steps=prov["steps"], total_steps=prov["total_steps"])
        record["parts"] = pack(args.work / "heads", args.out)
        report.write()
    report.doc["seconds"] = round(time.time() - started, 1)
    report.write()
    print(f"gpu_train: report in {report.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
