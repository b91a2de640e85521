"""--quant rtn|hqq|gptq|kquant: each of onnxruntime's weight-only quantizers exports the tiny model, fused and
portable, records itself in the manifest, and keeps speculative output equal to plain output of its graphs."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_identical, run_tokens, tiny_tokenizer_dir
from ort_helpers import HEADS_SEED, PROMPTS, tiny_modules

from clover.artifact import open_artifact
from clover.errors import CloverError
from clover.export.artifact import ArtifactOptions, artifact_from_modules
from clover.export.config import ExportConfig
from clover.export.quantize import CalibrationSet, check_block_layout, quantized_ops
from clover.models.heads import BaseFingerprint
from clover.runtime.backends.ort import load_runner
from clover.runtime.tree import resolve_tree

N = 24
TREE = "chain-2"  # fused int4/int8 graphs verify chains (quantize.py)
ARCH = "medusa"  # one draft graph: the fewest to trace
# (weights, quant, symmetric): every quantizer at each width it writes (rtn asymmetric: test_weights_quant.py)
CONFIGS = [("int4", "hqq", False), ("int4", "kquant", False), ("int8", "kquant", False), ("int4", "gptq", False)]
CONFIGS += [("int4", "rtn", True)]


def tiny_calibration(base) -> CalibrationSet:
    rng = np.random.default_rng(0)
    V = base.config.vocab_size
    sequences = tuple((rng.integers(3, V, 20).astype(np.int64), 8) for _ in range(3))
    return CalibrationSet(sequences, "tiny sequences", dataclasses.asdict(BaseFingerprint.of(base)))


def export(root, weights: str, quant: str, symmetric: bool, attention: str):
    base, heads = tiny_modules(ARCH)
    # no parity / agreement runs (test_weights_quant.py has them): the test below checks losslessness itself
    config = ExportConfig(
        tree=TREE, weights=weights, quant=quant, symmetric=symmetric, attention=attention, max_batch=1, verify=False
    )
    out = root / f"{weights}-{quant}-{'sym' if symmetric else 'asym'}-{attention}"
    calibration = tiny_calibration(base) if quant == "gptq" else None
    tokenizer = tiny_tokenizer_dir(root / "tokenizer")
    options = ArtifactOptions(heads_name=f"random:{ARCH}:{HEADS_SEED}", calibration=calibration)
    return artifact_from_modules(base, heads, tokenizer, out, config, options)


@pytest.mark.parametrize("attention", ["fused", "portable"])
@pytest.mark.parametrize("weights,quant,symmetric", CONFIGS)
def test_every_quantizer_exports_and_stays_lossless(tmp_path_factory, weights, quant, symmetric, attention):
    root = export(tmp_path_factory.mktemp("quant"), weights, quant, symmetric, attention)
    m = open_artifact(root)
    q = m.weights.quantizer
    assert (
        (q["name"], q["bits"], q["symmetric"])
        == (quant, int(weights[3:]), symmetric)
        == (quant, q["bits"], m.weights.symmetric)
    )
    assert q["config"].startswith("onnxruntime.quantization.matmul_nbits_quantizer.")
    assert ("calibration" in q) == (quant == "gptq")
    assert all("MatMulNBits" in quantized_ops(root / g.file) for n, g in m.graphs.items() if n != "base_batch")
    assert m.weights.embedding == ("int4" if weights == "int4" else "float32")
    plain, speculative = load_runner(root, heads="none"), load_runner(root)
    for p in PROMPTS:
        want, _ = run_tokens(plain, p, resolve_tree("plain"), N)
        got, _ = run_tokens(speculative, p, resolve_tree(TREE), N)
        assert_identical(got, want, f"ORT {weights} {quant} {'symmetric' if symmetric else ''} {attention}")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"quant": "hqq"}, r"--quant choose how --weights rounds the weights: add --weights int4"),
        ({"symmetric": True}, r"--symmetric choose how --weights rounds.*drop --symmetric"),
        ({"weights": "int4", "quant": "awq"}, r"unknown --quant 'awq': use one of rtn, hqq, gptq, kquant"),
        ({"weights": "int8", "quant": "gptq"}, r"--quant gptq writes int4 weights only.*--quant rtn or kquant"),
        ({"weights": "int8", "quant": "hqq"}, r"--quant hqq writes int4 weights only.*float zero points"),
        ({"weights": "int4", "quant": "kquant", "symmetric": True}, r"always stores a zero point.*drop --symmetric"),
        ({"weights": "int4", "quant": "gptq", "calibration_sequences": 0}, r"--calibration-sequences must be"),
    ],
)
def test_config_rejects(kwargs, message):
    with pytest.raises(CloverError, match=message):
        ExportConfig(**kwargs)


def test_odd_block_counts_are_refused_for_packed_zero_points():
    sizes = {"hidden": 576, "intermediate": 1536}  # SmolLM2: 576 is 9 blocks of 64
    with pytest.raises(CloverError, match=r"hidden 576 = 9 blocks.*--block-size 16 or 32.*--symmetric"):
        check_block_layout("gptq", "int4", False, 64, sizes)
    with pytest.raises(CloverError, match=r"4.5 blocks.*--quant rtn or hqq"):
        check_block_layout("kquant", "int4", False, 128, sizes)
    check_block_layout("gptq", "int4", True, 128, sizes)  # no zero points to pack
    check_block_layout("hqq", "int4", False, 128, sizes)  # its own writer
    check_block_layout("kquant", "int4", False, 32, sizes)


def test_gptq_without_calibration_is_refused(tmp_path):
    base, heads = tiny_modules("none")
    config = ExportConfig(weights="int4", quant="gptq")
    with pytest.raises(CloverError, match=r"--quant gptq needs calibration sequences.*--calibration CORPUS"):
        artifact_from_modules(base, None, tiny_tokenizer_dir(tmp_path / "tok"), tmp_path / "out", config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--quant", "gptq"], "--weights int4"),
        (["--weights", "int4", "--quant", "gptq", "--calibration", "no/such/corpus"], "--calibration CORPUS"),
        (["--weights", "int4", "--calibration", "data/x"], "--calibration calibrate --weights int4 --quant gptq"),
        (["--weights", "int8", "--quant", "hqq"], "--quant hqq writes int4 weights only"),
    ],
)
def test_cli_names_the_problem_and_the_fix(tmp_path, flags, message):
    r = subprocess.run(
        [sys.executable, "-m", "clover.tools.export", "--out", str(tmp_path / "a"), *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert not (tmp_path / "a").exists()
