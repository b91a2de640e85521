"""The same benchmark on two versions of the code, interleaved: did a change move speed or tokens?

    python benchmarks/ab_commits.py --before REV [--rounds 3] [--num-prompts 8]

REV (a commit of this repository) is checked out into a temporary worktree and imported through PYTHONPATH ahead of
the installed (working-tree) package. Each round runs `clover-bench` on the demo's int4 artifact (plain decoding, the
artifact's heads and prompt lookup, MT-Bench first turns) and `clover-bench --concurrency N` (clover.Engine under N
closed-loop streams: plain, the heads' tree and auto) once per version, alternating which goes first; then each
version's greedy outputs of the same prompts (plain, heads, lookup) are compared token for token, and every engine
request's tokens against its own solo plain decoding. Writes benchmarks/results/ab_commits.json and prints a table:
tokens/s per round and the median ratio after / before per mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
# the repository's folders that install as clover.<name> (pyproject.toml's package-dir)
SUBPACKAGES = ("models", "runtime", "plugins", "export", "train", "tools", "serve")
# each version's greedy outputs of the benchmark's prompts: the API of either side of the change
OUTPUTS = """
import json, sys
from clover.runtime.generator import Generator
from clover.tools.bench import load_prompts
art, heads, n, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
gen = Generator.load(art, heads=heads, backend="ort", tree="plain" if heads == "none" else None)
if "params" in __import__("inspect").signature(gen.generate).parameters:  # the request-options object
    from clover.runtime.params import GenerationParams

    run = lambda p: gen.generate(p, GenerationParams(max_new_tokens=new), chat=True)
else:
    run = lambda p: gen.generate(p, max_new_tokens=new, chat=True)
print(json.dumps([run(p).token_ids for p in load_prompts("mtbench", n)]))
"""


def package_of(rev: str, into: Path) -> Path:
    """`rev` laid out as the installed package (clover/ with its subpackages inside) under `into`."""
    tree = into / "worktree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
    )
    pkg = into / "pkg"
    shutil.copytree(tree / "clover", pkg / "clover")
    for name in SUBPACKAGES:
        shutil.copytree(tree / name, pkg / "clover" / name)
    return pkg


def env_for(pkg: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if pkg is not None:
        env["PYTHONPATH"] = f"{pkg}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def bench(pkg: Path | None, artifact: Path, a: argparse.Namespace, out: Path) -> dict[str, float]:
    """tokens/s of plain and lookup in one clover-bench run of one version."""
    cmd = [sys.executable, "-m", "clover.tools.bench", "--artifact", str(artifact), "--backend", "ort"]
    cmd += ["--heads", "lookup", "--num-prompts", str(a.num_prompts), "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--no-replay", "--json", str(out)]
    subprocess.run(cmd, check=True, env=env_for(pkg), cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    return {("plain" if r["heads"] == "none" else r["heads"]): r["tokens_per_second"] for r in doc["results"]}


def engine_bench(pkg: Path | None, artifact: Path, a: argparse.Namespace, out: Path) -> dict[str, dict]:
    """Aggregate tokens/s and identity with solo plain per mode of one `clover-bench --concurrency` run."""
    n = a.concurrency
    cmd = [sys.executable, "-m", "clover.tools.bench", "--artifact", str(artifact), "--backend", "ort"]
    cmd += ["--concurrency", str(n), "--num-prompts", str(2 * n), "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--tree", a.tree, "--json", str(out)]
    subprocess.run(cmd, check=True, env=env_for(pkg), cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    return {f"engine-c{n} {r['mode']}": r for r in doc["results"] if r["concurrency"] == n}


def outputs(pkg: Path | None, artifact: Path, heads: str, a: argparse.Namespace) -> list[list[int]]:
    args = [str(artifact), heads, str(a.num_prompts), str(a.max_new_tokens)]
    done = subprocess.run(
        [sys.executable, "-c", OUTPUTS, *args], check=True, env=env_for(pkg), capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit to compare the working tree against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8, help="the engine's closed-loop streams (0: no engine run)")
    ap.add_argument("--tree", default="mc26", help="the engine's tree for the heads")
    ap.add_argument("--artifact", type=Path, default=None, help="default: the demo's artifact (make demo)")
    ap.add_argument("--json", type=Path, default=RESULTS / "ab_commits.json")
    a = ap.parse_args()
    from clover.tools.demo import demo_artifact
    from clover.tools.machine import host

    artifact = a.artifact or demo_artifact()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", a.before], check=True, capture_output=True, text=True
    )
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout
    after_name = head.stdout.strip() + ("+changes" if dirty.strip() else "")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pkg = package_of(a.before, tmp)
        versions = {"before": pkg, "after": None}
        rounds: list[dict] = []
        identity: dict[str, set[str]] = {}  # engine mode -> "k/n" requests equal to solo plain, over runs
        try:
            for i in range(a.rounds):
                order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                row = {v: bench(versions[v], artifact, a, tmp / f"{v}-{i}.json") for v in order}
                if a.concurrency:
                    for v in order:
                        runs = engine_bench(versions[v], artifact, a, tmp / f"{v}-engine-{i}.json")
                        row[v] |= {m: r["tokens_per_second"] for m, r in runs.items()}
                        for m, r in runs.items():
                            identity.setdefault(m, set()).add(r["identical_to_solo_plain"])
                rounds.append(row)
                print(f"round {i + 1}: " + ", ".join(f"{v} {row[v]}" for v in order), file=sys.stderr, flush=True)
            modes = {m: {"plain": "none", "lookup": "lookup"}.get(m, "artifact") for m in rounds[0]["before"]}
            same = {
                mode: outputs(pkg, artifact, heads, a) == outputs(None, artifact, heads, a)
                for mode, heads in modes.items()
                if not mode.startswith("engine-")
            }
            # an engine mode is the same when every request of every run equals its own solo plain decoding
            same |= {m: all(x.split("/")[0] == x.split("/")[1] for x in ks) for m, ks in identity.items()}
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "worktree")], check=False
            )
    modes = list(rounds[0]["before"])
    summary = {}
    print(f"\n{'mode':16} {'before ' + rev.stdout.strip():>22} {'after ' + after_name:>26} {'ratio':>7} same tokens")
    for m in modes:
        b = [r["before"][m] for r in rounds]
        f = [r["after"][m] for r in rounds]
        ratio = statistics.median(y / x for x, y in zip(b, f))
        summary[m] = {"before_tok_s": b, "after_tok_s": f, "median_ratio": round(ratio, 3), "same_tokens": same.get(m)}
        print(
            f"{m:16} {' '.join(f'{x:6.1f}' for x in b):>22} {' '.join(f'{x:6.1f}' for x in f):>26} {ratio:7.3f} {same.get(m)}"
        )
    doc = {
        "date": datetime.date.today().isoformat(),
        "host": host(),
        "before": rev.stdout.strip(),
        "after": after_name,
        "artifact": artifact.name,
        "num_prompts": a.num_prompts,
        "max_new_tokens": a.max_new_tokens,
        "concurrency": a.concurrency,
        "engine_tree": a.tree,
        "rounds": rounds,
        "summary": summary,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
