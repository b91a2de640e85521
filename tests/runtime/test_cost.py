"""runtime/cost.py: the draft-confidence calibration dynamic trees size themselves by."""

import numpy as np

from clover.runtime.cost import DraftConfidence


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
