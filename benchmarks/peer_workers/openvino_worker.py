"""OpenVINO GenAI LLMPipeline on an optimum-intel export (int8 weights), own venv.

    python openvino_worker.py --model DIR --threads 2 --modes plain,prompt-lookup --ngram-size 3 --draft-tokens 4
prompt-lookup: LLMPipeline(prompt_lookup=True) with max_ngram_size / num_assistant_tokens, greedy.
Each mode gets its own pipeline: prompt lookup runs on OpenVINO GenAI's continuous-batching pipeline.
"""

from __future__ import annotations

from importlib.metadata import version

from protocol import Generation, TokenClock, serve, worker_args

MODES = ("plain", "prompt-lookup")


def main() -> None:
    args = worker_args("OpenVINO GenAI", MODES, ("--ngram-size", int, 3), ("--draft-tokens", int, 4))
    modes = args.modes
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    pipes = {
        m: ov_genai.LLMPipeline(
            args.model, "CPU", prompt_lookup=m == "prompt-lookup", INFERENCE_NUM_THREADS=args.threads
        )
        for m in modes
    }

    class Clocked(ov_genai.StreamerBase):
        def __init__(self, clock: TokenClock):
            super().__init__()
            self.clock = clock

        def write(self, token):
            done = self.clock.add(token if isinstance(token, list) else [token])
            return ov_genai.StreamingStatus.STOP if done else ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def generate(mode: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Generation:
        pipe = pipes[mode]
        config = pipe.get_generation_config()
        config.max_new_tokens, config.do_sample = max_new_tokens, False
        config.stop_token_ids = set(stop_ids)
        if mode == "prompt-lookup":
            config.max_ngram_size, config.num_assistant_tokens = args.ngram_size, args.draft_tokens
        clock = TokenClock(max_new_tokens, stop_ids)
        pipe.generate(ov.Tensor(np.array([prompt_ids], dtype=np.int64)), config, Clocked(clock))
        return clock.result()

    serve(
        {m: m for m in modes}, {"openvino-genai": version("openvino-genai"), "openvino": version("openvino")}, generate
    )


if __name__ == "__main__":
    main()
