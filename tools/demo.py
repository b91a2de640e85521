"""`make demo`: the embedded default end to end: speculative decoding next to plain decoding.

Streams the speculative answer, then prints whether it is token-identical to plain decoding, the
acceptance length and the speed ratio, both measured in this run on the same backend.
"""

from __future__ import annotations

import argparse
import sys

from clover.errors import CloverError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="clover-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--heads", default="smollm2-clover2")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--prompt", default="Give me three tips for staying healthy.")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    try:
        from clover.runtime.generator import Generator
        from clover.runtime.torch_backend import TorchRunner

        spec = Generator.load(args.base, args.heads, "torch", args.tree)
        plain = Generator(TorchRunner(spec.runner.base), spec.tokenizer)  # same weights, no heads
        print(f"base {args.base}, heads {args.heads}, tree {spec.tree.name} ({spec.tree.num_nodes} nodes), torch backend\n")
        stream = spec.stream(args.prompt, chat=True, max_new_tokens=args.max_new_tokens)
        for delta in stream:
            print(delta, end="", flush=True)
        fast = stream.result
        ref = plain.generate(args.prompt, chat=True, max_new_tokens=args.max_new_tokens)
    except CloverError as e:
        print(f"clover-demo: error: {e}", file=sys.stderr)
        return 2
    same = "identical to" if fast.token_ids == ref.token_ids else "DIFFERENT from"
    print(f"\n\nspeculative output is {same} plain greedy decoding ({fast.new_tokens} tokens)")
    print(f"acceptance length {fast.tokens_per_step:.2f} tokens/step (bonus token included)")
    print(f"speculative {fast.tokens_per_second:.1f} tok/s, plain {ref.tokens_per_second:.1f} tok/s: "
          f"{fast.tokens_per_second / ref.tokens_per_second:.2f}x")
    if args.heads.startswith("random:"):
        print("(untrained heads accept almost nothing, so this shows losslessness, not speed; trained heads "
              "come with clover-train)")
    return 0 if fast.token_ids == ref.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
