"""The replanner's simulated judge (evaluate.by_simulation): the arithmetic on a scripted ranker,
then the real one (sim/rank.py) on the cluster simulator: no replanning on a stationary trace,
a move when the plan in force falls behind."""

from __future__ import annotations

import math

import pytest

from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_train import Layout
from libra.services.planner.replan import Replanner, StepObservation
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.services.planner.sim import control, run as sim_run
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.rank import SimRanker
from libra.traces import synthetic
from tests.unit.replan_scripted import EVERY_STEP, GPU, MODEL, POOR, ScriptedRanker


def observed(ranker, current=POOR, **settings) -> Replanner:
    lengths = [(1000, 2000)] * 64
    r = Replanner(MODEL, GPU, 16, ReplanSettings(**{**EVERY_STEP, **settings}),
                  SearchConfig(total_gpus=16, whole_nodes="off"), current, ranker)  # splits of every size
    for step in range(6):
        assert r.observe_step(StepObservation(step, 100.0, 90.0, 50.0, lengths=lengths)) is None
    assert not r.consider(0.0).trigger  # the interval counts from here
    return r


def test_a_move_is_applied_when_the_simulated_gain_beats_the_simulated_move():
    ranker = ScriptedRanker({8: 100.0}, move_extra=50.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})  # every other split is 20% faster
    r = observed(ranker, horizon_steps=50)
    first = r.consider(10.0)  # two evaluations in a row must call for a move (confirm: 2)
    assert not first.applied and first.reason.startswith("not applied yet: 1 of 2 evaluations"), first.reason
    d = r.consider(20.0)
    assert d.applied and "simulated on the last 4 steps (1 to warm up)" in d.reason, d.reason
    assert d.predicted_current_s == pytest.approx(100.0) and d.predicted_new_s == pytest.approx(80.0)
    assert d.transition_cost_s == pytest.approx(50.0)  # C - B - (A - B) / W: the scripted extra, exactly
    assert d.gain_s == pytest.approx(20.0 * 50)
    assert d.downtime_s > 0 and d.chosen.layout.gpus != 8


def test_no_move_within_the_minimum_gain_or_when_the_move_costs_more():
    ranker = ScriptedRanker({8: 100.0}, move_extra=10.0)
    ranker.per_step.update({g: 99.0 for g in range(1, 16) if g != 8})  # 1% better: pays, but below min_gain_ratio
    d = observed(ranker).consider(10.0)
    assert not d.applied and "below min_gain_ratio" in d.reason and d.gain_s > d.transition_cost_s
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    ranker.move_extra = 5_000.0  # the move loses more than 50 steps x 20 s
    d = observed(ranker).consider(10.0)
    assert not d.applied and "does not pay for the transition" in d.reason


def test_the_replay_calibrates_the_pipeline_and_plays_again_when_it_moved():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0, span_factor=2.0)  # batches took 2x the replay
    r = observed(ranker, shortlist=1, neighbours=0, whole_exchanges=False, other_splits=False, confirm=1)
    r.consider(10.0)
    assert r.calibration.pipeline_slowdown() == pytest.approx(2.0)
    assert ranker.plays == 1 + 1 + 2  # current, current again at the new speed, one candidate fixed and moved
    before = ranker.plays
    r.consider(20.0)
    assert r.calibration.pipeline_slowdown() == pytest.approx(2.0)  # the replay at 2x matches: no second play
    assert ranker.plays - before == 1 + 2


def test_the_plan_in_force_at_other_data_parallel_degrees_is_simulated_too():
    """With `other_splits` the search's best split is not the only other split replayed: the plan in
    force with a replica fewer or more, half or twice as many (its TP kept, the fleet scaled) is
    too, and here only one of those replays faster (the plan in force: 8 training GPUs of 16, 8
    groups, so its even neighbour is 4 replicas; that one 20% faster, every other plan slower)."""
    for other_splits in (False, True):
        ranker = ScriptedRanker({8: 100.0, 4: 80.0}, move_extra=0.0)
        r = observed(ranker, shortlist=1, neighbours=0, whole_exchanges=False, other_splits=other_splits, confirm=1)
        d = r.consider(10.0)
        if other_splits:
            assert d.applied and d.chosen.layout == Layout(1, 1, 4, 1), d.reason
            assert d.predicted_new_s == pytest.approx(80.0) and "2 candidates" in d.reason, d.reason  # the best, dp 4
            assert sum(tp * n for tp, n in d.chosen.rollout) == 12  # the GPUs left, to the fleet
        else:
            assert not d.applied and "1 candidates" in d.reason, d.reason


class SpeedRanker(ScriptedRanker):
    """Its replays run at the calibrated speed (finish times too, not only the spans), so a candidate
    played before a recalibration would show if it were used; with `workers` > 1 the judge plays
    ahead as it does for worker processes."""

    def __init__(self, workers: int):
        super().__init__({g: 100.0 for g in range(1, 16)}, 0.0, span_factor=2.0)  # no split gains: no move
        self.workers = workers

    def play(self, window, plan, rollout, train, move_to=None, transition_s=0.0):
        played = super().play(window, plan, rollout, train, move_to, transition_s)
        slowdown = 0.7 / rollout.decode_bw
        return type(played)(tuple(t * slowdown for t in played.finish_s), played.rollout_spans, played.warm)


