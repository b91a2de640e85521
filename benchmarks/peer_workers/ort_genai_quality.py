"""onnxruntime-genai (own venv) for benchmarks/quality.py: teacher-forced logits of every position (the prefill's
logits output) and greedy decoding on one model folder made by its model builder.

    python ort_genai_quality.py --model DIR --threads 2
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version

from ort_genai_worker import load_model
from quality_protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import numpy as np
    import onnxruntime_genai as og

    model = load_model(args.model, args.threads)
    vocab = json.loads(open(f"{args.model}/genai_config.json").read())["model"]["vocab_size"]

    def logits(ids: list[int], start: int):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + 1)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        rows = np.asarray(generator.get_output("logits"))  # [1, T, V]: the prefill's logits of every position
        return rows.reshape(-1, rows.shape[-1])[start - 1 : len(ids) - 1]

    def greedy(ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        out = []
        while not generator.is_done() and len(out) < max_new_tokens:
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
            if out[-1] in stop_ids:
                break
        return out

    serve(vocab, {"onnxruntime-genai": version("onnxruntime-genai")}, logits, greedy)


if __name__ == "__main__":
    main()
