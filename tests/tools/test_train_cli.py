"""clover-train end to end on a tiny random base: every architecture, determinism, resume, errors."""

import json
import shutil

import numpy as np
import pytest
from helpers import tiny_hf_folder
from safetensors.numpy import load_file

from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.tools.train import main as train_main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    base = tiny_hf_folder(root / "base", seed=0)
    rng = np.random.default_rng(0)
    data = root / "chats.jsonl"
    with data.open("w") as f:
        for i in range(40):
            user = " ".join(f"w{x}" for x in rng.integers(6, 96, size=rng.integers(2, 8)))
            if i % 2:
                f.write(
                    json.dumps(
                        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "w10 w11"}]}
                    )
                    + "\n"
                )
            else:
                f.write(
                    json.dumps({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "w12"}]})
                    + "\n"
                )
    return root, base, data


def _train(setup, out, *extra):
    root, base, data = setup
    return train_main(
        [
            "--base",
            str(base),
            "--data",
            str(data),
            "--out",
            str(out),
            "--cache-dir",
            str(root / "features"),
            "--max-tokens",
            "400",
            "--max-new-tokens",
            "12",
            "--max-length",
            "40",
            "--gen-batch",
            "8",
            "--batch-tokens",
            "256",
            "--topk",
            "8",
            *extra,
        ]
    )


@pytest.mark.parametrize("arch", ["medusa", "clover", "clover2"])
def test_each_architecture_trains_and_stays_lossless(setup, arch, capsys):
    root, base, _ = setup
    out = root / f"heads-{arch}"
    assert _train(setup, out, "--arch", arch, "--num-heads", "3", "--epochs", "2") == 0
    err = capsys.readouterr().err
    assert "epoch 2:" in err and "val top-1 per depth" in err and "top-3" in err
    prov = json.loads((out / "training.json").read_text())
    last = prov["epochs"][-1]  # held-out accuracy@1 and @3 per depth (accuracy@3 >= accuracy@1)
    assert len(last["val_top1"]) == len(last["val_topk"]) == 3
    assert all(0 <= a <= b <= 1 for a, b in zip(last["val_top1"], last["val_topk"])), last
    assert last["val_top1_early"] == last["val_top1"]  # every answer here is shorter than EARLY_ANSWER_TOKENS
    assert "top-1 over the first 128 answer tokens" in err
    assert prov["command"].startswith("clover-train --base ") and f"--arch {arch}" in prov["command"]
    assert len(prov["epochs"]) == 2 and prov["data"]["responses"] == "base" and prov["data"]["seed"] == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch-0.pt", "epoch-1.pt"]
    plain = Generator.load(base, "none").generate(
        [3, 20, 21, 4, 5], GenerationParams(max_new_tokens=20, ignore_eos=True)
    )
    fast = Generator.load(base, str(out), tree="chain-3").generate(
        [3, 20, 21, 4, 5], GenerationParams(max_new_tokens=20, ignore_eos=True)
    )
    assert fast.token_ids == plain.token_ids


def test_same_seed_same_heads_and_resume_continues_exactly(setup):
    root, _, _ = setup
    a, b, c = root / "a", root / "b", root / "c"
    assert _train(setup, a, "--arch", "clover2", "--epochs", "2", "--num-heads", "2") == 0
    assert _train(setup, b, "--arch", "clover2", "--epochs", "2", "--num-heads", "2") == 0
    wa, wb = load_file(str(a / "heads.safetensors")), load_file(str(b / "heads.safetensors"))
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    # c was interrupted after epoch 1: resuming must reproduce the uninterrupted run
    (c / "checkpoints").mkdir(parents=True)
    shutil.copy(a / "checkpoints" / "epoch-0.pt", c / "checkpoints" / "epoch-0.pt")
    assert _train(setup, c, "--arch", "clover2", "--epochs", "2", "--num-heads", "2", "--resume") == 0
    wc = load_file(str(c / "heads.safetensors"))
    assert all(np.array_equal(wa[k], wc[k]) for k in wa)
    # a finished run resumed for more epochs: training.json keeps both invocations
    assert len(json.loads((c / "training.json").read_text())["runs"]) == 1
    assert _train(setup, c, "--arch", "clover2", "--epochs", "3", "--num-heads", "2", "--resume") == 0
    prov = json.loads((c / "training.json").read_text())
    assert [r["command"].split("--epochs ")[1][0] for r in prov["runs"]] == ["2", "3"]
    assert prov["total_wall_seconds"] == pytest.approx(sum(r["wall_seconds"] for r in prov["runs"]), abs=0.2)
    assert [e["epoch"] for e in prov["epochs"]] == [1, 2, 3]


