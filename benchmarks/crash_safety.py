"""Crash safety of the two commands that write big outputs: clover-export (an artifact folder built in a staging
folder and moved into place, clover.atomic) and clover-data grow (shards appended to a corpus).

SIGKILL at uniform random moments of an uninterrupted run's measured duration (seeded; the seed is printed), then:
  - clover-export: the destination is the old artifact or the new one, whole: clover.artifact.open_artifact checks
    every file's sha256, and the file list must equal the old or the new uninterrupted export's;
  - clover-data grow: the corpus opens and every shard's sha256 checks (Corpus.conversations), the shards it held
    before are unchanged, and at the end every answer kept equals an uninterrupted run's answer at that position;
  - what a killed run leaves (`.tmp-*` / `.old-*` folders beside the artifact, temporary shard and provenance files)
    is gone after the next run.
Then a kill at each of two windows too narrow for random kills to hit (a real run that SIGKILLs itself just before a
rename): an export as publish_folder swaps the artifacts, and a grow writing a new corpus's first provenance.json.
Then a destination on a device too small for it (a tmpfs; without permission to mount one, a file size limit,
RLIMIT_FSIZE): the command exits non-zero with one line naming the problem and the fix and no traceback, nothing new
appears under the final name, and an old artifact or the shards already written stay whole.

Prints a table and writes JSON (default benchmarks/results/crash_safety.json). tests/tools/test_crash_safety.py runs
the same with 2 kills each, on the exports of --quick.

    python benchmarks/crash_safety.py [--kills 20] [--seed S] [--quick | --real]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPORT = [sys.executable, "-m", "clover.tools.export"]
DATA = [sys.executable, "-m", "clover.tools.data"]
PAGE = 4096
# Two exports of one base that differ in every graph's weights: each replaces the other in turn.
HEADS_VARIANTS = (
    ("--heads", "random:clover2:1", "--tree", "small"),
    ("--heads", "random:clover2:2", "--tree", "small"),
)
# The same with the fused base alone (~3 s an export instead of ~15 s on 2 cores): the CI version.
FUSED_VARIANTS = (("--attention", "fused", "--max-batch", "2"), ("--attention", "fused", "--max-batch", "4"))
GROW_FLAGS = ("--max-new-tokens", "12", "--max-batch", "4", "--threads", "1", "--shard-tokens", "60")


# -- running a command, killing it -------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    returncode: int
    seconds: float
    stderr: str
    phase: str  # what it was doing when killed (watch's answer), or "finished" when it ended first


def launch(
    argv: list[str],
    kill_after: float | None = None,
    watch: Callable[[int], str] | None = None,
    preexec: Callable[[], None] | None = None,
    timeout: float = 1800,
) -> Outcome:
    """Run `argv` in its own session; with `kill_after`, SIGKILL its process group that many seconds after the start
    unless it ended first (`watch(pid)` names its phase just before). stderr goes through a pipe: a file size limit
    (preexec) applies to the command's files, not to its output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    phase = "finished"
    try:
        proc.wait(timeout=timeout if kill_after is None else kill_after)
    except subprocess.TimeoutExpired:
        if kill_after is not None:
            phase = watch(proc.pid) if watch is not None else "running"
        with contextlib.suppress(ProcessLookupError):  # it ended in between
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if kill_after is None:
            raise RuntimeError(f"{' '.join(argv[2:4])} ran past {timeout} s") from None
    seconds = time.perf_counter() - t0
    reader.join()
    return Outcome(proc.returncode, seconds, b"".join(chunks).decode(errors="replace"), phase)


def completed(argv: list[str]) -> Outcome:
    out = launch(argv)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return out


# -- clover-export ------------------------------------------------------------------------------------


def export_argv(base: str, dest: Path, variant: tuple[str, ...]) -> list[str]:
    return [*EXPORT, "--base", base, "--out", str(dest), "--no-verify", *variant]


def artifact_files(dest: Path) -> dict:
    from clover.artifact import open_artifact

    return open_artifact(dest).files


