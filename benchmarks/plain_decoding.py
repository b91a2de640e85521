"""Plain greedy decoding on the embedded default: clover's torch backend vs transformers' generate().

Both decode the same chat prompts for exactly N new tokens (EOS ignored) in one process, alternating
per prompt so load drift hits both alike; the generated token ids are compared too. Prints a table
and writes JSON (default benchmarks/results/plain_decoding.json).

    python benchmarks/plain_decoding.py [--new-tokens 64] [--repeats 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from clover.runtime.params import GenerationParams
from clover.tools.machine import host

PROMPTS = [
    "What is the capital of France? Answer in one paragraph.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a beginner.",
    "Give me three tips for staying healthy.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "plain_decoding.json")
    args = ap.parse_args()

    import transformers
    from tqdm import tqdm

    from clover.runtime.backends.torch import base_dir
    from clover.runtime.generator import Generator

    path = base_dir(args.base)
    gen = Generator.load(args.base, "none", "torch")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Exactly N tokens on both sides without changing the argmax: drop EOS instead of min_new_tokens,
    # which would suppress the EOS logit and so change transformers' greedy choice.
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    prompts = [gen.encode_prompt(p, chat=True) for p in PROMPTS]
    N = args.new_tokens

    def ours(ids):
        t = time.perf_counter()
        r = gen.generate(ids, GenerationParams(max_new_tokens=N, ignore_eos=True))
        return r.token_ids, time.perf_counter() - t

    def theirs(ids):
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=0)
        return out[0, len(ids) :].tolist(), time.perf_counter() - t

    ours(prompts[0][:8]), theirs(prompts[0][:8])  # warm-up

    def margin_at_divergence(ids, a, b):
        """First index where the outputs differ and transformers' top-2 logit margin there."""
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.inference_mode():
            top = hf(torch.tensor([ids + b[:i]])).logits[0, -1].topk(2).values
        return {"index": i, "top2_margin": float(top[0] - top[1])}

    totals = {"clover-torch": 0.0, "transformers": 0.0}
    same, mismatches = 0, []
    runs = [(r, i) for r in range(args.repeats) for i in range(len(prompts))]
    for _, i in tqdm(runs, desc="plain decoding", unit="prompt"):
        a, ta = ours(prompts[i])
        b, tb = theirs(prompts[i])
        totals["clover-torch"] += ta
        totals["transformers"] += tb
        same += a == b
        if a != b:
            mismatches.append(margin_at_divergence(prompts[i], a, b))
    tokens = N * len(runs)
    rows = {k: {"seconds": v, "tokens": tokens, "tokens_per_second": tokens / v} for k, v in totals.items()}
    ratio = rows["clover-torch"]["tokens_per_second"] / rows["transformers"]["tokens_per_second"]
    print(
        f"\nplain greedy decoding, {args.base}, {len(runs)} generations x {N} tokens, "
        f"{torch.get_num_threads()} threads, fp32"
    )
    print(f"{'engine':<16}{'tokens/s':>10}{'seconds':>10}")
    for k, v in rows.items():
        print(f"{k:<16}{v['tokens_per_second']:>10.2f}{v['seconds']:>10.2f}")
    print(f"clover / transformers speed ratio: {ratio:.2f}x; identical token ids: {same}/{len(runs)}")
    for m in mismatches:
        print(f"  outputs diverge at token {m['index']}: transformers' top-2 logit margin there {m['top2_margin']:.2e}")
    doc = {
        "host": host(),
        "benchmark": "plain_decoding",
        "base": args.base,
        "new_tokens": N,
        "generations": len(runs),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "results": rows,
        "speed_ratio": ratio,
        "identical_outputs": same,
        "mismatches": mismatches,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
