"""The documentation stays true to the tree: docs/cli.md is what the parsers say, every relative Markdown link
in README.md and docs/ points at a file (and heading) that exists, and no tracked text speaks in the vocabulary
of a work log (numbered work periods, tracker numbers, scratch paths, "the VM this ran on") where it should
name dates, hardware profiles and commits."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import run_python

from clover.tools import cli_docs

ROOT = Path(__file__).resolve().parents[1]


# -- docs/cli.md -------------------------------------------------------------------------------------------


def test_cli_docs_current():
    """Rendered in a fresh interpreter, where building the parsers must import neither torch nor onnxruntime
    (the ORT path stays free of torch)."""
    out = run_python(
        "import sys\n"
        "from clover.tools import cli_docs\n"
        "sys.stdout.write(cli_docs.render())\n"
        "assert 'torch' not in sys.modules and 'onnxruntime' not in sys.modules, 'a parser imported it'\n"
    )
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == out, cli_docs.STALE


def test_cli_docs_covers_every_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert [name for name, _ in cli_docs.COMMANDS] == list(scripts)
    assert [module for _, module in cli_docs.COMMANDS] == [target.split(":")[0] for target in scripts.values()]


def test_cli_docs_check_says_stale(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "cli.md"
    monkeypatch.setattr(cli_docs, "DOC", doc)
    assert cli_docs.main(["--check"]) == 1  # missing
    doc.write_text(cli_docs.render() + "hand edit\n")
    assert cli_docs.main(["--check"]) == 1
    assert capsys.readouterr().err == 2 * (cli_docs.STALE + "\n")
    assert cli_docs.main([]) == 0 and cli_docs.main(["--check"]) == 0


def test_cli_docs_width_independent():
    """Usage lines wrap at cli_docs.WIDTH, not at the terminal's width."""
    env = {**os.environ, "COLUMNS": "40"}
    proc = subprocess.run(
        [sys.executable, "-m", "clover.tools.cli_docs", "--check"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


# -- work-log vocabulary -----------------------------------------------------------------------------------

WORK_LOG = {
    "a numbered work period": re.compile(
        r"\b[Ss]essions? \d"  # a numbered work period, singular or plural, any case
        r"|\(s\d{1,3}\)"  # (s25)
        r"|_s\d{2,3}_"  # bench_fp32_s25_code.json
        r"|(?<![\w/.-])s\d{2,3}:"  # s26: ...
        r"|\b(?:in|since|until|before|after|from) s\d{2,3}\b"
    ),  # in s24
    "a tracker number": re.compile(r"\b[Ii]ssues? #?\d+|\b(?:PR|[Pp]ull request) #?\d+"),
    "a scratch path": re.compile("/tmp/"),  # split so that this file does not match itself
    "the machine it ran on": re.compile(r"\bthe \d+-core (?:VM|machine)\b|\b(?:a|the) Zen \d VM\b|\breachable here\b"),
}
# "this machine" is left out: in the tools it is the host the code runs on (clover-doctor, TensorRT engine
# compatibility), which is what it should say there.
EXTERNAL_TRACKER = re.compile(r"[\w.-]+/[\w.-]+ $")  # "OWNER/REPO issue N" cites another project's tracker, not ours
MAX_BYTES = 2 * 2**20
# Third-party and model-written text (prompt sets, the corpora's prompts) is data, not prose of this project; and
# this file holds the patterns themselves. Test code needs no exclusion: it makes its scratch paths with tmp_path
# or tempfile, never a literal one.
SKIP = (re.compile(r"^(?:data|benchmarks/prompts)/.*\.jsonl$"), re.compile(r"^tests/test_docs\.py$"))


def tracked_text() -> list[tuple[str, str]]:
    """(path, text) of every tracked file that is UTF-8 text under MAX_BYTES, SKIP aside."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or any(p.match(name) for p in SKIP) or not path.is_file() or path.stat().st_size > MAX_BYTES:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "\0" not in text:
            found.append((name, text))
    return found


def work_log_lines(name: str, text: str) -> list[str]:
    bad = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in WORK_LOG.items():
            for m in pattern.finditer(line):
                if what == "a tracker number" and EXTERNAL_TRACKER.search(line[: m.start()]):
                    continue
                bad.append(f"{name}:{number}: {what} ({m.group(0)!r}): {line.strip()[:160]}")
    return bad


def test_no_work_log_vocabulary():
    files = tracked_text()
    assert len(files) > 50, "git ls-files found too little: not a checkout?"
    bad = [line for name, text in files for line in work_log_lines(name, text)]
    assert not bad, "work-log vocabulary (name a date, a hardware profile or a commit instead):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line, found",
    [
        ("Against session 15's store", True),
        ("sessions 17-23", True),
        ("bench_fp32_s25_code.json", True),
        ("(s25) measured", True),
        ("s26: faster", True),
        ("changed in s24", True),
        ("issue 13 targets", True),
        ("see issues #4", True),
        ("/tmp/s12/heads", True),
        ("on the 2-core VM", True),
        ("a Zen 3 VM", True),
        ("ort.InferenceSession(path, ort.SessionOptions())", False),
        ("requests.Session()", False),
        ("greedy (SafeAILab/EAGLE issue 143)", False),
        ("bench_fp32_2026-11-27_code.json", False),
        ("the 32 KiB table: in 24 steps", False),
        ("tmp_path / 's12.npz'", False),
        ("a 2-core AMD EPYC VM", False),
    ],
)
def test_work_log_patterns(line, found):
    assert bool(work_log_lines("x", line)) == found


# -- Markdown links ----------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in `path` that is not a URL, code blocks and code spans aside."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text(encoding="utf-8"))
    text = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
            found.append((text.count("\n", 0, m.start()) + 1, target))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of `path`: lowercase, punctuation dropped, spaces to hyphens, -1, -2 on
    repeats; plus explicit <a name=...> / id=... anchors."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_markdown_links_resolve():
    bad = []
    for md in markdown_files():
        for line, target in relative_links(md):
            file = target.split("#", 1)[0]
            if file and not (md.parent / file).exists():
                bad.append(f"{md.relative_to(ROOT)}:{line}: {target} (no such file)")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_markdown_anchors_resolve():
    bad = []
    for md in markdown_files():
        for line, target in relative_links(md):
            file, _, anchor = target.partition("#")
            dest = (md.parent / file) if file else md
            if anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
                bad.append(f"{md.relative_to(ROOT)}:{line}: {target} (no such heading)")
    assert not bad, "links to missing headings:\n" + "\n".join(bad)


def test_link_finder(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "[a](docs/gpu.md) [b](https://x.org) `[c](nope.md)` ![d](e.png#x)\n```\n[f](g.md)\n```\n"
        '[h](#top) [i](mailto:a@b.c) [j [k]](l.md "title")\n# Top\n## A `b`, c!\n## A b c\n'
    )
    assert relative_links(md) == [(1, "docs/gpu.md"), (1, "e.png#x"), (5, "#top"), (5, "l.md")]
    assert anchors(md) == {"top", "a-b-c", "a-b-c-1"}


# -- documents the source cites ----------------------------------------------------------------------------

# A Markdown file a docstring or comment cites (`docs/design.md`, README.md, "../docs/gpu.md"); a URL's path is not one
MD_CITATION = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)*[\w.-]+\.md)(?![\w-])")
JOINED = re.compile(r"\"\s*/\s*\"")  # a path joined from literals in code: ROOT / "docs" / "cli.md"
OTHER_PROJECT = re.compile(r"(?<![\w./-])[A-Za-z][\w-]*/[\w-]+ $")  # "OWNER/REPO path/README.md": not ours
CONVENTIONS = re.compile(r"\bConventions (\d+(?:, \d+)*)")  # docs/design.md, Conventions 1, 2
NOT_SOURCE = {"build", "dist", "__pycache__"}  # and every hidden folder (.git, .venv, tool caches), *.egg-info
CITATION_SKIP = {"tests/test_docs.py"}  # this file's sample citations of files that do not exist


def python_sources() -> list[str]:
    """Every .py file of the working tree (tracked or not, so a new file is checked before it is committed), as
    paths relative to the repository root."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and d[0] != "." and not d.endswith(".egg-info"))
        found += [(Path(folder) / f).relative_to(ROOT).as_posix() for f in sorted(files) if f.endswith(".py")]
    return [name for name in found if name not in CITATION_SKIP]


def design_conventions() -> list[int]:
    """The numbers of docs/design.md's Conventions section, in order."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = re.search(r"^## Conventions\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/design.md has no Conventions section"
    return [int(n) for n in re.findall(r"^(\d+)\. ", section.group(1), re.M)]


def citation_errors(name: str, text: str, conventions: set[int]) -> list[str]:
    """What `text` (the file `name`, relative to the root) cites that does not exist: a Markdown file neither at that
    path from the root nor from the file's folder, or a Conventions number that docs/design.md does not have."""
    bad = []
    folder = (ROOT / name).parent
    for number, line in enumerate(text.splitlines(), 1):
        joined = JOINED.sub("/", line)
        for m in MD_CITATION.finditer(joined):
            cited = m.group(1)
            if OTHER_PROJECT.search(joined[: m.start()]) or (ROOT / cited).is_file() or (folder / cited).is_file():
                continue
            bad.append(f"{name}:{number}: {cited} (no such file): {line.strip()[:160]}")
        for m in CONVENTIONS.finditer(line):
            for n in m.group(1).split(", "):
                if int(n) not in conventions:
                    bad.append(f"{name}:{number}: Conventions {n} (not in docs/design.md): {line.strip()[:160]}")
    return bad


def test_cited_documents_exist():
    numbers = design_conventions()
    assert numbers and numbers == list(range(1, len(numbers) + 1)), f"Conventions numbered {numbers}, not 1..N"
    names = python_sources()
    assert len(names) > 50, "found too few Python files: not a checkout?"
    bad = [line for name in names for line in citation_errors(name, (ROOT / name).read_text("utf-8"), set(numbers))]
    assert not bad, "citations of documents that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "name, line, errors",
    [
        ("runtime/x.py", "device (STYLE.md 5: public methods validate)", 1),
        ("runtime/x.py", "(docs/design.md, Conventions 5)", 0),
        ("models/x.py", "rebuild the model from it (docs/design.md, Conventions 1, 2).", 0),
        ("runtime/x.py", "(docs/design.md, Conventions 99)", 1),
        ("runtime/x.py", "(docs/design.md, Conventions 2, 99)", 1),
        ("runtime/x.py", "measured: docs/experiments.md, 2026-11-25; README.md, CHANGELOG.md", 0),
        ("runtime/x.py", "see docs/nothing.md", 1),
        ("runtime/x.py", "see design.md", 1),
        ("runtime/x.py", "see ../docs/design.md", 0),  # from the citing file's folder
        ("x.py", "see ../docs/design.md", 1),
        ("tools/x.py", 'DOC = Path(__file__).parents[1] / "docs" / "cli.md"', 0),
        ("tools/x.py", 'DOC = ROOT / "docs" / "nothing.md"', 1),
        ("runtime/x.py", "https://github.com/o/r/blob/main/NOTES.md", 0),
        ("plugins/x.py", "(NVIDIA/TensorRT samples/python/x/README.md)", 0),
        ("runtime/x.py", "docs/design.mdx and Conventions of the field", 0),
    ],
)
def test_citation_finder(name, line, errors):
    assert len(citation_errors(name, line, set(design_conventions()))) == errors
