"""Self-distillation losses: per draft depth, the head's distribution against the base's own.

Targets are the base's next-token distributions p_{t+d} (top-k, from the feature cache), never the
data's tokens. Per recipe:
- clover2 (paper and official code, main_clover2.py): per depth d, KL(p || q) + 10 x SmoothL1 between
  the head's pre-LM-head vector and the base's final-norm hidden state at t+d, weighted 0.7^(d-1).
  As in the official code, depth d at row t is trained only while the fed continuation x_{t+1..t+d}
  is what the base itself would have produced (its argmax), since only such paths are ever drafted
  from at inference.
- medusa: Medusa-2's self-distillation, KL(p || q) per head, weighted 0.8^(d-1). Medusa-1 used the
  data's tokens with cross-entropy; soft labels (the base's own distribution) carry more per token.
- clover: the Clover paper trains with Medusa's recipe; so do we (KL, 0.8^(d-1)).
KL(p || q) is computed as -sum_k p_k log q_k over the cached top-k tokens (the entropy of p is a
constant); the tail mass beyond top-k is left out.

The LM-head matmul over the 49k vocabulary dominates training time on CPU. Two economies, both
affecting the draft only, never what the base verifies:
- it runs in bfloat16 (forward and backward) where bfloat16 matmuls are fast (GPUs, CPUs with AVX-512;
  on a CPU with AVX2 only they are 20-45x slower than float32, so training runs in float32 there:
  `fastest_train_dtype`);
- during training the softmax runs over the batch's candidate set: every token in the base's top-k
  at any loss position of the batch, plus the 4096 tokens most often ranked first in the data (a few
  thousand of the 49k; sampled softmax with the base's own likely tokens as negatives). Every target lies in it by construction, and a token that the base
  ranks in its top-k anywhere in the data is a candidate in many batches; validation metrics use the
  full vocabulary. `--full-vocab` turns this off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clover.models.heads import DraftHeads, shifted


@dataclass(frozen=True)
class Recipe:
    decay: float  # loss weight of depth d is decay ** (d - 1)
    hidden_weight: float  # weight of the SmoothL1 hidden-state term (0: none)
    greedy_paths_only: bool  # train depth d only where x_{t+1..t+d} are the base's argmax tokens
    lr: float  # default peak learning rate


RECIPES = {
    "medusa": Recipe(decay=0.8, hidden_weight=0.0, greedy_paths_only=False, lr=1e-3),
    "clover": Recipe(decay=0.8, hidden_weight=0.0, greedy_paths_only=False, lr=5e-4),
    "clover2": Recipe(decay=0.7, hidden_weight=10.0, greedy_paths_only=True, lr=5e-4),
}


TOPK_ACCURACY = 3  # accuracy@k: a tree with k candidates at a depth (tree `small`: 3 at depth 1) catches these
# Held-out accuracy is also reported over each answer's first EARLY_ANSWER_TOKENS positions: what a benchmark of
# 128 new tokens drafts for. Late positions of long answers are easier (on SmolLM2's corpus, depth-1 top-1 0.39
# over positions 0-99, 0.51-0.53 after), so the all-positions figure reads above live acceptance there.
EARLY_ANSWER_TOKENS = 128


@dataclass
class DepthStats:
    """Sums over a batch for one depth (divide by count for means)."""

    loss: float = 0.0
    kl: float = 0.0
    hidden: float = 0.0
    correct: float = 0.0  # head argmax == base argmax
    in_topk: float = 0.0  # base argmax among the head's TOPK_ACCURACY most likely tokens
    count: int = 0
    correct_early: float = 0.0  # `correct` over rows among their answer's first EARLY_ANSWER_TOKENS positions
    count_early: int = 0


def depth_masks(batch: dict[str, torch.Tensor], depths: int, greedy_paths_only: bool) -> list[torch.Tensor]:
    """valid[d-1] [B, L]: row t has a target for depth d (p_{t+d} exists, is an assistant position and,
    if asked, the fed path is the base's greedy one)."""
    loss_mask = batch["loss_mask"]
    greedy = batch["topk_ids"][..., 0].long() == shifted(batch["tokens"].long(), 1)  # x_{t+1} == argmax p_t
    valid, path_ok = [], torch.ones_like(loss_mask)
    for d in range(1, depths + 1):
        path_ok = path_ok & shifted(greedy, d - 1) if greedy_paths_only else path_ok
        valid.append(shifted(loss_mask, d) & path_ok)
    return valid


@dataclass(frozen=True)
class Vocab:
    """The candidate set of the training softmax: `ids` [n] and `index` [V] (position in ids, -1 if absent)."""

    ids: torch.Tensor
    index: torch.Tensor
    lm: torch.Tensor  # LM-head rows of `ids`, in the training's matmul precision [n, H]

    @classmethod
    def of_batch(
        cls,
        batch: dict[str, torch.Tensor],
        lm_weight: torch.Tensor,
        always: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Vocab:
        """The batch's candidate set: the base's top-k tokens at its loss positions, plus `always`
        (the data's most frequent tokens, so small batches still see the usual confusions)."""
        ids = batch["topk_ids"][batch["loss_mask"]].reshape(-1)
        return cls.of(ids if always is None else torch.cat((ids, always.to(ids))), lm_weight, dtype)

    @classmethod
    def of(cls, ids: torch.Tensor, lm_weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Vocab:
        ids = torch.unique(ids.long())
        index = torch.full((lm_weight.shape[0],), -1, dtype=torch.long, device=ids.device)
        index[ids] = torch.arange(len(ids), device=ids.device)
        return cls(ids, index, lm_weight.detach()[ids].to(dtype))


def distill_loss(
    heads: DraftHeads,
    batch: dict[str, torch.Tensor],
    depths: int,
    recipe: Recipe,
    base_norm: torch.nn.Module,
    lm: torch.Tensor,
    vocab: Vocab | None = None,
    outs: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[DepthStats]]:
    """Weighted training loss of one batch and per-depth statistics (softmax over `vocab` if given;
    `outs`: the batch's `head_outputs`, if already computed; `lm`: the LM head in the matmuls' precision)."""
    hidden = batch["hidden"].float()
    outs = head_outputs(heads, batch, depths, dtype=lm.dtype) if outs is None else outs
    total = hidden.new_zeros(())
    stats = []
    early_rows = batch["loss_mask"].cumsum(1) <= EARLY_ANSWER_TOKENS  # row t among its answer's first positions
    for d, (out, valid) in enumerate(zip(outs, depth_masks(batch, depths, recipe.greedy_paths_only)), start=1):
        st = DepthStats()
        n = int(valid.sum())
        if n == 0:
            stats.append(st)
            continue
        x = out[valid]  # [n, H]
        target_rows = shifted_rows(valid, d)
        p = batch["topk_probs"][target_rows].float()  # [n, K]
        ids = batch["topk_ids"][target_rows].long()
        if vocab is not None and getattr(heads, "lm_heads", None) is None:
            logits = F.linear(x.to(vocab.lm.dtype), vocab.lm).float()
            cols = vocab.index[ids]
            assert bool((cols >= 0).all()), "a target outside the active vocabulary"
            predicted = vocab.ids[logits.argmax(-1)]
            top = vocab.ids[logits.topk(TOPK_ACCURACY, dim=-1).indices]
        else:
            logits = head_logits(heads, d, x, lm)
            cols = ids
            predicted = logits.argmax(-1)
            top = logits.topk(TOPK_ACCURACY, dim=-1).indices
        logq = torch.log_softmax(logits, dim=-1)
        kl = -(p * logq.gather(-1, cols)).sum(-1).mean()
        loss = kl
        if recipe.hidden_weight:
            target_h = base_norm(hidden[target_rows])
            h_loss = F.smooth_l1_loss(x.float(), target_h)
            loss = loss + recipe.hidden_weight * h_loss
            st.hidden = float(h_loss.detach()) * n
        total = total + recipe.decay ** (d - 1) * loss
        st.loss, st.kl, st.count = float(loss.detach()) * n, float(kl.detach()) * n, n
        right = predicted == ids[:, 0]
        st.correct = float(right.sum())
        st.in_topk = float((top == ids[:, :1]).any(-1).sum())
        early = early_rows[valid]
        st.correct_early, st.count_early = float((right & early).sum()), int(early.sum())
        stats.append(st)
    return total, stats


def head_outputs(
    heads: DraftHeads,
    batch: dict[str, torch.Tensor],
    depths: int,
    noise: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """The heads' teacher-forced pre-LM-head vectors per depth (float32), their matmuls in `dtype` inside; `noise`
    > 0 feeds them the base's features with uniform noise (`with_noise`), the targets staying clean."""
    hidden = batch["hidden"].float()
    if noise:
        hidden = with_noise(hidden, noise)
    with mixed_precision(hidden.device, dtype):
        return [o.float() for o in heads.teacher_forced(hidden, batch["tokens"].long(), depths)]


def with_noise(hidden: torch.Tensor, noise: float) -> torch.Tensor:
    """hidden + U(-a, a) per element, a = `noise` x the row's RMS. EAGLE trains its drafter on noisy features so
    that it tolerates the errors of its own predicted ones; scaling by the row's RMS makes one setting fit bases
    whose residual streams differ in scale (SmolLM2's rows: RMS ~32)."""
    amplitude = noise * hidden.pow(2).mean(-1, keepdim=True).sqrt()
    return hidden + (torch.rand_like(hidden) * 2 - 1) * amplitude


def mixed_precision(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """Matmuls in `dtype` with float32 master weights: bfloat16 trains the heads' bodies ~2x faster where it is
    fast; float32 turns autocast off."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def shifted_rows(valid: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of position t + d for every valid row t (batch index, position index)."""
    b, t = valid.nonzero(as_tuple=True)
    return b, t + d


def head_logits(heads: DraftHeads, depth: int, x: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Float32 logits of depth `depth` from its pre-LM-head vectors `x`; the shared LM head's matmul in `lm`'s
    precision."""
    if getattr(heads, "lm_heads", None) is not None:  # medusa with its own (trainable) LM heads, in float32
        return heads.head_logits(depth, x)
    return F.linear(x.to(lm.dtype), lm).float()


TRAIN_DTYPES = ("float32", "bfloat16")


def fastest_train_dtype(device: torch.device, rows: int = 256) -> str:
    """The matmul precision that trains faster here: bfloat16 on a GPU; on a CPU the faster of float32 and bfloat16
    autocast over a head-sized forward and backward (a CPU with AVX2 only runs bfloat16 20-45x slower; one with
    AVX-512 ~2x faster), timed once per machine and remembered in the user cache, so that --resume agrees."""
    if device.type != "cpu":
        return "bfloat16"
    from clover.train.features import remembered_fastest

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=g, requires_grad=True)
    w = torch.randn(4096, 576, generator=g)

    def seconds(name: str) -> float:
        dtype, times = getattr(torch, name), []
        for _ in range(3):  # the first warms the kernels up
            t = time.perf_counter()
            with mixed_precision(device, dtype):
                F.linear(x.to(dtype), w.to(dtype)).float().square().mean().backward()
            times.append(time.perf_counter() - t)
            if times[0] > 1.0:  # one slow pass says enough
                break
        return min(times[1:] or times)

    return remembered_fastest("train_dtype.json", TRAIN_DTYPES, seconds)
