"""llama.cpp through llama-cpp-python on one GGUF (own venv, compiled from PyPI's sdist).

    python llama_cpp_worker.py --model X.gguf --threads 2 --modes plain,prompt-lookup --num-pred-tokens 2
prompt-lookup: llama_cpp.llama_speculative.LlamaPromptLookupDecoding as draft_model, greedy. Each mode
gets its own Llama: a draft model makes llama-cpp-python keep the logits of every position (logits_all),
which plain decoding must not pay for.
"""

from __future__ import annotations

from importlib.metadata import version

from protocol import Generation, TokenClock, serve, worker_args

MODES = ("plain", "prompt-lookup")


def main() -> None:
    args = worker_args("llama.cpp", MODES, ("--num-pred-tokens", int, 2), ("--n-ctx", int, 1024))
    modes = args.modes
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(mode: str) -> Llama:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens) if mode == "prompt-lookup" else None
        return Llama(
            model_path=args.model,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            n_ctx=args.n_ctx,
            draft_model=draft,
            verbose=False,
        )

    llms = {m: load(m) for m in modes}

    def generate(mode: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
        llm = llms[mode]
        llm.reset()  # no KV reuse from the previous request: every prompt gets a full prefill, as elsewhere
        clock = TokenClock(max_new_tokens, stop_ids)
        for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0):  # temp 0: greedy sampler
            if clock.add([token]):
                break
        return clock.result()

    serve({m: m for m in modes}, {"llama-cpp-python": version("llama-cpp-python")}, generate)


if __name__ == "__main__":
    main()
