"""One tiny HF base folder and one artifact exported from it by clover-export, shared by the CLI tests
(an export costs ~15 s on 2 cores), built once per run for all xdist workers. Tests that change an artifact copy
it first."""

import pytest
from helpers import built_once, shared_root, tiny_hf_folder


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return built_once(shared_root(tmp_path_factory.getbasetemp()) / "cli-base", tiny_hf_folder)


@pytest.fixture(scope="session")
def cli_artifact(base_dir, tmp_path_factory):
    """random:clover2 heads, tree small, exported through the CLI (so it records its sources)."""
    from clover.tools.export import main as export_main

    def export(out):
        argv = ["--base", str(base_dir), "--heads", "random:clover2", "--out", str(out), "--tree", "small"]
        assert export_main(argv) == 0

    return built_once(shared_root(tmp_path_factory.getbasetemp()) / "cli-exports" / "clover2", export)