def artifact_state(dest: Path, known: dict[str, dict]) -> tuple[str, str]:
    """(which of `known` (name -> manifest file list) the artifact at `dest` is, or absent / broken / other, and what
    open_artifact said)."""
    from clover.errors import CloverError

    if not dest.exists():
        return "absent", "-"
    try:
        files = artifact_files(dest)
    except CloverError as e:
        return "broken", str(e)
    for name, want in known.items():
        if files == want:
            return name, f"{len(files)} files, sha256 ok"
    return "other", f"{len(files)} files, sha256 ok, but neither the old nor the new export's"


def export_phase(dest: Path, inode: int | None) -> Callable[[int], str]:
    """What the export with process id pid is doing, from what it has written beside `dest` so far."""

    def phase(pid: int) -> str:
        names = [p.name for p in dest.parent.iterdir()]
        if any(n.startswith(f".old-{dest.name}-{pid}") for n in names):
            return "publishing"
        if dest.exists() and dest.stat().st_ino != inode:
            return "published"  # exiting
        if any(n.startswith(f".tmp-{dest.name}-{pid}-") for n in names):
            return "staging"
        return "loading"  # imports, the model, before the staging folder exists

    return phase


def beside(dest: Path) -> list[str]:
    """What else is in `dest`'s folder: staging or set-aside folders."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


@dataclass(frozen=True)
class Exports:
    """One uninterrupted export of each of two variants of one base, each in its own folder: what the exports killed
    over one another are checked against."""

    base: str
    variants: tuple[tuple[str, ...], ...]
    paths: tuple[Path, ...]
    files: tuple[dict, ...]  # each one's manifest file list (sha256 and bytes by file)
    seconds: tuple[float, ...]  # each one's uninterrupted duration (a new artifact)


def reference_exports(base: str, folder: Path, variants) -> Exports:
    paths = tuple(folder / f"reference-{i}" / "art" for i in range(len(variants)))
    seconds = tuple(completed(export_argv(base, path, v)).seconds for path, v in zip(paths, variants))
    return Exports(base, tuple(variants), paths, tuple(artifact_files(path) for path in paths), seconds)


@dataclass
class ExportKill:
    delay_s: float
    phase: str
    state: str  # old / new / absent / broken / other
    verify: str
    left: list[str]  # beside the destination after the kill


def export_kills(
    refs: Exports, folder: Path, kills: int, rng: random.Random, say: Callable[[str], None] = print
) -> dict:
    """Export variant 1 over a copy of variant 0 (timed), then `kills` exports, each of the other variant over the
    artifact there, killed at a uniform random moment of that duration; finally one export runs to its end (it must
    sweep what the killed ones left)."""
    dest = folder / "art"
    shutil.copytree(refs.paths[0], dest)
    seconds = completed(export_argv(refs.base, dest, refs.variants[1])).seconds
    say(f"clover-export: uninterrupted {seconds:.1f} s (replacing an artifact), {refs.seconds[1]:.1f} s (a new one)")
    current, rows = 1, []
    for k in range(kills):
        new = 1 - current
        delay = rng.uniform(0, seconds)
        inode = dest.stat().st_ino if dest.exists() else None
        out = launch(
            export_argv(refs.base, dest, refs.variants[new]), kill_after=delay, watch=export_phase(dest, inode)
        )
        known = {"new": refs.files[new], **({"old": refs.files[current]} if current is not None else {})}
        state, verify = artifact_state(dest, known)
        rows.append(ExportKill(round(delay, 2), out.phase, state, verify, beside(dest)))
        say(
            f"  kill {k + 1:2d} at {delay:6.2f} s ({out.phase}): {state}, {verify}; beside it: "
            f"{', '.join(rows[-1].left) or '-'}"
        )
        current = new if state == "new" else current if state == "old" else None
    seen = sorted({name for r in rows for name in r.left})  # what killed runs left, over all the kills
    new = 1 - current if current is not None else 0
    final = completed(export_argv(refs.base, dest, refs.variants[new]))
    state, verify = artifact_state(dest, {"new": refs.files[new]})
    return {
        "variants": [" ".join(v) for v in refs.variants],
        "uninterrupted_s": round(seconds, 2),
        "uninterrupted_new_s": [round(t, 2) for t in refs.seconds],
        "kills": [asdict(r) for r in rows],
        "states": dict(Counter(r.state for r in rows)),
        "left_seen": seen,
        "next_run": {"seconds": round(final.seconds, 2), "state": state, "verify": verify, "left": beside(dest)},
        "artifact_bytes": sum(f["bytes"] for f in refs.files[1].values()),
    }


# -- clover-data grow ----------------------------------------------------------------------------------


def grow_argv(artifact: Path, prompts: Path, corpus: Path, target: int) -> list[str]:
    return [
        *DATA,
        "grow",
        "--artifact",
        str(artifact),
        "--prompts",
        str(prompts),
        "--out",
        str(corpus),
        "--target-tokens",
        str(target),
        *GROW_FLAGS,
    ]


def write_prompts(path: Path, count: int, seed: int = 0) -> Path:
    """`count` one-turn conversations of random words w6..w95 (the tiny tokenizer's; any tokenizer reads them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            user = " ".join(f"w{x}" for x in rng.integers(6, 96, size=rng.integers(2, 9)))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "w10"}]})
                + "\n"
            )
    return path


