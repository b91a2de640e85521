"""The training loop: batches from the features (a disk cache or a FeatureStore in the device's memory), AdamW
with warmup + cosine decay, bfloat16 autocast over float32 master weights, per-epoch validation, checkpoints at
each epoch's end and, on a clock, inside one, and resume from the newest. A time budget (`Budget`) stops a run
cleanly between two steps with a checkpoint, so the next run resumes there exactly (same batches, same optimizer
state). The base model never runs here (its features are computed before).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from clover import atomic
from clover.errors import CloverError
from clover.models.decoder import Decoder
from clover.models.heads import DraftHeads
from clover.train.features import FeatureCache, FeatureStore
from clover.train.objectives import (
    EARLY_ANSWER_TOKENS,
    RECIPES,
    TOPK_ACCURACY,
    DepthStats,
    Vocab,
    distill_loss,
    head_outputs,
)


@dataclass(frozen=True)
class TrainConfig:
    arch: str
    depths: int  # draft depths trained (the number of heads; clover2: depth trained for)
    epochs: float = 1  # may end inside an epoch (1.5: the second stops halfway; the schedule ends there)
    lr: float | None = None  # None: the recipe's default
    seed: int = 0
    batch_tokens: int = 4096  # padded tokens per optimiser step
    warmup_fraction: float = 0.03
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)
    batch_softmax: bool = True  # training softmax over the batch's candidate tokens (see objectives.py)
    feature_noise: float = 0.0  # uniform noise on the fed features, x each row's RMS (objectives.with_noise)
    compute_dtype: str = "bfloat16"  # the matmuls' precision (objectives.fastest_train_dtype); weights stay float32

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else RECIPES[self.arch].lr


@dataclass
class EpochMetrics:
    epoch: int
    train_loss: float | None  # None: epoch 0, the heads before training
    train_top1: list[float]
    val_loss: float
    val_top1: list[float]  # per depth: head argmax == base argmax, on validation rows with a target
    val_chain_accept: float  # 1 + mean run of consecutive correct depths: tokens/step on a chain tree
    seconds: float
    val_topk: list[float] = field(default_factory=list)  # per depth: base argmax in the head's top-k (TOPK_ACCURACY)
    # per depth: val_top1 over each answer's first EARLY_ANSWER_TOKENS positions (what short benchmarks draft for)
    val_top1_early: list[float] = field(default_factory=list)
    early_answer_tokens: int = EARLY_ANSWER_TOKENS


@dataclass
class History:
    epochs: list[EpochMetrics] = field(default_factory=list)
    initial: EpochMetrics | None = None  # the --init heads' validation before any step (epoch 0)
    steps: int = 0  # optimiser steps done (of the schedule's, total_steps)
    total_steps: int = 0
    stopped: bool = False  # the budget stopped the run before the schedule's end (a checkpoint holds where)


@dataclass(frozen=True)
class Budget:
    """When a run stops (time.time() seconds): at `deadline` between two steps, with a checkpoint; and a
    checkpoint every `checkpoint_seconds` inside an epoch (None: at epochs' ends only)."""

    deadline: float | None = None
    checkpoint_seconds: float | None = None


@dataclass
class EpochSums:
    """Training sums of the epoch under way (kept in a mid-epoch checkpoint so a resumed epoch reports alike)."""

    loss_sum: float = 0.0
    n_batches: int = 0
    correct: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    seconds: float = 0.0


def make_batches(cache: FeatureCache, seq_ids: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar-length sequences, each at most `batch_tokens` padded tokens."""
    ids = list(seq_ids)
    rng.shuffle(ids)
    batches: list[list[int]] = []
    for i in range(0, len(ids), 256):  # sort within windows: little padding, still shuffled
        window = sorted(ids[i : i + 256], key=cache.length)
        cur: list[int] = []
        for s in window:
            if cur and max(cache.length(x) for x in cur + [s]) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(s)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(1, int(total * cfg.warmup_fraction))
    if step < warm:
        return cfg.peak_lr * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return cfg.peak_lr * (cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(
        self,
        base: Decoder,
        heads: DraftHeads,
        cache: FeatureCache | FeatureStore,
        cfg: TrainConfig,
        out: Path,
        device: torch.device,
        initialised: bool = False,
    ):
        """`initialised`: the heads are trained ones (--init): `validate_initial` and `keep_best` may keep them."""
        self.base, self.heads, self.cache, self.cfg, self.out, self.device = base, heads, cache, cfg, Path(out), device
        # the --init heads as they came, before a resume overwrites them
        self.initial_state = {k: v.detach().clone() for k, v in heads.state_dict().items()} if initialised else None
        self.recipe = RECIPES[cfg.arch]
        self.dtype = getattr(torch, cfg.compute_dtype)
        self.lm = base.lm_head.weight.detach().to(self.dtype)
        params = [p for p in heads.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.train_ids = cache.sequences(validation=False)
        self.val_ids = cache.sequences(validation=True)
        probe = make_batches(cache, self.train_ids, cfg.batch_tokens, random.Random(0))
        self.steps_per_epoch = len(probe)
        self.total_steps = max(1, math.ceil(self.steps_per_epoch * cfg.epochs))
        self.frequent = frequent_tokens(cache, self.train_ids).to(device) if cfg.batch_softmax else None
        self.history = History(total_steps=self.total_steps)
        self.start_epoch, self.start_batch = 0, 0
        self.sums: EpochSums | None = None  # a resumed mid-epoch run's sums so far

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_path(self, epoch: int, batch: int | None = None) -> Path:
        """epoch-E.pt after epoch E (0-based) ended; epoch-E-batch-I.pt inside it, before its batch I."""
        name = f"epoch-{epoch}.pt" if batch is None else f"epoch-{epoch}-batch-{batch}.pt"
        return self.out / "checkpoints" / name

    def save_checkpoint(self, epoch: int, batch: int | None = None, sums: EpochSums | None = None) -> None:
        path = self.checkpoint_path(epoch, batch)
        state = {
            "epoch": epoch,
            "heads": self.heads.state_dict(),
            "optimizer": self.opt.state_dict(),
            "config": asdict(self.cfg),
            "history": [asdict(m) for m in self.history.epochs],
            "initial": asdict(self.history.initial) if self.history.initial is not None else None,
            "torch_rng": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if batch is not None:
            state["batch"], state["sums"] = batch, asdict(sums)
        with atomic.replacing(path) as f:
            torch.save(state, f)
        for older in checkpoints(self.out):  # mid-epoch ones are superseded by any later checkpoint
            if older != path and "-batch-" in older.name and _order(older) < _order(path):
                older.unlink(missing_ok=True)

    def resume(self) -> float:
        """Load the newest checkpoint; returns the epochs already done (fractional inside an epoch)."""
        ckpts = checkpoints(self.out)
        if not ckpts:
            raise CloverError(f"--resume: no checkpoint in {self.out / 'checkpoints'}: start without --resume")
        state = torch.load(ckpts[-1], weights_only=True)  # tensors, numbers, strings and containers only: no code runs
        saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in state["config"].items()}
        mine = asdict(self.cfg)
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # a field newer than the checkpoint
        differs = [k for k in mine if k not in ("epochs",) and saved.get(k, defaults[k]) != mine[k]]
        if differs:
            raise CloverError(
                f"--resume: checkpoint {ckpts[-1]} was trained with other settings ({', '.join(differs)}): "
                "pass the same options, or start a new --out"
            )
        self.heads.load_state_dict(state["heads"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.history.epochs = [EpochMetrics(**m) for m in state["history"]]
        if state.get("initial") is not None:
            self.history.initial = EpochMetrics(**state["initial"])
        if "batch" in state:  # inside an epoch: go on at its next batch with its sums so far
            self.start_epoch, self.start_batch = state["epoch"], state["batch"]
            self.sums = EpochSums(**state["sums"])
            return state["epoch"] + state["batch"] / self.steps_per_epoch
        self.start_epoch = state["epoch"] + 1
        return self.start_epoch

    # -- loop -----------------------------------------------------------------------------------
    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda" and batch["tokens"].device.type == "cpu":  # a disk cache's batch
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}
        return {k: v.to(self.device) for k, v in batch.items()}

    def train(
        self, log=print, budget: Budget = Budget(), on_epoch: Callable[[EpochMetrics], None] | None = None
    ) -> History:
        """Train to the schedule's end, or until `budget.deadline` (then `history.stopped`, and a checkpoint
        holds the next batch). `on_epoch` sees each epoch's metrics once its checkpoint is written."""
        cfg = self.cfg
        last_save = time.time()
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.history.steps = self.start_epoch * self.steps_per_epoch + self.start_batch
        for epoch in range(self.start_epoch, epochs):
            t0 = time.time()
            rng = random.Random(cfg.seed * 1000 + epoch)
            batches = make_batches(self.cache, self.train_ids, cfg.batch_tokens, rng)
            batches = batches[: self.total_steps - epoch * self.steps_per_epoch]  # the last epoch may stop inside
            first = self.start_batch if epoch == self.start_epoch else 0
            sums = self.sums if epoch == self.start_epoch and self.sums is not None else EpochSums()
            if not sums.correct:
                sums.correct, sums.count = [0.0] * cfg.depths, [0] * cfg.depths
            self.heads.train()
            bar = tqdm(
                total=len(batches),
                initial=first,
                desc=f"{cfg.arch} epoch {epoch + 1}/{epochs}",
                unit="batch",
                dynamic_ncols=True,
            )
            for i in range(first, len(batches)):
                self.step(epoch * self.steps_per_epoch + i, batches[i], sums)
                self.history.steps += 1
                bar.update(1)
                bar.set_postfix_str(
                    f"loss {sums.loss_sum / max(1, sums.n_batches):.3f} top1 "
                    + "/".join(f"{c / max(1, n):.2f}" for c, n in zip(sums.correct, sums.count))
                )
                now = time.time()
                if i + 1 < len(batches) and budget.deadline is not None and now >= budget.deadline:
                    sums.seconds += now - t0
                    self.save_checkpoint(epoch, i + 1, sums)
                    bar.close()
                    self.history.stopped = True
                    log(
                        f"time budget reached inside epoch {epoch + 1} (batch {i + 1}/{len(batches)}): checkpoint saved"
                    )
                    return self.history
                if budget.checkpoint_seconds is not None and now - last_save >= budget.checkpoint_seconds:
                    self.save_checkpoint(epoch, i + 1, dataclasses.replace(sums, seconds=sums.seconds + now - t0))
                    last_save = now
            bar.close()
            m = self.end_epoch(epoch, sums, sums.seconds + time.time() - t0)
            log(describe(m))
            if on_epoch is not None:
                on_epoch(m)
            last_save = time.time()
            if budget.deadline is not None and time.time() >= budget.deadline and epoch + 1 < epochs:
                self.history.stopped = True
                log(f"time budget reached after epoch {epoch + 1}: checkpoint saved")
                break
        return self.history

    def step(self, step: int, seq_ids: list[int], sums: EpochSums) -> None:
        """One optimiser step on the batch of `seq_ids`, its loss and per-depth accuracy added to `sums`."""
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.total_steps, cfg)
        batch = self.to_device(self.cache.batch(seq_ids))
        vocab = (
            Vocab.of_batch(batch, self.base.lm_head.weight, self.frequent, self.dtype) if cfg.batch_softmax else None
        )
        outs = head_outputs(self.heads, batch, cfg.depths, noise=cfg.feature_noise, dtype=self.dtype)
        loss, stats = distill_loss(
            self.heads, batch, cfg.depths, self.recipe, self.base.norm, self.lm, vocab, outs=outs
        )
        if not loss.requires_grad:  # no row of this batch has a target at any depth: nothing to learn
            return
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.heads.parameters(), cfg.grad_clip)
        self.opt.step()
        sums.loss_sum, sums.n_batches = sums.loss_sum + float(loss.detach()), sums.n_batches + 1
        for d, st in enumerate(stats):
            sums.correct[d] += st.correct
            sums.count[d] += st.count

    def end_epoch(self, epoch: int, sums: EpochSums, seconds: float) -> EpochMetrics:
        """Validation, the epoch's metrics in the history, and its checkpoint."""
        m = self.metrics(
            epoch + 1,
            round(sums.loss_sum / max(1, sums.n_batches), 4),
            [round(c / max(1, n), 4) for c, n in zip(sums.correct, sums.count)],
            seconds,
        )
        self.history.epochs.append(m)
        self.save_checkpoint(epoch)
        return m

    def validate_initial(self) -> EpochMetrics:
        """The heads' validation before training (epoch 0): the bar that `keep_best` holds trained epochs to."""
        t0 = time.time()
        self.history.initial = self.metrics(0, None, [], 0.0)
        self.history.initial.seconds = round(time.time() - t0, 1)
        return self.history.initial

    def keep_best(self) -> int:
        """Put back the heads of the validated epoch with the best chain acceptance (the first of equals; 0: the
        heads before training, if `validate_initial` measured them) and return that epoch."""
        if not self.history.epochs:
            return 0
        initial = [self.history.initial] if self.history.initial is not None and self.initial_state is not None else []
        best = max(initial + self.history.epochs, key=lambda m: (m.val_chain_accept, -m.epoch))
        if best is self.history.epochs[-1]:
            return best.epoch
        if best.epoch == 0:
            state = self.initial_state
        else:
            state = torch.load(self.checkpoint_path(best.epoch - 1), weights_only=True)["heads"]
        self.heads.load_state_dict(state)
        return best.epoch

    def metrics(self, epoch: int, train_loss: float | None, train_top1: list[float], seconds: float) -> EpochMetrics:
        val_loss, val_top1, val_topk, val_early, chain = self.validate()
        return EpochMetrics(
            epoch,
            train_loss,
            train_top1,
            round(val_loss, 4),
            [round(x, 4) for x in val_top1],
            round(chain, 3),
            round(seconds, 1),
            [round(x, 4) for x in val_topk],
            [round(x, 4) for x in val_early],
        )

    @torch.no_grad()
    def validate(self) -> tuple[float, list[float], list[float], list[float], float]:
        """Validation loss, per-depth accuracy@1 and @TOPK_ACCURACY, accuracy@1 over the answers' first
        EARLY_ANSWER_TOKENS positions, and the chain acceptance estimate (teacher-forced)."""
        self.heads.eval()
        sums = [DepthStats() for _ in range(self.cfg.depths)]
        loss_sum, n = 0.0, 0
        run_total, rows = 0.0, 0
        for seq_ids in make_batches(self.cache, self.val_ids, self.cfg.batch_tokens, random.Random(0)):
            batch = self.to_device(self.cache.batch(seq_ids))
            # shared by the loss and the chain estimate
            outs = head_outputs(self.heads, batch, self.cfg.depths, dtype=self.dtype)
            loss, stats = distill_loss(
                self.heads, batch, self.cfg.depths, self.recipe, self.base.norm, self.lm, outs=outs
            )
            loss_sum, n = loss_sum + float(loss), n + 1
            for acc, st in zip(sums, stats):
                acc.correct, acc.in_topk, acc.count = (
                    acc.correct + st.correct,
                    acc.in_topk + st.in_topk,
                    acc.count + st.count,
                )
                acc.correct_early, acc.count_early = (
                    acc.correct_early + st.correct_early,
                    acc.count_early + st.count_early,
                )
            r, c = chain_runs(self.heads, batch, outs, self.lm)
            run_total, rows = run_total + r, rows + c
        self.heads.train()
        return (
            loss_sum / max(1, n),
            [a.correct / max(1, a.count) for a in sums],
            [a.in_topk / max(1, a.count) for a in sums],
            [a.correct_early / max(1, a.count_early) for a in sums],
            1 + run_total / max(1, rows),
        )


