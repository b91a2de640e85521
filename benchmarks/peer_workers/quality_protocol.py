"""The JSON-lines protocol of benchmarks/quality.py's peer workers (stdlib + numpy: it runs in each peer's venv).

A worker loads its model once, prints one ready line, then answers one request line with one reply line:

    ready:   {"ready": true, "vocab_size": int, "versions": {package: version}}
    request: {"op": "logits", "ids": [int], "start": int, "out": path}
             -> writes float32 [len(ids) - start, vocab] to `out` (.npy): row i is the model's logits for ids[start + i]
                given ids[:start + i], all from one teacher-forced pass over `ids`
             {"op": "greedy", "ids": [int], "max_new_tokens": int, "stop_ids": [int]}
             -> {"token_ids": [int]}: greedy decoding, up to and including the first stop id
    reply:   {"ok": true, ...} or {"error": str}
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def serve(
    vocab_size: int,
    versions: dict[str, str],
    logits: Callable[[list[int], int], object],
    greedy: Callable[[list[int], int, list[int]], list[int]],
) -> None:
    """Answer requests on stdin until it closes."""
    import numpy as np

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints of native libraries go to stderr
    sys.stdout = sys.stderr
    out.write(json.dumps({"ready": True, "vocab_size": vocab_size, "versions": versions}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            ids = [int(t) for t in req["ids"]]
            if req["op"] == "logits":
                rows = np.asarray(logits(ids, int(req["start"])), dtype=np.float32)
                if rows.shape != (len(ids) - int(req["start"]), vocab_size):
                    raise ValueError(f"logits of shape {rows.shape}, expected {(len(ids) - req['start'], vocab_size)}")
                np.save(req["out"], rows)
                reply = {"ok": True}
            elif req["op"] == "greedy":
                reply = {"ok": True, "token_ids": greedy(ids, int(req["max_new_tokens"]), list(req["stop_ids"]))}
            else:
                raise ValueError(f"unknown op {req['op']!r}")
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which decides
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