def corpus_state(folder: Path, before) -> tuple[str, str, int]:
    """(old / grown / new / rewritten / broken, what reading every shard said, shards added) of the corpus at
    `folder`, against its provenance `before` the run."""
    from clover.errors import CloverError
    from clover.train.corpus import Corpus

    try:
        corpus = Corpus.open(folder)
        n = sum(1 for _ in corpus.conversations())  # every shard's sha256 and layout
    except CloverError as e:
        return "broken", str(e), 0
    prov = corpus.provenance
    added = len(prov.shards) - len(before.shards)
    verify = f"{len(prov.shards)} shards ({n} answers), sha256 ok"
    if prov.shards[: len(before.shards)] != before.shards:
        return "rewritten", verify + ", but its earlier shards changed", added
    state = "new" if len(prov.runs) > len(before.runs) else "grown" if added else "old"
    return state, verify, added


def corpus_leftovers(folder: Path) -> list[str]:
    """Temporary files of killed writes, and shard files its provenance does not list (written, then killed before
    the provenance that lists them)."""
    from clover.train.corpus import Corpus

    listed = {s.file for s in Corpus.open(folder).provenance.shards}
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.endswith(".tmp") or (p.name.startswith("shard-") and p.name not in listed)
    )


def answers(folder: Path) -> list[tuple]:
    from clover.train.corpus import Corpus

    return [
        (c.index, c.turn, c.sample, c.prompt.tolist(), c.response.tolist(), c.finish_reason)
        for c in Corpus.open(folder).conversations()
    ]


@dataclass
class GrowKill:
    delay_s: float
    phase: str
    state: str  # old (no shard added) / grown (shards added, killed before its end) / new (ran to its end) / broken
    shards_added: int
    verify: str
    left: list[str]


