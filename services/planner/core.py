"""Planner decisions as pure functions. `mode: static` turns the configured allocation into plan
generation 1; the Global Resource Planner's search plugs in here with the same outputs."""

from __future__ import annotations

from libra.plans import Bucket, Plan, Training
from libra.services.planner.config import PlannerConfig


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
