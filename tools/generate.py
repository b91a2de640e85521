"""clover-generate: generate text with a base model and (optionally) Clover draft heads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clover.errors import CloverError
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.cli import run_cli

PROVIDERS_HELP = (
    "ONNX Runtime execution providers, comma-separated in order of preference: cpu (default), cuda, "
    "or cuda,cpu (runs on the CPU, saying so in one line, where CUDA is not available); ort backend"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clover-generate",
        description="Generate text with speculative decoding (greedy output equals plain decoding).",
    )
    p.add_argument(
        "--base", default=None, help="Hugging Face model folder, or 'smollm2' (embedded default; torch backend)"
    )
    p.add_argument(
        "--heads",
        default=None,
        help="head checkpoint folder, random:ARCH[:SEED] (medusa, clover, clover2), none (default: none; "
        "with --artifact: the artifact's heads, or none for plain decoding), or lookup: prompt-lookup "
        "drafts on the base alone (--tree chain-N caps the drafts per step; default chain-12)",
    )
    p.add_argument(
        "--artifact", type=Path, default=None, help="artifact folder written by clover-export (ort and trt backends)"
    )
    p.add_argument(
        "--backend",
        default=None,
        help="torch (default), ort (default with --artifact), or trt (default with an artifact exported "
        "with --backend trt)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text ('-' for stdin)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template (a base model has none: give one with "
        "--chat-template, or leave --chat out to continue the text)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template --chat renders with, replacing the model's own or adding one to a base model: a "
        "file holding the Jinja template, or the template itself (as vLLM's --chat-template)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (0: off)")
    p.add_argument(
        "--min-p", type=float, default=0.0, help="sample from the tokens at least this times as likely as the first"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument(
        "--tree",
        default=None,
        help="plain, chain-N, small, mc26, a JSON file or inline JSON list (default: mc26 with heads; "
        "an artifact's own tree with --artifact)",
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default=None, help="float32 (default), float16 or bfloat16; an artifact has its own")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch intra-op / ONNX Runtime intra-op)")
    p.add_argument("--providers", default=None, help=PROVIDERS_HELP)
    p.add_argument(
        "--device",
        default=None,
        help="the torch backend's device (cuda, cuda:1, cpu): the stacked runner there, its whole step on the device "
        "with CUDA graphs on a GPU (default: the per-sequence runner on the CPU)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print text as it is generated")
    out.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and statistics")
    return p


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if str(args.prompt_file) == "-":
        return sys.stdin.read()
    if not args.prompt_file.is_file():
        raise CloverError(f"prompt file {args.prompt_file} does not exist")
    return args.prompt_file.read_text()


ARTIFACT_BACKENDS = ("ort", "trt")  # backends that run an exported artifact instead of --base / --heads


def backend_name(args: argparse.Namespace) -> str:
    """--backend, else trt for an artifact with TensorRT engines, ort for another artifact, torch without one."""
    if args.backend:
        return args.backend
    if args.artifact is None:
        return "torch"
    from clover.artifact import read_manifest

    return "trt" if read_manifest(args.artifact).backend == "trt" else "ort"


def model_source(args: argparse.Namespace) -> str | Path:
    """--artifact for the artifact backends, --base (default smollm2) for the others; never a mix."""
    backend = backend_name(args)
    if backend in ARTIFACT_BACKENDS:
        if args.artifact is None:
            raise CloverError(
                f"--backend {backend} runs an exported artifact: pass --artifact DIR (make one with clover-export)"
            )
        if args.base is not None:
            raise CloverError(
                "--base is for the torch backend: an artifact carries its base model, pass --artifact alone"
            )
        return args.artifact
    if args.artifact is not None:
        raise CloverError(
            f"--artifact runs on ONNX Runtime or TensorRT: pass --backend ort or trt "
            f"(the {backend} backend loads --base and --heads)"
        )
    return args.base or "smollm2"


def run(args: argparse.Namespace) -> int:
    from clover.runtime.generator import Generator
    from clover.runtime.sampling import SamplingParams

    if args.max_new_tokens < 1:
        raise CloverError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompt = read_prompt(args)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, top_k=args.top_k, min_p=args.min_p
    )
    if args.threads is not None and args.threads < 1:
        raise CloverError(f"--threads must be at least 1, got {args.threads}")
    gen = Generator.load(
        model_source(args),
        args.heads,
        backend_name(args),
        args.tree,
        options=EngineOptions(
            dtype=args.dtype,
            threads=args.threads,
            providers=args.providers,
            chat_template=args.chat_template,
            device=args.device,
        ),
    )
    params = GenerationParams(max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop))
    if args.chat and not gen.tokenizer.has_chat_template:
        raise CloverError(
            f"--chat renders the prompt with the model's chat template, and {model_source(args)} has none (a base "
            "model continues text): pass --chat-template FILE_OR_TEMPLATE, or leave --chat out"
        )
    if args.stream:
        stream = gen.stream(prompt, params, chat=args.chat)
        for delta in stream:
            print(delta, end="", flush=True)
        result = stream.result
        print()
        print(
            f"[{result.new_tokens} tokens, {result.tokens_per_second:.1f} tok/s, "
            f"{result.tokens_per_step:.2f} tokens/step (bonus included), finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    else:
        result = gen.generate(prompt, params, chat=args.chat)
        if args.json:
            doc = result.to_dict()
            doc["sampling"] = {
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "min_p": args.min_p,
                "seed": args.seed,
            }
            print(json.dumps(doc))
        else:
            print(result.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("clover-generate", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