def test_init_goes_on_from_given_heads(setup, capsys):
    root, _, _ = setup
    a, warm, fresh = root / "init-a", root / "init-warm", root / "init-fresh"
    assert _train(setup, a, "--arch", "clover2", "--epochs", "1", "--num-heads", "2") == 0
    # a learning rate too small to move fp16 weights: the result is the heads training started from
    assert _train(setup, warm, "--init", str(a), "--epochs", "1", "--lr", "1e-12", "--seed", "1") == 0
    assert (
        _train(setup, fresh, "--arch", "clover2", "--num-heads", "2", "--epochs", "1", "--lr", "1e-12", "--seed", "1")
        == 0
    )
    wa, ww, wf = (load_file(str(d / "heads.safetensors")) for d in (a, warm, fresh))
    assert all(np.array_equal(wa[k], ww[k]) for k in wa)  # --arch and --num-heads came from the --init heads
    assert not all(np.array_equal(wa[k], wf[k]) for k in wa)
    prov = json.loads((warm / "training.json").read_text())
    assert prov["init"] == str(a) and prov["train_config"]["arch"] == "clover2"
    assert prov["init_training"] == json.loads((a / "training.json").read_text())  # the heads' history goes along
    assert json.loads((fresh / "training.json").read_text())["init"] is None
    capsys.readouterr()
    assert _train(setup, root / "init-bad", "--init", str(a), "--arch", "medusa") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not match --arch medusa (they have clover2)" in err[0]
    assert _train(setup, root / "init-random", "--init", "random:clover2") == 2
    assert "is not trained heads" in capsys.readouterr().err


