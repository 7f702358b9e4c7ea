"""Replanner: each trigger, the gates, acceptance by gain minus transition cost, bad input, state."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from libra.config import build_run_config
from libra.errors import ConfigError
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.preflight import load_trace
from libra.services.planner.replan import Replanner, StepObservation, candidate_from_plan
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.services.planner.transition import transition_cost_s
from libra.v1 import common_pb2

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")
TRACE = load_trace("configs/traces/agentic-longtail.csv")
QUIET = dict(interval_s=0, queue_depth_high=0, active_rollouts_high=0, rejected_fraction_high=0, time_ratio_high=0,
             warmup_steps=0, min_history_samples=64, cooldown_s=0, recheck_s=0, batch_sequences=64)
# a poor plan for 16 GPUs on this long-tailed trace: rollout on eight TP1 instances (one TP8 is better)
POOR = Candidate(Layout(1, 1, 8, 1), ((1, 8),), math.nan, math.nan)


def replanner(current=None, **settings) -> Replanner:
    return Replanner(MODEL, GPU, 16, ReplanSettings(**{**QUIET, **settings}), SearchConfig(total_gpus=16), current)


def obs(step: int, **kw) -> StepObservation:
    base = dict(step=step, time_s=100.0, rollout_s=90.0, train_s=80.0, lengths=tuple(TRACE[step * 64:(step + 1) * 64]))
    return StepObservation(**{**base, **kw})


def feed(r: Replanner, steps: int, **kw) -> None:
    for i in range(steps):
        assert r.observe_step(obs(i, **kw)) is None


@pytest.mark.parametrize("settings, signal, trigger", [
    ({"queue_depth_high": 10}, {"queue_depth": 12}, "queue"),
    ({"active_rollouts_high": 100}, {"active_rollouts": 150}, "active"),
    ({"rejected_fraction_high": 0.2}, {"rejected_rollouts": 32}, "rejected"),  # 32 / (32 + 64)
    ({"time_ratio_high": 1.5}, {"rollout_s": 200.0, "train_s": 50.0}, "ratio"),
    ({"time_ratio_high": 1.5}, {"rollout_s": 20.0, "train_s": 50.0}, "ratio"),  # training-bound too
])
def test_each_pressure_trigger_fires_only_on_its_signal(settings, signal, trigger):
    calm = replanner(**settings)
    feed(calm, 3)
    decision = calm.consider(0.0)
    assert decision.trigger == "" and not decision.record
    hot = replanner(**settings)
    feed(hot, 3, **signal)
    decision = hot.consider(0.0)
    assert decision.trigger == trigger and decision.applied  # no plan in force: the best is adopted
    assert decision.chosen is not None and decision.inputs["steps_observed"] == 3


def test_interval_trigger_counts_from_the_first_consider_and_the_last_evaluation():
    r = replanner(interval_s=100)
    feed(r, 3)
    assert r.consider(0.0).trigger == ""
    assert r.consider(99.0).trigger == ""
    assert r.consider(100.0).trigger == "interval"
    assert r.consider(150.0).trigger == ""
    assert r.consider(200.0).trigger == "interval"


def test_warm_up_and_min_history_gate_and_repeats_are_not_recorded_twice():
    r = replanner(queue_depth_high=1, warmup_steps=3, min_history_samples=192)
    feed(r, 2, queue_depth=5)
    first = r.consider(0.0)
    assert first.trigger == "queue" and not first.applied and "warm-up (2 of 3" in first.reason and first.record
    again = r.consider(1.0)
    assert "warm-up" in again.reason and not again.record  # same trigger, same gate: not stored again
    r.observe_step(obs(2, queue_depth=5))
    r2 = replanner(queue_depth_high=1, warmup_steps=0, min_history_samples=1000)
    feed(r2, 3, queue_depth=5)
    assert "too little history (192 of 1000" in r2.consider(0.0).reason
    assert r.consider(2.0).applied  # 3 steps, 192 lengths: evaluated now


def test_cooldown_after_an_applied_plan_and_recheck_after_a_rejected_one():
    r = replanner(queue_depth_high=1, cooldown_s=100, recheck_s=30)
    feed(r, 3, queue_depth=5)
    assert r.consider(0.0).applied
    gated = r.consider(50.0)
    assert not gated.applied and "cooldown (50s left)" in gated.reason
    after = r.consider(100.0)  # cooldown over: searched; the plan in force is already the best
    assert not after.applied and "already the best" in after.reason
    assert "recheck wait" in r.consider(110.0).reason
    assert "already the best" in r.consider(130.0).reason


def test_a_better_plan_is_applied_when_gain_pays_for_the_transition():
    r = replanner(POOR, queue_depth_high=1, horizon_steps=50)
    feed(r, 3, queue_depth=5, train_s=2.0)  # measured: training is fast, so GPUs should move to rollout
    d = r.consider(0.0)
    assert d.applied and d.reason.startswith("applied:")
    assert d.predicted_new_s < d.predicted_current_s
    assert d.gain_s == pytest.approx((d.predicted_current_s - d.predicted_new_s) * 50)
    assert d.gain_s - d.transition_cost_s > 0 and r.current == d.chosen
    assert len(d.candidates) >= 1 and d.candidates[0] == d.chosen and len(d.trace) == 64


def test_not_applied_when_the_transition_costs_more_than_the_gain():
    r = replanner(POOR, queue_depth_high=1, horizon_steps=1, process_start_s=86_400)
    feed(r, 3, queue_depth=5, train_s=2.0)
    d = r.consider(0.0)
    assert not d.applied and "does not pay for the transition" in d.reason
    assert d.gain_s > 0 and d.gain_s - d.transition_cost_s <= 0 and r.current == POOR


def test_not_applied_below_the_minimum_gain_ratio():
    r = replanner(POOR, queue_depth_high=1, horizon_steps=1000, min_gain_ratio=0.99)
    feed(r, 3, queue_depth=5, train_s=2.0)
    d = r.consider(0.0)
    assert d.gain_s - d.transition_cost_s > 0
    assert not d.applied and "below min_gain_ratio" in d.reason


def test_transition_cost_model():
    s = ReplanSettings(drain_s=10, process_start_s=20, load_gbps=1)
    same = Candidate(Layout(1, 1, 8, 1), ((1, 8),), 1.0, 1.0)
    assert transition_cost_s(None, same, MODEL, s) == 0.0
    assert transition_cost_s(same, same, MODEL, s) == 0.0
    retrain = Candidate(Layout(2, 1, 4, 1), ((1, 8),), 1.0, 1.0)
    state = MODEL.total_params * (MODEL.bytes_per_param + 12.0 / 4) / 2
    assert transition_cost_s(same, retrain, MODEL, s) == pytest.approx(30 + state / 1e9)
    half = Candidate(Layout(1, 1, 8, 1), ((1, 4), (2, 2)), 1.0, 1.0)  # 4 of 8 rollout GPUs change
    assert transition_cost_s(same, half, MODEL, s) == pytest.approx((30 + MODEL.weight_bytes / 2 / 1e9) * 0.5)


def test_bad_observations_are_rejected_counted_and_change_nothing():
    r = replanner()
    for bad, why in [(obs(0, time_s=-1.0), "time_s is negative"), (obs(0, train_s=math.nan), "not a finite"),
                     (obs(0, rollout_s=1e12), "absurd"), (obs(0, lengths=((10, 0),)), "lengths out of range"),
                     (obs(0, rejected_rollouts=-3), "negative")]:
        assert why in r.observe_step(bad)
    assert r.steps_observed == 0 and len(r.lengths) == 0
    assert sum(r.rejected_inputs().values()) == 5


def test_settings_out_of_range_name_the_field():
    with pytest.raises(ValidationError, match="cooldown_s"):
        ReplanSettings(cooldown_s=-1)
    with pytest.raises(ValidationError, match="time_ratio_high"):
        ReplanSettings(time_ratio_high=0.5)
    with pytest.raises(ConfigError, match=r"planner\.replan\.min_gain_ratio"):
        build_run_config({"planner": {"replan": {"min_gain_ratio": 2}}}, env={})
    with pytest.raises(ConfigError, match=r"planner\.cluster\.hardware"):
        build_run_config({"planner": {"mode": "online", "cluster": {"hardware": "tpu-v9"}}}, env={})
    with pytest.raises(ConfigError, match="gpus"):
        Replanner(MODEL, GPU, 1, ReplanSettings(), SearchConfig(total_gpus=2))


def test_state_restores_a_replanner_that_continues_without_recounting():
    r = replanner(POOR, queue_depth_high=1, cooldown_s=100)
    feed(r, 3, queue_depth=5, train_s=2.0)
    assert r.consider(0.0).applied
    resumed = replanner(r.current, queue_depth_high=1, cooldown_s=100)
    resumed.restore(r.state())
    assert resumed.steps_observed == 3 and list(resumed.lengths) == list(r.lengths)
    assert resumed.calibration.snapshot() == r.calibration.snapshot()
    assert "cooldown" in resumed.consider(10.0).reason  # the applied time survived


def test_candidate_from_plan():
    plan = common_pb2.Plan(training=common_pb2.TrainingLayout(gpus=8, tp=2, pp=1, dp=4, micro_batch=2),
                           buckets=[common_pb2.BucketSpec(name="a", tp=1, replicas=4),
                                    common_pb2.BucketSpec(name="b", tp=2, replicas=2)])
    c = candidate_from_plan(plan)
    assert c.layout == Layout(2, 1, 4, 2) and c.rollout == ((1, 4), (2, 2))
    assert candidate_from_plan(common_pb2.Plan(training=common_pb2.TrainingLayout(gpus=0))) is None


def test_consider_uses_the_search_result_on_the_recent_trace():
    r = replanner(queue_depth_high=1)
    feed(r, 3, queue_depth=5)
    d = r.consider(0.0)
    best = search(MODEL, GPU, list(r.lengths)[-64:], SearchConfig(total_gpus=16)).best
    assert d.chosen.layout == best.layout and d.chosen.rollout == best.rollout  # no calibration yet (no plan)


def test_history_feeder_builds_steps_from_records():
    from libra.services.planner.core import HistoryFeeder, calibration_report, decision_proto

    r = replanner()
    turns = [common_pb2.HistoryRecord(kind="turn", bucket="long", prompt_tokens=100, output_tokens=50, seconds=1.0,
                                      queue_depth=q, active_rollouts=a, gap_seconds=g)
             for q, a, g in ((4, 10, 0.1), (8, 30, 0.3))]
    plan = common_pb2.Plan(buckets=[common_pb2.BucketSpec(name="long", tp=2, replicas=1)])
    feeder = HistoryFeeder()
    bare_step = common_pb2.HistoryRecord(kind="step", step=1, seconds=10.0, train_seconds=4.0, rollout_seconds=6.0)
    fed = feeder.feed(r, turns, [bare_step], plan)
    assert (fed.turns, fed.steps, fed.rejected) == (2, 1, [])
    step = r.window[-1]
    assert step.queue_depth == 6 and step.active_rollouts == 20 and list(step.lengths) == [(100, 50)] * 2
    assert r.calibration.fit.samples == 2
    odd = common_pb2.HistoryRecord(kind="step", step=2, seconds=1.0, prompt_lengths=[1, 2], output_lengths=[3])
    fed = feeder.feed(r, [], [odd], plan)
    assert fed.steps == 0 and "differ in length" in fed.rejected[0][1]
    d = r.consider(0.0)  # nothing fired: still converts
    message = decision_proto(d, plan, None, 5.0, 7)
    assert message.decision_id == 7 and message.trigger == "" and message.inputs["steps_observed"] == 1
    report = calibration_report(r.calibration.snapshot(), {"turn": 2, "step": 2}, 5.0)
    assert report.turns_read == 2 and {t.what for t in report.times} == {"turn", "step"}
    fitted = {e.name: e for e in report.efficiencies}
    assert fitted["decode_bw"].samples == 2 and fitted["request_s"].calibrated > 0  # the turn fit's terms
    from libra.services.planner.core import render_explain
    from libra.v1 import planner_pb2

    text = render_explain(planner_pb2.ExplainResponse(mode="online", calibration=report))
    assert "request_s" in text and "turn fit, 2 turns" in text
    assert fitted["turn_gap_s"].calibrated == pytest.approx(0.2, rel=1e-3) and fitted["turn_gap_s"].samples == 2
    assert "turn_gap_s       base 0s -> 0.2s  (mean, 2 turns)" in text, text


def test_explain_prints_the_verdict_once():
    from libra.services.planner.core import render_explain
    from libra.v1 import planner_pb2

    reply = planner_pb2.ExplainResponse(mode="online", decisions=[
        planner_pb2.PlanDecision(decision_id=1, trigger="interval", applied=False,
                                 reason="not applied: gain does not pay for the transition (numbers)"),
        planner_pb2.PlanDecision(decision_id=2, trigger="ratio", applied=True, reason="applied: predicted 2s -> 1s")])
    text = render_explain(reply)
    assert "not applied: gain does not pay for the transition (numbers)" in text
    assert "APPLIED: predicted 2s -> 1s" in text
    assert "not applied: not applied" not in text and "applied: applied" not in text.lower()


def test_a_waiting_move_and_the_run_record_print_the_verdict_once():
    from libra.services.planner.core import render_explain, split_verdict
    from libra.services.planner.telemetry import PlannerProbe
    from libra.v1 import planner_pb2

    waiting = planner_pb2.PlanDecision(decision_id=3, trigger="ratio", applied=False,
                                       reason="not applied yet: 1 of 2 evaluations in a row call for a move (x)")
    text = render_explain(planner_pb2.ExplainResponse(mode="online", decisions=[waiting]))
    assert "trigger=ratio not applied yet: 1 of 2 evaluations" in text and "not applied: not applied" not in text
    assert split_verdict(False, "no trigger fired") == ("not applied", "no trigger fired")

    class Captured:  # the recorder's interface: what the probe writes
        def __init__(self):
            self.texts = []

        def write(self, kind, **fields):
            self.texts.append(fields["text"]["plan/decision"])

    probe = PlannerProbe(Captured(), None)
    probe.decision(waiting)
    probe.decision(planner_pb2.PlanDecision(trigger="interval", applied=False, reason="not applied: too slow (y)"))
    assert probe.recorder.texts[0].startswith("**not applied yet** (ratio): 1 of 2 evaluations")
    assert probe.recorder.texts[1].startswith("**not applied** (interval): too slow (y)")
