"""A calibration estimator: an EWMA with a change-point rule (`Ewma`).

The calibration's pipeline, train and overhead estimators (calibration.py) are EWMAs (of slowdowns;
of seconds) with a change-point rule (`Ewma.update`): once `min_samples` samples are in, a sample
further than `reset_sigmas` standard deviations from the mean (the deviation has a floor of
`relative_floor` x mean, so a very steady series does not call every wobble a shift) is held back,
not folded in. `reset_after` such samples in a row, all on the same side, mean the regime changed
(a new kernel, a slower node): the estimator restarts from those samples. A sample back inside the
band drops the held ones (an isolated spike). Before `min_samples`, alpha is max(alpha, 1/n), so
the first samples are averaged plainly instead of being biased towards the first one. Pure: no
clock, no randomness.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libra.services.planner.calibration import CalibrationSettings


class Ewma:
    """Exponentially weighted mean and variance with the change-point reset of the module docstring."""

    def __init__(self, settings: CalibrationSettings):
        self.settings = settings
        self.mean = 0.0
        self.var = 0.0
        self.samples = 0
        self.resets = 0
        self.pending: list[float] = []

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def update(self, x: float) -> str:
        """Fold in one sample; returns 'folded', 'held' (change-point candidate) or 'reset'."""
        s = self.settings
        if self.samples >= s.min_samples:
            band = s.reset_sigmas * max(self.std, s.relative_floor * abs(self.mean))
            if abs(x - self.mean) > band:
                side = x > self.mean
                if self.pending and (self.pending[-1] > self.mean) != side:
                    self.pending = []
                self.pending.append(x)
                if len(self.pending) < s.reset_after:
                    return "held"
                held, self.pending = self.pending, []
                self.mean = sum(held) / len(held)
                self.var = sum((v - self.mean) ** 2 for v in held) / len(held)
                self.samples = len(held)
                self.resets += 1
                return "reset"
        self.pending = []
        self.samples += 1
        alpha = max(s.alpha, 1.0 / self.samples)
        delta = x - self.mean
        self.mean += alpha * delta
        self.var = (1.0 - alpha) * (self.var + alpha * delta * delta)
        return "folded"

    def value(self, default: float = 1.0) -> float:
        return self.mean if self.samples else default

    def snapshot(self) -> dict:
        return {"slowdown": round(self.value(), 6), "std": round(self.std, 6), "samples": self.samples,
                "resets": self.resets, "held": len(self.pending)}
