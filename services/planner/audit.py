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

A restarted planner keeps the errors (`state`), not a pending audit (the plans are not stored).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from libra.services.planner.calibration import Calibration
from libra.services.planner.evaluate import Ranker, measured_per_step
from libra.services.planner.search import Candidate

AUDITS_KEPT = 3


@dataclass(frozen=True)
class Move:
    """An applied move waiting for its audit."""

    after_step: int  # steps observed when it was applied
    old: Candidate
    predicted_ratio: float  # (a_old - b_new) / a_old, as the judge predicted it
    q_old: float  # the old plan's measured / replayed seconds per step, last seen
    step: int  # the number of the last step before it (what messages name)


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

    def margin(self) -> float:
        return max(0.0, sum(self.errors) / len(self.errors)) if self.errors else 0.0

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
            return Outcome(error, measured, old_s, True,
                           f"reverted: {said}; moving back gains {(measured - old_s) * horizon:.1f}s over {horizon} "
                           f"steps against {cost:.1f}s of downtime")
        return Outcome(error, measured, old_s, False, said)

    def state(self) -> dict:
        return {"errors": list(self.errors), "audited": self.audited, "reverted": self.reverted}

    def restore(self, state: dict) -> None:
        self.errors.extend(float(e) for e in state.get("errors", []))
        self.audited, self.reverted = int(state.get("audited", 0)), int(state.get("reverted", 0))