def describe(m: EpochMetrics) -> str:
    """One line of an epoch's metrics."""
    return (
        (f"epoch {m.epoch}: train loss {m.train_loss:.3f}, " if m.train_loss is not None else "before training: ")
        + f"val loss {m.val_loss:.3f}, val top-1 per depth "
        + " ".join(f"{x:.3f}" for x in m.val_top1)
        + f", top-{TOPK_ACCURACY} "
        + " ".join(f"{x:.3f}" for x in m.val_topk)
        + f", top-1 over the first {EARLY_ANSWER_TOKENS} answer tokens "
        + " ".join(f"{x:.3f}" for x in m.val_top1_early)
        + f", chain acceptance {m.val_chain_accept:.2f} ({m.seconds:.0f}s)"
    )


def checkpoints(out: Path) -> list[Path]:
    """The checkpoints in `out`, oldest first."""
    return sorted((out / "checkpoints").glob("epoch-*.pt"), key=_order)


def _order(path: Path) -> tuple[int, float]:
    parts = path.stem.split("-")  # epoch-E or epoch-E-batch-I
    return int(parts[1]), float(parts[3]) if len(parts) == 4 else math.inf


def frequent_tokens(cache: FeatureCache | FeatureStore, seq_ids: list[int], count: int = 4096) -> torch.Tensor:
    """The `count` token ids most often ranked first by the base at the loss positions of `seq_ids`."""
    import numpy as np

    if isinstance(cache, FeatureStore):
        hist_t = torch.bincount(cache.first_ranked(seq_ids).long())
        order_t = torch.argsort(-hist_t, stable=True)[:count]
        return order_t[hist_t[order_t] > 0].cpu()

    hist = np.zeros(1, dtype=np.int64)
    for i in seq_ids:
        s, e = cache.offsets[i], cache.offsets[i + 1]
        top = np.asarray(cache.arrays["topk_ids"][s:e, 0])[np.asarray(cache.arrays["loss_mask"][s:e])]
        counts = np.bincount(top)
        if len(counts) > len(hist):
            hist = np.pad(hist, (0, len(counts) - len(hist)))
        hist[: len(counts)] += counts
    order = np.argsort(-hist, kind="stable")[:count]
    return torch.from_numpy(order[hist[order] > 0])


@torch.no_grad()
def chain_runs(
    heads: DraftHeads, batch: dict[str, torch.Tensor], outs: list[torch.Tensor], lm: torch.Tensor
) -> tuple[float, int]:
    """Sum over greedy response rows of how many consecutive depths the heads' argmax gets right, and the
    number of rows (`outs`: the batch's head_outputs): with a chain tree of len(outs) nodes, 1 + mean
    run is the expected tokens/step."""
    from clover.train.objectives import depth_masks, head_logits

    masks = depth_masks(batch, len(outs), greedy_paths_only=True)
    rows = masks[0]  # rows with at least a depth-1 target on a greedy path
    alive = rows.clone()
    run = torch.zeros_like(rows, dtype=torch.float32)
    for d, (out, valid) in enumerate(zip(outs, masks), start=1):
        ok = torch.zeros_like(rows)
        sel = alive & valid
        if sel.any():
            logits = head_logits(heads, d, out[sel], lm)
            b, t = sel.nonzero(as_tuple=True)
            ok[b, t] = logits.argmax(-1) == batch["topk_ids"][b, t + d, 0].long()
        alive = alive & ok
        run += alive.float()
    return float(run[rows].sum()), int(rows.sum())
