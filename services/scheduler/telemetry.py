"""What the scheduler records: every C-MLFQ move as it happens, and every telemetry.sample_s the
buckets' occupancy and the routing decisions by reason (run record, TensorBoard, W&B).

Both come from `route` (the scheduler's hot path): a move is one line in the run record, a sample
is taken only when one is due, from `SchedulerService.stats()`. Tags: buckets/<bucket>/*,
routed/<reason> (the cumulative count, `:` in a reason written `_`); the step is the run's
elapsed seconds. Prometheus has the same per bucket and reason (libra_scheduler_*; requests in
flight per bucket, libra_scheduler_outstanding_requests, is set at each sample).
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import Gauge

from libra.routing.policy import Decision, Turn
from libra.telemetry.recorder import probe
from libra.v1 import scheduler_pb2

SERVICE = "scheduler"
REQUESTS = Gauge("libra_scheduler_outstanding_requests", "requests in flight per bucket (at the last sample)",
                 ["bucket"])


def sample_scalars(stats: scheduler_pb2.SchedulerStats) -> dict[str, float]:
    scalars: dict[str, float] = {"scheduler/active_trajectories": stats.active_trajectories}
    for bucket in stats.buckets:
        prefix = f"buckets/{bucket.bucket}"
        scalars.update({f"{prefix}/outstanding_requests": bucket.outstanding_requests,
                        f"{prefix}/outstanding_tokens": bucket.outstanding_tokens,
                        f"{prefix}/workers": bucket.workers, f"{prefix}/routed": bucket.routed})
    scalars.update({f"routed/{reason.replace(':', '_')}": count for reason, count in sorted(stats.reasons.items())})
    return scalars


class SchedulerProbe:
    def __init__(self, recorder, config, clock=time.monotonic) -> None:
        self.recorder, self.every, self.clock = recorder, config.telemetry.sample_s, clock
        self.last = float("-inf")

    def routed(self, turn: Turn, decision: Decision, stats: Callable[[], scheduler_pb2.SchedulerStats]) -> None:
        if decision.reason.startswith("move:"):
            self.recorder.write("move", trajectory_id=turn.trajectory_id, turn=turn.turn, bucket=decision.bucket,
                                reason=decision.reason, worker=decision.worker_id)
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            snapshot = stats()
            for bucket in snapshot.buckets:
                REQUESTS.labels(bucket.bucket).set(bucket.outstanding_requests)
            self.recorder.write(
                "sample", scalars=sample_scalars(snapshot), policy=snapshot.policy,
                buckets={b.bucket: {"requests": b.outstanding_requests, "tokens": b.outstanding_tokens,
                                    "workers": b.workers} for b in snapshot.buckets},
                reasons=dict(snapshot.reasons))


def scheduler_probe(config) -> SchedulerProbe:
    """This process's scheduler probe (the hook in `route`)."""
    return probe(config, SERVICE, SchedulerProbe)
