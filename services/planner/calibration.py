"""Calibration: measured turn and step times correct the cost model's efficiencies.

The cost model predicts times from datasheet peaks scaled by efficiencies (`RolloutEfficiency`,
`TrainEfficiency`), plus overheads the roofline lacks (per decode step, per sequence, per request).
What a deployment really reaches differs (kernels, batching, stragglers, a busy gateway), so
measured times give *slowdowns*: measured / predicted, where "predicted" is only the part of the
model that the efficiency scales (fixed costs such as collectives are subtracted first). A slowdown
divides the configured efficiency:

    calibrated_efficiency = clip(base_efficiency / slowdown, 1e-4, 1)

Six estimators:

    turns     (every measured turn: a least-squares fit of     -> RolloutEfficiency.prefill_mfu,
               the turn model's five terms, `turnfit.py`; the     decode_bw, step_overhead_s,
               recent turns' time beyond it, `gaps.Replies`)      step_per_seq_s, request_s (and
                                                                  request_quantiles)
    pipeline  (batches' measured rollout spans vs the spans     -> all of those, on top of the fit
               the cluster simulator plays for the same
               batches under the plan in force)
    train     (a step's training seconds vs cost_train)        -> TrainEfficiency.mfu
    overhead  (a step's seconds outside its wait, training and -> TrainEfficiency.step_overhead_s
               publish, as the trainer measures them)
    gap       (a trajectory's seconds before each turn outside   -> RolloutEfficiency.turn_gap_s
               tool calls, as the gateway measures them: a mean      (the mean), first_gap_quantiles,
               with the turn fit's forgetting, and the recent       turn_gap_quantiles
               ones, first turns apart, `gaps.GapWindows`)
    moments   (how the gaps and the times beyond the engine of   -> RolloutEfficiency.moment_s,
               turns that come back together on one engine, or     first_gap_correlation,
               start together, correlate: `moments.MomentWindows`)    gap_correlation, reply_correlation

`pipeline` calibrates the simulator the replanner ranks plans with (`sim/rank.py`): a batch's
rollout span (its first trajectory released to its last finished) is what the asynchronous
pipeline really took, tool calls, queueing and the previous batch's tail included. Its sample is
the absolute slowdown that would make the simulated spans match: measured / simulated x the
pipeline slowdown in force when the simulation ran.

A turn's prefill term is what its engine computed and what paused it, as the simulator charges a
prefill: its own new tokens and the prefills of the turns that joined its engine while it ran
(`prefills.Prefills`).

pipeline, train and overhead are EWMAs (of slowdowns; of seconds) with a change-point rule
(`changepoint.Ewma`: a shift held back until it persists, a spike dropped). The turn fit forgets
instead (`turn_window`).

Bad samples (non-finite, negative, slowdowns outside [1/max_slowdown, max_slowdown], a turn faster
than max_slowdown x the roofline) are rejected with a reason, counted in `Calibration.rejected`, and
change nothing. Pure: no clock, no network, no randomness.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from pydantic import Field

from libra.configbase import Section
from libra.services.planner import cost_rollout, cost_train
from libra.services.planner.changepoint import Ewma
from libra.services.planner.cost_rollout import Infeasible, RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.gaps import GapWindows, Replies
from libra.services.planner.moments import MomentWindows
from libra.services.planner.prefills import Prefills
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.turnfit import TERMS, ForgettingMean, TurnFit

MIN_EFFICIENCY = 1e-4


class CalibrationSettings(Section):
    """How measured times correct the cost model's efficiencies."""

    alpha: float = Field(0.2, gt=0, le=1, description="EWMA weight of a new slowdown sample")
    min_samples: int = Field(5, ge=1, le=10_000, description="samples before the change-point rule applies")
    reset_sigmas: float = Field(3.0, gt=0, le=100, description="a sample this many std devs off the mean is a "
                                                                 "change-point candidate")
    reset_after: int = Field(3, ge=1, le=1000, description="candidates in a row (same side) that reset the EWMA")
    relative_floor: float = Field(0.05, ge=0, le=10, description="the std dev used is at least this x the mean")
    max_slowdown: float = Field(1000.0, gt=1, le=1e9, description="samples whose measured/predicted ratio is "
                                                                  "outside [1/this, this] are rejected as absurd")
    turn_window: float = Field(2000.0, ge=2, le=1e9, description="turns the turn fit remembers: a turn's "
                                                                   "weight decays by 1 - 1/this per later turn")
    prior_turns: float = Field(0.05, ge=1e-6, le=1e6, description="turns' worth of evidence holding each term of "
                               "the turn fit at its base value (a ridge: it decides only what the turns cannot tell "
                               "apart; larger biases the fit towards the base)")
    moment_window_s: float = Field(0.02, ge=0, le=10, description="replies on one engine (and trajectory "
                                   "releases) this close in time are one moment: the calibration measures how their "
                                   "gaps and times beyond the engine correlate, and the simulator draws them so "
                                   "(gaps.Moments; 0: every turn its own draws)")


