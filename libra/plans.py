"""Plans as domain objects, and their conversion to and from `libra.v1.Plan`.

The planner produces them, the elastic coordinator executes them, the rollout gateway starts
workers from them and the scheduler orders its buckets by them.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from libra.errors import InvalidArgument
from libra.v1 import common_pb2

BUCKET_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_BUCKETS = 64
MAX_TP, MAX_PP, MAX_REPLICAS, MAX_TOKENS = 64, 256, 4096, 10_000_000
"""The bounds a plan's fields have in the config (planner.buckets, planner.training)."""


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


def check_bucket(spec: common_pb2.BucketSpec, where: str, replicas_from: int = 0) -> None:
    """A bucket of a request within the config's bounds (raises InvalidArgument naming the field)."""
    if not BUCKET_NAME.match(spec.name):
        raise InvalidArgument(f"{where}.name must be 1-32 of a-z, 0-9, _ and -, starting with a letter; "
                              f"got {spec.name[:40]!r}")
    if spec.tp > MAX_TP:
        raise InvalidArgument(f"{where}.tp must be in 1..{MAX_TP} (0: 1), got {spec.tp}")
    if spec.max_tokens > MAX_TOKENS:
        raise InvalidArgument(f"{where}.max_tokens must be <= {MAX_TOKENS}, got {spec.max_tokens}")
    if not replicas_from <= spec.replicas <= MAX_REPLICAS:
        raise InvalidArgument(f"{where}.replicas must be in {replicas_from}..{MAX_REPLICAS}, got {spec.replicas}")


def check_plan(message: common_pb2.Plan, max_gpus: int) -> None:
    """A plan from the wire within the config's bounds, its GPUs (training plus every rollout
    worker) at most `max_gpus` (security.limits.max_gpus)."""
    if len(message.buckets) > MAX_BUCKETS:
        raise InvalidArgument(f"plan.buckets: at most {MAX_BUCKETS} buckets, got {len(message.buckets)}")
    names = [b.name for b in message.buckets]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"plan.buckets names must be unique, got {names}")
    for index, bucket in enumerate(message.buckets):
        check_bucket(bucket, f"plan.buckets[{index}]")
    t = message.training
    for name, value, top in (("tp", t.tp, MAX_TP), ("pp", t.pp, MAX_PP), ("dp", t.dp, max_gpus),
                             ("micro_batch", t.micro_batch, 4096), ("gpus", t.gpus, max_gpus)):
        if value > top:
            raise InvalidArgument(f"plan.training.{name} must be <= {top}, got {value}")
    training = max(t.gpus, (t.tp or 1) * (t.pp or 1) * (t.dp or 1))
    rollout = sum((b.tp or 1) * b.replicas for b in message.buckets)
    if training + rollout > max_gpus:
        raise InvalidArgument(f"the plan uses {training} training and {rollout} rollout GPUs, more than "
                              f"security.limits.max_gpus ({max_gpus})")
    if not all(math.isfinite(v) for v in (message.predicted_step_seconds, message.created_at)):
        raise InvalidArgument("plan.predicted_step_seconds and plan.created_at must be finite numbers")
