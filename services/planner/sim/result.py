"""What a simulated run reports: a training step, a plan change, a whole cluster run (`SimResult`)
and one rollout window (`RolloutResult`).

`cluster.Simulator.run` builds a `SimResult` from `StepRecord`s and `PlanChangeRecord`s;
`rollout.Window.run` builds a `RolloutResult`. `run.py` (summary lines, JSON, plot), the CLI, the
plan controllers and the benchmarks read them. This module owns only the records: it knows nothing
of how the run was simulated (events, instances, policies) nor of how it is shown.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class StepRecord:
    """One finished training step, as the simulator measured it."""

    step: int
    time_s: float  # simulated clock when the step finished
    interval_s: float  # since the previous step finished (the step's wall time)
    rollout_s: float  # batch released -> its last trajectory finished
    train_s: float
    wait_s: float  # the trainer waited this long for the batch (what the real trainer reports as rollout seconds)
    sequences: int
    lengths: Sequence[tuple[int, int]]  # (prompt + tool payloads, output) per sequence of the batch
    queue_depth: float  # turns waiting in engine queues when the step finished
    active_rollouts: float  # trajectories in flight when the step finished


@dataclass
class PlanChangeRecord:
    """One plan change: when it was decided and ready, what it cost, and the turns it moved."""

    step: int
    time_s: float
    ready_s: float
    transition_s: float
    before: str
    after: str
    reason: str
    moved_turns: int


@dataclass
class SimResult:
    """The run: its steps and plan changes, what it produced, and how it was resolved (pooling, copies)."""

    steps: list[StepRecord]
    makespan_s: float
    trajectories: int
    output_tokens: int
    plan_changes: list[PlanChangeRecord]
    first_plan: str
    last_plan: str
    routes: int
    reasons: Counter
    peak_kv: float
    pooled: int  # largest number of engines behind one simulated worker
    copies: int
    wall_s: float  # seconds this run took on this machine (the initial plan's search included)
    cpu_s: float  # CPU seconds of this process for the run, and of its replay workers (if any)
    notes: list[str] = field(default_factory=list)
    worker_cpu_s: float = 0.0  # of cpu_s: the replay workers' (planner.replan.sim_workers > 1)
    # the replanner's decisions (online planner only): (step, applied, reason), oldest first
    decisions: list[tuple[int, bool, str]] = field(default_factory=list)

    @property
    def trajectories_per_s(self) -> float:
        return self.trajectories / self.makespan_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s


@dataclass
class RolloutResult:
    """One window played to its end: makespan (release to the last finish) and what filled it."""

    makespan_s: float
    trajectories: int
    output_tokens: int
    busy: dict[str, float]  # bucket -> mean fraction of the makespan its instances were busy
    moves: int  # turns routed to another instance than the trajectory's previous turn
    routes: int = 0
    reasons: Counter = field(default_factory=Counter)

    @property
    def trajectories_per_s(self) -> float:
        return self.trajectories / self.makespan_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s
