"""When the replanner searches again (replan.py): the pressure signals of the recent steps, and
the triggers they fire.

Triggers, checked in this order (the first that fires names the decision):
  interval   `interval_s` since the last evaluation (or since the first `consider`)
  queue      mean queue depth over the last `pressure_steps` steps >= `queue_depth_high`
  active     mean active rollouts over the last `pressure_steps` steps >= `active_rollouts_high`
  rejected   rejected / (rejected + trained) rollouts over the window >= `rejected_fraction_high`
  ratio      mean rollout/train seconds over the window outside [1/`time_ratio_high`, `time_ratio_high`]
A threshold of 0 disables its trigger. Pure.
"""

from __future__ import annotations

from typing import Sequence

from libra.services.planner.config import ReplanSettings
from libra.services.planner.observation import StepObservation

TRIGGERS = ("interval", "queue", "active", "rejected", "ratio")


def pressure(window: Sequence[StepObservation], pressure_steps: int) -> dict[str, float]:
    """The signals of the recent steps `window` (its last `pressure_steps` for the queue and the
    active rollouts) that the triggers read."""
    recent = list(window)[-pressure_steps:]
    trained = sum(o.sequences or len(o.lengths) for o in window)
    rejected = sum(o.rejected_rollouts for o in window)
    train = sum(o.train_s for o in window)
    return {
        "mean_queue_depth": _mean([o.queue_depth for o in recent]),
        "mean_active_rollouts": _mean([o.active_rollouts for o in recent]),
        "rejected_fraction": rejected / (rejected + trained) if rejected + trained else 0.0,
        "rollout_train_ratio": sum(o.rollout_s for o in window) / train if train > 0 else 0.0,
        "measured_step_s": _mean([o.time_s for o in window]),
    }


def fired(settings: ReplanSettings, x: dict, since_s: float, have_steps: bool) -> str:
    """The first trigger that fires on the signals `x`, `since_s` seconds after the last evaluation
    ("" for none; without steps observed only the interval can)."""
    s = settings
    if s.interval_s and since_s >= s.interval_s:
        return "interval"
    if not have_steps:
        return ""
    if s.queue_depth_high and x["mean_queue_depth"] >= s.queue_depth_high:
        return "queue"
    if s.active_rollouts_high and x["mean_active_rollouts"] >= s.active_rollouts_high:
        return "active"
    if s.rejected_fraction_high and x["rejected_fraction"] >= s.rejected_fraction_high:
        return "rejected"
    ratio = x["rollout_train_ratio"]
    if s.time_ratio_high and ratio > 0 and not 1 / s.time_ratio_high <= ratio <= s.time_ratio_high:
        return "ratio"
    return ""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
