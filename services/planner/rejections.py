"""Why the search dropped candidates: every reason with its count, and the binding resource.

When nothing passes, `explain` is the error's body: each side's smallest memory need seen (the
layout, GiB per GPU needed against what the GPU allows), then every reason, whole, with how many
layouts or fleets it removed. Pure bookkeeping; the search decides what to reject.
"""

from __future__ import annotations

from collections import Counter

from libra.services.planner.cost_rollout import OverMemory
from libra.services.planner.hardware import GpuSpec


class Rejections:
    """Why candidates were dropped: every reason with its count, and per side the smallest memory
    need seen (the binding resource when memory is what ruled a side out)."""

    def __init__(self) -> None:
        self.reasons: Counter = Counter()
        self.memory: dict[str, OverMemory] = {}

    def add(self, reason: str) -> None:
        self.reasons[reason] += 1

    def over_memory(self, error: OverMemory) -> None:
        self.reasons[f"{error.side} over memory"] += 1
        if error.side not in self.memory or error.needed_gib < self.memory[error.side].needed_gib:
            self.memory[error.side] = error

    def explain(self, gpu: GpuSpec) -> str:
        parts = []
        for side, error in sorted(self.memory.items()):
            parts.append(f"{side} memory: the least any {side} layout tried needs is {error.needed_gib:.1f} GiB per "
                         f"GPU ({error.layout}) and {gpu.name} allows {error.available_gib:.1f} GiB")
        reasons = "; ".join(f"{count} x {reason}" for reason, count in self.reasons.most_common())
        return ". ".join(parts + [f"rejected: {reasons or 'nothing (no layout to try)'}"])
