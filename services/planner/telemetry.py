"""What the planner records: every plan decision with its reason, and (online mode) each tick's
calibration: the step and turn times the calibrated model predicts against those measured, and
the cost model's efficiencies (run record, TensorBoard, W&B, Prometheus).

Tags: planner/* (seconds, efficiencies), plan/* (plan/applied 1 or 0 at each decision, the
generation of each applied one; plan/decision as text with the reason); the step is the run's elapsed seconds.
"""

from __future__ import annotations

from prometheus_client import Gauge

from libra.plans import from_proto
from libra.services.planner.core import describe, split_verdict
from libra.telemetry.recorder import probe
from libra.v1 import planner_pb2

SERVICE = "planner"
GENERATION = Gauge("libra_planner_plan_generation", "generation of the plan in force")


def tick_scalars(snapshot: dict) -> dict[str, float]:
    scalars = {"planner/predicted_step_s": snapshot["step_time"]["predicted_s"],
               "planner/measured_step_s": snapshot["step_time"]["measured_s"],
               "planner/step_samples": snapshot["step_time"]["samples"],
               "planner/predicted_turn_s": snapshot["turn_time"]["predicted_s"],
               "planner/measured_turn_s": snapshot["turn_time"]["measured_s"]}
    scalars.update({f"planner/efficiency/{name}": values["calibrated"]
                    for name, values in sorted(snapshot["efficiency"].items())})
    return scalars


class PlannerProbe:
    def __init__(self, recorder, config) -> None:
        self.recorder = recorder

    def tick(self, snapshot: dict) -> None:
        """An online tick's calibration snapshot (Calibration.snapshot())."""
        self.recorder.write("tick", scalars=tick_scalars(snapshot))

    def decision(self, record: planner_pb2.PlanDecision) -> None:
        """A decision as stored in plan:decisions."""
        plan = describe(from_proto(record.chosen)) if record.HasField("chosen") else ""
        scalars = {"plan/applied": float(record.applied)}
        if record.applied:
            scalars["plan/generation"] = record.chosen.generation
            GENERATION.set(record.chosen.generation)
        verdict, reason = split_verdict(record.applied, record.reason)
        self.recorder.write(
            "decision", t=record.timestamp or None, scalars=scalars,
            text={"plan/decision": f"**{verdict}** ({record.trigger or 'config'}): {reason}\n\n{plan}"},
            trigger=record.trigger, applied=record.applied, reason=record.reason, plan=plan,
            generation=record.chosen.generation if record.applied else None,
            predicted_current_s=record.predicted_current_seconds, predicted_new_s=record.predicted_new_seconds,
            predicted_gain_s=record.predicted_gain, transition_cost_s=record.transition_cost)


def planner_probe(config) -> PlannerProbe:
    """This process's planner probe (hooks: each online tick, each stored decision)."""
    return probe(config, SERVICE, PlannerProbe)
