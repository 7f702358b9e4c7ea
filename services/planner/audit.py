"""Every applied move is measured against its prediction before the next one (the replanner's
track record), and undone when it measurably lost.

Why: a replay of a short window misjudges plans by several percent each way (a long tail lands
on other engines, the pipeline's backlog is not the run's), and differently for each plan; on a
512-GPU drifting trace the moves it predicted 3-11% faster each lost. The replay of the plan in
force can be checked against the run (its measured steps); a candidate's cannot, until it runs.

    q  = measured seconds per step / replayed seconds per step, of the plan in force on the same
         window, before the replay's pipeline calibration (`evaluate.by_simulation` reports it)

    a move from O to N, applied after step s, predicted gain ratio p = (a_O - b_N) / a_O:
      record q_O (the last q while O was in force); no other evaluation until the replay's
      measured steps all ran on N (the gate: and the pipeline calibration stays O's meanwhile),
      then, on that window:
        q_N     = its q                            error e = q_N / q_O - 1 (N's replay was e too
                                                    optimistic, relative to O's)
        O now   = replay of O x q_O                (what O would have measured on these steps)
        revert  when O now beats N's measured seconds per step by min_gain_ratio and the
                difference over the horizon pays for moving back (the closed-form downtime)

    margin = the mean of the last `AUDITS_KEPT` errors (>= 0): any later move must be predicted
             to gain min_gain_ratio + margin (a revert not: its plan's q was measured)

    an undone move is remembered (the last `UNDONE_KEPT`): the same move again, from the same plan
    to the same plan, must be predicted to gain min_gain_ratio + margin + its miss (what it was
    predicted to gain less what it measured), else the judge passes it over for the next best.
    Why: the margin is a mean over every audited move and a single accurate audit lowers it, while
    a window's replays misjudge one particular move again and again (at 4,096 GPUs one move was
    predicted +4.7% and measured -13.7%, undone, and made again 3 steps later at +3.7%).

A restarted planner keeps the errors and the undone moves (`state`), not a pending audit.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from libra.services.planner.calibration import Calibration
from libra.services.planner.evaluate import Ranker, measured_per_step
from libra.services.planner.search import Candidate
from libra.services.planner.transition import PlanKey, plan_key

AUDITS_KEPT = 3
UNDONE_KEPT = 8


@dataclass(frozen=True)
class Move:
    """An applied move waiting for its audit."""

    after_step: int  # steps observed when it was applied
    old: Candidate
    predicted_ratio: float  # (a_old - b_new) / a_old, as the judge predicted it
    q_old: float  # the old plan's measured / replayed seconds per step, last seen
    step: int  # the number of the last step before it (what messages name)


@dataclass(frozen=True)
class Undone:
    """A move that measurably lost and was undone."""

    old: PlanKey  # the plan it left (and went back to)
    new: PlanKey  # the plan it moved to
    miss: float  # predicted gain ratio - measured gain ratio (> 0)
    step: int  # the number of the last step before the move


@dataclass
class Outcome:
    """An audit's result: the error and, when the move lost, the plan to go back to."""

    error: float
    measured_s: float  # the new plan's measured seconds per step
    old_s: float  # the old plan's on the same steps (its replay x its q)
    revert: bool
    reason: str


