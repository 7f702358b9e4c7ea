"""The replanner's track record (audit.py): every simulated move is measured against its
prediction before the next one, undone when it measurably lost, and its error raises the gain
later moves must promise; gains are counted over the steps the run has left."""

from __future__ import annotations

import math

import pytest

from libra.services.planner.config import ReplanSettings
from libra.services.planner.replan import Replanner, StepObservation
from libra.services.planner.search import SearchConfig
from tests.unit.replan_scripted import EVERY_STEP, GPU, MODEL, POOR, ScriptedRanker

LENGTHS = [(1000, 2000)] * 64


def replanner(ranker, total_steps=None, **settings) -> Replanner:
    r = Replanner(MODEL, GPU, 16, ReplanSettings(**{**EVERY_STEP, "sim_window_steps": 3, **settings}),
                  SearchConfig(total_gpus=16, whole_nodes="off"), POOR, ranker, total_steps=total_steps)
    run(r, 100.0, 6)
    assert not r.consider(0.0).trigger  # the interval counts from here
    return r


def run(r: Replanner, seconds: float, steps: int) -> None:
    """`steps` more steps measured at `seconds` each."""
    first = r.steps_observed
    for step in range(first, first + steps):
        assert r.observe_step(StepObservation(step, seconds, 0.9 * seconds, 50.0, lengths=LENGTHS)) is None


def moved(r: Replanner, now: float = 10.0):
    """Two evaluations in a row (confirm: 2) that call for the 20% faster plan; the second applies it."""
    assert not r.consider(now).applied
    decision = r.consider(now + 10.0)
    assert decision.applied and decision.chosen.layout.gpus != 8, decision.reason
    return decision


def test_a_move_that_measurably_lost_is_undone_and_its_error_raises_the_margin():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})  # replays say: every other split 20% faster
    r = replanner(ranker)
    move = moved(r)
    run(r, 110.0, 2)  # the new plan really takes 110 s a step (its replay said 80)
    waiting = r.consider(100.0)
    assert not waiting.applied and "the move after step 5 is measured first (2 of 4 steps" in waiting.reason
    run(r, 110.0, 2)
    back = r.consider(200.0)
    assert back.applied and back.reason.startswith("reverted: the move after step 5 was predicted +20.0% per step "
                                                   "and measured -10.0%"), back.reason
    assert back.chosen.layout == POOR.layout and r.current.layout == POOR.layout and back.chosen != move.chosen
    assert back.predicted_current_s == pytest.approx(110.0) and back.predicted_new_s == pytest.approx(100.0)
    assert r.audits.margin() == pytest.approx(110.0 / 80.0 - 1.0)  # its replay was 37.5% too optimistic
    assert r.audits.pending is None  # going back to a measured plan is not audited again
    run(r, 100.0, 4)
    again = r.consider(300.0)  # the same 20% on the replays no longer clears 3% + 37.5% (+ its own 30% miss)
    assert not again.applied
    assert "it is predicted +20.0% net against the 70.5% it must clear" in again.reason, again.reason
    assert r.signals()["replay_error_margin"] == pytest.approx(0.375)


def test_a_move_that_paid_as_predicted_is_kept_and_leaves_no_margin():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    r = replanner(ranker)
    moved(r)
    run(r, 80.0, 4)  # measured as replayed
    d = r.consider(200.0)
    assert not d.applied and "audit: the move after step 5 was predicted +20.0% per step and measured +20.0%" \
        in d.reason, d.reason
    assert r.audits.margin() == pytest.approx(0.0) and r.audits.audited == 1 and r.audits.reverted == 0
    state = r.state()
    other = Replanner(MODEL, GPU, 16, r.settings, SearchConfig(total_gpus=16, whole_nodes="off"), r.current, ranker)
    other.restore(state)
    assert other.audits.audited == 1 and list(other.audits.errors) == pytest.approx([0.0])


