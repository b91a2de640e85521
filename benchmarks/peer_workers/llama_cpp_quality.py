"""llama.cpp (llama-cpp-python, own venv) for benchmarks/quality.py: teacher-forced logits of every position
(logits_all) and greedy decoding on one GGUF.

    python llama_cpp_quality.py --model X.gguf --threads 2
"""

from __future__ import annotations

import argparse
from importlib.metadata import version

from quality_protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=1024)
    args = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.n_ctx,
        logits_all=True,
        verbose=False,
    )

    def logits(ids: list[int], start: int):
        llm.reset()
        llm.eval(ids)
        return llm.scores[start - 1 : len(ids) - 1]  # row t: the logits after ids[:t + 1]

    def greedy(ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
        llm.reset()
        out = []
        for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) >= max_new_tokens or token in stop_ids:
                break
        return out

    serve(llm.n_vocab(), {"llama-cpp-python": version("llama-cpp-python")}, logits, greedy)


if __name__ == "__main__":
    main()
