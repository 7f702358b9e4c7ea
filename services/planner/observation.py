"""What the replanner is told: one finished training step's runtime facts (`StepObservation`), their
checks, and the plan in force as the search's `Candidate`. Pure data and checks; no decisions.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from libra.services.planner.cost_train import Layout
from libra.services.planner.search import Candidate


@dataclass(frozen=True)
class StepObservation:
    """One finished training step's runtime facts.

    `lengths` are the (prompt, output) tokens of rollouts finished since the previous step;
    `sequences` the rollouts trained on (0: len(lengths)); seconds are wall time of the step, the
    rollout side (the batch's rollout span: its first trajectory released to its last finished,
    not the trainer's wait) and the training side. `trajectories` (`TrajectorySpec`s, optional)
    are the batch's trajectories with their turns and tool calls, for the simulated replay; without
    them it replays `lengths` as single-turn trajectories.
    """

    step: int
    time_s: float
    rollout_s: float
    train_s: float
    queue_depth: float = 0.0
    active_rollouts: float = 0.0
    rejected_rollouts: int = 0
    lengths: Sequence[tuple[int, int]] = ()
    sequences: int = 0
    trajectories: Sequence = ()
    overhead_s: float = 0.0  # the trainer's seconds outside its wait, training and publish (0: not reported)



def check_step(obs: StepObservation) -> str | None:
    """Why a step's facts are unusable (None: they are fine)."""
    for name in ("time_s", "rollout_s", "train_s", "queue_depth", "active_rollouts", "rejected_rollouts",
                 "overhead_s"):
        value = getattr(obs, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name} is not a finite number ({value!r})"
        if value < 0:
            return f"{name} is negative ({value!r})"
    if max(obs.time_s, obs.rollout_s, obs.train_s, obs.overhead_s) > 7 * 86_400:
        return (f"step seconds are absurd (over one week: {obs.time_s}, {obs.rollout_s}, {obs.train_s}, "
                f"{obs.overhead_s})")
    if obs.sequences < 0:
        return f"sequences is negative ({obs.sequences})"
    for index, (p, o) in enumerate(obs.lengths):
        if not (0 <= p <= 10_000_000 and 1 <= o <= 10_000_000):
            return f"lengths out of range (lengths[{index}] = ({p}, {o}))"
    return None


def candidate_from_plan(plan) -> Candidate | None:
    """The plan in force (`libra.v1.Plan` or `libra.plans.Plan`) as a search candidate; None for a
    plan the cost model cannot describe (no training GPUs: CPU training)."""
    t = plan.training
    if not t.gpus:
        return None
    counts: Counter = Counter()
    for bucket in plan.buckets:
        if bucket.replicas:
            counts[int(bucket.tp or 1)] += int(bucket.replicas)
    layout = Layout(int(t.tp or 1), int(t.pp or 1), int(t.dp or 1), int(t.micro_batch or 1))
    return Candidate(layout, tuple(sorted(counts.items())), math.nan, math.nan)
