"""`make demo`'s tool on a tiny base: streams, checks identity with plain decoding, exits 0."""

from clover.tools.demo import main
from helpers import tiny_hf_folder as make_base


def test_demo_runs_and_reports_identity(tmp_path, capsys):
    base = make_base(tmp_path / "base")
    code = main(["--base", str(base), "--heads", "random:clover2", "--prompt", "w7 w8", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "identical to plain greedy decoding" in out and "acceptance length" in out


def test_demo_error_is_one_line(tmp_path, capsys):
    code = main(["--base", str(tmp_path / "missing")])
    assert code == 2 and "clover-demo: error:" in capsys.readouterr().err
