"""benchmarks/training_curve.py on training.json records: each validated epoch at the token passes the heads had
seen, a run that went on from other heads (--init) starting where they ended, and the plot and its JSON written."""

import json
import sys
from pathlib import Path

from helpers import script_module

CURVE = Path(__file__).resolve().parents[2] / "benchmarks" / "training_curve.py"


def record(path: Path, command: str, tokens: int, accepts: list[float], initial: float | None = None) -> Path:
    doc = {
        "command": command,
        "data": {"train_loss_tokens": tokens},
        "epochs": [{"epoch": i + 1, "val_chain_accept": a} for i, a in enumerate(accepts)],
    }
    if initial is not None:
        doc["initial"] = {"epoch": 0, "val_chain_accept": initial}
    path.mkdir(parents=True, exist_ok=True)
    (path / "training.json").write_text(json.dumps(doc))
    return path / "training.json"


def test_runs_from_other_heads_start_where_those_ended(tmp_path, monkeypatch):
    first = record(tmp_path / "first", "clover-train --out first", 1000, [1.4, 1.6, 1.7])
    second = record(tmp_path / "second", f"clover-train --init {first.parent} --out second", 500, [1.8], initial=1.65)
    with script_module(CURVE) as curve:
        assert [p for p, _ in curve.points(first)["points"]] == [1000, 2000, 3000]
        assert curve.points(second)["points"] == [(3000, 1.65), (3500, 1.8)]  # after first's 3 epochs of 1000
        shipped = curve.history(curve.SHIPPED / "smollm2-clover2" / "training.json")
        assert [len(run["points"]) for run in shipped] == [12, 3]  # 12 epochs from scratch, then a continuation
        assert all(1.0 < a < 5.0 for run in shipped for _, a in run["points"])
        out = tmp_path / "curve.png"
        monkeypatch.setattr(sys, "argv", ["training_curve.py", str(first), str(second), "--out", str(out)])
        assert curve.main() == 0
    assert out.stat().st_size > 0 and len(json.loads(out.with_suffix(".json").read_text())) == 2


def test_a_record_carries_the_history_of_the_heads_it_went_on_from(tmp_path):
    """clover-train nests the --init heads' training.json as `init_training`: the passes add up even when those
    heads' folder is gone or was replaced by the new heads (shipped heads retrained under the same name)."""
    first = json.loads(record(tmp_path / "first", "clover-train --out first", 1000, [1.4, 1.6]).read_text())
    second = json.loads(record(tmp_path / "second", "clover-train --out s", 400, [1.7], initial=1.6).read_text())
    second["init_training"] = first
    third = record(tmp_path / "third", "clover-train --init gone --out t", 300, [1.8, 1.9], initial=1.7)
    doc = json.loads(third.read_text())
    doc["init_training"] = second
    third.write_text(json.dumps(doc))
    with script_module(CURVE) as curve:
        assert curve.points(third)["points"] == [(2400, 1.7), (2700, 1.8), (3000, 1.9)]  # 2 x 1000 + 1 x 400 first
        # the plot draws every run of the lineage, the earliest first
        assert [c["points"][-1] for c in curve.history(third)] == [(2000, 1.6), (2400, 1.7), (3000, 1.9)]
