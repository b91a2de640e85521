"""The README's Python examples run as written (docs/design.md, Conventions 10); the Serve section's client example
against a real clover-serve app (over a tiny artifact, on a free port in place of 8000)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SERVE_URL = "http://127.0.0.1:8000/v1"


def blocks() -> list[str]:
    found = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert found, "README has no python example"
    return found


@pytest.mark.slow
def test_readme_python_example_runs(capsys, smollm2_path):
    for code in blocks():
        if SERVE_URL not in code:
            exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.strip()


def test_readme_serve_client_example_runs(capsys, tmp_path_factory):
    from helpers import Server
    from ort_helpers import tiny_artifact

    from clover.runtime.engine import Engine

    (code,) = [c for c in blocks() if SERVE_URL in c]
    engine = Engine.load(tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused"), log=None)
    server = Server(engine, "tiny")
    try:
        exec(compile(code.replace(SERVE_URL, server.url), str(README), "exec"), {})
    finally:
        server.close()
        engine.close()
    assert len(capsys.readouterr().out.split()) > 3  # the streamed answer
