"""Planner decisions as pure functions. `mode: static` turns the configured allocation into plan
generation 1; `mode: online` feeds runtime history to the `Replanner` (`HistoryFeeder`) and turns
its decisions and calibration into the records stored in Redis and shown by Explain."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from libra.plans import Bucket, Plan, Training, from_proto
from libra.services.planner.config import PlannerConfig
from libra.services.planner.preflight import to_plan
from libra.services.planner.replan import ReplanDecision, Replanner, StepObservation
from libra.v1 import common_pb2, planner_pb2


def static_plan(config: PlannerConfig, now: float) -> Plan:
    """The allocation written in the config, as plan generation 1."""
    t = config.training
    return Plan(
        generation=1,
        training=Training(gpus=t.gpus, tp=t.tp, pp=t.pp, dp=t.dp, micro_batch=t.micro_batch),
        buckets=tuple(Bucket(b.name, b.tp, b.max_tokens, b.replicas) for b in config.buckets),
        source="config",
        reason="allocation given in the run config (planner.mode: static)",
        created_at=now,
    )


def describe(plan: Plan) -> str:
    """One line for logs: 'train 0 GPU tp1 pp1 dp1 | short tp1x1, long tp1x1'."""
    t = plan.training
    layout = ", ".join(f"{b.name} tp{b.tp}x{b.replicas}" for b in plan.buckets)
    return f"gen {plan.generation}: train {t.gpus} GPU tp{t.tp} pp{t.pp} dp{t.dp} | {layout}"


# -- online mode: runtime history in, decisions out (pure conversions) -----------------------------

@dataclass
class Fed:
    """What one batch of history did: records taken, and the rejected ones with their reasons."""

    turns: int = 0
    steps: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (kind, reason)


@dataclass
class HistoryFeeder:
    """Turns `HistoryRecord`s into Replanner calls, in stream order (turns before the step after them).

    Turns calibrate prefill/decode and supply the queue depth and active rollouts of the next step;
    a step without per-sequence lengths uses the (context, output) of the turns since the last step.
    """

    pending_queue: list[float] = field(default_factory=list)
    pending_active: list[float] = field(default_factory=list)
    pending_lengths: list[tuple[int, int]] = field(default_factory=list)

    def feed(self, replanner: Replanner, turns, steps, plan: common_pb2.Plan | None) -> Fed:
        fed = Fed()
        bucket_tp = {b.name: b.tp for b in plan.buckets} if plan is not None else {}
        for record in turns:
            tp = record.tp or bucket_tp.get(record.bucket) or 1
            # the engine's own batch where it reports one (the hf engine), else the requests in flight
            reason = replanner.observe_turn(tp, record.prompt_tokens, record.output_tokens, record.seconds,
                                            record.engine_batch or record.batch or 1, record.gap_seconds,
                                            record.turn_number,
                                            worker=record.worker_id, end_s=record.timestamp,
                                            trajectory=record.trajectory_id)
            if reason:
                fed.rejected.append(("turn", reason))
                continue
            fed.turns += 1
            self.pending_queue.append(record.queue_depth)
            self.pending_active.append(record.active_rollouts)
            if record.output_tokens:
                self.pending_lengths.append((record.prompt_tokens, record.output_tokens))
        for record in steps:
            reason = self._step(replanner, record)
            if reason:
                fed.rejected.append(("step", reason))
            else:
                fed.steps += 1
        return fed

    def _step(self, replanner: Replanner, record) -> str | None:
        if len(record.prompt_lengths) != len(record.output_lengths):
            return (f"prompt_lengths ({len(record.prompt_lengths)}) and output_lengths "
                    f"({len(record.output_lengths)}) differ in length")
        lengths = list(zip(record.prompt_lengths, record.output_lengths)) or self.pending_lengths
        obs = StepObservation(
            step=record.step, time_s=record.seconds, rollout_s=record.rollout_seconds,
            train_s=record.train_seconds or record.seconds,
            queue_depth=_mean(self.pending_queue), active_rollouts=_mean(self.pending_active),
            rejected_rollouts=record.rejected_rollouts, lengths=tuple(lengths), sequences=record.sequences,
            overhead_s=record.overhead_seconds)
        reason = replanner.observe_step(obs)
        self.pending_queue, self.pending_active, self.pending_lengths = [], [], []
        return reason


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def flat_inputs(inputs: dict, prefix: str = "") -> dict[str, float]:
    """A decision's nested inputs as `map<string, double>` (numbers only; nested keys dotted)."""
    out: dict[str, float] = {}
    for key, value in inputs.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_inputs(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def decision_proto(decision: ReplanDecision, current: common_pb2.Plan | None, chosen: common_pb2.Plan | None,
                   now: float, decision_id: int) -> planner_pb2.PlanDecision:
    """A Replanner decision as the record stored in Redis and shown by Explain."""
    candidates = [planner_pb2.Candidate(plan=to_plan(c, decision.trace, now) if decision.trace else None,
                                        predicted_train_seconds=c.train_s, predicted_rollout_seconds=c.rollout_s,
                                        feasible=True, note=c.describe() + _replayed(decision, c))
                  for c in decision.candidates]
    return planner_pb2.PlanDecision(
        decision_id=decision_id, timestamp=now, chosen=chosen, candidates=candidates, applied=decision.applied,
        reason=decision.reason, predicted_gain=_finite(decision.gain_s),
        transition_cost=_finite(decision.transition_cost_s), trigger=decision.trigger, current=current,
        predicted_current_seconds=_finite(decision.predicted_current_s),
        predicted_new_seconds=_finite(decision.predicted_new_s),
        inputs=flat_inputs({k: v for k, v in decision.inputs.items() if k != "calibration"}),
        trace_sequences=len(decision.trace))


def _replayed(decision: ReplanDecision, candidate) -> str:
    """What the simulated replay gave a candidate, when it played it."""
    played = decision.simulated.get((candidate.layout, candidate.rollout))
    if played is None:
        return ""
    return f"; replayed: {played[0]:.1f}s per step, move cost {played[1]:.0f}s"


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def calibration_report(snapshot: dict, read: dict, now: float) -> planner_pb2.CalibrationReport:
    """`Calibration.snapshot()` and the history counters as the Explain RPC's report."""
    report = planner_pb2.CalibrationReport(turns_read=read.get("turn", 0), steps_read=read.get("step", 0),
                                           updated_at=now)
    estimators, fit = snapshot.get("estimators", {}), snapshot.get("turn_fit", {})
    rows = {name: {"slowdown": fit.get(term, 1.0), "samples": fit.get("samples", 0)}
            for term, name in (("prefill", "prefill_mfu"), ("decode", "decode_bw"))}
    rows.update({name: {"slowdown": 0.0, "samples": fit.get("samples", 0)}  # seconds, not efficiencies
                 for name in ("step_overhead_s", "step_per_seq_s", "request_s")})
    rows.update({"train_mfu": estimators.get("train", {}), "rollout_pipeline": estimators.get("pipeline", {}),
                 "train_overhead_s": {**estimators.get("overhead", {}), "slowdown": 0.0},
                 "turn_gap_s": {"slowdown": 0.0,
                                "samples": snapshot.get("efficiency", {}).get("turn_gap_s", {}).get("samples", 0)}})
    for name, e in rows.items():
        eff = snapshot.get("efficiency", {}).get(name, {})
        report.efficiencies.append(planner_pb2.Efficiency(
            name=name, base=eff.get("base", 0.0), calibrated=eff.get("calibrated", 0.0),
            slowdown=e.get("slowdown", 1.0), std=e.get("std", 0.0), samples=e.get("samples", 0),
            resets=e.get("resets", 0)))
    for what, key in (("turn", "turn_time"), ("step", "step_time")):
        t = snapshot.get(key, {})
        report.times.append(planner_pb2.PredictedVsMeasured(
            what=what, predicted_seconds=t.get("predicted_s", 0.0), measured_seconds=t.get("measured_s", 0.0),
            samples=t.get("samples", 0)))
    for reason, count in snapshot.get("rejected", {}).items():
        report.rejected[reason] = count
    return report


def replan_plan(decision: ReplanDecision, generation: int, now: float) -> common_pb2.Plan:
    """The plan a taken decision installs: the chosen candidate's layout and buckets, `generation`."""
    plan = to_plan(decision.chosen, decision.trace, now)
    plan.generation, plan.source, plan.reason = generation, "replan", decision.reason[:400]
    return plan


def render_explain(reply: planner_pb2.ExplainResponse) -> str:
    """`libra plan explain`: decisions (oldest first), then the calibration, as plain text."""
    lines = [f"mode: {reply.mode or 'static'}"]
    if reply.HasField("plan"):
        lines.append(f"plan in force: {describe(_plan_of(reply.plan))} (source {reply.plan.source})")
    lines.append(f"decisions ({len(reply.decisions)}):")
    for d in reply.decisions:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.timestamp))
        verdict, reason = split_verdict(d.applied, d.reason)
        lines.append(f"  #{d.decision_id} {when} trigger={d.trigger or '-'} {'APPLIED' if d.applied else verdict}: "
                     f"{reason}")
        if d.HasField("current"):
            predicted = f"  predicted {d.predicted_current_seconds:.2f}s" if d.predicted_current_seconds else ""
            lines.append(f"      current: {describe(_plan_of(d.current))}{predicted}")
        if d.HasField("chosen"):
            lines.append(f"      chosen:  {describe(_plan_of(d.chosen))}  predicted "
                         f"{d.predicted_new_seconds or d.chosen.predicted_step_seconds:.2f}s")
        if d.transition_cost or d.predicted_gain:
            lines.append(f"      gain {d.predicted_gain:.1f}s over the horizon, "
                         f"transition cost {d.transition_cost:.1f}s")
        if d.inputs:
            shown = ", ".join(f"{k}={v:.3g}" for k, v in sorted(d.inputs.items()) if not k.startswith("rejected"))
            lines.append(f"      inputs: {shown}")
    c = reply.calibration
    if c.efficiencies:
        lines.append(f"calibration ({c.turns_read} turns, {c.steps_read} steps read):")
        for e in c.efficiencies:
            if e.name == "rollout_pipeline":  # no efficiency of its own: divides both rollout ones
                lines.append(f"  {e.name:<16} slowdown {e.slowdown:.3f} ± {e.std:.3f} ({e.samples} samples, "
                             f"{e.resets} resets; measured batch rollout spans / simulated ones, on top of "
                             f"prefill and decode)")
                continue
            if e.name.endswith("_s"):  # seconds: the turn fit's terms, the trainer's overhead, the turn gap
                source = {"train_overhead_s": f"EWMA, {e.samples} steps",
                          "turn_gap_s": f"mean, {e.samples} turns"}.get(e.name, f"turn fit, {e.samples} turns")
                lines.append(f"  {e.name:<16} base {e.base:.4g}s -> {e.calibrated:.4g}s  ({source})")
                continue
            if e.name in ("prefill_mfu", "decode_bw"):
                lines.append(f"  {e.name:<16} base {e.base:.3f} -> {e.calibrated:.3f}  (slowdown {e.slowdown:.3f}, "
                             f"turn fit, {e.samples} turns)")
                continue
            lines.append(f"  {e.name:<16} base {e.base:.3f} -> {e.calibrated:.3f}  (slowdown {e.slowdown:.3f} "
                         f"± {e.std:.3f}, {e.samples} samples, {e.resets} resets)")
        for t in c.times:
            lines.append(f"  {t.what} time: predicted {t.predicted_seconds:.3f}s, measured {t.measured_seconds:.3f}s "
                         f"({t.samples} samples)")
        for reason, count in sorted(c.rejected.items()):
            lines.append(f"  ignored: {reason} x{count}")
    return "\n".join(lines)


VERDICTS = ("not applied yet", "not applied", "applied")  # longest first: the prefixes reasons start with


def split_verdict(applied: bool, reason: str) -> tuple[str, str]:
    """(verdict, reason without it): the verdict a reason starts with ('not applied yet: 1 of 2 ...'),
    else 'applied' / 'not applied' from the flag, so that Explain and the run record print each
    verdict once (never 'not applied: not applied: ...')."""
    for verdict in VERDICTS:
        if reason.startswith(verdict + ": "):
            return verdict, reason[len(verdict) + 2:]
    return ("applied" if applied else "not applied"), reason


def _plan_of(message: common_pb2.Plan) -> Plan:
    return from_proto(message)
