"""One tiny HF base folder and one artifact exported from it by clover-export, shared by the CLI tests
(an export costs ~15 s on 2 cores). Tests that change an artifact copy it first."""

import pytest
from helpers import tiny_hf_folder


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_hf_folder(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def cli_artifact(base_dir, tmp_path_factory):
    """random:clover2 heads, tree small, exported through the CLI (so it records its sources)."""
    from clover.tools.export import main as export_main

    out = tmp_path_factory.mktemp("exports") / "clover2"
    assert (
        export_main(["--base", str(base_dir), "--heads", "random:clover2", "--out", str(out), "--tree", "small"]) == 0
    )
    return out
