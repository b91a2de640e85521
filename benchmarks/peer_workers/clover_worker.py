"""clover-deploy on ONNX Runtime, one artifact, every requested tree on one shared runner (project venv).

    python clover_worker.py --artifact DIR --threads 2 --modes plain,default,chain-2
Modes are trees: plain, default (the artifact's own tree), or any tree spec clover-generate --tree takes; and
lookup[:chain-N]: prompt-lookup drafts (at most N per step) on a second runner without the heads.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from protocol import Generation, fail_to_start, serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="plain,default")
    args = ap.parse_args()
    try:
        from clover.errors import CloverError
        from clover.runtime.generator import Generator
    except ImportError as e:
        fail_to_start(f"clover-deploy is not importable in {sys.executable}: {e}")
    try:
        modes = args.modes.split(",")
        tree = lambda mode: None if mode == "default" else mode  # noqa: E731
        trees = [m for m in modes if not m.startswith("lookup")]
        gen = Generator.load(
            args.artifact, backend="ort", threads=args.threads, tree=tree(trees[0] if trees else "plain")
        )
        gens = {m: Generator(gen.runner, gen.tokenizer, tree(m)) for m in trees}
        lookups = [m for m in modes if m.startswith("lookup")]
        if lookups:
            plain = Generator.load(args.artifact, heads="lookup", backend="ort", threads=args.threads)
            gens |= {
                m: Generator(plain.runner, plain.tokenizer, m.partition(":")[2] or None, "lookup") for m in lookups
            }
        gens = {m: gens[m] for m in modes}
    except CloverError as e:
        fail_to_start(str(e))

    def generate(mode: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
        if set(stop_ids) != set(gen.tokenizer.eos_token_ids):
            raise ValueError(
                f"clover stops at its tokenizer's EOS ids {gen.tokenizer.eos_token_ids}, asked for {stop_ids}"
            )
        r = gens[mode].generate(prompt_ids, max_new_tokens=max_new_tokens)
        prefill = r.timings["prefill"]
        return Generation(
            r.token_ids,
            prefill,
            r.seconds - prefill,
            {"tokens_per_step": round(r.tokens_per_step, 3), "steps": r.steps},
        )

    serve(
        {m: f"lookup-{g.tree.max_depth}" if g.drafts == "lookup" else g.tree.name for m, g in gens.items()},
        {"clover-deploy": version("clover-deploy"), "onnxruntime": version("onnxruntime")},
        generate,
    )


if __name__ == "__main__":
    main()
