"""The project as users install it: `python -m build` makes an sdist and a wheel that `twine check` accepts; the
wheel installs into a fresh virtual environment (from the package index, without torch) where the commands answer
--help and the ONNX Runtime serving path imports without torch; every requirement pyproject.toml names can be
satisfied from the index. The index-dependent parts skip, saying so, where no package index answers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build")
pytest.importorskip("twine")
from packaging.requirements import Requirement  # noqa: E402  (after the skip: packaging comes with the test extra)

OFFLINE = (
    "Could not find a version",
    "No matching distribution",
    "Network is unreachable",
    "Failed to establish",
    "Temporary failure in name resolution",
    "Max retries exceeded",
)


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


def skip_if_offline(out: subprocess.CompletedProcess, what: str) -> None:
    if out.returncode and any(s in out.stderr + out.stdout for s in OFFLINE):
        pytest.skip(f"{what}: no package index answers ({out.stderr.strip().splitlines()[-1][:200]})")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy: setuptools stages the sdist's tree and the wheel's build/ inside the project, where a test
    # running beside this one (tests/test_docs.py walks the checkout) would find a second copy of every file.
    src = tmp_path_factory.mktemp("src") / ROOT.name
    hidden = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, src, ignore=hidden, symlinks=True)
    built = run(sys.executable, "-m", "build", "--outdir", out, src)
    skip_if_offline(built, "python -m build (its isolated environment installs setuptools)")
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def test_sdist_and_wheel_pass_twine_check(dist):
    files = sorted(dist.iterdir())
    assert sorted(f.suffix for f in files) == [".gz", ".whl"], files
    checked = run(sys.executable, "-m", "twine", "check", "--strict", *files)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_wheel_installs_and_runs_in_a_fresh_venv_without_torch(dist, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    (wheel,) = dist.glob("*.whl")
    # the serving path's extra plus ONNX Runtime alone (the onnx extra's exporters are not needed to serve)
    onnxruntime = next(
        r
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["onnx"]
        if r.startswith("onnxruntime")
    )
    installed = run(python, "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{wheel}[serve]", onnxruntime)
    skip_if_offline(installed, "pip install of the wheel's dependencies")
    assert installed.returncode == 0, installed.stderr[-3000:]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for command in ("clover-generate", "clover-serve", "clover-export", "clover-doctor"):
        helped = run(env_dir / "bin" / command, "--help", env=clean, cwd=tmp_path)
        assert helped.returncode == 0 and "usage:" in helped.stdout, (command, helped.stderr[-2000:])
    probe = (
        "import sys, clover, clover.runtime.backends.ort, clover.serve.app, clover.tools.serve\n"
        "from clover import Engine, Generator, GenerationResult, StreamDelta, QueueFull, SamplingParams\n"
        "assert 'torch' not in sys.modules, 'the ORT serving path imported torch'\n"
        "import importlib.util; assert importlib.util.find_spec('torch') is None\n"
        "print(clover.__version__, clover.__file__)"
    )
    imported = run(python, "-c", probe, env=clean, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert str(env_dir) in imported.stdout, imported.stdout  # the installed copy, not this checkout
    shipped = run(
        python,
        "-c",
        "import importlib.resources as r; print(r.files('clover.models') / 'pretrained')",
        env=clean,
        cwd=tmp_path,
    )  # the shipped heads come as package data
    assert shipped.returncode == 0 and len(list(Path(shipped.stdout.strip()).glob("*/heads.safetensors"))) == 3, (
        shipped.stdout + shipped.stderr
    )
    no_corpus = run(
        env_dir / "bin" / "clover-export",
        "--base",
        "smollm2",
        "--heads",
        "lookup",
        "--out",
        tmp_path / "a",
        "--ngram-store",
        env=clean,
        cwd=tmp_path,
    )
    assert no_corpus.returncode == 2 and "--ngram-store" in no_corpus.stderr and "Traceback" not in no_corpus.stderr, (
        no_corpus.stderr[-2000:]
    )
    no_torch = run(
        env_dir / "bin" / "clover-export",
        "--base",
        "smollm2",
        "--heads",
        "lookup",
        "--out",
        tmp_path / "a",
        env=clean,
        cwd=tmp_path,
    )  # exporting needs torch: one line saying how to get it
    assert no_torch.returncode == 2 and "torch==2.13.0" in no_torch.stderr and "Traceback" not in no_torch.stderr, (
        no_torch.stderr[-2000:]
    )


def test_every_pinned_requirement_is_satisfiable_from_the_index():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for reqs in project["optional-dependencies"].values() for r in reqs]
    unmet = []
    for req in {r.name: r for r in wanted}.values():
        out = run(
            sys.executable, "-m", "pip", "index", "versions", req.name, "--disable-pip-version-check", timeout=120
        )
        skip_if_offline(out, f"pip index versions {req.name}")
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("Available versions:")), None)
        if line is None:  # some packages have no wheel for this Python or platform: say so
            unmet.append(f"{req}: the index lists no version for Python {sys.version_info[:2]}")
            continue
        versions = [v.strip() for v in line.split(":", 1)[1].split(",")]
        if not any(req.specifier.contains(v, prereleases=False) for v in versions):
            unmet.append(f"{req}: the index has {', '.join(versions[:5])}")
    assert not unmet, "pyproject.toml asks for versions the index does not have:\n" + "\n".join(unmet)
