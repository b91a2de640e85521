"""The training loop: batches from the feature cache, AdamW with warmup + cosine decay, per-epoch
validation, checkpoints each epoch and resume. The base model never runs here (features are cached).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from clover import atomic
from clover.errors import CloverError
from clover.models.decoder import Decoder
from clover.models.heads import DraftHeads
from clover.train.features import FeatureCache
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
    epochs: int = 1
    lr: float | None = None  # None: the recipe's default
    seed: int = 0
    batch_tokens: int = 4096  # padded tokens per optimiser step
    warmup_fraction: float = 0.03
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    betas: tuple[float, float] = (0.9, 0.95)
    batch_softmax: bool = True  # training softmax over the batch's candidate tokens (see objectives.py)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else RECIPES[self.arch].lr


@dataclass
class EpochMetrics:
    epoch: int
    train_loss: float
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
        self, base: Decoder, heads: DraftHeads, cache: FeatureCache, cfg: TrainConfig, out: Path, device: torch.device
    ):
        self.base, self.heads, self.cache, self.cfg, self.out, self.device = base, heads, cache, cfg, Path(out), device
        self.recipe = RECIPES[cfg.arch]
        self.lm_bf16 = base.lm_head.weight.detach().to(torch.bfloat16)
        params = [p for p in heads.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.train_ids = cache.sequences(validation=False)
        self.val_ids = cache.sequences(validation=True)
        probe = make_batches(cache, self.train_ids, cfg.batch_tokens, random.Random(0))
        self.steps_per_epoch = len(probe)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.frequent = frequent_tokens(cache, self.train_ids).to(device) if cfg.batch_softmax else None
        self.history = History()
        self.start_epoch = 0

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_path(self, epoch: int) -> Path:
        return self.out / "checkpoints" / f"epoch-{epoch}.pt"

    def save_checkpoint(self, epoch: int) -> None:
        path = self.checkpoint_path(epoch)
        with atomic.replacing(path) as f:
            torch.save(
                {
                    "epoch": epoch,
                    "heads": self.heads.state_dict(),
                    "optimizer": self.opt.state_dict(),
                    "config": asdict(self.cfg),
                    "history": [asdict(m) for m in self.history.epochs],
                    "torch_rng": torch.get_rng_state(),
                },
                f,
            )

    def resume(self) -> int:
        """Load the newest checkpoint; returns the number of epochs already done."""
        ckpts = sorted(self.out.glob("checkpoints/epoch-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        if not ckpts:
            raise CloverError(f"--resume: no checkpoint in {self.out / 'checkpoints'}: start without --resume")
        state = torch.load(ckpts[-1], weights_only=True)  # tensors, numbers, strings and containers only: no code runs
        saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in state["config"].items()}
        mine = asdict(self.cfg)
        differs = [k for k in mine if k not in ("epochs",) and saved.get(k) != mine[k]]
        if differs:
            raise CloverError(
                f"--resume: checkpoint {ckpts[-1]} was trained with other settings ({', '.join(differs)}): "
                "pass the same options, or start a new --out"
            )
        self.heads.load_state_dict(state["heads"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.history.epochs = [EpochMetrics(**m) for m in state["history"]]
        self.start_epoch = state["epoch"] + 1
        return self.start_epoch

    # -- loop -----------------------------------------------------------------------------------
    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in batch.items()}

    def train(self, log=print) -> History:
        cfg = self.cfg
        for epoch in range(self.start_epoch, cfg.epochs):
            t0 = time.time()
            rng = random.Random(cfg.seed * 1000 + epoch)
            batches = make_batches(self.cache, self.train_ids, cfg.batch_tokens, rng)
            sums = [DepthStats() for _ in range(cfg.depths)]
            loss_sum, n_batches = 0.0, 0
            self.heads.train()
            bar = tqdm(batches, desc=f"{cfg.arch} epoch {epoch + 1}/{cfg.epochs}", unit="batch", dynamic_ncols=True)
            for i, seq_ids in enumerate(bar):
                step = epoch * self.steps_per_epoch + i
                for group in self.opt.param_groups:
                    group["lr"] = lr_at(step, self.total_steps, cfg)
                batch = self.to_device(self.cache.batch(seq_ids))
                vocab = Vocab.of_batch(batch, self.base.lm_head.weight, self.frequent) if cfg.batch_softmax else None
                loss, stats = distill_loss(
                    self.heads, batch, cfg.depths, self.recipe, self.base.norm, self.lm_bf16, vocab
                )
                if not loss.requires_grad:  # no row of this batch has a target at any depth: nothing to learn
                    continue
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.heads.parameters(), cfg.grad_clip)
                self.opt.step()
                loss_sum, n_batches = loss_sum + float(loss.detach()), n_batches + 1
                for acc, st in zip(sums, stats):
                    acc.correct, acc.count = acc.correct + st.correct, acc.count + st.count
                bar.set_postfix_str(
                    f"loss {loss_sum / n_batches:.3f} top1 "
                    + "/".join(f"{a.correct / max(1, a.count):.2f}" for a in sums)
                )
            bar.close()
            val_loss, val_top1, val_topk, val_early, chain = self.validate()
            m = EpochMetrics(
                epoch + 1,
                round(loss_sum / max(1, n_batches), 4),
                [round(a.correct / max(1, a.count), 4) for a in sums],
                round(val_loss, 4),
                [round(x, 4) for x in val_top1],
                round(chain, 3),
                round(time.time() - t0, 1),
                [round(x, 4) for x in val_topk],
                [round(x, 4) for x in val_early],
            )
            self.history.epochs.append(m)
            self.save_checkpoint(epoch)
            log(
                f"epoch {m.epoch}: train loss {m.train_loss:.3f}, val loss {m.val_loss:.3f}, val top-1 per depth "
                + " ".join(f"{x:.3f}" for x in m.val_top1)
                + f", top-{TOPK_ACCURACY} "
                + " ".join(f"{x:.3f}" for x in m.val_topk)
                + f", top-1 over the first {EARLY_ANSWER_TOKENS} answer tokens "
                + " ".join(f"{x:.3f}" for x in m.val_top1_early)
                + f", chain acceptance {m.val_chain_accept:.2f} ({m.seconds:.0f}s)"
            )
        return self.history

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
            outs = head_outputs(self.heads, batch, self.cfg.depths)  # shared by the loss and the chain estimate
            loss, stats = distill_loss(
                self.heads, batch, self.cfg.depths, self.recipe, self.base.norm, self.lm_bf16, outs=outs
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
            r, c = chain_runs(self.heads, batch, outs, self.lm_bf16)
            run_total, rows = run_total + r, rows + c
        self.heads.train()
        return (
            loss_sum / max(1, n),
            [a.correct / max(1, a.count) for a in sums],
            [a.in_topk / max(1, a.count) for a in sums],
            [a.correct_early / max(1, a.count_early) for a in sums],
            1 + run_total / max(1, rows),
        )


def frequent_tokens(cache: FeatureCache, seq_ids: list[int], count: int = 4096) -> torch.Tensor:
    """The `count` token ids most often ranked first by the base at the loss positions of `seq_ids`."""
    import numpy as np

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
    heads: DraftHeads, batch: dict[str, torch.Tensor], outs: list[torch.Tensor], lm_bf16: torch.Tensor
) -> tuple[float, int]:
    """Sum over greedy response rows of how many consecutive depths the heads' argmax gets right, and the
    number of rows (`outs`: the batch's head_outputs): with a chain tree of len(outs) nodes, 1 + mean
    run is the expected tokens/step."""
    from clover.train.objectives import depth_masks, head_logits_bf16

    masks = depth_masks(batch, len(outs), greedy_paths_only=True)
    rows = masks[0]  # rows with at least a depth-1 target on a greedy path
    alive = rows.clone()
    run = torch.zeros_like(rows, dtype=torch.float32)
    for d, (out, valid) in enumerate(zip(outs, masks), start=1):
        ok = torch.zeros_like(rows)
        sel = alive & valid
        if sel.any():
            logits = head_logits_bf16(heads, d, out[sel], lm_bf16)
            b, t = sel.nonzero(as_tuple=True)
            ok[b, t] = logits.argmax(-1) == batch["topk_ids"][b, t + d, 0].long()
        alive = alive & ok
        run += alive.float()
    return float(run[rows].sum()), int(rows.sum())
