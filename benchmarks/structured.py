"""Structured output on the demo artifact: JSON-schema requests (three schemas of growing size), plain and
speculative, against free-form answers to the same prompts.

  python benchmarks/structured.py [--artifact DIR] [--num-prompts 8] [--max-new-tokens 128] [--repeats 3]

Per prompt and schema, every mode runs the prompt (which shows the schema) with the schema's grammar and without
a grammar (the free-form answer to the same prompt), interleaved (same machine, same process, one sequence at a
time, greedy; each prompt's schema / free-form pair runs --repeats times in a row, all modes each time, and a
prompt's time is its median over the repeats, so one slow moment on a shared host does not decide a row): plain
decoding, the artifact's heads on its default tree, prompt lookup (the n-gram store included), heads + lookup.
Reports tokens/s after the first token, tokens per verify step, the time to the first token (the prefill, where the
heads also read the prompt), drafted tokens the grammar pruned, the grammar's own cost (state + mask computation)
per generated token, whether each speculative output equals plain constrained decoding, and whether every finished
output parses and validates against its schema.
The target: speculation under a grammar at least as fast as the same speculation on free-form answers.

Writes benchmarks/results/structured.json (and prints the table). Needs the `structured` extra (llguidance).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
from tqdm import tqdm

from clover.runtime.backends.ort import OrtOptions, base_dir, load_runner
from clover.runtime.generator import Generator
from clover.runtime.grammar import Grammar
from clover.runtime.params import GenerationParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools.demo import demo_artifact, demo_tree
from clover.tools.machine import host

HERE = Path(__file__).parent
OUT = HERE / "results" / "structured.json"

SCHEMAS = {
    "small": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["name", "year"],
        "additionalProperties": False,
    },
    "medium": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "category": {"enum": ["science", "history", "art", "technology", "sport"]},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "summary": {"type": "string"},
        },
        "required": ["title", "category", "rating", "keywords", "summary"],
        "additionalProperties": False,
    },
    "large": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "born": {"type": "integer"},
                    "nationality": {"type": "string"},
                    "occupations": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "born", "nationality", "occupations"],
                "additionalProperties": False,
            },
            "achievements": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"year": {"type": "integer"}, "what": {"type": "string"}},
                    "required": ["year", "what"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
            "famous": {"type": "boolean"},
            "field": {"enum": ["mathematics", "physics", "chemistry", "biology", "computing", "literature"]},
        },
        "required": ["person", "achievements", "famous", "field"],
        "additionalProperties": False,
    },
}
TOPICS = [
    "Ada Lovelace and her notes on the Analytical Engine",
    "Marie Curie's research on radioactivity",
    "Alan Turing and the Turing machine",
    "the invention of the printing press by Johannes Gutenberg",
    "Isaac Newton's laws of motion",
    "Grace Hopper and the first compiler",
    "Rosalind Franklin and the structure of DNA",
    "Leonhard Euler's work on graph theory",
]
MODES = ("plain", "heads", "lookup", "heads+lookup")


def prompt(topic: str, schema: dict | None) -> list[dict[str, str]]:
    if schema is None:
        return [{"role": "user", "content": f"Tell me about {topic}."}]
    return [
        {
            "role": "user",
            "content": f"Describe {topic} as a JSON object that follows this JSON schema: {json.dumps(schema)}",
        }
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None, help="default: the demo's (int4, fused, with the shipped corpora)")
    p.add_argument("--num-prompts", type=int, default=len(TOPICS), help="of the %(default)s topics")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs of each prompt and mode (median time)")
    p.add_argument("--modes", default=",".join(MODES), help="of %(default)s; plain always runs (the reference)")
    p.add_argument("--schemas", default=",".join(SCHEMAS), help="of %(default)s")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    modes = ["plain"] + [m for m in MODES if m != "plain" and m in a.modes.split(",")]
    schemas = {k: v for k, v in SCHEMAS.items() if k in a.schemas.split(",")}
    if not schemas or any(m not in MODES for m in a.modes.split(",")):
        p.error(f"--modes takes {', '.join(MODES)}; --schemas takes {', '.join(SCHEMAS)}")
    artifact = Path(a.artifact) if a.artifact else demo_artifact()
    tok = Tokenizer.from_dir(base_dir(artifact))
    tree = demo_tree(artifact)
    plain_runner = load_runner(artifact, heads="none", options=OrtOptions(checksums=False))
    heads_runner = load_runner(artifact)
    gens = {
        "plain": Generator(plain_runner, tok, "plain"),
        "heads": Generator(heads_runner, tok, tree),
        "lookup": Generator(plain_runner, tok, drafts="lookup"),
        "heads+lookup": Generator(heads_runner, tok, tree, drafts="heads+lookup"),
    }
    for gen in gens.values():  # each generator's llguidance tokenizer is built on first use (~0.3 s): not timed
        gen.grammars.state(Grammar.json_object())
    runs: list[dict] = []
    topics = TOPICS[: a.num_prompts]
    total = len(topics) * len(schemas) * 2 * len(modes) * a.repeats
    with tqdm(total=total, desc="structured", file=sys.stderr) as bar:
        for i, topic in enumerate(topics):
            for (case, schema), constrained, rep in itertools.product(schemas.items(), (True, False), range(a.repeats)):
                grammar = Grammar.json_schema(schema) if constrained else None
                plain_ids = None
                for mode in modes:
                    t0 = time.perf_counter()
                    r = gens[mode].generate(
                        prompt(topic, schema),
                        GenerationParams(max_new_tokens=a.max_new_tokens, grammar=grammar),
                        chat=True,
                    )
                    wall = time.perf_counter() - t0
                    if mode == "plain":
                        plain_ids = r.token_ids
                    valid = None
                    if constrained and r.finish_reason == "stop":
                        try:
                            jsonschema.validate(json.loads(r.text), schema)
                            valid = True
                        except (ValueError, jsonschema.ValidationError):
                            valid = False
                    runs.append(
                        {
                            "prompt": i,
                            "repeat": rep,
                            "schema": case,
                            "grammar": constrained,
                            "mode": mode,
                            "new_tokens": r.new_tokens,
                            "seconds": wall,
                            "decode_seconds": r.seconds - r.time_to_first_token,  # after the first token
                            "first_token_seconds": r.time_to_first_token,  # the prefill (and the heads' pass)
                            "tokens_per_step": r.tokens_per_step,
                            "drafted": r.drafted_tokens,
                            "pruned": r.pruned_tokens,
                            "grammar_ms": 1e3 * r.timings.get("grammar", 0.0),
                            "finish_reason": r.finish_reason,
                            "identical_to_plain": r.token_ids == plain_ids,
                            "valid": valid,
                        }
                    )
                    bar.update()
    rows = summarize(runs)
    print_table(rows)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "host": host(),
        "artifact": artifact.name,
        "tree": tree,
        "max_new_tokens": a.max_new_tokens,
        "prompts": len(topics),
        "repeats": a.repeats,
        "rows": rows,
        "runs": runs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    bad = [r for r in runs if not r["identical_to_plain"] or r["valid"] is False]
    return 1 if bad else 0


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for schema, mode, constrained in itertools.product(SCHEMAS, MODES, (True, False)):
        every = [r for r in runs if r["schema"] == schema and r["mode"] == mode and r["grammar"] == constrained]
        if every:
            rs = [r for r in every if r.get("repeat", 0) == 0]  # greedy: every repeat emits the same tokens
            # each prompt's decode time: its median over the repeats
            seconds = [statistics.median(r["decode_seconds"] for r in every if r["prompt"] == q["prompt"]) for q in rs]
            tokens = sum(r["new_tokens"] for r in rs)
            rows.append(
                {
                    "schema": schema,
                    "mode": mode,
                    "grammar": constrained,
                    "tokens": tokens,
                    # decode speed over all of the mode's tokens (first tokens and prefill left out)
                    "decode_tokens_per_s": sum(r["new_tokens"] - 1 for r in rs) / sum(seconds),
                    "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in rs),
                    # the first token's wait (prefill), median over every run: decode speed leaves it out
                    "first_token_ms": 1e3 * statistics.median(r.get("first_token_seconds", 0.0) for r in every),
                    "pruned_per_100_tokens": 100 * sum(r["pruned"] for r in rs) / max(tokens, 1),
                    "grammar_us_per_token": 1e3
                    * sum(r["grammar_ms"] for r in every)
                    / max(sum(r["new_tokens"] for r in every), 1),
                    "identical": f"{sum(r['identical_to_plain'] for r in every)}/{len(every)}",
                    "finished_valid": f"{sum(r['valid'] is True for r in rs)}/{sum(r['finish_reason'] == 'stop' for r in rs)}"
                    if constrained
                    else "-",
                }
            )
    free = {(r["schema"], r["mode"]): r["decode_tokens_per_s"] for r in rows if not r["grammar"]}
    for r in rows:  # the same mode on the same prompts' free-form answers
        r["vs_free_form"] = r["decode_tokens_per_s"] / free[(r["schema"], r["mode"])]
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'schema':7} {'grammar':7} {'mode':13} {'tok/s':>7} {'vs free':>8} {'tok/step':>8} {'TTFT ms':>8} {'pruned%':>8} {'grammar us/tok':>15} {'identical':>9} {'valid':>6}"
    print(head)
    for r in rows:
        print(
            f"{r['schema']:7} {'json' if r['grammar'] else 'none':7} {r['mode']:13} {r['decode_tokens_per_s']:7.1f} "
            f"{r['vs_free_form']:8.2f} "
            f"{r['tokens_per_step']:8.2f} {r['first_token_ms']:8.1f} {r['pruned_per_100_tokens']:8.1f} {r['grammar_us_per_token']:15.1f} "
            f"{r['identical']:>9} {r['finished_valid']:>6}"
        )


if __name__ == "__main__":
    sys.exit(main())
