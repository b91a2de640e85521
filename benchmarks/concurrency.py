"""clover.Engine under concurrent load on the embedded default, CPU, against its targets (below).

  python benchmarks/concurrency.py [--precision int4|fp32|both] [--num-prompts N] [--max-new-tokens N]

For each artifact (int4: the `make demo` artifact; fp32: the same with float32 weights; both fused, with the
batched base graph and the shipped Clover-2 heads), runs `clover-bench --concurrency 1,2,4,8,16 --control` over MT-Bench
prompts with modes plain, plain-2 (A/A), chain-1 and auto (interleaved per round, one run), writes
benchmarks/results/concurrency_<precision>.json and .png, and checks the targets:

- aggregate output tokens/s at concurrency 8 >= 4x concurrency 1 plain;
- at every concurrency, auto >= plain and within 5% of the best fixed tree (plain included). Plain runs twice,
  as plain and plain-2 (A/A, interleaved like every mode): its rate is their mean, and "auto >= plain" allows
  the run's noise floor (the RMS over concurrencies of the two identical engines' relative difference).

Exit status 0 when every target holds for every artifact run, 1 otherwise (the tables say which).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from clover.tools.bench import main as bench_main
from clover.tools.bench_concurrency import CONTROL
from clover.tools.demo import cached_artifact

RESULTS = Path(__file__).parent / "results"
ARTIFACTS = {"int4": {"weights": "int4"}, "fp32": {"weights": None}}
SCALE_TARGET, AUTO_SLACK = 4.0, 0.05


def noise_floor(tps: dict) -> float:
    """The run's A/A noise: root mean square over concurrencies of plain-2's relative difference from plain (two
    identical engines measured in the same rounds)."""
    spreads = [(tps[(c, CONTROL)] - a) / a for (c, m), a in tps.items() if m == "plain" and (c, CONTROL) in tps]
    return float(sum(x * x for x in spreads) / len(spreads)) ** 0.5 if spreads else 0.0


def check(doc: dict) -> list[str]:
    """The targets that failed, one line each. Plain is measured twice (plain and plain-2, A/A, interleaved): the
    plain rate is their mean, and auto may fall short of it by no more than the run's A/A noise floor."""
    rows = doc["results"]
    tps = {(r["concurrency"], r["mode"]): r["tokens_per_second"] for r in rows}
    failed = []
    if (1, "plain") in tps and (8, "plain") in tps:
        best8 = max(v for (c, _), v in tps.items() if c == 8)
        if best8 < SCALE_TARGET * tps[(1, "plain")]:
            failed.append(
                f"concurrency 8 reaches {best8 / tps[(1, 'plain')]:.2f}x concurrency 1 plain "
                f"({best8:.0f} vs {tps[(1, 'plain')]:.0f} tok/s), target {SCALE_TARGET:.0f}x"
            )
    noise = noise_floor(tps)
    for c in sorted({c for c, _ in tps}):
        auto, a = tps.get((c, "auto")), tps.get((c, "plain"))
        if auto is None or a is None:
            continue
        plain = (a + tps.get((c, CONTROL), a)) / 2
        best = max([plain] + [v for (cc, m), v in tps.items() if cc == c and m not in ("auto", "plain", CONTROL)])
        if auto < plain * (1 - noise):
            failed.append(
                f"concurrency {c}: auto {auto:.0f} < plain {plain:.0f} tok/s by more than the A/A noise "
                f"floor {noise:.1%}"
            )
        if auto < (1 - AUTO_SLACK) * best:
            failed.append(
                f"concurrency {c}: auto {auto:.0f} is more than {AUTO_SLACK:.0%} below the best fixed "
                f"tree ({best:.0f} tok/s)"
            )
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=("int4", "fp32", "both"), default="both")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    args = ap.parse_args()
    failed: dict[str, list[str]] = {}
    for precision in ("int4", "fp32") if args.precision == "both" else (args.precision,):
        artifact = cached_artifact("smollm2", "smollm2-clover2", **ARTIFACTS[precision])
        out = RESULTS / f"concurrency_{precision}.json"
        print(f"== {precision}: {artifact}", flush=True)
        rc = bench_main(
            [
                "--artifact",
                str(artifact),
                "--backend",
                "ort",
                "--concurrency",
                args.concurrency,
                "--tree",
                "chain-1",
                "--control",
                "--prompts",
                "mtbench",
                "--num-prompts",
                str(args.num_prompts),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--threads",
                "2",
                "--max-batch",
                "8",
                "--json",
                str(out),
            ]
        )
        doc = json.loads(out.read_text())
        failed[precision] = check(doc) + ([] if rc == 0 else ["a request's tokens differ from its solo plain decoding"])
        tps = {(r["concurrency"], r["mode"]): r["tokens_per_second"] for r in doc["results"]}
        doc["targets"] = {
            "failed": failed[precision],
            "scale_target": SCALE_TARGET,
            "auto_slack": AUTO_SLACK,
            "aa_noise_floor": round(noise_floor(tps), 4),
        }
        out.write_text(json.dumps(doc, indent=2) + "\n")
    for precision, lines in failed.items():
        print(f"{precision}: " + ("all targets met" if not lines else "; ".join(lines)))
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