def grow_kills(
    artifact: Path,
    prompts: Path,
    folder: Path,
    kills: int,
    rng: random.Random,
    tokens: int,
    say: Callable[[str], None] = print,
) -> dict:
    """A corpus grown once (the seed), a copy of it grown by `tokens` response tokens (timed), then `kills` runs each
    asked to add `tokens` to the corpus, killed at a uniform random moment of that duration; then one run to its
    end (it must remove what the killed ones left), and a fresh corpus grown in one run to the same size: every
    answer kept must be its answer at that position."""
    from clover.train.corpus import Corpus

    corpus = folder / "corpus"
    completed(grow_argv(artifact, prompts, corpus, tokens))
    timed = folder / "timed"
    shutil.copytree(corpus, timed)
    held = Corpus.open(corpus).provenance.totals["response_tokens"]
    seconds = completed(grow_argv(artifact, prompts, timed, held + tokens)).seconds
    shutil.rmtree(timed)
    say(f"clover-data grow: uninterrupted {seconds:.2f} s for {tokens} response tokens")
    rows = []
    for k in range(kills):
        before = Corpus.open(corpus).provenance
        delay = rng.uniform(0, seconds)
        out = launch(grow_argv(artifact, prompts, corpus, before.totals["response_tokens"] + tokens), kill_after=delay)
        state, verify, added = corpus_state(corpus, before)
        left = corpus_leftovers(corpus) if state != "broken" else []
        rows.append(GrowKill(round(delay, 2), out.phase, state, added, verify, left))
        say(
            f"  kill {k + 1:2d} at {delay:5.2f} s ({out.phase}): {state}, +{added} shards, {verify}; left: "
            f"{', '.join(left) or '-'}"
        )
    seen = sorted({name for r in rows for name in r.left})  # what killed runs left, over all the kills
    total = Corpus.open(corpus).provenance.totals["response_tokens"] + tokens
    final = completed(grow_argv(artifact, prompts, corpus, total))
    reference = folder / "reference"  # a little further than the corpus: it holds an answer for each of its positions
    completed(grow_argv(artifact, prompts, reference, total + tokens // 2))
    got, want = answers(corpus), answers(reference)
    same = len(want) >= len(got) and got == want[: len(got)]
    positions = Corpus.open(corpus).provenance.next_position
    return {
        "tokens_per_run": tokens,
        "uninterrupted_s": round(seconds, 2),
        "kills": [asdict(r) for r in rows],
        "states": dict(Counter(r.state for r in rows)),
        "left_seen": seen,
        "next_run": {
            "seconds": round(final.seconds, 2),
            "left": corpus_leftovers(corpus),
            "answers": len(got),
            "positions": positions,
        },
        "answers_equal_uninterrupted": same,
        "compared_answers": len(got),
    }


# -- kills at the two narrow windows --------------------------------------------------------------------

# Runs a module as `python -m` does, SIGKILLing itself just before the first rename (or atomic exchange,
# clover.atomic.exchange) onto a file named argv[1].
KILL_BEFORE_RENAME = """import os, runpy, signal, sys
from clover import atomic
real, real_exchange, name = os.replace, atomic.exchange, sys.argv[1]
def kill_if_onto(dst):
    if os.path.basename(os.fspath(dst)) == name:
        os.kill(os.getpid(), signal.SIGKILL)
def replace(src, dst, *args, **kwargs):
    kill_if_onto(dst)
    return real(src, dst, *args, **kwargs)
def exchange(a, b):
    kill_if_onto(b)
    return real_exchange(a, b)
os.replace, atomic.exchange = replace, exchange
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def killed_before_rename(name: str, argv: list[str]) -> Outcome:
    """`argv` (a `python -m MODULE ...` command) killed just before it renames anything onto `name`."""
    return launch([sys.executable, "-c", KILL_BEFORE_RENAME, name, argv[2], *argv[3:]])


def kill_between_renames(refs: Exports, folder: Path) -> dict:
    """An export over an artifact killed as it publishes: just before its atomic exchange of the new artifact with
    the old one (Linux), or where the system has no exchange, between its two renames (the old artifact moved aside,
    the new one not yet in place); then what the next export does first (clover.atomic.sweep_stale), then the next
    export."""
    from clover import atomic

    dest = folder / "art"
    shutil.copytree(refs.paths[1], dest)
    out = killed_before_rename(dest.name, export_argv(refs.base, dest, refs.variants[0]))
    known = {"old": refs.files[1], "new": refs.files[0]}
    killed = artifact_state(dest, known)[0], beside(dest)
    atomic.sweep_stale(dest)
    swept = artifact_state(dest, known)[0], beside(dest)
    completed(export_argv(refs.base, dest, refs.variants[0]))
    after = artifact_state(dest, known)[0], beside(dest)
    return {
        "case": "clover-export killed as it publishes (before its exchange, or between its two renames)",
        "returncode": out.returncode,
        "after_kill": f"{killed[0]}; beside it: {', '.join(killed[1]) or '-'}",
        "after_sweep": f"{swept[0]}; beside it: {', '.join(swept[1]) or '-'}",
        "after_next_run": f"{after[0]}; beside it: {', '.join(after[1]) or '-'}",
        "passed": swept == ("old", []) and after == ("new", []),
    }


def kill_creating_corpus(artifact: Path, prompts: Path, folder: Path, tokens: int) -> dict:
    """A grow of a new corpus killed just before its first provenance.json is renamed into place, then the next grow."""
    from clover.errors import CloverError
    from clover.train.corpus import Corpus

    corpus = folder / "new-corpus"
    out = killed_before_rename("provenance.json", grow_argv(artifact, prompts, corpus, tokens))
    killed = sorted(p.name for p in corpus.iterdir()) if corpus.is_dir() else []
    after = launch(grow_argv(artifact, prompts, corpus, tokens))
    try:
        verify = f"{len(Corpus.open(corpus).provenance.shards)} shards, sha256 ok" if after.returncode == 0 else ""
        n = sum(1 for _ in Corpus.open(corpus).conversations()) if after.returncode == 0 else 0
    except CloverError as e:
        verify, n = str(e), 0
    left = corpus_leftovers(corpus) if after.returncode == 0 else []
    return {
        "case": "clover-data grow killed writing a new corpus's first provenance",
        "returncode": out.returncode,
        "after_kill": ", ".join(killed) or "-",
        "after_next_run": f"exit {after.returncode}: {verify or said(after.stderr, 'clover-data')}; left: "
        f"{', '.join(left) or '-'}",
        "passed": after.returncode == 0 and n > 0 and not left,
    }


# -- a full device -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A folder whose writes run out of room at `bytes`: a tmpfs of that size (how "tmpfs"), or, where mounting is
    not permitted, any folder with a file size limit for the command (how "RLIMIT_FSIZE", `preexec`)."""

    folder: Path
    how: str
    bytes: int
    preexec: Callable[[], None] | None = None


def file_size_limit(limit: int) -> Callable[[], None]:
    def preexec() -> None:  # in the child: a write past the limit fails with EFBIG instead of a SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def mount_tmpfs(folder: Path, size: int) -> str:
    """'' once a tmpfs of `size` bytes is mounted on `folder`, else why not."""
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
        )
    except OSError as e:
        return str(e)
    return "" if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


@contextlib.contextmanager
def small_device(folder: Path, size: int, file_limit: int, allow_mount: bool = True) -> Iterator[Device]:
    """A tmpfs of `size` bytes on `folder` (unmounted after), or without permission to mount, `folder` with a
    `file_limit` bytes file size limit."""
    folder.mkdir(parents=True, exist_ok=True)
    why = mount_tmpfs(folder, size) if allow_mount else "not tried"
    if why:
        yield Device(folder, f"RLIMIT_FSIZE (mount: {why})", file_limit, file_size_limit(file_limit))
        return
    try:
        yield Device(folder, "tmpfs", size)
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def pages(folder: Path) -> int:
    """Bytes `folder`'s files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in folder.rglob("*") if p.is_file())


def error_lines(stderr: str, prog: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{prog}: error:")]


def said(stderr: str, prog: str) -> str:
    """The command's error line(s), else its last line (an exception's, after a traceback)."""
    lines = error_lines(stderr, prog) or [line for line in stderr.strip().splitlines()[-1:]]
    return " | ".join(lines)


@dataclass
class FullDevice:
    case: str
    device: str
    device_bytes: int
    returncode: int
    error: str  # the command's error line(s)
    traceback: bool
    state: str  # what is under the final name afterwards
    left: list[str]  # temporary files or folders left on the device
    passed: bool


def full_device_export(refs: Exports, folder: Path, replace: bool, allow_mount: bool = True) -> FullDevice:
    """Export variant 1 onto a device with room for half of it (`replace`: after a copy of variant 0 there): a clean
    error, and under the final name nothing new (`replace`: the old artifact, whole)."""
    room = pages(refs.paths[1])
    need = pages(refs.paths[0]) if replace else 0
    biggest = max(p.stat().st_size for p in refs.paths[1].rglob("*") if p.is_file())
    known = {"new": refs.files[1], **({"old": refs.files[0]} if replace else {})}
    with small_device(
        folder / ("full-replace" if replace else "full-new"), need + room // 2, biggest // 2, allow_mount
    ) as device:
        dest = device.folder / "art"
        if replace:
            shutil.copytree(refs.paths[0], dest)
        out = launch(export_argv(refs.base, dest, refs.variants[1]), preexec=device.preexec)
        state, _ = artifact_state(dest, known)
        left = beside(dest)
    errors = error_lines(out.stderr, "clover-export")
    want = "old" if replace else "absent"
    ok = (
        out.returncode == 2
        and len(errors) == 1
        and "Traceback" not in out.stderr
        and state == want
        and not left
        and bool(re.search("no space left|file too large", errors[0] if errors else ""))
    )
    return FullDevice(
        "clover-export, replacing an artifact" if replace else "clover-export, new artifact",
        device.how,
        device.bytes,
        out.returncode,
        said(out.stderr, "clover-export"),
        "Traceback" in out.stderr,
        state,
        left,
        ok,
    )


def full_device_grow(
    artifact: Path, prompts: Path, corpus: Path, folder: Path, tokens: int, allow_mount: bool = True
) -> FullDevice:
    """Grow a copy of `corpus` by `tokens` on a device with room for a few more shards: a clean error, every shard
    the provenance lists (the old ones unchanged) reads back with its sha256, no temporary file left."""
    from clover.train.corpus import Corpus

    before = Corpus.open(corpus).provenance
    biggest = max(p.stat().st_size for p in corpus.iterdir())  # its provenance: it grows with every shard
    room = 2 * -(-biggest // PAGE) * PAGE + 4 * PAGE  # a new provenance beside the old one, and a few shards
    with small_device(folder / "full-grow", pages(corpus) + room, biggest + 2048, allow_mount) as device:
        dest = device.folder / "corpus"
        shutil.copytree(corpus, dest)
        out = launch(
            grow_argv(artifact, prompts, dest, before.totals["response_tokens"] + tokens), preexec=device.preexec
        )
        state, verify, added = corpus_state(dest, before)
        left = corpus_leftovers(dest) if state != "broken" else []
    errors = error_lines(out.stderr, "clover-data")
    temporary = [n for n in left if n.endswith(".tmp")]
    ok = (
        out.returncode == 2
        and len(errors) == 1
        and "Traceback" not in out.stderr
        and state in ("old", "grown")
        and not temporary
        and bool(re.search("no space left|file too large", errors[0] if errors else ""))
    )
    return FullDevice(
        "clover-data grow, adding shards",
        device.how,
        device.bytes,
        out.returncode,
        said(out.stderr, "clover-data"),
        "Traceback" in out.stderr,
        f"{state} (+{added} shards; {verify})",
        left,
        ok,
    )


# -- the report ----------------------------------------------------------------------------------------


def commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_tables(doc: dict) -> None:
    e, g = doc["export"], doc["grow"]
    print(
        f"\nclover-export, {doc['export_model']}: {len(e['kills'])} SIGKILLs, uninterrupted "
        f"{e['uninterrupted_s']:.1f} s (replacing an artifact)"
    )
    print(f"{'kill':>4} {'delay s':>8}  {'phase':<11} {'destination':<12} {'verified':<26} left beside it")
    for i, r in enumerate(e["kills"], 1):
        print(
            f"{i:>4} {r['delay_s']:>8.2f}  {r['phase']:<11} {r['state']:<12} {r['verify'][:26]:<26} "
            f"{len(r['left'])} ({', '.join(r['left'])[:60] or '-'})"
        )
    n = e["next_run"]
    print(
        f"destinations: {e['states']}; the kills left {len(e['left_seen'])} staging / set-aside folders; after "
        f"the next run: {n['state']}, {n['verify']}, {len(n['left'])} left"
    )
    print(
        f"\nclover-data grow, {doc['grow_model']}: {len(g['kills'])} SIGKILLs, uninterrupted "
        f"{g['uninterrupted_s']:.2f} s for {g['tokens_per_run']} response tokens"
    )
    print(f"{'kill':>4} {'delay s':>8}  {'phase':<9} {'corpus':<7} {'+shards':>7}  {'verified':<40} left")
    for i, r in enumerate(g["kills"], 1):
        print(
            f"{i:>4} {r['delay_s']:>8.2f}  {r['phase']:<9} {r['state']:<7} {r['shards_added']:>7}  "
            f"{r['verify'][:40]:<40} {', '.join(r['left']) or '-'}"
        )
    n = g["next_run"]
    print(
        f"corpora: {g['states']}; the kills left {len(g['left_seen'])} temporary or unlisted files; after the next "
        f"run {len(n['left'])}; the {g['compared_answers']} answers kept equal an uninterrupted run's: "
        f"{g['answers_equal_uninterrupted']}"
    )
    print()
    for w in doc["windows"]:
        print(
            f"{w['case']}: after the kill {w['after_kill']}"
            + (f"; after the sweep {w['after_sweep']}" if "after_sweep" in w else "")
            + f"; after the next run {w['after_next_run']}: {'ok' if w['passed'] else 'FAILED'}"
        )
    print(f"\n{'full device':<38} {'device':<18} {'exit':>4}  {'under the final name':<28} ok  error line")
    for r in doc["full_device"]:
        device = f"{r['device'].split(' ')[0]} {r['device_bytes'] // 1024} KiB"
        print(
            f"{r['case']:<38} {device:<18} {r['returncode']:>4}  {r['state'][:28]:<28} "
            f"{'yes' if r['passed'] else 'NO':<3} {r['error']}"
        )


def failures(doc: dict) -> list[str]:
    e, g = doc["export"], doc["grow"]
    bad = [
        f"export kill {i}: {r['state']} ({r['verify']})"
        for i, r in enumerate(e["kills"], 1)
        if r["state"] not in ("old", "new")
    ]
    if e["next_run"]["left"] or e["next_run"]["state"] != "new":
        bad.append(f"export's next run: {e['next_run']}")
    bad += [
        f"grow kill {i}: {r['state']} ({r['verify']})"
        for i, r in enumerate(g["kills"], 1)
        if r["state"] not in ("old", "grown", "new")
    ]
    if g["next_run"]["left"]:
        bad.append(f"grow's next run left {g['next_run']['left']}")
    if not g["answers_equal_uninterrupted"]:
        bad.append("grow: the answers kept differ from an uninterrupted run's")
    bad += [f"{w['case']}: {w}" for w in doc["windows"] if not w["passed"]]
    bad += [f"full device, {r['case']}: {r['error']}" for r in doc["full_device"] if not r["passed"]]
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs per command (default 20)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the kill moments (default: a random one, printed)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="export the fused base alone (~3 s an export): the CI "
        "version's exports, instead of the portable graphs with random Clover-2 heads (~15 s)",
    )
    mode.add_argument(
        "--real",
        action="store_true",
        help="clover-export exports the embedded SmolLM2-135M base "
        "(minutes an export on 2 cores) instead of the tiny random Llama; grow keeps the tiny artifact",
    )
    ap.add_argument("--grow-tokens", type=int, default=1500, help="response tokens each grow run adds (default 1500)")
    ap.add_argument("--no-mount", action="store_true", help="use the file size limit even where a tmpfs can be mounted")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "crash_safety.json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import tiny_hf_folder

    from clover import atomic
    from clover.tools.machine import host

    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    variants = FUSED_VARIANTS if args.quick else HEADS_VARIANTS
    with tempfile.TemporaryDirectory(prefix="clover-crash-") as scratch:
        root = Path(scratch)
        tiny = str(tiny_hf_folder(root / "tiny-base"))
        base = "smollm2" if args.real else tiny
        model = "SmolLM2-135M (embedded)" if args.real else "tiny random Llama (2 layers, hidden 64, vocab 96)"
        export_model = f"{model}, {' / '.join(' '.join(v) for v in variants)}, --no-verify"
        refs = reference_exports(base, root / "references", variants)
        export = export_kills(refs, root / "export", args.kills, rng)
        artifact = root / "grow-artifact"
        completed(export_argv(tiny, artifact, ("--attention", "fused")))
        count = (args.kills + 4) * args.grow_tokens // 6  # up to 12 tokens an answer: twice the prompts the runs use
        prompts = write_prompts(root / "prompts.jsonl", count)
        grow = grow_kills(artifact, prompts, root / "grow", args.kills, rng, args.grow_tokens)
        windows = [
            kill_between_renames(refs, root / "renames"),
            kill_creating_corpus(artifact, prompts, root, args.grow_tokens),
        ]
        full = [full_device_export(refs, root, replace, not args.no_mount) for replace in (False, True)]
        seed_corpus = root / "seed-corpus"
        completed(grow_argv(artifact, prompts, seed_corpus, args.grow_tokens))
        full.append(full_device_grow(artifact, prompts, seed_corpus, root, args.grow_tokens, not args.no_mount))
    doc = {
        "benchmark": "crash_safety",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit(),
        "host": host(),
        "seed": seed,
        "export_model": export_model,
        "grow_model": "tiny random Llama, fused float32 artifact, " + " ".join(GROW_FLAGS),
        "export": export,
        "grow": grow,
        "windows": windows,
        "full_device": [asdict(r) for r in full],
    }
    doc = json.loads(json.dumps(doc).replace(scratch, "SCRATCH"))  # where it ran says nothing
    doc["failures"] = failures(doc)
    print_tables(doc)
    atomic.write_text(args.json, json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    for line in doc["failures"]:
        print(f"FAILED: {line}")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
