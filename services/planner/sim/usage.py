"""What the simulated GPUs did, per pool, and how stale the trained trajectories were.

`cluster.Simulator` feeds a `Usage` as it goes: the plan's GPU split whenever it changes
(provisioned GPU-seconds are integrated over time), the busy GPU-seconds of every training step
and of every engine (an engine is busy while it decodes or stalls: prefill, weight sync), the lag
of every trained trajectory, and at the end the trajectories rejected as stale (batching.py). It
knows nothing of events, engines or policies.

Pools: `train` and `rollout` for disaggregated plans; `colocated` when every GPU does both (its
busy time is rollout plus training). Staleness of a trajectory trained at step s: s minus the
version of its first token (what the real trainer checks against `max_staleness`: the oldest
version that produced any of its tokens).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Usage:
    colocated: bool = False
    provisioned: Counter = field(default_factory=Counter)  # pool -> GPU-seconds the plan gave it
    busy: Counter = field(default_factory=Counter)  # pool -> GPU-seconds of work
    staleness: Counter = field(default_factory=Counter)  # versions behind -> trajectories trained
    rejected: int = 0  # trajectories rolled out, then rejected as stale (their work lost)
    split: tuple[int, int] = (0, 0)  # (training GPUs, rollout GPUs) of the plan in force
    since: float = 0.0

    def plan(self, now: float, train_gpus: int, rollout_gpus: int) -> None:
        """The plan's split from `now` on (the time before is charged to the old split)."""
        self._charge(now)
        self.split = (train_gpus, rollout_gpus)

    def trained(self, seconds: float, gpus: int) -> None:
        self.busy["colocated" if self.colocated else "train"] += seconds * gpus

    def engine(self, busy_s: float, gpus: int) -> None:
        """An engine's busy seconds (once per engine: when it leaves the plan, or at the end)."""
        self.busy["colocated" if self.colocated else "rollout"] += busy_s * gpus

    def close(self, now: float) -> None:
        self._charge(now)

    def fractions(self) -> dict[str, float]:
        """Pool -> busy GPU-seconds over provisioned GPU-seconds."""
        return {pool: self.busy[pool] / seconds for pool, seconds in sorted(self.provisioned.items()) if seconds}

    def staleness_shares(self) -> dict[int, float]:
        """Versions behind -> share of the trained trajectories."""
        total = sum(self.staleness.values())
        return {lag: count / total for lag, count in sorted(self.staleness.items())} if total else {}

    def _charge(self, now: float) -> None:
        span = now - self.since
        train, rollout = self.split
        if self.colocated:
            self.provisioned["colocated"] += span * max(train, rollout)
        else:
            self.provisioned["train"] += span * train
            self.provisioned["rollout"] += span * rollout
        self.since = now
