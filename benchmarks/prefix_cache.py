"""The prefix cache on resent conversations: multi-turn chats and an agent loop, each turn's time to first token with
the cache on and off, side by side in one run on the demo artifact (int4).

  python benchmarks/prefix_cache.py [--artifact DIR] [--chats 2] [--turns 6] [--max-new-tokens 96] [--threads 0]

Two engines of the same artifact, one with the prefix cache (its default budget) and one without
(EngineOptions(prefix_cache_mb=0)), serve the same conversations, each turn on the cache-less one first and then on
the other (interleaved: same machine, same moment). A chat is three MT-Bench questions, both turns each, after a
system prompt; the agent loop is a system prompt with tool definitions and a report format, a task, and `--turns`
rounds of the model's call and a tool result (a JSON document of ~150 tokens). Every turn resends the whole history,
as clients do; the history holds the answers as generated (the same text on both engines: checked each turn).

Reports per turn the history's tokens, the TTFT off and on and their ratio, and the share of the prompt the cache
served (cached_tokens). Targets: later turns' TTFT at least 4x lower near a 1.5k-token history, cached tokens at
least 80% of a resent prompt, the same text. Writes benchmarks/results/prefix_cache.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from clover.runtime.engine import Engine
from clover.runtime.params import EngineOptions, GenerationParams
from clover.tools.bench import mtbench_questions
from clover.tools.demo import demo_artifact
from clover.tools.machine import host

OUT = Path(__file__).parent / "results" / "prefix_cache.json"

CHAT_SYSTEM = (
    "You are a careful, friendly assistant for a team of engineers and writers. Answer in plain English. Keep "
    "answers focused: say what matters first, then the details that support it. When a question is ambiguous, say "
    "which reading you answer. When you are unsure of a fact, say so rather than guess. Prefer short paragraphs and "
    "lists where they help the reader. For code, give a complete, runnable example with a one-line explanation of "
    "what it does, and mention the language version it needs. For math, show the steps. For writing tasks, match the "
    "tone the user asks for, and keep to the length asked. Never invent sources or quotes. If the user asks for an "
    "opinion, give one and the reasons for it. If the user asks you to revise an earlier answer, revise it rather "
    "than starting over, and keep what they liked."
)

TOOLS = [
    {"name": "search_docs", "description": "Search the product documentation", "parameters": {"query": "string"}},
    {"name": "read_ticket", "description": "Read a support ticket by id", "parameters": {"id": "integer"}},
    {
        "name": "run_sql",
        "description": "Run a read-only SQL query on the metrics database",
        "parameters": {"sql": "string"},
    },
    {"name": "list_deploys", "description": "Recent deployments of a service", "parameters": {"service": "string"}},
]
AGENT_SYSTEM = (
    "You are an operations agent. You can call these tools by writing one line of JSON "
    '{"tool": NAME, "arguments": {...}} and nothing else; the tool\'s result comes back as the next message. Tools: '
    + json.dumps(TOOLS)
    + " When you have found the cause, write a report in this format: Summary (one sentence), Evidence (a list of the "
    "tool results that show it, each with the tool and the key value), Impact (who was affected and for how long), "
    "Next steps (a numbered list). Do not guess: call a tool when you need a fact."
)
AGENT_TASK = "Checkout latency doubled for some users since yesterday. Find out why."


def tool_result(turn: int) -> str:
    """A deterministic tool output of ~150 tokens: a JSON document such as search or SQL results return."""
    rows = [
        {
            "ts": f"2026-12-0{1 + (turn + i) % 3}T{(7 * i + turn) % 24:02d}:{(13 * i) % 60:02d}Z",
            "service": "checkout",
            "p95_ms": 180 + 37 * ((i * turn) % 9),
            "region": ("eu-west", "us-east", "ap-south")[(i + turn) % 3],
            "deploy": f"v2.{14 + (i + turn) % 4}.{i}",
        }
        for i in range(4)
    ]
    return "Tool result: " + json.dumps({"turn": turn, "rows": rows, "truncated": False})


def chats(count: int) -> list[list[str]]:
    """`count` conversations of three MT-Bench questions each, both turns: six user messages."""
    questions = [json.loads(line)["turns"] for line in mtbench_questions().read_text().splitlines() if line.strip()]
    return [[t for q in questions[3 * i : 3 * i + 3] for t in q[:2]] for i in range(count)]


def turn(engines: dict[str, Engine], messages: list[dict], params: GenerationParams, history: int) -> dict:
    """One turn on both engines (cache off first): TTFTs, cached tokens, and the answer (the same on both)."""
    results = {name: e.generate(messages, params) for name, e in engines.items()}
    off, on = results["off"], results["on"]
    return {
        "history_tokens": off.prompt_tokens,
        "ttft_off_s": off.time_to_first_token,
        "ttft_on_s": on.time_to_first_token,
        "speedup": off.time_to_first_token / max(on.time_to_first_token, 1e-9),
        "cached_tokens": on.cached_tokens,
        "cached_share": on.cached_tokens / off.prompt_tokens,
        "same_text": off.token_ids == on.token_ids,
        "text": off.text,
        "turn": history,
    }


def run_chat(engines, users: list[str], params) -> list[dict]:
    messages, rows = [{"role": "system", "content": CHAT_SYSTEM}], []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        row = turn(engines, messages, params, i + 1)
        messages.append({"role": "assistant", "content": row.pop("text")})
        rows.append(row)
    return rows


def run_agent(engines, turns: int, params) -> list[dict]:
    messages, rows = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": AGENT_TASK}], []
    for i in range(turns):
        row = turn(engines, messages, params, i + 1)
        messages += [{"role": "assistant", "content": row.pop("text")}, {"role": "user", "content": tool_result(i)}]
        rows.append(row)
    return rows


def table(name: str, rows: list[dict]) -> list[str]:
    out = [
        f"| {name} turn | history tokens | TTFT off (s) | TTFT on (s) | off/on | cached | same text |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['turn']} | {r['history_tokens']} | {r['ttft_off_s']:.3f} | {r['ttft_on_s']:.3f} | "
            f"{r['speedup']:.1f}x | {100 * r['cached_share']:.0f}% | {'yes' if r['same_text'] else 'NO'} |"
        )
    return out


def summary(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] > 1]
    return {
        "later_turns_median_speedup": statistics.median(r["speedup"] for r in later),
        "later_turns_median_cached_share": statistics.median(r["cached_share"] for r in later),
        "same_text": all(r["same_text"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None, help="an artifact folder (default: the demo's int4 artifact)")
    p.add_argument("--chats", type=int, default=2)
    p.add_argument("--turns", type=int, default=6, help="the agent loop's rounds")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    artifact = Path(a.artifact) if a.artifact else demo_artifact()
    threads = a.threads or None
    engines = {
        name: Engine.load(artifact, options=EngineOptions(max_batch=1, threads=threads, prefix_cache_mb=mb), log=None)
        for name, mb in (("off", 0), ("on", None))
    }
    params = GenerationParams(max_new_tokens=a.max_new_tokens)
    try:
        for e in engines.values():  # warm both (graph setup), on a prompt no workload begins with
            e.generate("Say hello.", GenerationParams(max_new_tokens=4), chat=True)
        workloads = {f"chat {i + 1}": run_chat(engines, users, params) for i, users in enumerate(chats(a.chats))}
        workloads["agent"] = run_agent(engines, a.turns, params)
    finally:
        for e in engines.values():
            e.close()
    lines = []
    for name, rows in workloads.items():
        lines += table(name, rows) + [""]
    every = [r for rows in workloads.values() for r in rows]
    doc = {
        "artifact": artifact.name,
        "host": host(),
        "max_new_tokens": a.max_new_tokens,
        "summary": {name: summary(rows) for name, rows in workloads.items()} | {"all": summary(every)},
        "workloads": workloads,
    }
    print("\n".join(lines))
    print(json.dumps(doc["summary"], indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if doc["summary"]["all"]["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
