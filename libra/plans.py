"""Plans as domain objects, and their conversion to and from `libra.v1.Plan`.

The planner produces them, the elastic coordinator executes them, the rollout gateway starts
workers from them and the scheduler orders its buckets by them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from libra.v1 import common_pb2


@dataclass(frozen=True)
class Bucket:
    name: str
    tp: int
    max_tokens: int
    replicas: int


@dataclass(frozen=True)
class Training:
    gpus: int = 0
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 8


@dataclass(frozen=True)
class Plan:
    generation: int
    training: Training
    buckets: tuple[Bucket, ...]
    source: str = "config"
    reason: str = ""
    predicted_step_seconds: float = 0.0
    created_at: float = field(default_factory=time.time)

    def bucket(self, name: str) -> Bucket:
        for bucket in self.buckets:
            if bucket.name == name:
                return bucket
        raise KeyError(name)


def to_proto(plan: Plan) -> common_pb2.Plan:
    return common_pb2.Plan(
        generation=plan.generation,
        training=common_pb2.TrainingLayout(**vars(plan.training)),
        buckets=[common_pb2.BucketSpec(name=b.name, tp=b.tp, max_tokens=b.max_tokens, replicas=b.replicas)
                 for b in plan.buckets],
        source=plan.source, reason=plan.reason,
        predicted_step_seconds=plan.predicted_step_seconds, created_at=plan.created_at)


def from_proto(message: common_pb2.Plan) -> Plan:
    t = message.training
    return Plan(
        generation=message.generation,
        training=Training(gpus=t.gpus, tp=t.tp or 1, pp=t.pp or 1, dp=t.dp or 1, micro_batch=t.micro_batch or 1),
        buckets=tuple(Bucket(b.name, b.tp, b.max_tokens, b.replicas) for b in message.buckets),
        source=message.source, reason=message.reason,
        predicted_step_seconds=message.predicted_step_seconds, created_at=message.created_at)
