"""How the replanner judges a move from the plan in force to one of its candidates (the search's
best distinct splits, the plans one engine exchange away from the plan in force, and its whole
exchanges: `shortlist.py`).

Two judges, one rule (transition.accept: the gain over `horizon_steps` less the cost of moving
must be positive and at least `min_gain_ratio` of the time the plan in force would take):

  by_simulation   (the default) plays the recent window of the trace through the cluster
                  simulator, the asynchronous pipeline as it runs: staleness, the routing policy,
                  tool latencies, weight syncs. For the plan in force (A), for each candidate held
                  fixed (B), and, for the `MOVES_PLAYED` fastest of those, for the move itself (C:
                  the plan in force for the window's first step, then the candidate after its
                  transition: engines drained and started,
                  turns moved, the trainer resharded). A replay starts cold: an empty pipeline and
                  a routing policy that has learned nothing (C-MLFQ's prefix forest), and a short
                  cold replay misranks plans whose worth is in the long tail. So the first
                  `warmup` steps of the window only warm it up; rates run from the end of step
                  `warmup` (where C moves) to the last step's end, n intervals, a whole number of
                  pipeline periods (staleness + 1 steps: with staleness 1 the steps come in pairs,
                  a long one and a short one; the ranker sizes the window so):

                      per step    a = (A_end - A_warm) / n, b likewise from B
                      move cost   (C_end - C_warm) - b n                  (>= 0: what the move
                                                                            loses against b)
                      net gain    (a - b) x horizon - move cost

                  Before ranking, the simulator is calibrated on the same replay: the window's
                  measured batch rollout spans after the warm-up against A's
                  (`Calibration.observe_pipeline`); A is
                  played again when that moved the slowdown by more than `REPLAY_TOLERANCE`.
  by_closed_form  max(T_train, T_rollout) of one synchronous step from the cost model (what the
                  search ranks by) and the closed-form transition cost; for tests and for runs
                  without a simulator.

The simulator is behind `Ranker`, so this module (and the replanner) import no simulation code:
`sim/rank.py` is the implementation, built by whoever drives the replanner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from libra.services.planner.calibration import Calibration
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import TrainEfficiency
from libra.services.planner.search import Candidate
from libra.services.planner.transition import accept

REPLAY_TOLERANCE = 0.02
MOVES_PLAYED = 2  # candidates (fastest held fixed) whose move is replayed too


@dataclass(frozen=True)
class Played:
    """One replay of the window: when each step finished, and each batch's rollout span."""

    finish_s: tuple[float, ...]
    rollout_spans: tuple[float, ...]
    warm: int = 0  # the step whose end the rates start from (the move, if any, came after it)

    @property
    def steps(self) -> int:
        return len(self.finish_s)

    @property
    def intervals(self) -> int:
        return self.steps - 1 - self.warm

    @property
    def elapsed_s(self) -> float:
        """The warm step's end to the last's: the pipeline once running."""
        return self.finish_s[-1] - self.finish_s[self.warm]

    @property
    def per_step_s(self) -> float:
        return self.elapsed_s / self.intervals


@dataclass(frozen=True)
class Replay:
    """One replay of a window: under `plan`, or under `plan` until the warm-up's end and `move_to`
    after it, ready `transition_s` later; at these efficiencies."""

    plan: Candidate
    rollout: RolloutEfficiency
    train: TrainEfficiency
    move_to: Candidate | None = None
    transition_s: float = 0.0


class Ranker(Protocol):
    """Plays a window of recent steps under a plan (and optionally a move to another)."""

    workers: int  # replays played side by side (> 1: the judge plays ahead what it may need)

    def window(self, observations: Sequence) -> object | None:
        """The replayable window of these `StepObservation`s (None: too little to replay)."""

    def play(self, window: object, plan: Candidate, rollout: RolloutEfficiency, train: TrainEfficiency,
             move_to: Candidate | None = None, transition_s: float = 0.0) -> Played: ...

    def play_all(self, window: object, replays: Sequence[Replay]) -> list[Played]:
        """Each replay's `Played`, in order (the same as `play` on each)."""


@dataclass
class Verdict:
    """What a judge decided about the shortlist: the candidate (if any) and the numbers why."""

    applied: bool
    reason: str
    chosen: Candidate | None = None
    current_s: float = math.nan  # per step, plan in force
    new_s: float = math.nan  # per step, chosen candidate
    cost_s: float = 0.0
    gain_s: float = 0.0
    ranked: list[tuple[Candidate, float, float]] | None = None  # (candidate, per-step seconds, move cost)
    q: float = math.nan  # the plan in force: measured / replayed seconds per step (before the recalibration)


def measured_per_step(observations: Sequence, intervals: int) -> float:
    """The run's mean seconds per step over its last `intervals` steps (a replay's measured part)."""
    recent = [o.time_s for o in list(observations)[-intervals:]] if intervals > 0 else []
    return sum(recent) / len(recent) if recent else 0.0


