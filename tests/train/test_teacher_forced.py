"""Training must see exactly what inference computes: teacher_forced row t at depth d equals the draft
logits begin/step produce after accepting x_<=t and drafting along the true continuation."""

import pytest
import torch
from helpers import tiny_base
from numerics import assert_close_paths, chain_reduction

from clover.models.decoder import causal_mask
from clover.models.head_io import build_heads
from clover.train.objectives import RECIPES, depth_masks, distill_loss


def _random_heads(base, arch, depths):
    heads = build_heads(base, arch, num_heads=depths)
    heads.init_weights(base, torch.Generator().manual_seed(1))
    with torch.no_grad():  # move away from the identity-like start so every term matters
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads.eval()


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_teacher_forced_matches_begin_and_step(arch):
    torch.manual_seed(0)
    base = tiny_base()
    depths = 3
    heads = _random_heads(base, arch, depths)
    L = 12
    K = chain_reduction(base.config, layers=heads.num_cache_layers + 1, context=L)  # the heads' chain (numerics.py)
    tokens = torch.randint(0, 96, (2, L))
    keys, values = base.empty_cache(2, 0)
    out = base(tokens, torch.arange(L).expand(2, L), causal_mask(L, 2), torch.zeros(2, dtype=torch.long), keys, values)
    hidden = out.hidden_states
    with torch.no_grad():
        tf = [heads.head_logits(d, x) for d, x in enumerate(heads.teacher_forced(hidden, tokens, depths), start=1)]
        for b in range(2):
            for t in (0, 4, L - 1 - depths):
                hk, hv = base.empty_cache(1, 0, heads.num_cache_layers)
                first = heads.begin(
                    hidden[b : b + 1, : t + 1],
                    tokens[b : b + 1, 1 : t + 2],
                    torch.arange(t + 1)[None],
                    torch.zeros(1, dtype=torch.long),
                    hk,
                    hv,
                )
                assert_close_paths(tf[0][b, t], first.logits[0], reduction=K)
                state = first.state
                for d in range(2, depths + 1):
                    state, logits = heads.step(d - 1, state, tokens[b : b + 1, t + d])
                    assert_close_paths(tf[d - 1][b, t], logits[0], reduction=K)


def test_depth_masks_follow_targets_and_greedy_paths():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0]])
    # argmax of p_t: x_{t+1} for t = 0, 1, 3 (greedy), not for t = 2
    top = torch.tensor([[6, 7, 1, 9, 0, 0]])
    batch = {
        "tokens": tokens,
        "topk_ids": top[..., None],
        "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool),
    }
    free = depth_masks(batch, 2, greedy_paths_only=False)
    assert free[0].tolist() == [[1, 1, 1, 1, 0, 0]]  # row t has a depth-1 target iff loss_mask[t+1]
    assert free[1].tolist() == [[1, 1, 1, 0, 0, 0]]
    greedy = depth_masks(batch, 2, greedy_paths_only=True)
    assert greedy[0].tolist() == [[1, 1, 0, 1, 0, 0]]  # fed x_{t+1} must be argmax p_t
    assert greedy[1].tolist() == [[1, 0, 0, 0, 0, 0]]  # and x_{t+2} argmax p_{t+1}


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_distillation_loss_decreases(arch):
    torch.manual_seed(0)
    base = tiny_base()
    heads = build_heads(base, arch, num_heads=2)
    heads.init_weights(base, torch.Generator().manual_seed(0))
    heads.float().train()
    B, L, K = 2, 16, 4
    tokens = torch.randint(0, 96, (B, L))
    keys, values = base.empty_cache(B, 0)
    out = base(tokens, torch.arange(L).expand(B, L), causal_mask(L, B), torch.zeros(B, dtype=torch.long), keys, values)
    p, ids = torch.topk(torch.softmax(out.logits, -1), K)
    tokens[:, 1:] = ids[:, :-1, 0]  # a greedy continuation, so clover2's path filter keeps rows
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, -1] = False
    batch = {
        "tokens": tokens,
        "hidden": out.hidden_states.half(),
        "topk_ids": ids.int(),
        "topk_probs": p.half(),
        "loss_mask": mask,
    }
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    lm = base.lm_head.weight.to(torch.bfloat16)
    first = None
    for _ in range(30):
        loss, stats = distill_loss(heads, batch, 2, RECIPES[arch], base.norm, lm)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.8 * first
    assert all(st.count > 0 for st in stats)


def test_early_accuracy_counts_each_answers_first_positions(monkeypatch):
    """Held-out accuracy over each answer's first EARLY_ANSWER_TOKENS positions: rows are counted by how many
    answer (loss) positions precede them in their own sequence, and their hits are a subset of all hits."""
    import clover.train.objectives as objectives

    monkeypatch.setattr(objectives, "EARLY_ANSWER_TOKENS", 3)
    torch.manual_seed(0)
    base = tiny_base()
    heads = _random_heads(base, "medusa", 1)
    B, L = 2, 10
    tokens = torch.randint(0, 96, (B, L))
    keys, values = base.empty_cache(B, 0)
    out = base(tokens, torch.arange(L).expand(B, L), causal_mask(L, B), torch.zeros(B, dtype=torch.long), keys, values)
    p, ids = torch.topk(torch.softmax(out.logits, -1), 4)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, 2:9] = True  # sequence 0 answers from position 2, sequence 1 from position 5
    mask[1, 5:9] = True
    batch = {
        "tokens": tokens,
        "hidden": out.hidden_states,
        "topk_ids": ids.int(),
        "topk_probs": p.half(),
        "loss_mask": mask,
    }
    with torch.no_grad():
        _, stats = distill_loss(heads, batch, 1, RECIPES["medusa"], base.norm, base.lm_head.weight.to(torch.bfloat16))
    st = stats[0]
    # depth-1 rows are t with loss_mask[t + 1] (7 + 4 = 11 rows below 9); early ones have cumsum(loss_mask)[t] <= 3:
    # sequence 0: t = 1..4 (cumsum 0, 1, 2, 3), sequence 1: t = 4..7 (0, 1, 2, 3)
    assert (st.count, st.count_early) == (11, 8)
    assert 0 <= st.correct_early <= st.correct
