"""What one run of the cluster simulator reports: its steps, its plan changes and its throughput.

`simulator.Simulator.run` builds a `SimResult`; `sim_run` (summary lines, JSON, plot), the CLI and
`benchmarks/grp_eval.py` read it. This module owns only the record: it knows nothing of how the run
was simulated (events, engines, policies) nor of how it is shown.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from libra.services.planner.plan_control import StepRecord


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
    cpu_s: float  # CPU seconds of this process for the run (less sensitive to a shared machine)
    notes: list[str] = field(default_factory=list)

    @property
    def trajectories_per_s(self) -> float:
        return self.trajectories / self.makespan_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s
