"""A scripted stand-in for the replanner's simulated judge (`evaluate.Ranker`) and the settings
that make the replanner decide after every step: what the replanner's tests on a scripted ranker
share (test_replan_simulated.py, test_replan_audit.py)."""

from __future__ import annotations

import math

from libra.services.planner.cost_train import Layout
from libra.services.planner.evaluate import Played
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import Candidate

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")
EVERY_STEP = dict(interval_s=1, queue_depth_high=0, active_rollouts_high=0, rejected_fraction_high=0, time_ratio_high=0,
                  warmup_steps=0, min_history_samples=64, cooldown_s=0, recheck_s=0, batch_sequences=64)
POOR = Candidate(Layout(1, 1, 8, 1), ((1, 8),), math.nan, math.nan)


class ScriptedRanker:
    """Per-step seconds by training GPUs; a move costs `move_extra` on top of its steps."""

    def __init__(self, per_step: dict[int, float], move_extra: float, span_factor: float = 1.0):
        self.per_step, self.move_extra, self.span_factor = per_step, move_extra, span_factor
        self.plays = 0

    def seconds(self, plan: Candidate) -> float:
        return self.per_step.get(plan.layout.gpus, 1000.0)

    def window(self, observations):
        recent = list(observations)[-4:]
        return recent if len(recent) >= 2 else None

    workers = 1

    def play_all(self, window, replays) -> list[Played]:
        return [self.play(window, r.plan, r.rollout, r.train, r.move_to, r.transition_s) for r in replays]

    def play(self, window, plan, rollout, train, move_to=None, transition_s=0.0) -> Played:
        self.plays += 1
        steps = len(window)
        then = move_to if move_to is not None else plan
        finish = [self.seconds(plan) + self.seconds(then) * i for i in range(steps)]
        finish[-1] += self.move_extra if move_to is not None else 0.0
        slowdown = 0.7 / rollout.decode_bw  # the replay runs at the calibrated speed: its spans scale
        spans = tuple(o.rollout_s / self.span_factor * slowdown for o in window)
        return Played(tuple(finish), spans)
