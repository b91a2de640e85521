"""benchmarks/quality.py's pure parts: the metrics, the Pareto front, the export flags of a config. No model runs."""

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import script_module

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"


@pytest.fixture(scope="module")
def quality():
    with script_module(QUALITY, also_drop=("peers",)) as module:
        yield module


def test_tally_of_identical_laws_is_fp32(quality):
    lp = quality.log_softmax(np.random.default_rng(0).standard_normal((5, 7)))
    t = quality.Tally()
    targets = np.array([0, 1, 2, 3, 4])
    t.add(lp, lp, targets)
    s = t.summary()
    assert s["top1_agreement"] == 1.0 and abs(s["kl_mean"]) < 1e-12
    assert math.isclose(s["perplexity"], math.exp(-lp[np.arange(5), targets].mean()))


def test_kl_and_agreement_of_a_different_law(quality):
    p = quality.log_softmax(np.array([[3.0, 0.0, 0.0]]))
    q = quality.log_softmax(np.array([[0.0, 3.0, 0.0]]))
    t = quality.Tally()
    t.add(p, q, np.array([0]))
    s = t.summary()
    assert s["top1_agreement"] == 0.0
    assert math.isclose(s["kl_mean"], float((np.exp(p) * (p - q)).sum()))


def test_pareto_front_and_prefix(quality):
    points = [("a", 10.0, 100.0), ("b", 12.0, 150.0), ("c", 12.5, 120.0), ("d", 9.0, 50.0)]
    assert [p[0] for p in quality.pareto(points)] == ["d", "a", "b"]  # c: b is faster and better
    assert quality.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_config_flags(quality):
    assert quality.config_flags("fp32")[-2:] == ["--max-batch", "1"]
    flags = quality.config_flags("int4-rtnsym-64")
    assert flags[-7:] == ["--weights", "int4", "--quant", "rtn", "--block-size", "64", "--symmetric"]