def test_a_gain_is_counted_over_the_steps_the_run_has_left():
    ranker = ScriptedRanker({8: 100.0}, move_extra=50.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    assert replanner(ranker).horizon() == 50  # the run's length unknown: horizon_steps
    near_end = replanner(ranker, total_steps=9)  # 6 steps done, 3 left
    assert near_end.horizon() == 3
    near_end.consider(10.0)
    d = near_end.consider(20.0)
    assert "gain 60.0s over 3 steps" in d.reason and d.applied, d.reason  # 20 s x 3, not x 50
    last = replanner(ranker, total_steps=7)  # one step left: 20 s cannot pay for a 50 s move
    last.consider(10.0)
    d = last.consider(20.0)
    assert not d.applied and "does not pay for the transition" in d.reason and math.isfinite(d.gain_s), d.reason


def test_a_plan_in_force_that_cannot_run_the_trace_moves_at_once_even_with_an_audit_pending():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    r = replanner(ranker)
    moved_to = moved(r).chosen
    run(r, 80.0, 1)
    assert "measured first" in r.consider(100.0).reason
    plain = r.predict
    r.predict = lambda candidate, trace: ((math.inf,) * 3 if candidate == moved_to else plain(candidate, trace))
    forced = r.consider(200.0)  # e.g. the trace outgrew every engine's KV cache
    assert forced.applied and forced.reason.startswith("the plan in force cannot run the recent trace"), forced.reason
    assert r.audits.pending is None and r.audits.audited == 0  # nothing to measure the earlier move against now


def _passed_over(move) -> str:
    layout = move.layout
    return f"passed over train tp{layout.tp} pp{layout.pp} dp{layout.dp} mb{layout.micro_batch} ({layout.gpus} GPUs"


def _undone(ranker):
    """A replanner that moved to another split (replayed 20% faster), measured it 10% slower
    (a 30% miss) and went back; its mean replay error then cleared, as accurate audits of other
    moves would, and from then on only that plan replays faster, so that only the memory of the
    undone move stands in the way."""
    r = replanner(ranker)
    move = moved(r)
    run(r, 110.0, 4)
    assert r.consider(100.0).reason.startswith("reverted:")
    r.audits.errors.clear()
    undone = (move.chosen.layout, move.chosen.rollout)  # (every other plan replays at 100 s, as the one in force)
    ranker.seconds = lambda plan: ranker.per_step[undone[0].gpus] if (plan.layout, plan.rollout) == undone else 100.0
    run(r, 100.0, 4)
    return r, move.chosen


def test_an_undone_move_is_passed_over_unless_it_promises_more_than_it_missed_by():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    r, undone = _undone(ranker)
    assert r.audits.retry_bar(POOR, undone) == (pytest.approx(0.30), "the same move, made after step 5, was undone: "
                                                                     "it gained 30.0% less than predicted")
    assert r.audits.retry_bar(undone, POOR) == (0.0, "")  # the move back is another move
    again = r.consider(200.0)  # the same +20% clears 3% + 0% margin, not 3% + its 30% miss
    assert not again.applied and r.current.layout == POOR.layout
    assert _passed_over(undone) in again.reason and (
        "the same move, made after step 5, was undone: it gained 30.0% less than predicted, and it is predicted "
        "+20.0% net against the 33.0% it must clear") in again.reason, again.reason
    assert again.reason.startswith("not applied: gain does not pay"), again.reason  # the next best: no gain

    plain = ranker.seconds  # one 8-GPU plan with another rollout fleet replays 10% faster: the next best is taken
    ranker.seconds = lambda plan: 90.0 if plan.layout == POOR.layout and plan.rollout != POOR.rollout \
        else plain(plan)
    assert not r.consider(300.0).applied  # (confirm: 2 evaluations in a row)
    taken = r.consider(400.0)
    assert taken.applied and taken.chosen.layout == POOR.layout and taken.chosen.rollout != POOR.rollout, taken.reason
    assert _passed_over(undone) in taken.reason and taken.predicted_new_s == pytest.approx(90.0)


def test_an_undone_move_promising_more_than_it_missed_by_is_made_again_also_after_a_restart():
    ranker = ScriptedRanker({8: 100.0}, move_extra=0.0)
    ranker.per_step.update({g: 80.0 for g in range(1, 16) if g != 8})
    r, undone = _undone(ranker)
    other = Replanner(MODEL, GPU, 16, r.settings, SearchConfig(total_gpus=16, whole_nodes="off"), r.current, ranker)
    other.restore(r.state())  # a restarted planner remembers the undone move (Redis keeps `state()` as JSON)
    assert other.audits.retry_bar(POOR, undone)[0] == pytest.approx(0.30)
    assert not other.consider(200.0).applied and "passed over" in other.consider(210.0).reason
    ranker.per_step[undone.layout.gpus] = 60.0  # now replayed +40%: more than 3% + its 30% miss
    other.consider(300.0)
    d = other.consider(310.0)
    assert d.applied and d.chosen.layout == undone.layout and "passed over" not in d.reason, d.reason