def test_played_ahead_the_candidates_are_played_again_after_a_recalibration_and_decide_the_same():
    decisions = []
    for ranker in (SpeedRanker(workers=1), SpeedRanker(workers=2)):
        r = observed(ranker, shortlist=1, neighbours=0, whole_exchanges=False, other_splits=False, confirm=1)
        first = r.consider(10.0)
        counts = [ranker.plays]
        second = r.consider(20.0)
        counts.append(ranker.plays - counts[0])
        decisions.append((first.applied, first.reason, first.predicted_current_s, first.predicted_new_s,
                          second.reason, counts))
    alone, ahead = decisions
    # ahead: the plan in force and the candidate (2), both again at the recalibrated speed (2), the
    # move (1); then, with nothing to recalibrate, 2 + 1 (one after the other: 1 + 1 + 2, then 1 + 2)
    assert alone[-1] == [4, 3] and ahead[-1] == [5, 3]
    assert alone[:-1] == ahead[:-1]  # the same verdicts: the replays before the recalibration were not used


# -- the real ranker on the cluster simulator --------------------------------------------------------
SMALL = SearchConfig(total_gpus=16, group_size=4, exact_multiset_limit=64)


def test_the_replanner_does_not_replan_on_a_stationary_trace():
    """Drift 0, a decision after every step, starting from the best fixed plan the simulator finds
    (with hindsight, among a shortlist wider than the replanner's): every decision keeps it."""
    trace = synthetic.drifting(14, 16, 4, seed=3, drift=0.0)
    shortlist = search(MODEL, GPU, trace.pairs(0), SMALL.model_copy(update={"top_k": 8, "distinct_splits": True,
                                                                           "fleets_per_split": 2}))
    fixed = {c: sim_run.run_plan(MODEL, GPU, trace, c, SMALL) for c in shortlist.alternatives}
    best = max(fixed, key=lambda c: fixed[c].trajectories_per_s)
    settings = ReplanSettings(**{**EVERY_STEP, "batch_sequences": 0, "min_history_samples": 1,
                                 "sim_window_steps": 5, "sim_warmup_steps": 2})
    online = control.Online(MODEL, GPU, SMALL, settings, SimConfig(), first=best)
    result = Simulator(MODEL, GPU, trace, online, SMALL).run()
    judged = [reason for _, _, reason in online.decisions if "simulated on the last" in reason]
    assert len(judged) >= 5, online.decisions  # it did look, every step once warm
    assert not result.plan_changes and not online.changes, online.decisions
    assert result.trajectories_per_s == pytest.approx(fixed[best].trajectories_per_s, rel=1e-9)


def test_the_replanner_moves_off_a_plan_that_falls_behind():
    """Half the GPUs on training and narrow engines for a rollout-bound trace (a fifth behind the
    best fixed plan): the replay shows a better plan, the move is priced in the replay (the trainer
    resharding, engines starting), and the run ends faster than the plan it started from."""
    trace = synthetic.drifting(16, 16, 4, seed=3, drift=0.0)
    poor = Candidate(Layout(1, 1, 8, 1), ((1, 4), (4, 1)), math.nan, math.nan)
    fixed = sim_run.run_plan(MODEL, GPU, trace, poor, SMALL)
    settings = ReplanSettings(**{**EVERY_STEP, "batch_sequences": 0, "min_history_samples": 1,
                                 "sim_window_steps": 5, "sim_warmup_steps": 2, "horizon_steps": 10, "drain_s": 5,
                                 "process_start_s": 10, "neighbours": 0, "whole_exchanges": False,
                                 "other_splits": False})
    # (the search's splits only: a move that reshards the trainer and starts engines, priced by the replay)
    online = control.Online(MODEL, GPU, SMALL, settings, SimConfig(), first=poor)
    result = Simulator(MODEL, GPU, trace, online, SMALL).run()
    assert len(result.plan_changes) == 1 and result.plan_changes[0].transition_s > 0, online.decisions
    applied = [reason for _, taken, reason in online.decisions if taken][0]
    assert "simulated on the last 7 steps (3 to warm up)" in applied and "transition 0.0s" not in applied, applied
    assert result.trajectories_per_s > fixed.trajectories_per_s


def test_the_window_replays_trajectories_or_single_turn_lengths():
    trace = synthetic.drifting(4, 4, 4, seed=1, drift=0.5)
    ranker = SimRanker(MODEL, GPU, SMALL, SimConfig(), window_steps=3, warmup_steps=0, max_units=4)
    obs = [StepObservation(s, 10.0, 9.0, 5.0, lengths=trace.pairs(s), trajectories=trace.steps[s]) for s in range(4)]
    window = ranker.window(obs)
    assert [len(step) for step in window.steps] == [16, 16, 16]
    assert window.steps[0][0].turns == trace.steps[1][0].turns  # the last three steps, with their turns
    bare = ranker.window([StepObservation(s, 10.0, 9.0, 5.0, lengths=trace.pairs(s)) for s in range(4)])
    assert [sum(spec.copies for spec in step) for step in bare.steps] == [16, 16, 16]
    assert all(len(spec.turns) == 1 and spec.copies == 4 for step in bare.steps for spec in step)  # 16 -> 4 cohorts
    assert ranker.window(obs[:2]) is None  # fewer steps than the window
    played = ranker.play(window, poor_plan(), SMALL.rollout, SMALL.train)
    assert played.steps == 3 and len(played.rollout_spans) == 3 and 0 < played.finish_s[0] < played.finish_s[-1]


def poor_plan() -> Candidate:
    return Candidate(Layout(1, 1, 4, 1), ((1, 4),), math.nan, math.nan)