def test_errors_are_one_line_with_exit_code_2(setup, capsys):
    root, base, data = setup
    busy = root / "a-busy"
    (busy / "checkpoints").mkdir(parents=True)
    assert _train(setup, busy, "--arch", "medusa") == 2
    assert "pass --resume" in capsys.readouterr().err
    assert _train(setup, root / "fresh", "--arch", "medusa", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err
    other = root / "not-heads"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert _train(setup, other, "--arch", "medusa") == 2
    assert "not a heads folder" in capsys.readouterr().err
    assert (
        train_main(
            [
                "--base",
                str(base),
                "--data",
                str(root / "nope.jsonl"),
                "--out",
                str(root / "x"),
                "--cache-dir",
                str(root / "features"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]
    assert not (root / "x").exists()


def test_a_run_cut_by_its_time_budget_resumes_to_the_uncut_runs_heads(setup, capsys):
    root, _, _ = setup
    whole, cut = root / "budget-whole", root / "budget-cut"
    args = ("--arch", "clover2", "--epochs", "1.5", "--num-heads", "2")
    assert _train(setup, whole, *args) == 0
    # a budget spent at once: each invocation makes one step, then stops with a checkpoint inside the epoch
    assert _train(setup, cut, *args, "--max-minutes", "0.00001") == 0
    assert "stopped at the time budget after 1/" in capsys.readouterr().err
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["epoch-0-batch-1.pt"]
    prov = json.loads((cut / "training.json").read_text())
    assert prov["complete"] is False and prov["steps"] == 1 and prov["runs"][0]["stopped_at_budget"] is True
    assert (cut / "heads.safetensors").is_file()  # the heads so far, usable
    assert _train(setup, cut, *args, "--max-minutes", "0.00001", "--resume") == 0
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["epoch-0-batch-2.pt"]  # the older one superseded
    assert _train(setup, cut, *args, "--resume", "--checkpoint-minutes", "0.00001") == 0
    ww, wc = load_file(str(whole / "heads.safetensors")), load_file(str(cut / "heads.safetensors"))
    assert all(np.array_equal(ww[k], wc[k]) for k in ww)
    a, b = (json.loads((d / "training.json").read_text()) for d in (whole, cut))
    assert [e["epoch"] for e in b["epochs"]] == [1, 2] and b["complete"] and b["steps"] == a["steps"]
    for ea, eb in zip(a["epochs"], b["epochs"]):  # the cut epoch reports what the uncut one did
        assert (ea["train_loss"], ea["val_top1"], ea["val_chain_accept"]) == (
            eb["train_loss"],
            eb["val_top1"],
            eb["val_chain_accept"],
        )
    assert [r["stopped_at_budget"] for r in b["runs"]] == [True, True, False]
    assert all(r["device"] == "cpu" and r["cuda"] is None for r in b["runs"])
    assert a["complete"] and a["total_steps"] == a["steps"]  # 1.5 epochs: the second stops halfway through
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["epoch-0.pt", "epoch-1.pt"]


def test_features_in_memory_train_the_same_heads_as_the_disk_cache(setup):
    root, _, _ = setup
    disk, memory = root / "feat-disk", root / "feat-memory"
    args = ("--arch", "clover", "--epochs", "1", "--num-heads", "2", "--cache-dir", str(root / "features-mem"))
    assert _train(setup, disk, *args) == 0
    assert _train(setup, memory, *args[:-2], "--features", "memory", "--cache-dir", str(root / "features-none")) == 0
    assert not (root / "features-none").exists()  # nothing written to disk
    wd, wm = load_file(str(disk / "heads.safetensors")), load_file(str(memory / "heads.safetensors"))
    assert all(np.array_equal(wd[k], wm[k]) for k in wd)
    assert json.loads((memory / "training.json").read_text())["data"]["features"] == "memory"


def test_bfloat16_heads_load_as_float16_ones_do(setup):
    import torch

    from clover.models.head_io import load_heads, save_heads
    from clover.models.loading import load_base

    root, base, _ = setup
    a = root / "bf16-src"
    assert _train(setup, a, "--arch", "clover2", "--epochs", "1", "--num-heads", "2") == 0
    b = load_base(base, "float32")
    heads = load_heads(a, b)
    save_heads(heads, root / "bf16", dtype=torch.bfloat16)
    again = load_heads(root / "bf16", b)
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v.to(torch.bfloat16).float())


def test_best_epoch_is_kept_and_feature_noise_is_seeded(setup, capsys):
    root, _, _ = setup
    start = root / "keep-start"
    assert _train(setup, start, "--arch", "clover2", "--epochs", "2", "--num-heads", "2") == 0
    # a learning rate that wrecks the heads: no trained epoch beats the --init heads, which are written back.
    # float32 matmuls: under bfloat16 this step leaves the tiny heads' validation top-1 as it was (a tie, not a wreck)
    best, last = root / "keep-best", root / "keep-last"
    wreck = ("--init", str(start), "--epochs", "1", "--lr", "50", "--seed", "1", "--train-dtype", "float32")
    capsys.readouterr()
    assert _train(setup, best, *wreck) == 0
    err = capsys.readouterr().err
    assert "before training: val loss" in err and "kept the heads of epoch 0" in err
    assert _train(setup, last, *wreck, "--keep", "last") == 0
    prov = json.loads((best / "training.json").read_text())
    assert prov["kept_epoch"] == 0 and prov["initial"]["epoch"] == 0 and prov["initial"]["train_loss"] is None
    assert prov["initial"]["val_chain_accept"] > prov["epochs"][0]["val_chain_accept"]
    assert json.loads((last / "training.json").read_text())["kept_epoch"] is None
    ws, wb, wl = (load_file(str(d / "heads.safetensors")) for d in (start, best, last))
    assert all(np.array_equal(ws[k], wb[k]) for k in ws)
    assert not all(np.array_equal(ws[k], wl[k]) for k in ws)
    # noise on the fed features changes the heads, the same way for the same seed, and they stay lossless
    args = ("--arch", "clover2", "--epochs", "1", "--num-heads", "2", "--feature-noise", "0.5")
    n1, n2, clean = root / "noise-1", root / "noise-2", root / "noise-0"
    assert _train(setup, n1, *args) == 0 and _train(setup, n2, *args) == 0
    assert _train(setup, clean, *args[:-2]) == 0
    w1, w2, w0 = (load_file(str(d / "heads.safetensors")) for d in (n1, n2, clean))
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert not all(np.array_equal(w1[k], w0[k]) for k in w1)
    assert json.loads((n1 / "training.json").read_text())["train_config"]["feature_noise"] == 0.5
    _, base, _ = setup
    prompt, params = [3, 20, 21, 4, 5], GenerationParams(max_new_tokens=20, ignore_eos=True)
    plain = Generator.load(base, "none").generate(prompt, params)
    assert Generator.load(base, str(n1), tree="chain-2").generate(prompt, params).token_ids == plain.token_ids


def test_train_dtype_is_recorded_and_a_resume_keeps_it(setup, capsys):
    """--train-dtype picks the matmuls' precision (default: the faster here, timed once); both train heads of
    about the same held-out loss, training.json records it, and --resume refuses another."""
    root, _, _ = setup
    args = ("--arch", "clover2", "--epochs", "1", "--num-heads", "2")
    losses = {}
    for dtype in ("float32", "bfloat16"):
        out = root / f"dtype-{dtype}"
        assert _train(setup, out, *args, "--train-dtype", dtype) == 0
        prov = json.loads((out / "training.json").read_text())
        assert prov["train_config"]["compute_dtype"] == dtype
        losses[dtype] = prov["epochs"][-1]["val_loss"]
    assert abs(losses["float32"] - losses["bfloat16"]) < 0.05 * losses["float32"], losses
    capsys.readouterr()
    other = "bfloat16"
    assert _train(setup, root / "dtype-float32", *args, "--train-dtype", other, "--resume") == 2
    assert "compute_dtype" in capsys.readouterr().err