class Audits:
    """The pending audit, the recorded errors and the margin they imply."""

    def __init__(self) -> None:
        self.pending: Move | None = None
        self.errors: deque[float] = deque(maxlen=AUDITS_KEPT)
        self.audited = 0
        self.reverted = 0
        self.undone: deque[Undone] = deque(maxlen=UNDONE_KEPT)

    def margin(self) -> float:
        return max(0.0, sum(self.errors) / len(self.errors)) if self.errors else 0.0

    def retry_bar(self, current: Candidate, candidate: Candidate) -> tuple[float, str]:
        """The gain ratio a move from `current` to `candidate` must promise on top of min_gain_ratio
        + margin, and why (0 and "" unless the same move was undone before; its largest miss)."""
        old, new = plan_key(current), plan_key(candidate)
        misses = [u for u in self.undone if u.old == old and u.new == new]
        if not misses:
            return 0.0, ""
        worst = max(misses, key=lambda u: u.miss)
        return worst.miss, (f"the same move, made after step {worst.step}, was undone: it gained {worst.miss:.1%} less "
                            f"than predicted")

    def wait(self, steps_observed: int, measured_steps: int) -> str:
        """Why an evaluation must wait for the pending audit ("" when it need not)."""
        if self.pending is None:
            return ""
        ran = steps_observed - self.pending.after_step
        if ran > measured_steps:  # the transition's step, then every measured step on the new plan
            return ""
        return (f"the move after step {self.pending.step} is measured first ({ran} of {measured_steps + 1} "
                f"steps on the new plan)")

    def judge(self, ranker: Ranker, observations: Sequence, current: Candidate, calibration: Calibration,
              min_gain_ratio: float, horizon: int, downtime: Callable[[Candidate, Candidate], float]) -> Outcome | None:
        """The pending move's audit on the recent window (None: nothing to audit or no window)."""
        move, self.pending = self.pending, None
        window = ranker.window(observations) if move is not None else None
        if window is None or move is None:
            return None
        rollout, train = calibration.rollout_efficiency(), calibration.train_efficiency()
        new = ranker.play(window, current, rollout, train)
        measured = measured_per_step(observations, new.intervals)
        if not (math.isfinite(new.per_step_s) and new.per_step_s > 0 and measured > 0 and move.q_old > 0):
            return None
        q_new = measured / new.per_step_s
        error = q_new / move.q_old - 1.0
        self.errors.append(error)
        self.audited += 1
        old_s = ranker.play(window, move.old, rollout, train).per_step_s * move.q_old
        realized = (old_s - measured) / old_s if math.isfinite(old_s) and old_s > 0 else math.inf
        cost = downtime(current, move.old)
        revert = (-realized >= min_gain_ratio and math.isfinite(old_s)
                  and (measured - old_s) * horizon > cost)
        said = (f"the move after step {move.step} was predicted {move.predicted_ratio:+.1%} per step and "
                f"measured {realized:+.1%} ({measured:.2f}s per step against {old_s:.2f}s for the plan before "
                f"it on the same steps; its replay was {error:+.1%} off, relative to the old plan's)")
        if revert:
            self.reverted += 1
            self.undone.append(Undone(plan_key(move.old), plan_key(current), move.predicted_ratio - realized,
                                      move.step))
            return Outcome(error, measured, old_s, True,
                           f"reverted: {said}; moving back gains {(measured - old_s) * horizon:.1f}s over {horizon} "
                           f"steps against {cost:.1f}s of downtime")
        return Outcome(error, measured, old_s, False, said)

    def state(self) -> dict:
        return {"errors": list(self.errors), "audited": self.audited, "reverted": self.reverted,
                "undone": [{"old": _key_json(u.old), "new": _key_json(u.new), "miss": u.miss, "step": u.step}
                           for u in self.undone]}

    def restore(self, state: dict) -> None:
        self.errors.extend(float(e) for e in state.get("errors", []))
        self.audited, self.reverted = int(state.get("audited", 0)), int(state.get("reverted", 0))
        self.undone.extend(Undone(_key_from_json(u["old"]), _key_from_json(u["new"]), float(u["miss"]), int(u["step"]))
                           for u in state.get("undone", []))


def _key_json(key: PlanKey) -> list:
    return [*key[:4], [list(pair) for pair in key[4]]]


def _key_from_json(value: list) -> PlanKey:
    tp, pp, dp, micro_batch, rollout = value
    return (int(tp), int(pp), int(dp), int(micro_batch), tuple(sorted((int(t), int(n)) for t, n in rollout)))
