"""The change-point EWMA the calibration's slowdowns use (services/planner/changepoint.py): convergence,
plain means at first, a reset after a sustained shift and not after a spike or alternating outliers."""

from __future__ import annotations

import random

import pytest

from libra.services.planner.calibration import CalibrationSettings
from libra.services.planner.changepoint import Ewma


def test_ewma_converges_to_the_mean_of_noisy_samples():
    rng = random.Random(0)
    ewma = Ewma(CalibrationSettings(alpha=0.1))
    for _ in range(300):
        assert ewma.update(2.0 + rng.gauss(0, 0.05)) == "folded"
    assert ewma.value() == pytest.approx(2.0, rel=0.03)
    assert 0.01 < ewma.std < 0.1 and ewma.resets == 0


def test_first_samples_are_averaged_plainly():
    ewma = Ewma(CalibrationSettings(alpha=0.1))
    for x in (1.0, 2.0, 3.0):
        ewma.update(x)
    assert ewma.value() == pytest.approx(2.0)  # alpha = max(alpha, 1/n), not biased towards the first


def test_change_point_resets_after_a_sustained_shift_but_not_after_a_spike():
    rng = random.Random(1)
    ewma = Ewma(CalibrationSettings(alpha=0.05, reset_sigmas=3, reset_after=3, min_samples=5))
    for _ in range(50):
        ewma.update(1.0 + rng.gauss(0, 0.02))
    assert ewma.update(5.0) == "held"  # one spike is held back...
    assert ewma.update(1.0) == "folded"  # ...and dropped when the series returns
    assert ewma.resets == 0 and ewma.value() == pytest.approx(1.0, abs=0.05)
    outcomes = [ewma.update(3.0 + rng.gauss(0, 0.02)) for _ in range(3)]
    assert outcomes == ["held", "held", "reset"]
    assert ewma.resets == 1 and ewma.value() == pytest.approx(3.0, abs=0.05)
    # a plain EWMA at alpha 0.05 would still sit near 1.3 after three samples of 3.0
    for _ in range(10):
        assert ewma.update(3.0 + rng.gauss(0, 0.02)) == "folded"
    assert ewma.value() == pytest.approx(3.0, abs=0.05)


def test_alternating_outliers_do_not_reset():
    ewma = Ewma(CalibrationSettings(reset_after=2, min_samples=3))
    for _ in range(10):
        ewma.update(1.0)
    assert [ewma.update(x) for x in (3.0, 0.1, 3.0)] == ["held", "held", "held"]  # sides differ: no run
    assert ewma.resets == 0
