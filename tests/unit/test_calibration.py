"""Calibration: EWMA convergence, change-point reset, efficiencies from measured times, bad samples."""

from __future__ import annotations

import math
import random

import pytest

from libra.services.planner import cost_rollout
from libra.services.planner.calibration import Calibration, CalibrationSettings, Ewma, predicted_times
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.hardware import gpu_named, model_named

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")


def calibration(**settings) -> Calibration:
    return Calibration(MODEL, GPU, RolloutEfficiency(), TrainEfficiency(), CalibrationSettings(**settings))


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


def test_decode_and_prefill_efficiency_follow_measured_turns():
    cal = calibration()
    inst = cost_rollout.instance(MODEL, GPU, 1, RolloutEfficiency())
    comm = 0.0  # tp 1: no all-reduce
    decode_step = inst.decode_step_seconds(1, 200 + 400 / 2)
    for _ in range(20):  # decode-dominated: measured decode part is twice the model's
        measured = inst.prefill_seconds(200) + 400 * decode_step * 2.0 + comm
        assert cal.observe_turn(1, 200, 400, measured) is None
    for _ in range(20):  # prefill-dominated (long prompt, one token): 1.5x slower prefill
        step = inst.decode_step_seconds(1, 30000.5)
        measured = inst.prefill_seconds(30000) * 1.5 + step * cal.estimators["decode"].value()
        assert cal.observe_turn(1, 30000, 1, measured) is None
    eff = cal.rollout_efficiency()
    assert eff.decode_bw == pytest.approx(0.7 / 2.0, rel=0.01)
    assert eff.prefill_mfu == pytest.approx(0.5 / 1.5, rel=0.01)
    snap = cal.snapshot()
    assert snap["turn_time"]["samples"] == 40 and snap["turn_time"]["measured_s"] > 0


def test_training_mfu_reproduces_the_measured_step():
    cal = calibration()
    layout, lengths = Layout(1, 1, 8, 1), [(1000, 2000)] * 64
    base_train, _ = predicted_times(MODEL, GPU, layout, ((1, 8),), lengths, RolloutEfficiency(), TrainEfficiency())
    for _ in range(10):
        assert cal.observe_train(layout, lengths, base_train * 2.5) is None
    calibrated_train, _ = predicted_times(MODEL, GPU, layout, ((1, 8),), lengths, cal.rollout_efficiency(),
                                          cal.train_efficiency())
    assert calibrated_train == pytest.approx(base_train * 2.5, rel=0.01)
    assert cal.train_efficiency().mfu < TrainEfficiency().mfu


def test_pipeline_slowdown_divides_both_rollout_efficiencies_on_top_of_turns():
    """Batches really take twice what the simulator plays at the model's speeds: every replay (run
    at the slowdown in force, so its spans scale with it) pulls the slowdown to 2, and the
    simulator's speeds halve."""
    cal = calibration()

    def replay() -> float:
        return 100.0 * cal.pipeline_slowdown()  # the spans a replay plays at the slowdown in force

    assert cal.observe_pipeline(200.0, replay(), cal.pipeline_slowdown()) is None
    assert cal.pipeline_slowdown() == pytest.approx(2.0)
    for _ in range(4):  # replays at the new speeds match the measurement: it stays
        assert cal.observe_pipeline(200.0, replay(), cal.pipeline_slowdown()) is None
    assert cal.pipeline_slowdown() == pytest.approx(2.0)
    eff = cal.rollout_efficiency()
    assert eff.decode_bw == pytest.approx(0.35, rel=0.01) and eff.prefill_mfu == pytest.approx(0.25, rel=0.01)
    for _ in range(5):  # turns measured at half the model's decode speed as well: both corrections stack
        cal.observe_turn(1, 10, 2000, 2 * 2000 * cost_rollout.instance(MODEL, GPU, 1, RolloutEfficiency())
                         .decode_step_seconds(1, 1010))
    assert cal.rollout_efficiency().decode_bw == pytest.approx(0.7 / 4, rel=0.05)
    assert cal.observe_pipeline(-1.0, 100.0, 1.0) is not None and cal.estimators["pipeline"].samples == 5


@pytest.mark.parametrize("prompt, output, seconds, why", [
    (10, 10, -1.0, "seconds is negative"),
    (10, 10, math.nan, "seconds is not a finite number"),
    (10, 10, math.inf, "seconds is not a finite number"),
    (10, 10, 1e9, "seconds is absurd"),
    (10, 10**9, 1.0, "output is absurd"),
    (10, 10, 1e-12, "measured/predicted"),  # far faster than the hardware peak allows
])
def test_bad_turns_are_rejected_with_a_reason_and_counted(prompt, output, seconds, why):
    cal = calibration()
    reason = cal.observe_turn(1, prompt, output, seconds)
    assert reason is not None and why in reason
    assert sum(cal.rejected.values()) == 1
    assert all(e.samples == 0 for e in cal.estimators.values())


def test_state_round_trips():
    cal = calibration()
    for x in (1.0, 2.0, 3.0):
        cal.estimators["train"].update(x)
    cal.observe_turn(1, 10, 10, -1.0)
    other = calibration()
    other.restore(cal.state())
    assert other.snapshot() == cal.snapshot()


def test_training_efficiency_follows_a_regime_change_within_reset_after_samples():
    cal = calibration(alpha=0.05, reset_after=3)
    layout, lengths = Layout(1, 1, 8, 1), [(1000, 2000)] * 64
    base_train, _ = predicted_times(MODEL, GPU, layout, ((1, 8),), lengths, RolloutEfficiency(), TrainEfficiency())
    for _ in range(30):
        cal.observe_train(layout, lengths, base_train * 2.0)
    slow = cal.train_efficiency().mfu
    for _ in range(3):  # a slower node joins: training now takes 4x the model's estimate
        cal.observe_train(layout, lengths, base_train * 4.0)
    assert cal.estimators["train"].resets == 1
    assert cal.train_efficiency().mfu == pytest.approx(slow / 2, rel=0.02)
