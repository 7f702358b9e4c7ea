"""Online replanning: when to search again, and whether a better plan is worth moving to.

A deterministic step function over runtime facts (the planner service and the cluster simulator
both drive it; neither Redis, RPCs nor a clock are known here: time comes in as `now_s`):

    observe_step(StepObservation) ─┬─▶ window of recent steps (pressure signals)
    observe_turn(...)              ├─▶ recent (prompt, output) lengths (the trace searched)
                                   └─▶ Calibration (efficiencies from measured times)
    consider(now_s) ─▶ trigger? ─▶ gates (warm-up, min history, cooldown, recheck)
                             └─▶ search(calibrated) ─▶ gain - transition cost > 0 and ratio ok? ─▶ apply

Triggers (triggers.py, checked in order; the first that fires names the decision): interval,
queue, active, rejected, ratio.

Gates, in order: warm-up (`warmup_steps` steps observed), minimum history (`min_history_samples`
lengths), cooldown (`cooldown_s` since the last applied plan), recheck (`recheck_s` since the
last evaluation that searched) and, with a simulated judge, the last move's audit (audit.py: no
evaluation until the replay's measured steps all ran on the plan it moved to; then the move is
measured against its prediction, undone if it lost, and its error raises the gain later moves need;
the same move again must promise more than it missed by). A gated decision is returned with its reason; `record` is False
when it repeats the previous gated decision (same trigger, same gate), so a persistent signal does
not flood the decision log.

What a move is worth is judged in evaluate.py: by default by playing the recent window of the
trace through the cluster simulator (a `Ranker`, injected: `sim/rank.py`) for the plan in force,
for the search's shortlist and for the move itself (`rank: simulate`), or by the closed-form cost
model of one synchronous step (`rank: closed_form`, or no ranker). Either way a plan is applied
only when the gain over `horizon_steps`, less the cost of moving, is positive and at least
`min_gain_ratio` of the time the plan in force would take (transition.py).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

from libra.errors import ConfigError
from libra.services.planner.audit import Audits, Move
from libra.services.planner.calibration import Calibration, predicted_times
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.evaluate import Ranker, Verdict, by_closed_form, by_simulation
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.observation import StepObservation, candidate_from_plan, check_step
from libra.services.planner.search import Candidate, SearchConfig, SearchResult, search
from libra.services.planner.shortlist import shortlist
from libra.services.planner.transition import same_plan, transition_cost_s
from libra.services.planner.triggers import TRIGGERS, fired, pressure

__all__ = ["ReplanDecision", "Replanner", "StepObservation", "candidate_from_plan", "TRIGGERS"]


@dataclass
class ReplanDecision:
    applied: bool
    reason: str
    trigger: str  # "" when nothing fired
    current: Candidate | None = None
    chosen: Candidate | None = None
    candidates: list[Candidate] = field(default_factory=list)
    predicted_current_s: float = math.nan
    predicted_new_s: float = math.nan
    transition_cost_s: float = 0.0  # what the move costs the run (simulated, or closed-form)
    downtime_s: float = 0.0  # how long the sides that change are down (transition.transition_cost_s)
    gain_s: float = 0.0
    inputs: dict = field(default_factory=dict)
    record: bool = True  # False: a repeat of the previous gated decision (not worth storing again)
    trace: list[tuple[int, int]] = field(default_factory=list)  # the lengths searched
    simulated: dict = field(default_factory=dict)  # (layout, fleet) -> (seconds per step, move cost) replayed


class Replanner:
    """Decides when to replan and whether to apply; holds the plan it believes is in force."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, gpus: int, settings: ReplanSettings,
                 search_config: SearchConfig, current: Candidate | None = None, ranker: Ranker | None = None,
                 total_steps: int | None = None):
        if gpus < 2:
            raise ConfigError(f"gpus must be >= 2 (one to train, one to roll out), got {gpus}")
        self.model, self.gpu, self.settings = model, gpu, settings
        self.search_config = search_config.model_copy(update={"total_gpus": gpus})
        self.calibration = Calibration(model, gpu, search_config.rollout, search_config.train,
                                       settings.calibration)
        self._current = current
        self.ranker = ranker if settings.rank == "simulate" else None
        self._applied_at_step = 0  # steps_observed when the plan in force was applied
        self._calls = 0  # simulated evaluations in a row that called for a move
        self.total_steps = total_steps  # the run's length, when known: a gain is counted over what is left
        self.audits = Audits()  # every simulated move measured before the next (audit.py)
        self._q = math.nan  # the plan in force: measured / replayed seconds per step, last seen
        self.window: deque[StepObservation] = deque(maxlen=settings.window_steps)
        self.lengths: deque[tuple[int, int]] = deque(maxlen=settings.trace_window)
        self.steps_observed = 0
        self.rejected: Counter = Counter()
        self._origin_s: float | None = None
        self._last_evaluated_s: float | None = None
        self._last_searched_s: float | None = None
        self._last_applied_s: float | None = None
        self._last_gate: tuple[str, str] | None = None

    @property
    def current(self) -> Candidate | None:
        return self._current

    # -- inputs ----------------------------------------------------------------------------
    def observe_step(self, obs: StepObservation) -> str | None:
        """Take one step's facts; returns why they were rejected (nothing changes then), or None."""
        reason = check_step(obs)
        if reason:
            self.rejected["step: " + reason.split(" (")[0]] += 1
            return reason
        if self._current is not None and obs.lengths:
            predicted = self.predict(self._current, list(obs.lengths))
            self.calibration.record_step(predicted[2], obs.time_s)
            self.calibration.observe_train(self._current.layout, list(obs.lengths), obs.train_s, obs.overhead_s)
        self.window.append(obs)
        self.lengths.extend((int(p), int(o)) for p, o in obs.lengths)
        self.steps_observed += 1
        return None

    def observe_lengths(self, lengths: Sequence[tuple[int, int]]) -> str | None:
        """Finished rollouts reported apart from steps (the service reads them from turn history)."""
        for index, (p, o) in enumerate(lengths):
            if not (0 <= p <= 10_000_000 and 1 <= o <= 10_000_000):
                self.rejected["lengths: out of range"] += 1
                return f"lengths[{index}] = ({p}, {o}) out of range (prompt 0..1e7, output 1..1e7)"
        self.lengths.extend((int(p), int(o)) for p, o in lengths)
        return None

    def observe_turn(self, tp: int, prompt: int, output: int, seconds: float, batch: float = 1,
                     gap_s: float = 0.0, turn_number: int = 0, **moment) -> str | None:
        """One measured turn on a TP-`tp` instance (calibrates the turn model and the gap between turns;
        `moment`: Calibration.observe_turn's worker, end_s and trajectory)."""
        return self.calibration.observe_turn(tp, prompt, output, seconds, batch, gap_s,  # counts its rejections
                                             turn_number, **moment)

    def adopt(self, candidate: Candidate | None) -> None:
        """The plan in force changed outside `consider` (e.g. a resumed planner)."""
        self._current = candidate

    def state(self) -> dict:
        """What a restarted planner needs to continue (JSON-safe): window, lengths, clocks, EWMAs."""
        return {"window": [[o.step, o.time_s, o.rollout_s, o.train_s, o.queue_depth, o.active_rollouts,
                            o.rejected_rollouts, o.sequences or len(o.lengths)] for o in self.window],
                "lengths": [list(pair) for pair in self.lengths], "steps_observed": self.steps_observed,
                "rejected": dict(self.rejected), "origin_s": self._origin_s,
                "last_evaluated_s": self._last_evaluated_s, "last_searched_s": self._last_searched_s,
                "last_applied_s": self._last_applied_s, "applied_at_step": self._applied_at_step,
                "calibration": self.calibration.state(), "audits": self.audits.state()}

    def restore(self, state: dict) -> None:
        """Continue from `state()` of an earlier instance. Nothing is observed again: restored window
        steps keep their counts but not their lengths (those live on in `lengths`)."""
        for row in state.get("window", []):
            step, time_s, rollout_s, train_s, queue, active, rejected, sequences = row
            self.window.append(StepObservation(int(step), time_s, rollout_s, train_s, queue, active,
                                               int(rejected), (), int(sequences)))
        self.lengths.extend((int(p), int(o)) for p, o in state.get("lengths", []))
        self.steps_observed = int(state.get("steps_observed", 0))
        self.rejected.update(state.get("rejected", {}))
        self._origin_s = state.get("origin_s")
        self._last_evaluated_s = state.get("last_evaluated_s")
        self._last_searched_s = state.get("last_searched_s")
        self._last_applied_s = state.get("last_applied_s")
        self._applied_at_step = int(state.get("applied_at_step", 0))
        self.calibration.restore(state.get("calibration", {}))
        self.audits.restore(state.get("audits", {}))

    # -- the decision ----------------------------------------------------------------------
    def consider(self, now_s: float) -> ReplanDecision:
        """One decision at time `now_s`: trigger, gates, then search and acceptance (see the module
        docstring). Applying is the caller's job; the returned decision says whether to."""
        if self._origin_s is None:
            self._origin_s = now_s
        inputs = self.signals()
        trigger = self._trigger(now_s, inputs)
        if not trigger:
            return ReplanDecision(False, "no trigger fired", "", self._current, inputs=inputs, record=False)
        self._last_evaluated_s = now_s
        gate = self._gate(now_s)
        if gate:
            repeat = self._last_gate == (trigger, gate.split(" (")[0])
            self._last_gate = (trigger, gate.split(" (")[0])
            return ReplanDecision(False, f"not evaluated: {gate}", trigger, self._current, inputs=inputs,
                                  record=not repeat)
        self._last_gate = None
        self._last_searched_s = now_s
        audited = self._audit(trigger, inputs)
        if audited is not None and audited.applied:  # the last move measurably lost: back to the plan before it
            decision = audited
        else:
            decision = self._evaluate(trigger, inputs)
            if audited is not None:
                decision.reason = f"{decision.reason}; audit: {audited.reason}"
            forced = decision.applied and not math.isfinite(decision.gain_s)  # the plan in force could not run
            if forced:
                self.audits.pending = None  # nothing to measure a move against
            elif decision.applied and self.ranker is not None and math.isfinite(self._q) and self._current is not None \
                    and math.isfinite(decision.predicted_current_s) and decision.predicted_current_s > 0:
                predicted = 1.0 - decision.predicted_new_s / decision.predicted_current_s
                self.audits.pending = Move(self.steps_observed, self._current, predicted, self._q,
                                           self.window[-1].step)
        if decision.applied:
            self._current = decision.chosen
            self._last_applied_s = now_s
            self._applied_at_step = self.steps_observed
        return decision

    def rejected_inputs(self) -> dict[str, int]:
        """Every ignored input by reason (steps and lengths here, turns and costing in calibration)."""
        return dict(self.rejected + self.calibration.rejected)

    def signals(self) -> dict:
        """The window's pressure signals and the calibration in force (a decision's inputs)."""
        return {
            "steps_observed": self.steps_observed, "window_steps": len(self.window),
            "lengths_kept": len(self.lengths),
            **pressure(list(self.window), self.settings.pressure_steps),
            "replay_error_margin": self.audits.margin(),
            "calibration": self.calibration.snapshot(),
            "rejected_inputs": self.rejected_inputs(),
        }

    def predict(self, candidate: Candidate, trace: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
        """(train, rollout, step) seconds of `candidate` on `trace` under the calibrated model."""
        train_s, rollout_s = predicted_times(self.model, self.gpu, candidate.layout, candidate.rollout, trace,
                                             self.calibration.rollout_efficiency(),
                                             self.calibration.train_efficiency())
        return train_s, rollout_s, max(train_s, rollout_s)

    def _trigger(self, now_s: float, x: dict) -> str:
        since = self._last_evaluated_s if self._last_evaluated_s is not None else self._origin_s
        return fired(self.settings, x, now_s - since, bool(self.window))

    def _gate(self, now_s: float) -> str:
        s = self.settings
        if self.steps_observed < s.warmup_steps:
            return f"warm-up ({self.steps_observed} of {s.warmup_steps} steps observed)"
        if len(self.lengths) < max(s.min_history_samples, self.search_config.group_size):
            return f"too little history ({len(self.lengths)} of {s.min_history_samples} rollouts)"
        if self._last_applied_s is not None and now_s - self._last_applied_s < s.cooldown_s:
            return f"cooldown ({s.cooldown_s - (now_s - self._last_applied_s):.0f}s left)"
        if self._last_searched_s is not None and now_s - self._last_searched_s < s.recheck_s:
            return f"recheck wait ({s.recheck_s - (now_s - self._last_searched_s):.0f}s left)"
        wait = self.audits.wait(self.steps_observed, s.sim_window_steps) if self.ranker is not None else ""
        if wait and self._runs_recent_trace():  # (a plan in force that cannot run the trace moves at once)
            return wait
        return ""

    def trace(self) -> list[tuple[int, int]]:
        """The recent lengths the search plans for: one batch, the most recent ones."""
        group = self.search_config.group_size
        size = self.settings.batch_sequences or len(self.lengths) // group * group
        return list(self.lengths)[-size:] if 0 < size <= len(self.lengths) else []

    def _evaluate(self, trigger: str, inputs: dict) -> ReplanDecision:
        trace = self.trace()
        base = ReplanDecision(False, "", trigger, self._current, inputs=inputs, trace=trace)
        if not trace:
            base.reason = (f"not evaluated: the trace window holds {len(self.lengths)} rollouts, fewer than one "
                           f"batch of {self.settings.batch_sequences or self.search_config.group_size}")
            return base
        config = self.search_config.model_copy(update={
            "rollout": self.calibration.rollout_efficiency(), "train": self.calibration.train_efficiency(),
            **({"distinct_splits": True, "fleets_per_split": 2, "top_k": self.settings.shortlist + 1}
               if self.ranker else {})})
        try:
            result = search(self.model, self.gpu, trace, config)
        except Infeasible as error:
            base.reason = f"not applied: no feasible plan for the recent trace ({error})"
            return base
        best = result.best
        base.chosen, base.candidates, base.predicted_new_s = best, list(result.alternatives), best.step_s
        if self._current is None:
            base.applied, base.reason = True, f"no plan in force: adopting the best ({best.describe()})"
            return base
        current = self.predict(self._current, trace)
        base.current = Candidate(self._current.layout, self._current.rollout, current[0], current[1])
        base.predicted_current_s = current[2]
        if not math.isfinite(current[2]):
            base.applied, base.gain_s = True, math.inf
            base.transition_cost_s = base.downtime_s = transition_cost_s(self._current, best, self.model,
                                                                         self.settings)
            base.reason = f"the plan in force cannot run the recent trace; moving to {best.describe()}"
            return base
        if self.ranker is not None:
            return self._judged(base, self._confirmed(self._simulated(result, trace, config)))
        if same_plan(self._current, best):
            base.reason = f"not applied: the plan in force is already the best ({best.step_s:.2f}s per step)"
            return base
        cost = transition_cost_s(self._current, best, self.model, self.settings)
        return self._judged(base, by_closed_form(current[2], best, cost, self.settings, self.horizon()))

    def _runs_recent_trace(self) -> bool:
        """Whether the plan in force can run the recent trace at all (the closed form's check)."""
        trace = self.trace()
        return self._current is None or not trace or math.isfinite(self.predict(self._current, trace)[2])

    def horizon(self) -> int:
        """The steps a gain is counted over: `horizon_steps`, or fewer when the run ends sooner."""
        if self.total_steps is None or not self.window:
            return self.settings.horizon_steps
        left = self.total_steps - (self.window[-1].step + 1)
        return max(1, min(self.settings.horizon_steps, left))

    def _audit(self, trigger: str, inputs: dict) -> ReplanDecision | None:
        """The pending move's audit, once due (the gate waited for it): a decision to go back when
        the move measurably lost (applied), else one whose reason tells how it went (not applied)."""
        move = self.audits.pending
        if self.ranker is None or move is None or self._current is None \
                or self.audits.wait(self.steps_observed, self.settings.sim_window_steps):
            return None  # nothing pending, or not due (a forced move passed the gate)
        observations = list(self.window)
        outcome = self.audits.judge(self.ranker, observations, self._current, self.calibration,
                                    self.settings.min_gain_ratio, self.horizon(),
                                    lambda old, new: transition_cost_s(old, new, self.model, self.settings))
        if outcome is None:
            return None
        decision = ReplanDecision(outcome.revert, outcome.reason, trigger, self._current, inputs=inputs)
        if outcome.revert:
            downtime = transition_cost_s(self._current, move.old, self.model, self.settings)
            decision.chosen, decision.trace = move.old, self.trace()
            decision.predicted_current_s, decision.predicted_new_s = outcome.measured_s, outcome.old_s
            decision.transition_cost_s = decision.downtime_s = downtime
            decision.gain_s = (outcome.measured_s - outcome.old_s) * self.horizon()
            self._q = move.q_old
        return decision

    def _simulated(self, result: SearchResult, trace, config: SearchConfig) -> Verdict:
        candidates = shortlist(result, self.model, self.gpu, trace, config, self._current, self.settings.shortlist,
                               self.settings.neighbours, self.settings.whole_exchanges, self.settings.other_splits)
        observations = list(self.window)
        first = self.steps_observed - len(observations) + 1  # the step number of observations[0]
        calibrate_from = max(0, self._applied_at_step + 3 - first)  # steps wholly run on the plan in force
        verdict = by_simulation(self.ranker, observations, self._current, candidates, self.calibration,
                                self.settings, calibrate_from,
                                lambda old, new: transition_cost_s(old, new, self.model, self.settings),
                                self.horizon(), self.audits.margin(), self.audits.retry_bar)
        if math.isfinite(verdict.q) and verdict.q > 0:
            self._q = verdict.q
        return verdict

    def _confirmed(self, verdict: Verdict) -> Verdict:
        """A simulated move waits until `confirm` evaluations in a row have called for one (it goes
        to the latest one's choice): a single replay of a short window can be an outlier."""
        if not verdict.applied or verdict.chosen is None:
            self._calls = 0
            return verdict
        self._calls += 1
        if self._calls < self.settings.confirm and math.isfinite(verdict.current_s):
            verdict.applied = False
            verdict.reason = (f"not applied yet: {self._calls} of {self.settings.confirm} evaluations in a row "
                              f"call for a move ({verdict.reason.removeprefix('applied: ')})")
        else:
            self._calls = 0
        return verdict

    def _judged(self, base: ReplanDecision, verdict: Verdict) -> ReplanDecision:
        base.applied, base.reason, base.gain_s = verdict.applied, verdict.reason, verdict.gain_s
        base.transition_cost_s = verdict.cost_s
        base.simulated = {(c.layout, c.rollout): (per_step, cost) for c, per_step, cost in verdict.ranked or []}
        if verdict.chosen is not None:
            base.chosen, base.predicted_new_s = verdict.chosen, verdict.new_s
            base.downtime_s = transition_cost_s(self._current, verdict.chosen, self.model, self.settings)
        if math.isfinite(verdict.current_s):
            base.predicted_current_s = verdict.current_s
        return base