@dataclass
class Comparison:
    """EWMAs of what was predicted (with the calibration in force before the sample) and measured."""

    predicted_s: float = 0.0
    measured_s: float = 0.0
    samples: int = 0
    alpha: float = 0.2

    def add(self, predicted: float, measured: float) -> None:
        self.samples += 1
        a = max(self.alpha, 1.0 / self.samples)
        self.predicted_s += a * (predicted - self.predicted_s)
        self.measured_s += a * (measured - self.measured_s)

    def snapshot(self) -> dict:
        return {"predicted_s": round(self.predicted_s, 6), "measured_s": round(self.measured_s, 6),
                "samples": self.samples}


@dataclass
class Calibration:
    """The estimators, the efficiencies they imply and the predicted-vs-measured record."""

    model: ModelSpec
    gpu: GpuSpec
    base_rollout: RolloutEfficiency
    base_train: TrainEfficiency
    settings: CalibrationSettings = field(default_factory=CalibrationSettings)
    rejected: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.estimators = {name: Ewma(self.settings) for name in ("pipeline", "train", "overhead")}
        b = self.base_rollout
        self.fit = TurnFit((1.0, 1.0, b.step_overhead_s, b.step_per_seq_s, b.request_s), self.settings.turn_window,
                           self.settings.prior_turns)
        self.gap = ForgettingMean(b.turn_gap_s, self.settings.turn_window)
        self.prefills = Prefills(self.settings.turn_window)
        self.gaps = GapWindows(self.settings.turn_window)
        self.replies = Replies(self.settings.turn_window)
        self.moments = MomentWindows(self.settings.turn_window, self.settings.moment_window_s)
        self.turns = Comparison(alpha=self.settings.alpha)
        self.steps = Comparison(alpha=self.settings.alpha)
        self._instances: dict[int, cost_rollout.Instance] = {}

    # -- efficiencies ----------------------------------------------------------------------
    def rollout_efficiency(self) -> RolloutEfficiency:
        pipeline = self.pipeline_slowdown()
        fit = self.fit.coefficients()
        prefill, decode, overhead, per_seq, request = fit
        b = self.base_rollout
        return b.model_copy(update={"prefill_mfu": _scaled(b.prefill_mfu, prefill * pipeline),
                                    "decode_bw": _scaled(b.decode_bw, decode * pipeline),
                                    "step_overhead_s": min(10.0, overhead * pipeline),
                                    "step_per_seq_s": min(1.0, per_seq * pipeline),
                                    "request_s": min(60.0, request * pipeline),
                                    "turn_gap_s": min(600.0, self.gap.value()),
                                    **self.gaps.efficiency(), **self.replies.efficiency(fit),
                                    **self.moments.efficiency(fit)})

    def train_efficiency(self) -> TrainEfficiency:
        b = self.base_train
        overhead = self.estimators["overhead"]
        return b.model_copy(update={"mfu": _scaled(b.mfu, self.estimators["train"].value()),
                                    "step_overhead_s": min(3600.0, overhead.value()) if overhead.samples
                                    else b.step_overhead_s})

    # -- samples ---------------------------------------------------------------------------
    def observe_turn(self, tp: int, prompt: int, output: int, seconds: float, batch: float = 1,
                     gap_s: float = 0.0, turn_number: int = 0, *, worker: str = "", end_s: float = 0.0,
                     trajectory: str = "") -> str | None:
        """One measured turn on a TP-`tp` instance of `batch` running sequences, `gap_s` seconds after
        its trajectory's previous turn or start (outside tool calls; 0: not measured), the
        `turn_number`th of its trajectory (1: the first; 0: not reported), served by `worker` with its
        reply back at `end_s` (wall-clock seconds; with the trajectory's id, they place it in a moment:
        moments.MomentWindows); returns why it was rejected, or None."""
        reason = (_bad_numbers(seconds=seconds, prompt=prompt, output=output, tp=tp, batch=batch)
                  or _bad_numbers(seconds=gap_s))
        if reason is None and output + prompt == 0:
            reason = "a turn with no tokens"
        inst = None if reason else self._instance(tp)
        if reason is None and inst is None:
            reason = f"tp {tp} cannot hold {self.model.name} on {self.gpu.name}"
        if reason:
            return self._reject("turn", reason)  # keyed by the reason without its value
        batch = max(1, batch)
        context = prompt + output / 2.0
        prefill = self.prefills.charge(inst.prefill_seconds, trajectory, worker, prompt, output, end_s, seconds)
        comm_step = 2 * self.model.layers * inst.allreduce_seconds(batch)
        memory_step = inst.decode_step_seconds(batch, batch * context) - comm_step - inst.overhead_seconds(batch)
        x = (prefill, output * memory_step, float(output), float(output * batch), 1.0)
        comm = output * comm_step
        roofline = prefill + x[1] + comm
        limit = self.settings.max_slowdown
        if seconds * limit < roofline:
            return self._reject("turn", f"turns: measured/predicted {seconds / roofline:.3g} outside "
                                        f"[1/{limit:g}, {limit:g}] (faster than the hardware allows)",
                                "turn faster than the roofline")
        if gap_s > 0:
            self.gap.add(gap_s)
            self.gaps.add(gap_s, turn_number)
        c = self.fit.in_force  # the calibration in force (no solve per turn: the fit solves when asked)
        self.turns.add(sum(ci * xi for ci, xi in zip(c, x)) + comm, seconds)
        self.fit.add(x, max(0.0, seconds - comm), 1.0 / batch)  # its share of the engine's steps
        self.replies.add(x, comm, seconds)
        self.moments.add(worker, end_s, seconds, gap_s, turn_number, trajectory, x, comm)
        return None

    def observe_train(self, layout: Layout, lengths: Sequence[tuple[int, int]], seconds: float,
                      overhead_s: float = 0.0) -> str | None:
        """One step's measured training seconds on `layout` for a batch of `lengths`, and its seconds
        outside wait, training and publish (`overhead_s`; 0: not reported)."""
        reason = (_bad_numbers(seconds=seconds) or _bad_numbers(seconds=overhead_s)
                  or ("a step with no sequences" if not lengths else None))
        if reason:
            return self._reject("step", reason)
        if overhead_s > 0:
            self.estimators["overhead"].update(overhead_s)
        base = self.base_train.model_copy(update={"step_overhead_s": 0.0})  # the optimizer step alone
        estimate = _train_estimate(self.model, self.gpu, layout, lengths, base)
        if estimate is None:
            return self._reject("step", f"training layout tp{layout.tp} pp{layout.pp} dp{layout.dp} cannot be "
                                        f"costed for this batch")
        scale, est = estimate
        scaled_part = scale * est.compute_s / (1.0 - est.bubble)
        fixed = scale * (est.seconds - est.compute_s / (1.0 - est.bubble))
        return self._sample("train", seconds - fixed, scaled_part, "step")

    def pipeline_slowdown(self) -> float:
        """The simulator's rollout slowdown in force (1: the cost model's speeds as they are)."""
        return self.estimators["pipeline"].value()

    def observe_pipeline(self, measured_s: float, simulated_s: float, slowdown_in_force: float) -> str | None:
        """Batches' measured rollout seconds against what the simulator played for the same batches
        under the plan in force, with `slowdown_in_force` applied then."""
        reason = _bad_numbers(seconds=measured_s) or _bad_numbers(seconds=simulated_s)
        if reason:
            return self._reject("step", reason)
        return self._sample("pipeline", measured_s * slowdown_in_force, simulated_s, "step")

    def record_step(self, predicted_s: float, measured_s: float) -> None:
        """Predicted (calibrated, before this step) vs measured step time, for the report."""
        if math.isfinite(predicted_s) and math.isfinite(measured_s) and predicted_s > 0 and measured_s >= 0:
            self.steps.add(predicted_s, measured_s)

    # -- report ----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        r, t = self.rollout_efficiency(), self.train_efficiency()
        return {
            "estimators": {name: e.snapshot() for name, e in self.estimators.items()},
            "turn_fit": {**{term: round(c, 9) for term, c in zip(TERMS, self.fit.coefficients())},
                         "samples": self.fit.samples, "weight": round(self.fit.weight, 3)},
            "efficiency": {
                "prefill_mfu": {"base": self.base_rollout.prefill_mfu, "calibrated": round(r.prefill_mfu, 6)},
                "decode_bw": {"base": self.base_rollout.decode_bw, "calibrated": round(r.decode_bw, 6)},
                "step_overhead_s": {"base": self.base_rollout.step_overhead_s,
                                    "calibrated": round(r.step_overhead_s, 9)},
                "step_per_seq_s": {"base": self.base_rollout.step_per_seq_s,
                                   "calibrated": round(r.step_per_seq_s, 9)},
                "request_s": {"base": self.base_rollout.request_s, "calibrated": round(r.request_s, 9)},
                "turn_gap_s": {"base": self.base_rollout.turn_gap_s, "calibrated": round(r.turn_gap_s, 6),
                               "samples": self.gap.samples},
                "train_mfu": {"base": self.base_train.mfu, "calibrated": round(t.mfu, 6)},
                "train_overhead_s": {"base": self.base_train.step_overhead_s,
                                     "calibrated": round(t.step_overhead_s, 6)}},
            "turn_time": self.turns.snapshot(),
            "step_time": self.steps.snapshot(),
            "rejected": dict(self.rejected),
        }

    def state(self) -> dict:
        """The estimators and comparisons, JSON-safe, for `restore`."""
        return {"estimators": {name: [e.mean, e.var, e.samples, e.resets, list(e.pending)]
                               for name, e in self.estimators.items()},
                "turn_fit": self.fit.state(),
                "turn_gap": self.gap.state(),
                "turn_prefill": self.prefills.state(),
                "turn_gaps": self.gaps.state(),
                "replies": self.replies.state(),
                "moments": self.moments.state(),
                "turns": [self.turns.predicted_s, self.turns.measured_s, self.turns.samples],
                "steps": [self.steps.predicted_s, self.steps.measured_s, self.steps.samples],
                "rejected": dict(self.rejected)}

    def restore(self, state: dict) -> None:
        for name, row in state.get("estimators", {}).items():
            if name in self.estimators:
                e = self.estimators[name]
                e.mean, e.var, e.samples, e.resets, e.pending = row[0], row[1], int(row[2]), int(row[3]), list(row[4])
        parts = {"turn_fit": self.fit, "turn_gap": self.gap, "turn_gaps": self.gaps, "replies": self.replies,
                 "moments": self.moments, "turn_prefill": self.prefills}
        for key in parts.keys() & state.keys():  # (a state from before a part existed lacks it)
            parts[key].restore(state[key])
        for name in ("turns", "steps"):
            if name in state:
                c = getattr(self, name)
                c.predicted_s, c.measured_s, c.samples = state[name][0], state[name][1], int(state[name][2])
        self.rejected.update(state.get("rejected", {}))

    # -- helpers ---------------------------------------------------------------------------
    def _instance(self, tp: int) -> cost_rollout.Instance | None:
        if tp not in self._instances:
            try:
                self._instances[tp] = cost_rollout.instance(self.model, self.gpu, tp, self.base_rollout)
            except Infeasible:
                return None
        return self._instances[tp]

    def _sample(self, name: str, measured_part: float, predicted_part: float, kind: str) -> str | None:
        if predicted_part <= 0:
            return self._reject(kind, f"{name}: nothing to calibrate (predicted part is 0)")
        slowdown = measured_part / predicted_part
        limit = self.settings.max_slowdown
        if not (1.0 / limit <= slowdown <= limit):
            return self._reject(kind, f"{name}: measured/predicted {slowdown:.3g} outside [1/{limit:g}, {limit:g}]",
                                f"{name} slowdown out of range")
        self.estimators[name].update(slowdown)
        return None

    def _reject(self, kind: str, reason: str, key: str = "") -> str:
        self.rejected[f"{kind}: {key or reason.split(' (')[0]}"] += 1
        return reason


