"""benchmarks/gpu_train.py on a tiny model and two tiny corpora on the CPU: the code a GPU run runs, end to
end (features once, each architecture trained in its share, the report and the packed heads after every epoch)."""

import json
import tarfile
from pathlib import Path

from helpers import script_module, tiny_corpus, tiny_hf_folder

from clover.models.head_io import load_heads
from clover.models.loading import load_base

GPU_TRAIN = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"


def test_all_architectures_report_every_epoch_and_come_back_packed(tmp_path):
    base = tiny_hf_folder(tmp_path / "base")
    corpora = [str(tiny_corpus(base, tmp_path / name)) for name in ("c1", "c2")]
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--out", str(out), "--work", str(work), "--base", str(base), "--data", *corpora, "--device", "cpu"]
    argv += ["--minutes", "1", "--max-epochs", "2", "--batch-tokens", "64", "--max-length", "40"]
    with script_module(GPU_TRAIN) as module:
        assert module.main([*argv, "--extra", "--topk 8 --threads 1"]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["features"]["sequences"] == 8 and report["features"]["train_loss_tokens"] > 0
        assert list(report["runs"]) == ["clover2", "clover", "medusa"]
        for arch, run in report["runs"].items():
            assert run["exit_code"] == 0 and run["complete"], (arch, run)
            assert 0 < run["epochs"] <= 2 and run["epoch_metrics"], (arch, run)
            assert all(m["val_chain_accept"] >= 1 for m in run["epoch_metrics"])
        parts = sorted(out.glob("heads.tar.part-*"))
        assert parts and all(p.stat().st_size <= module.PART_BYTES for p in parts)
        assert len(list(out.iterdir())) <= 8  # few small files: what an offline GPU host hands back
        (tmp_path / "heads.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
        with tarfile.open(tmp_path / "heads.tar") as tar:
            tar.extractall(tmp_path / "back", filter="data")
        for arch in ("clover2", "clover", "medusa"):
            heads = load_heads(tmp_path / "back" / arch, load_base(base, "float32"))
            assert heads.config.arch == arch
            prov = json.loads((tmp_path / "back" / arch / "training.json").read_text())
            assert prov["complete"] and len(prov["data"]["sources"]) == 2
        # finished runs are skipped by --resume (nothing trained again)
        assert module.main([*argv, "--resume", "--extra", "--topk 8 --threads 1"]) == 0
        again = json.loads((out / "report.json").read_text())
        assert again["runs"] == {}
