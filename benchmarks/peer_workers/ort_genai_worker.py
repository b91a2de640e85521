"""onnxruntime-genai on one model folder made by its model builder (own venv).

    python ort_genai_worker.py --model DIR --threads 2 --modes plain,prompt-lookup --ngram-size 3 --draft-tokens 4
prompt-lookup: its n-gram speculation (speculative options ngram_size / max_draft_tokens), greedy.
"""

from __future__ import annotations

import json
from importlib.metadata import version

from protocol import Generation, TokenClock, serve, worker_args

MODES = ("plain", "prompt-lookup")


def load_model(folder: str, threads: int):
    """The builder's model folder as an onnxruntime_genai.Model on `threads` intra-op threads."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(
        json.dumps(
            {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}
        )
    )
    return og.Model(config)


def main() -> None:
    args = worker_args("onnxruntime-genai", MODES, ("--ngram-size", int, 3), ("--draft-tokens", int, 4))
    modes = args.modes
    import onnxruntime_genai as og

    model = load_model(args.model, args.threads)

    def generate(mode: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt_ids) + max_new_tokens)
        if mode == "prompt-lookup":
            params.set_speculative_options(ngram_size=args.ngram_size, max_draft_tokens=args.draft_tokens)
        generator = og.Generator(model, params)
        clock = TokenClock(max_new_tokens, stop_ids)
        generator.append_tokens(prompt_ids)
        while not generator.is_done():
            generator.generate_next_token()
            seq = generator.get_sequence(0)
            if clock.add(seq[len(prompt_ids) + len(clock.token_ids) :]):
                break
        stats = {}
        if mode == "prompt-lookup":
            s = generator.get_speculative_stats()
            stats = {
                k: s[k] for k in ("draft_tokens_proposed", "draft_tokens_accepted", "target_forward_passes") if k in s
            }
        return clock.result(**stats)

    serve(
        {m: m for m in modes},
        {"onnxruntime-genai": version("onnxruntime-genai"), "onnxruntime": version("onnxruntime")},
        generate,
    )


if __name__ == "__main__":
    main()
