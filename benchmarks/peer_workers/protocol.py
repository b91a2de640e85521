"""The JSON-lines protocol every peer worker speaks (stdlib only: it runs in each peer's own venv).

A worker loads its model once, prints one ready line, then answers one request line with one reply line:

    ready:   {"ready": true, "modes": {mode: label}, "versions": {package: version}}
    request: {"mode": str, "prompt_ids": [int], "max_new_tokens": int, "stop_ids": [int]}
    reply:   {"token_ids": [int], "prefill_s": float, "decode_s": float, "stats": {...}}
             or {"error": str}

token_ids: the generated tokens, up to and including the first stop id, at most max_new_tokens.
prefill_s: from handing over the prompt to the first generated token; decode_s: from the first
generated token to the last. Anything a library prints goes to stderr: stdout carries only protocol lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class Generation:
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    stats: dict = field(default_factory=dict)


class TokenClock:
    """Collects streamed tokens with their arrival times; stops at a stop id or at max_new_tokens."""

    def __init__(self, max_new_tokens: int, stop_ids: Sequence[int]):
        self.max_new_tokens, self.stop_ids = max_new_tokens, frozenset(stop_ids)
        self.start = time.perf_counter()
        self.first = self.last = None
        self.token_ids: list[int] = []

    def add(self, tokens: Iterable[int]) -> bool:
        """Record tokens that just arrived; True once generation is finished."""
        now = time.perf_counter()
        for t in tokens:
            if self.done:
                break
            self.token_ids.append(int(t))
            self.first = self.first if self.first is not None else now
            self.last = now
        return self.done

    @property
    def done(self) -> bool:
        return len(self.token_ids) >= self.max_new_tokens or bool(
            self.token_ids and self.token_ids[-1] in self.stop_ids
        )

    def result(self, **stats) -> Generation:
        if self.first is None:
            raise RuntimeError("the engine generated no token")
        return Generation(self.token_ids, self.first - self.start, self.last - self.first, stats)


def answer_lines(ready: dict, answer: Callable[[dict], dict]) -> None:
    """The JSON-lines loop of a worker: the ready line, then one reply per request line until stdin closes; an
    exception becomes that request's {"error": ...} reply (the orchestrator decides), with its traceback on stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints of native libraries go to stderr
    sys.stdout = sys.stderr
    out.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which decides
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


def serve(
    modes: dict[str, str], versions: dict[str, str], generate: Callable[[str, list[int], int, list[int]], Generation]
) -> None:
    """Answer requests on stdin until it closes. `generate(mode, prompt_ids, max_new_tokens, stop_ids)`."""

    def answer(req: dict) -> dict:
        if req["mode"] not in modes:
            raise ValueError(f"unknown mode {req['mode']!r}: this worker serves {', '.join(modes)}")
        g = generate(
            req["mode"],
            [int(t) for t in req["prompt_ids"]],
            int(req["max_new_tokens"]),
            [int(t) for t in req.get("stop_ids", [])],
        )
        return {"token_ids": g.token_ids, "prefill_s": g.prefill_s, "decode_s": g.decode_s, "stats": g.stats}

    answer_lines({"ready": True, "modes": modes, "versions": versions}, answer)


def worker_args(system: str, modes: Sequence[str], *extra: tuple[str, type, object]) -> argparse.Namespace:
    """The options every peer worker takes (--model, --threads, --modes) plus its own (name, type, default);
    --modes comes back as a list, checked against `modes`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(modes))
    for name, kind, default in extra:
        ap.add_argument(name, type=kind, default=default)
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - set(modes))
    if unknown:
        fail_to_start(f"unknown modes {unknown}: {system} serves {', '.join(modes)}")
    return args


def fail_to_start(message: str) -> None:
    """Tell the orchestrator why the model could not be loaded, then exit."""
    print(json.dumps({"ready": False, "error": message}), flush=True)
    sys.exit(1)
