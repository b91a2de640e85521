"""Clover-2 draft-head variants at equal budgets: does capacity, richer features or the objective move
depth-1 accuracy on MT-Bench, where the shipped heads draft the base's next token a third of the time?

Every arm trains on the same features (the corpus's greedy first answers, training split, bfloat16 base) for the
same steps, and is scored teacher-forced along the fp32 ONNX artifact's plain greedy outputs (128 tokens) for
MT-Bench and for ShareGPT prompts of the corpus's validation split (never trained on):
- from the shipped heads: `shipped` (go on training as they are), `layers` (EAGLE-3-style: the base's layer
  2/14/26 hidden states, normalised, projected and added to the last layer's; zero at the start), `deeper` (two
  more augmenting layers, identity at the start), `kl-only` (no hidden-state regression term);
- from scratch: `scratch` and `scratch-layers`.
Before training, the shipped heads' depth-1 accuracy is also split by the base's probability of the token.

  python benchmarks/head_variants.py [--tokens 400000] [--epochs 2] [--scratch-epochs 5] [--arms ...]

Writes benchmarks/results/head_variants.json. Takes ~1 hour on 2 cores at the defaults (features ~10 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from clover.models.decoder import DecoderLayer, causal_mask
from clover.models.head_io import resolve_heads
from clover.models.loading import load_base
from clover.models.smollm2 import resolve_base
from clover.runtime.generator import Generator
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.bench import load_prompts
from clover.tools.demo import SHIPPED_CORPUS, cached_artifact
from clover.tools.machine import host
from clover.train.corpus import Corpus
from clover.train.data import load_conversations
from clover.train.objectives import RECIPES, Vocab, distill_loss, mixed_precision
from clover.train.trainer import TrainConfig, lr_at

HERE = Path(__file__).parent
AUX_LAYERS = (2, 14, 26)  # low, middle, high of SmolLM2's 30 (EAGLE-3 takes three such)
MAX_LENGTH, TOPK, DEPTHS, BATCH_TOKENS = 512, 16, 2, 4096
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9)
FROM_SHIPPED = ("shipped", "layers", "deeper", "kl-only")
FROM_SCRATCH = ("scratch", "scratch-layers")


def eval_sequences(per_set: int, new_tokens: int) -> dict[str, list[tuple[list[int], int]]]:
    """(prompt + plain greedy output, prompt length) for MT-Bench and ShareGPT validation prompts, from the fp32
    ONNX artifact with the shipped heads: what clover-bench's replay scores along."""
    corpus = Corpus.open(SHIPPED_CORPUS)
    conversations = load_conversations("sharegpt")
    sharegpt = [
        conversations[i][0]["content"]
        for i in sorted(corpus.validation_indices())
        if conversations[i][0]["role"] == "user" and 20 < len(conversations[i][0]["content"]) < 800
    ]
    art = cached_artifact("smollm2", "smollm2-clover2", weights=None, draft_quant="int8", corpus=SHIPPED_CORPUS)
    gen = Generator.load(art, heads=None, backend="ort", tree="plain", options=EngineOptions(threads=2))
    sets = {
        "mtbench": load_prompts("mtbench", per_set),
        "sharegpt-val": sharegpt[:: max(1, len(sharegpt) // per_set)][:per_set],
    }
    out = {}
    for name, prompts in sets.items():
        seqs = []
        for p in tqdm(prompts, desc=f"plain outputs {name}", unit="prompt"):
            ids = gen.encode_prompt([{"role": "user", "content": p}], chat=True)
            r = gen.generate(ids, GenerationParams(max_new_tokens=new_tokens))
            if len(r.token_ids) > 4:
                seqs.append((list(ids) + list(r.token_ids), len(ids)))
        out[name] = seqs
    return out


def training_sequences(tokens: int, corpus_dir: Path = SHIPPED_CORPUS) -> list[tuple[list[int], int]]:
    """The corpus's greedy answers of the training split, in corpus order, up to `tokens` answer tokens."""
    corpus = Corpus.open(corpus_dir)
    held_out, seqs, n = corpus.validation_indices(), [], 0
    for c in corpus.conversations():
        if c.index in held_out or c.sample != 1 or len(c.prompt) >= MAX_LENGTH - 32:
            continue
        ids = (list(c.prompt) + list(c.response))[:MAX_LENGTH]
        seqs.append((ids, len(c.prompt)))
        n += len(ids) - len(c.prompt)
        if n >= tokens:
            break
    return seqs


@torch.inference_mode()
def features(base, seqs: list[tuple[list[int], int]], desc: str) -> list[dict[str, np.ndarray]]:
    """Per sequence: tokens, last-layer hidden (pre-norm), the AUX_LAYERS' hidden states, the base's top-k next
    tokens at answer positions and the loss mask (as clover.train.features, plus the aux states)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        base.layers[i].register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0])) for i in AUX_LAYERS
    ]
    res, order = [], sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    bar = tqdm(total=sum(len(s[0]) for s in seqs), desc=f"features {desc}", unit="tok", unit_scale=True)
    i = 0
    while i < len(order):
        group = [seqs[j] for j in order[i : i + max(1, BATCH_TOKENS // len(seqs[order[i]][0]))]]
        i += len(group)
        B, L = len(group), max(len(s[0]) for s in group)
        ids = torch.zeros(B, L, dtype=torch.long)
        for b, (x, _) in enumerate(group):
            ids[b, : len(x)] = torch.tensor(x)
        keys, values = base.empty_cache(B, 0)
        out = base(
            ids,
            torch.arange(L).expand(B, L),
            causal_mask(L, B),
            torch.zeros(B, dtype=torch.long),
            keys,
            values,
            logit_rows=torch.zeros(0, dtype=torch.long),
        )
        for b, (x, prompt) in enumerate(group):
            n = len(x)
            h = out.hidden_states[b, :n]
            mask = np.zeros(n, dtype=bool)
            mask[prompt - 1 : n - 1] = True  # p_t is over an answer token
            probs = torch.softmax(base.lm_head(base.norm(h[torch.from_numpy(mask)])).float(), -1).topk(TOPK, -1)
            tk_ids, tk_p = np.zeros((n, TOPK), np.int32), np.zeros((n, TOPK), np.float16)
            tk_ids[mask], tk_p[mask] = probs.indices.numpy(), probs.values.numpy()
            res.append(
                {
                    "tokens": np.array(x, np.int32),
                    "hidden": h.to(torch.float16).numpy(),
                    "aux": torch.cat([captured[j][b, :n] for j in AUX_LAYERS], -1).to(torch.float16).numpy(),
                    "topk_ids": tk_ids,
                    "topk_probs": tk_p,
                    "loss_mask": mask,
                }
            )
            bar.update(n)
    bar.close()
    for h in hooks:
        h.remove()
    return res


def collate(items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    L = max(len(it["tokens"]) for it in items)
    out = {}
    for k, a in items[0].items():
        arr = np.zeros((len(items), L) + a.shape[1:], a.dtype)
        for b, it in enumerate(items):
            arr[b, : len(it[k])] = it[k]
        out[k] = torch.from_numpy(arr)
    return out


def batches(data: list[dict], rng: random.Random) -> list[list[int]]:
    """Length-sorted batches of at most BATCH_TOKENS padded tokens, shuffled."""
    order = sorted(range(len(data)), key=lambda i: len(data[i]["tokens"]) + rng.random())
    res, cur, L = [], [], 0
    for i in order:
        n = len(data[i]["tokens"])
        if cur and max(L, n) * (len(cur) + 1) > BATCH_TOKENS:
            res.append(cur)
            cur, L = [], 0
        cur.append(i)
        L = max(L, n)
    res += [cur] if cur else []
    rng.shuffle(res)
    return res


class AuxFusion(nn.Module):
    """h + W [norm(h_2); norm(h_14); norm(h_26)], W zero at the start (so the arm starts as the heads it is given)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.proj = nn.Linear(len(AUX_LAYERS) * hidden, hidden, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        a = aux.float().unflatten(-1, (len(AUX_LAYERS), self.hidden))
        a = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)
        return hidden + self.proj(a.flatten(-2))


@dataclasses.dataclass
class Arm:
    name: str
    heads: nn.Module
    fusion: AuxFusion | None
    recipe: object

    def parameters(self) -> list[torch.Tensor]:
        return list(self.heads.parameters()) + (list(self.fusion.parameters()) if self.fusion else [])

    def outputs(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        hidden = batch["hidden"].float()
        with mixed_precision(hidden.device):
            x = hidden if self.fusion is None else self.fusion(hidden, batch["aux"])
            return [o.float() for o in self.heads.teacher_forced(x, batch["tokens"].long(), DEPTHS)]


def make_arm(name: str, base32) -> Arm:
    heads = resolve_heads("smollm2-clover2", base32)
    if name.startswith("scratch"):
        heads.init_weights(base32, torch.Generator().manual_seed(0))
    if name == "deeper":
        for j in range(2):
            layer = DecoderLayer(base32.config)
            layer.load_state_dict(base32.layers[-1 - j].state_dict())
            nn.init.zeros_(layer.self_attn.o_proj.weight)  # residual branches zero: identity at the start
            nn.init.zeros_(layer.mlp.down_proj.weight)
            heads.augment.layers.append(layer)
    fusion = AuxFusion(base32.config.hidden_size) if name.endswith("layers") else None
    recipe = dataclasses.replace(RECIPES["clover2"], hidden_weight=0.0) if name == "kl-only" else RECIPES["clover2"]
    return Arm(name, heads.requires_grad_(True), fusion, recipe)


def without_aux(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "aux"}


@torch.no_grad()
def evaluate(arm: Arm, data: list[dict], base32, lm_bf16) -> dict:
    """Teacher-forced top-1 / top-3 per depth (full vocabulary), as clover-train's validation."""
    right, top3, count = [0.0] * DEPTHS, [0.0] * DEPTHS, [0] * DEPTHS
    for idx in batches(data, random.Random(0)):
        b = collate([data[i] for i in idx])
        _, stats = distill_loss(
            arm.heads, without_aux(b), DEPTHS, arm.recipe, base32.norm, lm_bf16, None, arm.outputs(b)
        )
        for d, st in enumerate(stats):
            right[d], top3[d], count[d] = right[d] + st.correct, top3[d] + st.in_topk, count[d] + st.count
    return {
        "top1": [round(r / max(1, c), 4) for r, c in zip(right, count)],
        "top3": [round(r / max(1, c), 4) for r, c in zip(top3, count)],
        "positions": count,
    }


@torch.no_grad()
def by_confidence(arm: Arm, data: list[dict], lm_bf16) -> list[dict]:
    """Depth 1 on the base's greedy path, split by the base's probability of the token drafted for."""
    conf, right = [], []
    for it in data:
        b = collate([it])
        out = arm.outputs(b)[0][0]
        mask = b["loss_mask"][0]
        rows = torch.nonzero(mask[:-1] & mask[1:]).flatten()
        on_path = b["topk_ids"][0, rows, 0] == b["tokens"][0, rows + 1]  # the fed token is the base's argmax
        rows = rows[on_path]
        pred = F.linear(out[rows].to(torch.bfloat16), lm_bf16).float().argmax(-1)
        conf += b["topk_probs"][0, rows + 1, 0].float().tolist()
        right += (pred == b["topk_ids"][0, rows + 1, 0].long()).tolist()
    conf, right = np.array(conf), np.array(right)
    edges = (0.0, *CONFIDENCE_EDGES, 1.0)
    bins = np.searchsorted(CONFIDENCE_EDGES, conf, side="right")
    return [
        {
            "p": [edges[i], edges[i + 1]],
            "share": round(float((bins == i).mean()), 4),
            "top1": round(float(right[bins == i].mean()), 4) if (bins == i).any() else None,
        }
        for i in range(len(edges) - 1)
    ]


def train(arm: Arm, data: list[dict], evals: dict[str, list[dict]], epochs: int, lr: float, base32, lm_bf16) -> dict:
    """clover-train's optimiser and cosine schedule (its TrainConfig), with a 5% warm-up; evaluated after every epoch."""
    cfg = TrainConfig("clover2", DEPTHS, lr=lr, warmup_fraction=0.05)
    params = arm.parameters()
    opt = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    rng = random.Random(1)
    plan = [batches(data, rng) for _ in range(epochs)]
    total, step, t0, seen = sum(map(len, plan)), 0, time.time(), 0
    res: dict = {"epochs": []}
    for epoch, order in enumerate(plan, 1):
        for idx in tqdm(order, desc=f"{arm.name} epoch {epoch}/{epochs}", unit="batch"):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, cfg)
            b = collate([data[i] for i in idx])
            bb = without_aux(b)
            loss, _ = distill_loss(
                arm.heads,
                bb,
                DEPTHS,
                arm.recipe,
                base32.norm,
                lm_bf16,
                Vocab.of_batch(bb, base32.lm_head.weight),
                arm.outputs(b),
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step, seen = step + 1, seen + int(bb["loss_mask"].sum())
        res["epochs"].append({name: evaluate(arm, v, base32, lm_bf16) for name, v in evals.items()})
        print(arm.name, epoch, json.dumps({k: v["top1"] for k, v in res["epochs"][-1].items()}), flush=True)
    res["loss_tokens_per_s"] = round(seen / (time.time() - t0))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=400_000, help="training answer tokens")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the arms that go on from the shipped heads")
    p.add_argument("--scratch-epochs", type=int, default=5, help="epochs of the arms trained from scratch")
    p.add_argument("--arms", default=",".join(FROM_SHIPPED + FROM_SCRATCH))
    p.add_argument(
        "--corpus",
        default=str(SHIPPED_CORPUS),
        help="corpus folder(s) (clover-data) the arms train on; "
        "several, comma-separated: every arm on each, side by side (rows ARM@CORPUS)",
    )
    p.add_argument("--eval-prompts", type=int, default=80, help="prompts per evaluation set (MT-Bench has 80)")
    p.add_argument("--json", default=str(HERE / "results" / "head_variants.json"))
    args = p.parse_args()
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(FROM_SHIPPED + FROM_SCRATCH))
    if unknown:
        raise SystemExit(
            f"head_variants: unknown arm(s) {unknown}: choose from {', '.join(FROM_SHIPPED + FROM_SCRATCH)}"
        )
    torch.manual_seed(0)
    torch.set_num_threads(2)
    evals_seqs = eval_sequences(args.eval_prompts, 128)
    base = load_base(resolve_base("smollm2"), "bfloat16").eval()
    evals = {name: features(base, seqs, name) for name, seqs in evals_seqs.items()}
    corpora = [Path(c) for c in args.corpus.split(",")]
    data = {c: features(base, training_sequences(args.tokens, c), f"training {c.name}") for c in corpora}
    del base
    base32 = load_base(resolve_base("smollm2"), "float32").eval().requires_grad_(False)
    lm_bf16 = base32.lm_head.weight.detach().to(torch.bfloat16)
    shipped = make_arm("shipped", base32)
    doc = {
        "host": host(),
        "corpora": {
            c.name: {"path": str(c), "training_answer_tokens": int(sum(d["loss_mask"].sum() for d in data[c]))}
            for c in corpora
        },
        "aux_layers": AUX_LAYERS,
        "depths": DEPTHS,
        "shipped": {name: evaluate(shipped, v, base32, lm_bf16) for name, v in evals.items()},
        "shipped_by_base_probability": {name: by_confidence(shipped, v, lm_bf16) for name, v in evals.items()},
        "arms": {},
    }
    for c in corpora:
        for name in arms:
            epochs, lr = (args.scratch_epochs, 5e-4) if name in FROM_SCRATCH else (args.epochs, 2.5e-4)
            key = name if len(corpora) == 1 else f"{name}@{c.name}"
            doc["arms"][key] = train(make_arm(name, base32), data[c], evals, epochs, lr, base32, lm_bf16)
            doc["arms"][key].update(epochs_run=epochs, lr=lr, corpus=c.name)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1))
    print(
        "\ndepth-1 / depth-2 top-1, teacher-forced along the fp32 artifact's plain outputs (training answer tokens: "
        + ", ".join(f"{k} {v['training_answer_tokens']}" for k, v in doc["corpora"].items())
        + ")"
    )
    print(f"{'arm':30s} {'epochs':>6s} " + " ".join(f"{n:>18s}" for n in evals))
    row = lambda e: " ".join(f"{e[n]['top1'][0]:8.3f} {e[n]['top1'][1]:8.3f} " for n in evals)  # noqa: E731
    print(f"{'shipped (as is)':30s} {'':>6s} " + row(doc["shipped"]))
    for name, r in doc["arms"].items():
        print(f"{name:30s} {r['epochs_run']:>6d} " + row(r["epochs"][-1]))
    for name, bins in doc["shipped_by_base_probability"].items():
        print(
            f"shipped heads, depth 1 on {name} by the base's probability of the token: "
            + ", ".join(f"p {b['p'][0]:.1f}-{b['p'][1]:.1f}: {b['top1']} ({b['share']:.0%})" for b in bins)
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
