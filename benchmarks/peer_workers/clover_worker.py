"""clover-deploy on ONNX Runtime, one artifact, every requested mode (project venv).

    python clover_worker.py --artifact DIR --threads 2 --modes plain,default,chain-2,lookup
Modes: plain; default (what the artifact runs when --heads is not given: its `drafts` and tree, timed at export);
any tree spec clover-generate --tree takes (the artifact's heads); lookup[:chain-N]: prompt-lookup drafts (at most N
per step) on a second runner without the heads.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from protocol import Generation, fail_to_start, serve

from clover.runtime.params import EngineOptions, GenerationParams


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
        from clover.artifact import read_manifest

        modes = args.modes.split(",")
        drafts = read_manifest(args.artifact).drafts or "heads"
        gen = Generator.load(
            args.artifact, heads="artifact", backend="ort", tree="plain", options=EngineOptions(threads=args.threads)
        )
        plain_runner = None
        if any(m.startswith("lookup") for m in modes) or (drafts == "lookup" and "default" in modes):
            plain_runner = Generator.load(
                args.artifact, heads="lookup", backend="ort", options=EngineOptions(threads=args.threads)
            ).runner
        gens = {}
        for m in modes:
            if m.startswith("lookup"):
                gens[m] = Generator(plain_runner, gen.tokenizer, m.partition(":")[2] or None, "lookup")
            elif m == "default":
                runner = plain_runner if drafts == "lookup" else gen.runner
                gens[m] = Generator(runner, gen.tokenizer, None, drafts)
            else:
                gens[m] = Generator(gen.runner, gen.tokenizer, m)
    except CloverError as e:
        fail_to_start(str(e))

    def generate(mode: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
        if set(stop_ids) != set(gen.tokenizer.eos_token_ids):
            raise ValueError(
                f"clover stops at its tokenizer's EOS ids {gen.tokenizer.eos_token_ids}, asked for {stop_ids}"
            )
        r = gens[mode].generate(prompt_ids, GenerationParams(max_new_tokens=max_new_tokens))
        prefill = r.timings["prefill"]
        return Generation(
            r.token_ids,
            prefill,
            r.seconds - prefill,
            {"tokens_per_step": round(r.tokens_per_step, 3), "steps": r.steps},
        )

    def label(m: str, g: Generator) -> str:
        name = {"lookup": f"lookup-{g.tree.max_depth}", "heads+lookup": f"{g.tree.name}+lookup"}.get(g.drafts)
        return f"default {name or g.tree.name}" if m == "default" else name or g.tree.name

    serve(
        {m: label(m, g) for m, g in gens.items()},
        {"clover-deploy": version("clover-deploy"), "onnxruntime": version("onnxruntime")},
        generate,
    )


if __name__ == "__main__":
    main()
