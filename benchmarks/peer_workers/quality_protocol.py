"""The JSON-lines protocol of benchmarks/quality.py's peer workers (stdlib + numpy: it runs in each peer's venv; the
line loop is protocol.py's).

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

from collections.abc import Callable

from protocol import answer_lines


def serve(
    vocab_size: int,
    versions: dict[str, str],
    logits: Callable[[list[int], int], object],
    greedy: Callable[[list[int], int, list[int]], list[int]],
) -> None:
    """Answer requests on stdin until it closes."""
    import numpy as np

    def answer(req: dict) -> dict:
        ids = [int(t) for t in req["ids"]]
        if req["op"] == "logits":
            start = int(req["start"])
            rows = np.asarray(logits(ids, start), dtype=np.float32)
            if rows.shape != (len(ids) - start, vocab_size):
                raise ValueError(f"logits of shape {rows.shape}, expected {(len(ids) - start, vocab_size)}")
            np.save(req["out"], rows)
            return {"ok": True}
        if req["op"] == "greedy":
            return {"ok": True, "token_ids": greedy(ids, int(req["max_new_tokens"]), list(req["stop_ids"]))}
        raise ValueError(f"unknown op {req['op']!r}")

    answer_lines({"ready": True, "vocab_size": vocab_size, "versions": versions}, answer)
