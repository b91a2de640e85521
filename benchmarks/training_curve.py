"""How the heads' acceptance grew with training: each clover-train run's validated epochs against the token passes
the heads had seen by then, from the runs' training.json records.

    python benchmarks/training_curve.py [RECORD ...] [--out benchmarks/results/training_curve.png]

RECORD: a training.json (default: the shipped heads' and every run kept under benchmarks/results/training_runs/).
A run that went on from other heads (`--init`) starts where they ended: the passes of the heads it started from
(the training.json clover-train nests as `init_training`, else theirs where it can be found: a shipped name or a
folder) are added to its own, and each earlier run of the lineage is drawn too. The y axis is each run's validation
chain-acceptance estimate (tokens per step of a chain of the heads' top-1 drafts, bonus included) on that run's own
held-out conversations, so two runs on different data are compared on different sets; the held-out MT-Bench figures
of the heads that were shipped or tried are in docs/experiments.md. Writes the PNG and a JSON of the points beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / "results" / "training_runs"
SHIPPED = ROOT / "models" / "pretrained"


def _init_record(record: dict, at: Path) -> Path | None:
    """The training.json of the heads a run started from (--init), where it can be found."""
    words = shlex.split(record.get("command", ""))
    if "--init" not in words:
        return None
    name = words[words.index("--init") + 1]
    for folder in (SHIPPED / name, Path(name), at.parent.parent / name):
        if (folder / "training.json").is_file():
            return folder / "training.json"
    return None


def passes_before(record: dict, at: Path) -> float:
    """Token passes the heads had seen before this run: those of the heads it started from, recursively (from the
    `init_training` clover-train records, else from their training.json where it can be found)."""
    earlier = record.get("init_training")
    prior = at
    if earlier is None:
        prior = _init_record(record, at)
        if prior is None or prior.resolve() == at.resolve():
            return 0.0
        earlier = json.loads(prior.read_text())
    return passes_before(earlier, prior) + earlier["data"]["train_loss_tokens"] * len(earlier.get("epochs", []))


def points(path: Path, record: dict | None = None) -> dict:
    """One run's curve: (token passes, validation chain acceptance) per validated epoch, the start included
    (`record`: one of the runs nested in `path`'s record; default: its own)."""
    record = json.loads(path.read_text()) if record is None else record
    data = record["data"] if isinstance(record["data"], dict) else {}
    tokens = data["train_loss_tokens"]
    start = passes_before(record, path)
    curve = []
    if record.get("initial"):  # the --init heads validated on this run's split before its first step
        curve.append((start, record["initial"]["val_chain_accept"]))
    curve += [(start + e["epoch"] * tokens, e["val_chain_accept"]) for e in record["epochs"]]
    return {
        "record": str(path.relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path),
        "command": record.get("command"),
        "train_loss_tokens": tokens,
        "kept_epoch": record.get("kept_epoch"),
        "points": curve,
    }


def history(path: Path) -> list[dict]:
    """The curves of a record's run and, first, of the runs it went on from (its nested `init_training`)."""
    chain, record = [], json.loads(path.read_text())
    while record is not None:
        chain.append(record)
        record = record.get("init_training")
    return [points(path, r) for r in reversed(chain)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "training_curve.png")
    a = ap.parse_args()
    records = a.records or [SHIPPED / "smollm2-clover2" / "training.json", *sorted(RUNS.glob("*.json"))]
    runs, seen = [], set()
    for run in (run for p in records for run in history(p)):
        key = (run["command"], tuple(run["points"]))
        if key not in seen:  # a run drawn already, as a record of its own or in another's lineage
            seen.add(key)
            runs.append(run)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn, nth = Counter(run["record"] for run in runs), Counter()
    for run in runs:
        x, y = zip(*run["points"])
        record = Path(run["record"])
        name = record.stem if record.parent.name == RUNS.name else record.parent.name  # a kept run: its file's name
        nth[run["record"]] += 1
        if drawn[run["record"]] > 1:  # heads trained over several runs drawn from one record: which run
            name = f"{name}, run {nth[run['record']]}"
        label = f"{name} ({run['train_loss_tokens'] / 1e3:.0f}k tokens)"
        ax.plot([v / 1e6 for v in x], y, marker="o", label=label)
    ax.set_xlabel("token passes the heads have seen (millions)")
    ax.set_ylabel("validation chain acceptance (tokens/step)")
    ax.set_title("Clover-2 heads for SmolLM2-135M: acceptance against training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    a.out.with_suffix(".json").write_text(json.dumps(runs, indent=1) + "\n")
    for run in runs:
        print(run["record"], " ".join(f"{x / 1e6:.2f}M:{y:.3f}" for x, y in run["points"]))
    print(f"wrote {a.out} and {a.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
