"""clover-doctor: the table and the exit code on this machine (every GPU row not available, the CPU identity
row passing, exit 3), how rows and exit codes follow from checks that pass, fail, break or cannot run, and on
a GPU (marked gpu) that nothing fails."""

import re
import subprocess
import sys

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
