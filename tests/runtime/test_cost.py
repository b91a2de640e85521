"""runtime/cost.py: the draft-confidence calibration dynamic trees size themselves by."""

import numpy as np

from clover.runtime.policy import DraftConfidence


def test_confidence_starts_at_the_raw_probability_and_learns_the_hit_rate():
    c = DraftConfidence(prior=4.0)
    p = np.array([0.9, 0.3, 0.05, 1e-6])
    np.testing.assert_allclose(c(p), p)  # no observations: the draft's own probability
    # nodes drafted at p = 0.05 are in fact accepted half the time (under-confident heads)
    c.observe(np.full(400, 0.05), np.arange(400) % 2 == 0)
    assert abs(c(np.array([0.05]))[0] - 0.5) < 0.02
    assert c(np.array([0.9]))[0] == 0.9  # other bins keep their prior
    c.observe_draft(2.0)
    c.observe_draft(4.0)
    assert c.draft_ms == 2.2


def test_the_verify_cost_curve_is_measured_once_per_runner(monkeypatch):
    from helpers import tiny_base

    import clover.runtime.cost as cost
    from clover.runtime.backends.torch_runner import TorchRunner

    measured = []
    real = cost.calibrate
    monkeypatch.setattr(
        cost, "calibrate", lambda runner, max_rows, reps=7: measured.append(max_rows) or real(runner, max_rows, 1)
    )
    runner, other = TorchRunner(tiny_base()), TorchRunner(tiny_base())
    a = cost.verify_cost(runner, 8)
    b = cost.verify_cost(runner, 5)  # covered by the first curve
    assert measured == [8] and a is not b and a.to_dict() == b.to_dict()
    a.observe(4, 2, 2 * a.curve(4))
    assert b.correction == {}  # each caller learns its own corrections
    cost.verify_cost(runner, 12)  # longer than measured: measured again
    cost.verify_cost(other, 5)  # another runner, its own curve
    assert measured == [8, 12, 5]


def test_the_calibrated_curve_never_falls():
    from helpers import tiny_base

    from clover.runtime.backends.torch_runner import TorchRunner
    from clover.runtime.cost import calibrate

    curve = calibrate(TorchRunner(tiny_base()), 12, reps=3)
    assert curve.rows.tolist() == [1, 2, 3, 4, 5, 8, 11, 12]
    assert np.all(curve.ms > 0) and np.all(np.diff(curve.ms) >= 0)  # more rows never cost less on the curve


def test_engine_loads_read_the_cached_curve_and_a_changed_key_measures_again(tmp_path, monkeypatch):
    """tree="auto" calibrates once per artifact, machine and batch setting: a second Engine.load reads the curve from
    the user cache; another thread count, batch size or artifact measures (and caches) its own; the env var turns the
    cache off."""
    from ort_helpers import tiny_artifact

    import clover.runtime.cost as cost
    from clover.runtime.engine import Engine
    from clover.runtime.params import EngineOptions

    artifact = tiny_artifact(tmp_path, "clover2", attention="fused")
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cost.COST_CACHE_ENV, "1")
    measured = []
    real = cost.calibrate
    monkeypatch.setattr(
        cost, "calibrate", lambda runner, max_rows, reps=7: measured.append(max_rows) or real(runner, max_rows, 1)
    )

    def load(**kw):
        engine = Engine.load(
            artifact, tree="auto", log=None, options=EngineOptions(**{"max_batch": 2, "threads": 1, **kw})
        )
        engine.close()
        return engine.policy.cost

    first = load()
    assert len(measured) == 1 and "cached in" in first.source
    files = list((tmp_path / "cache" / "verify-cost").glob("*.json"))
    assert len(files) == 1
    second = load()
    assert len(measured) == 1 and second.source == f"read from {files[0]}"
    assert second.to_dict()["rows_ms"] == first.to_dict()["rows_ms"]
    load(threads=2)  # another key: measured and cached beside the first
    load(max_batch=1)  # (no batched graph; the tiny context caps the rows of larger batches alike)
    assert len(measured) == 3 and len(list(files[0].parent.glob("*.json"))) == 3
    files[0].write_text("{not json")  # a damaged entry is measured again and rewritten
    load()
    assert len(measured) == 4 and load().source.startswith("read from")
    monkeypatch.setenv(cost.COST_CACHE_ENV, "0")
    assert load().source.startswith("calibrated in") and len(measured) == 5
