"""The training's matmul precision: timed once per machine, and both precisions train the same heads' shape of loss."""

import json

import torch

from clover.train.objectives import TRAIN_DTYPES, Vocab, fastest_train_dtype, head_logits, mixed_precision


def test_the_faster_train_dtype_is_timed_once_per_machine(tmp_path, monkeypatch):
    """On a CPU the faster of float32 and bfloat16 (20-45x apart on AVX2-only CPUs, where bfloat16 is emulated) is
    timed once and kept in the user cache, so that --resume trains in the precision the run began with."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    first = fastest_train_dtype(torch.device("cpu"))
    assert first in TRAIN_DTYPES
    memo = tmp_path / "train_dtype.json"
    assert list(json.loads(memo.read_text()).values()) == [first]
    other = "float32" if first == "bfloat16" else "bfloat16"
    memo.write_text(json.dumps({k: other for k in json.loads(memo.read_text())}))
    assert fastest_train_dtype(torch.device("cpu")) == other  # read back, not timed again


def test_float32_turns_autocast_off_and_logits_follow_the_lm_heads_precision():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with mixed_precision(x.device, torch.float32):
        assert lin(x).dtype == torch.float32
    with mixed_precision(x.device, torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    lm = torch.randn(16, 8)
    exact = head_logits(None, 1, x, lm)
    assert exact.dtype == torch.float32 and torch.equal(exact, x @ lm.T)
    rounded = head_logits(None, 1, x, lm.to(torch.bfloat16))
    assert rounded.dtype == torch.float32 and torch.allclose(rounded, exact, rtol=0.05, atol=0.1)
    vocab = Vocab.of(torch.tensor([3, 1, 3]), lm, torch.float32)
    assert vocab.ids.tolist() == [1, 3] and vocab.lm.dtype == torch.float32 and torch.equal(vocab.lm, lm[[1, 3]])