def by_simulation(ranker: Ranker, observations: Sequence, current: Candidate, shortlist: Sequence[Candidate],
                  calibration: Calibration, settings: ReplanSettings, calibrate_from: int,
                  transition: Callable[[Candidate, Candidate], float], horizon: int | None = None,
                  margin: float = 0.0,
                  retry_bar: Callable[[Candidate, Candidate], tuple[float, str]] | None = None) -> Verdict:
    """Rank `shortlist` against `current` on the replayed window (module docstring).

    `calibrate_from`: index into `observations` of the first step measured wholly under `current`
    (steps before it ran through a plan change and would skew the pipeline calibration).
    `horizon`: the steps a gain is counted over (default `horizon_steps`); `margin`: added to
    `min_gain_ratio` (the replays' measured error, audit.py); `retry_bar(current, candidate)`: the
    extra gain ratio a move undone before must promise, and why (audit.py); a best candidate that
    does not clear it is passed over for the next best."""
    window = ranker.window(observations)
    if window is None:
        return Verdict(False, "not evaluated: too few recent steps to replay")
    rollout, train = calibration.rollout_efficiency(), calibration.train_efficiency()
    # in parallel, the candidates are played beside the plan in force at the speeds before this
    # window's recalibration, and again only if it moved them (the same results, fewer rounds)
    ahead = ranker.workers > 1
    played = ranker.play_all(window, [Replay(plan, rollout, train) for plan in [current, *(shortlist if ahead else [])]])
    base = played[0]
    steps = base.steps
    measured_s = measured_per_step(observations, base.intervals)
    q = measured_s / base.per_step_s if measured_s > 0 and 0 < base.per_step_s < math.inf else math.nan
    measured = [o.rollout_s for o in observations[-steps:]]
    pairs = [(m, s) for index, (m, s) in enumerate(zip(measured, base.rollout_spans))  # warm replayed steps, run
             if index > max(base.warm, calibrate_from - (len(observations) - steps) - 1) and m > 0]  # under `current`
    if pairs:
        before = calibration.pipeline_slowdown()
        calibration.observe_pipeline(sum(m for m, _ in pairs), sum(s for _, s in pairs), before)
        if abs(calibration.pipeline_slowdown() / before - 1.0) > REPLAY_TOLERANCE:
            rollout = calibration.rollout_efficiency()
            played = ranker.play_all(window, [Replay(plan, rollout, train) for plan in [current, *shortlist]])
    if len(played) < 1 + len(shortlist):  # (not played ahead, and no recalibration played them)
        played += ranker.play_all(window, [Replay(plan, rollout, train) for plan in shortlist])
    a = played[0].per_step_s
    fixed = sorted(((replay.per_step_s, index, candidate)
                    for index, (replay, candidate) in enumerate(zip(played[1:], shortlist))), key=lambda row: row[:2])
    moving = [candidate for b, _, candidate in fixed[:MOVES_PLAYED] if math.isfinite(b)]  # the fastest few: their
    moves = ranker.play_all(window, [Replay(current, rollout, train, candidate, transition(current, candidate))
                                     for candidate in moving])  # move itself is played too
    ranked = []
    for order, (b, _, candidate) in enumerate(fixed):
        cost = math.inf
        if order < len(moves):
            cost = max(0.0, moves[order].elapsed_s - b * moves[order].intervals)
        ranked.append((candidate, b, cost))
    if not ranked:
        return Verdict(False, "not applied: the search found no other plan to simulate", current_s=a, q=q)
    horizon = horizon or settings.horizon_steps

    def net(row: tuple[Candidate, float, float]) -> float:
        return (a - row[1]) * horizon - row[2] if math.isfinite(row[1]) else -math.inf

    best = max(ranked, key=net)
    if not math.isfinite(best[1]):
        return Verdict(False, "not applied: no candidate can run the recent steps", current_s=a, q=q)
    if not math.isfinite(a):
        return Verdict(True, f"the plan in force cannot run the recent steps; moving to {best[0].describe()}",
                       best[0], a, best[1], best[2], math.inf, ranked, q)
    passed, rest = [], list(ranked)  # moves undone before that do not promise enough to be tried again
    while retry_bar is not None and best is not None:
        extra, why = retry_bar(current, best[0])
        if extra <= 0 or accept(a, best[1], best[2], settings, horizon, margin + extra)[0]:
            break
        predicted = net(best) / (a * horizon) if a > 0 else 0.0
        passed.append(f"passed over {best[0].describe()}: {why}, and it is predicted {predicted:+.1%} net "
                      f"against the {settings.min_gain_ratio + margin + extra:.1%} it must clear")
        rest = [row for row in rest if row is not best]
        best = max(rest, key=net) if rest else None
    note = f"; {'; '.join(passed)}" if passed else ""
    where = (f"; simulated on the last {steps} steps ({base.warm + 1} to warm up), {len(ranked)} "
             f"candidates (pipeline slowdown {calibration.pipeline_slowdown():.3f})")
    if best is None or not math.isfinite(best[1]):
        return Verdict(False, f"not applied: no other candidate{note}{where}", current_s=a, ranked=ranked, q=q)
    applied, gain, reason = accept(a, best[1], best[2], settings, horizon, margin)
    return Verdict(applied, f"{reason}{note}{where}", best[0], a, best[1], best[2], gain, ranked, q)


def by_closed_form(current_s: float, best: Candidate, cost_s: float, settings: ReplanSettings,
                   horizon: int | None = None) -> Verdict:
    """The synchronous one-step prediction (module docstring)."""
    applied, gain, reason = accept(current_s, best.step_s, cost_s, settings, horizon)
    return Verdict(applied, reason, best, current_s, best.step_s, cost_s, gain)
