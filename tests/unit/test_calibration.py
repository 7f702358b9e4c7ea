"""Calibration: efficiencies from measured times, bad samples, state (the change-point EWMA: test_changepoint.py;
the prefill a turn waited through: test_prefills.py)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from libra.services.planner import cost_rollout
from libra.services.planner.calibration import Calibration, CalibrationSettings, predicted_times
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.gaps import GAP_PROBS, draw
from libra.services.planner.hardware import gpu_named, model_named

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")


def calibration(**settings) -> Calibration:
    return Calibration(MODEL, GPU, RolloutEfficiency(), TrainEfficiency(), CalibrationSettings(**settings))


TRUTH = RolloutEfficiency(prefill_mfu=0.5 / 1.5, decode_bw=0.7 / 2.0, step_overhead_s=0.004, step_per_seq_s=0.0002,
                          request_s=0.05)


def varied_turns(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """(prompt, output, batch) of n turns as a run sees them: short and long, alone and in a crowd."""
    rng = random.Random(seed)
    return [(rng.choice((50, 400, 4000, 30000)), rng.choice((1, 20, 300, 2000)), rng.choice((1, 4, 32, 128)))
            for _ in range(n)]


def measured_on(eff: RolloutEfficiency, prompt: int, output: int, batch: int) -> float:
    """What a turn takes on an engine of efficiency `eff` (the model the fit assumes: one prefill,
    `output` passes at the batch's step cost, the time outside the engine)."""
    inst = cost_rollout.instance(MODEL, GPU, 1, eff)
    context = prompt + output / 2
    return inst.prefill_seconds(prompt) + output * inst.decode_step_seconds(batch, batch * context) + eff.request_s


def test_the_turn_fit_recovers_every_term_from_varied_turns():
    """Turns measured on an engine 1.5x slower at prefill, 2x at decode, with 4 ms per pass, 0.2 ms
    per row and 50 ms outside the engine: the fit finds all five, whatever share each has per turn."""
    cal = calibration(prior_turns=1e-6)
    for prompt, output, batch in varied_turns(400):
        assert cal.observe_turn(1, prompt, output, measured_on(TRUTH, prompt, output, batch), batch) is None
    eff = cal.rollout_efficiency()
    assert eff.prefill_mfu == pytest.approx(TRUTH.prefill_mfu, rel=0.01)
    assert eff.decode_bw == pytest.approx(TRUTH.decode_bw, rel=0.01)
    assert eff.step_overhead_s == pytest.approx(0.004, rel=0.01)
    assert eff.step_per_seq_s == pytest.approx(0.0002, rel=0.01)
    assert eff.request_s == pytest.approx(0.05, rel=0.01)
    snap = cal.snapshot()
    assert snap["turn_time"]["samples"] == 400 and snap["turn_fit"]["samples"] == 400
    assert snap["efficiency"]["request_s"]["calibrated"] == pytest.approx(0.05, rel=0.01)


def test_turns_all_alike_are_predicted_right_and_leave_the_terms_near_their_base():
    """One kind of turn cannot tell the terms apart: the fit reproduces its time, and the prior
    shares the excess out instead of pinning it on one term at random."""
    cal = calibration()
    measured = measured_on(TRUTH, 200, 400, 1)
    for _ in range(50):
        assert cal.observe_turn(1, 200, 400, measured) is None
    assert measured_on(cal.rollout_efficiency(), 200, 400, 1) == pytest.approx(measured, rel=0.02)
    inst = cost_rollout.instance(MODEL, GPU, 1, RolloutEfficiency())
    features = (inst.prefill_seconds(200), 400 * inst.decode_step_seconds(1, 400), 400, 400, 1)
    shares = [(c - base) * x for c, base, x in zip(cal.fit.coefficients(), (1, 1, 0, 0, 0), features)]
    assert min(shares) > 0 and max(shares) == pytest.approx(min(shares), rel=0.05)  # equal shares of the excess


def test_the_turn_fit_forgets_an_old_regime_within_its_window():
    cal = calibration(turn_window=200)
    slow = TRUTH.model_copy(update={"decode_bw": TRUTH.decode_bw / 2, "step_overhead_s": 0.008})
    for eff, seed in ((TRUTH, 1), (slow, 2)):
        for prompt, output, batch in varied_turns(1000, seed):
            cal.observe_turn(1, prompt, output, measured_on(eff, prompt, output, batch), batch)
    eff = cal.rollout_efficiency()
    assert eff.decode_bw == pytest.approx(slow.decode_bw, rel=0.05)
    assert eff.step_overhead_s == pytest.approx(0.008, rel=0.05)


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
    half = RolloutEfficiency(decode_bw=0.35)
    for prompt, output, batch in varied_turns(200):  # turns at half the model's decode speed: both corrections stack
        cal.observe_turn(1, prompt, output, measured_on(half, prompt, output, batch), batch)
    assert cal.rollout_efficiency().decode_bw == pytest.approx(0.7 / 4, rel=0.05)
    assert cal.rollout_efficiency().prefill_mfu == pytest.approx(0.25, rel=0.05)
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
    assert all(e.samples == 0 for e in cal.estimators.values()) and cal.fit.samples == 0


def test_state_round_trips():
    cal = calibration()
    for x in (1.0, 2.0, 3.0):
        cal.estimators["train"].update(x)
    cal.observe_turn(1, 10, 10, -1.0)
    for prompt, output, batch in varied_turns(20):
        cal.observe_turn(1, prompt, output, measured_on(TRUTH, prompt, output, batch), batch)
        cal.observe_turn(1, prompt, output, measured_on(TRUTH, prompt, output, batch), batch, gap_s=0.05 * batch)
    other = calibration()
    other.restore(cal.state())
    assert other.snapshot() == cal.snapshot()
    assert other.rollout_efficiency().turn_gap_s == cal.rollout_efficiency().turn_gap_s > 0


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


def test_the_trainers_overhead_is_an_ewma_in_seconds_that_the_step_time_includes():
    cal = calibration()
    layout, lengths = Layout(1, 1, 8, 1), [(1000, 2000)] * 64
    base_train, _ = predicted_times(MODEL, GPU, layout, ((1, 8),), lengths, RolloutEfficiency(), TrainEfficiency())
    for _ in range(10):  # the optimizer step as the model says, and 0.4 s of bookkeeping around it
        assert cal.observe_train(layout, lengths, base_train, overhead_s=0.4) is None
    eff = cal.train_efficiency()
    assert eff.step_overhead_s == pytest.approx(0.4) and eff.mfu == pytest.approx(TrainEfficiency().mfu)
    train_s, _ = predicted_times(MODEL, GPU, layout, ((1, 8),), lengths, cal.rollout_efficiency(), eff)
    assert train_s == pytest.approx(base_train + 0.4, rel=1e-6)
    assert cal.snapshot()["efficiency"]["train_overhead_s"]["calibrated"] == pytest.approx(0.4)
    assert cal.observe_train(layout, lengths, base_train, overhead_s=-1.0) is not None  # rejected, counted
    assert calibration().train_efficiency().step_overhead_s == 0.0  # none reported: the configured value


def test_the_gap_between_turns_is_the_mean_of_the_measured_gaps():
    """The gateway's seconds before each turn (skewed: most short, a queue's tail long) calibrate
    `turn_gap_s` as their plain mean, which is what the simulator's constant per turn must add up
    to; turns that did not measure one (0: an external harness) change nothing."""
    cal = calibration()
    assert cal.rollout_efficiency().turn_gap_s == 0.0  # nothing measured: the configured value
    for prompt, output, batch in varied_turns(40):
        seconds = measured_on(TRUTH, prompt, output, batch)
        assert cal.observe_turn(1, prompt, output, seconds, batch, gap_s=0.01) is None
        assert cal.observe_turn(1, prompt, output, seconds, batch, gap_s=0.0) is None
    for prompt, output, batch in varied_turns(10):
        cal.observe_turn(1, prompt, output, measured_on(TRUTH, prompt, output, batch), batch, gap_s=0.41)
    assert cal.rollout_efficiency().turn_gap_s == pytest.approx(0.09, rel=0.02)  # (40 x 0.01 + 10 x 0.41) / 50
    assert cal.snapshot()["efficiency"]["turn_gap_s"]["samples"] == 50
    reason = cal.observe_turn(1, 10, 10, 1.0, 1, gap_s=-0.5)
    assert reason is not None and "negative" in reason


def test_the_gaps_distribution_is_measured_with_first_turns_apart_and_survives_a_restart():
    """With each turn's place reported (HistoryRecord.turn_number), the calibration exports the
    recent gaps' quantiles, a trajectory's first turn apart from its later ones; the mean stays
    what the closed-form cost model uses. Restored from its state, it exports the same."""
    cal = calibration()
    for i, (prompt, output, batch) in enumerate(varied_turns(300)):
        seconds = measured_on(TRUTH, prompt, output, batch)
        number = 1 + i % 3  # three-turn trajectories: the first waits longer
        gap = 0.3 if number == 1 else 0.02 + 0.001 * (i % 7)
        assert cal.observe_turn(1, prompt, output, seconds, batch, gap_s=gap, turn_number=number) is None
    r = cal.rollout_efficiency()
    assert set(r.first_gap_quantiles) == {0.3} and r.turn_gap_quantiles[0] == pytest.approx(0.02)
    assert r.turn_gap_quantiles[-1] == pytest.approx(0.026) and r.turn_gap_s == pytest.approx(0.1153, rel=0.01)
    other = calibration()
    other.restore(cal.state())
    restored = other.rollout_efficiency()
    assert restored.first_gap_quantiles == pytest.approx(r.first_gap_quantiles)
    assert restored.turn_gap_quantiles == pytest.approx(r.turn_gap_quantiles) and other.snapshot() == cal.snapshot()


def test_a_turns_time_beyond_the_fitted_engine_time_is_exported_as_a_factor_on_request_s():
    """The turn fit explains the mean; what each turn takes beyond its fitted engine time varies
    (jitter): the calibration exports that spread as quantiles of a factor on request_s, mean ~1,
    taken against the fit when asked (not the fit in force when the turn came), and keeps it over
    a restart. A run whose turns all take what the model says shows only the fit's residue."""
    def fed(jitter) -> Calibration:
        cal = calibration()
        for i, (prompt, output, batch) in enumerate(varied_turns(400)):
            seconds = measured_on(TRUTH, prompt, output, batch) + jitter(i)
            assert cal.observe_turn(1, prompt, output, seconds, batch) is None
        return cal
    steady = fed(lambda i: 0.0).rollout_efficiency()
    assert steady.request_s == pytest.approx(TRUTH.request_s, rel=0.05)
    assert all(0.8 < f < 1.2 for f in steady.request_quantiles[1:10])  # p10-p90: the fit's residue only
    cal = fed(lambda i: 0.4 * TRUTH.request_s * (i % 5))  # 0, 0.4, ..., 1.6 x request_s beyond, equally often
    r = cal.rollout_efficiency()
    factors = r.request_quantiles
    assert len(factors) == len(GAP_PROBS) and factors[-1] > 2.0 * factors[len(GAP_PROBS) // 2] > 0
    assert statistics.fmean(draw(factors, f"t{i}") for i in range(4000)) == pytest.approx(1.0, abs=0.05)
    other = calibration()
    other.restore(cal.state())
    assert other.rollout_efficiency().request_quantiles == pytest.approx(factors, rel=1e-3)


def waves(cal: Calibration, shared: bool, placed: bool = True, count: int = 120) -> None:
    """Three-turn trajectories released eight at a time onto alternate workers, a wave every second.
    With `shared` a wave's turns move together: its first gaps are one (one scheduler write answers
    them), each turn is sent at one moment, takes the same time beyond the engine and comes back
    together, and the gaps after it are one; else every turn draws its own gap and time beyond
    the engine. `placed`: the records name their worker, reply time and trajectory."""
    rng = random.Random(5)

    def own() -> tuple[float, float, float]:  # (first gap, later gap, time beyond the engine)
        return rng.uniform(0.05, 0.5), rng.uniform(0.001, 0.05), rng.uniform(0.0, 0.1)

    prompt, output, batch = 400, 20, 8
    engine = measured_on(TRUTH, prompt, output, batch)
    for w in range(count):
        wave = [own() for _ in range(3)]
        clock = [1000.0 + w] * 8  # each trajectory's time: released together
        for k in range(3):
            for j in range(8):
                first, gap, beyond = wave[k] if shared else own()
                wait = first if k == 0 else gap
                seconds = engine + beyond
                clock[j] += wait + seconds
                moment = dict(worker=f"w{w % 2}", end_s=clock[j], trajectory=f"t{w}-{j}") if placed else {}
                assert cal.observe_turn(1, prompt, output, seconds, batch, gap_s=wait, turn_number=k + 1,
                                        **moment) is None


def test_turns_that_come_back_together_are_measured_to_deviate_together_and_kept_over_a_restart():
    """With each turn record's worker, reply time and trajectory, the calibration finds how the draws
    of one moment correlate: the gaps and the time beyond the engine of turns that came back
    together on one worker, the first gaps of trajectories released together. Turns that deviate
    on their own measure ~0; turns reported without those fields leave the correlations at 0 (every
    turn its own draws, as before). The measure survives a restart."""
    cal = calibration()
    waves(cal, shared=True)
    r = cal.rollout_efficiency()
    assert r.moment_s == 0.02
    assert r.first_gap_correlation > 0.95 and r.gap_correlation > 0.95 and r.reply_correlation > 0.9
    other = calibration()
    other.restore(cal.state())
    again = other.rollout_efficiency()
    assert (again.first_gap_correlation, again.gap_correlation, again.reply_correlation) == pytest.approx(
        (r.first_gap_correlation, r.gap_correlation, r.reply_correlation))
    alone = calibration()
    waves(alone, shared=False)
    r = alone.rollout_efficiency()
    assert r.first_gap_correlation < 0.3 and r.gap_correlation < 0.3 and r.reply_correlation < 0.3
    unplaced = calibration()
    waves(unplaced, shared=True, placed=False)
    r = unplaced.rollout_efficiency()
    assert (r.moment_s, r.first_gap_correlation, r.gap_correlation, r.reply_correlation) == (0.0, 0.0, 0.0, 0.0)
    assert r.turn_gap_quantiles  # the distributions themselves are measured all the same
    off = calibration(moment_window_s=0.0)
    waves(off, shared=True)
    assert off.rollout_efficiency().gap_correlation == 0.0
    old = cal.state()
    del old["moments"]  # a state saved before moments existed
    before = calibration()
    before.restore(old)
    assert before.rollout_efficiency().gap_correlation == 0.0


def test_the_moments_are_measured_once_per_new_sample_not_per_export(monkeypatch):
    """The planner exports the efficiencies several times a step (its prediction, its snapshot): the
    moments' correlations are measured again only when a turn came in (or the fit moved)."""
    from libra.services.planner import moments

    cal = calibration()
    waves(cal, shared=True, count=40)
    measured = []
    real = moments.moment_correlation
    monkeypatch.setattr(moments, "moment_correlation", lambda *a: measured.append(1) or real(*a))
    first = cal.rollout_efficiency()
    assert cal.rollout_efficiency() == first and len(measured) == 3  # three kinds, once
    waves(cal, shared=True, count=1)
    cal.rollout_efficiency()
    assert len(measured) == 6