def _scaled(base: float, slowdown: float) -> float:
    return min(1.0, max(MIN_EFFICIENCY, base / slowdown)) if slowdown > 0 else 1.0


def _bad_numbers(**values: float) -> str | None:
    """The first value that is not a finite number in range, as a reason."""
    for name, value in values.items():
        if value is None or isinstance(value, bool) or not math.isfinite(value):
            return f"{name} is not a finite number ({value!r})"
        if value < 0:
            return f"{name} is negative ({value!r})"
        if name == "seconds" and value > 7 * 86_400:
            return f"seconds is absurd ({value!r} > one week)"
        if name in ("prompt", "output") and value > 10_000_000:
            return f"{name} is absurd ({value!r} tokens)"
        if name == "tp" and not 1 <= value <= 1024:
            return f"tp must be in 1..1024 ({value!r})"
    return None


def _train_estimate(model: ModelSpec, gpu: GpuSpec, layout: Layout, lengths: Sequence[tuple[int, int]],
                    eff: TrainEfficiency) -> tuple[float, cost_train.TrainEstimate] | None:
    """cost_train for a batch of `lengths`, rounded up to a batch the layout divides, and the factor
    that scales the estimate back to the real batch (`None` when the layout cannot run at all)."""
    n = len(lengths)
    unit = layout.dp * layout.micro_batch
    padded = -(-n // unit) * unit
    seq_len = max(1, round(sum(p + o for p, o in lengths) / n))
    try:
        return n / padded, cost_train.step_time(model, gpu, layout, padded, seq_len, eff)
    except Infeasible:
        return None


def predicted_times(model: ModelSpec, gpu: GpuSpec, layout: Layout, fleet: Sequence[tuple[int, int]],
                    lengths: Sequence[tuple[int, int]], rollout: RolloutEfficiency,
                    train: TrainEfficiency) -> tuple[float, float]:
    """(train seconds, rollout seconds) of one step of `lengths` on a plan; inf where it cannot run."""
    estimate = _train_estimate(model, gpu, layout, lengths, train) if lengths else None
    train_s = estimate[0] * estimate[1].seconds if estimate else math.inf
    try:
        instances = [cost_rollout.instance(model, gpu, tp, rollout) for tp, n in fleet for _ in range(n)]
        rollout_s = cost_rollout.rollout_time(lengths, instances) if instances and lengths else math.inf
    except Infeasible:
        rollout_s = math.inf
    return train_s, rollout_s
