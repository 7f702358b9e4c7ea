"""What the rollout gateway records: throughput, turn latency per bucket, and the policy version
each worker serves (run record, TensorBoard, W&B, Prometheus).

Turns are collected as they finish (`turn`); every telemetry.sample_s the gateway's monitor loop
(`sample`) turns them and the gateway's counters into one record: rates over the interval, latency
percentiles, queue depth, and each worker's bucket, state and version (`libra report` joins these
with the trainer's versions to show each worker's lag). The step is the run's elapsed seconds.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Iterable

from prometheus_client import Gauge, Histogram

from libra.telemetry.recorder import probe
from libra.services.rollout.workers import PoolWorker
from libra.v1 import common_pb2, rollout_pb2

SERVICE = "rollout"
TURN_SECONDS = Histogram("libra_rollout_turn_seconds", "time of one model turn, retries included", ["bucket"],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
ROUTE_SECONDS = Histogram("libra_rollout_route_seconds", "a turn's wait for the scheduler's routing decision",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
WORKER_VERSION = Gauge("libra_rollout_worker_policy_version", "policy version a rollout worker serves",
                       ["worker", "bucket"])
RATES = {"trajectories_per_s": "completed", "failed_per_s": "failed", "turns_per_s": "turns",
         "tokens_per_s": "generated_tokens"}


def _percentiles(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {f"{prefix}/p50_s": pick(0.5), f"{prefix}/p90_s": pick(0.9), f"{prefix}/max_s": ordered[-1],
            f"{prefix}/mean_s": statistics.fmean(ordered)}


class RolloutProbe:
    def __init__(self, recorder, config, clock=time.monotonic) -> None:
        self.recorder, self.every, self.clock = recorder, config.telemetry.sample_s, clock
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.routes: list[float] = []  # each turn's wait for the scheduler's decision
        self.last: tuple[float, dict[str, int]] | None = None  # when, and the counters then
        self.labelled: set[tuple[str, str]] = set()

    def turn(self, bucket: str, seconds: float, route_s: float | None = None) -> None:
        TURN_SECONDS.labels(bucket).observe(seconds)
        self.latencies[bucket].append(seconds)
        if route_s is not None:
            ROUTE_SECONDS.observe(route_s)
            self.routes.append(route_s)

    def sample(self, stats: rollout_pb2.RolloutStats, workers: Iterable[PoolWorker]) -> None:
        workers = list(workers)
        self._export_versions(workers)
        now = self.clock()
        if self.last is not None and now - self.last[0] < self.every:
            return
        previous, self.last = self.last, (now, {field: getattr(stats, field) for field in RATES.values()})
        if previous is None:  # the baseline of the first interval
            self.latencies.clear()
            self.routes.clear()
            return
        seconds = now - previous[0]
        scalars = {f"rollout/{name}": (getattr(stats, field) - previous[1][field]) / seconds
                   for name, field in RATES.items()}
        scalars.update({"rollout/queued": stats.queued, "rollout/running": stats.running,
                        "rollout/recent_reward": stats.mean_reward})
        every_turn = [s for values in self.latencies.values() for s in values]
        scalars.update(_percentiles("turn_latency", every_turn))
        scalars.update(_percentiles("route_wait", self.routes))
        for bucket, values in sorted(self.latencies.items()):
            scalars.update(_percentiles(f"turn_latency/{bucket}", values))
            scalars[f"turns/{bucket}_per_s"] = len(values) / seconds
        for worker in workers:
            scalars[f"workers/{worker.worker_id}/policy_version"] = worker.version
            scalars[f"workers/{worker.worker_id}/inflight"] = worker.inflight
        rows = [{"id": w.worker_id, "bucket": w.bucket, "version": w.version, "inflight": w.inflight,
                 "busy_s": round(w.busy_seconds(), 4), "state": common_pb2.WorkerState.Name(w.state)[13:].lower()}
                for w in workers]
        self.recorder.write("sample", scalars=scalars, histograms={"turn_latency_s": every_turn}, workers=rows,
                            interval_s=round(seconds, 3))
        self.latencies.clear()
        self.routes.clear()

    def _export_versions(self, workers: list[PoolWorker]) -> None:
        current = {(w.worker_id, w.bucket) for w in workers}
        for gone in self.labelled - current:
            WORKER_VERSION.remove(*gone)
        for worker in workers:
            WORKER_VERSION.labels(worker.worker_id, worker.bucket).set(worker.version)
        self.labelled = current


def rollout_probe(config) -> RolloutProbe:
    """This process's rollout probe (the gateway's hooks: a finished turn, a monitor round)."""
    return probe(config, SERVICE, RolloutProbe)
