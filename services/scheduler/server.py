"""The scheduler service: per-turn routing with replay-safe reports and metrics per bucket.

Routing state is in memory for speed (a Route must add well under a millisecond); the worker
registry is saved to Redis so a restarted scheduler routes at once, and in-flight loads are
rebuilt from the reports that follow.

Replays (a request id seen before, on the Session stream or a unary RPC) are answered by the RPC
boundary from `replies`, a window of the last REPLAY_WINDOW requests kept in memory: the state it
protects is in memory too, and a restarted scheduler must apply the reports a reconnecting
gateway sends again, since they rebuild its loads. Scopes are per RPC, so a Route and a report
that share a request id are two requests.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client import Counter, Gauge

from libra import log as liblog
from libra.config import RunConfig
from libra.replay import MemoryReplies
from libra.routing.policy import Decision, Turn, Worker
from libra.routing.registry import make_policy
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.scheduler import convert
from libra.services.scheduler.servicer import SchedulerServicer
from libra.v1 import scheduler_pb2, scheduler_pb2_grpc

_log = liblog.get("libra.scheduler")
ROUTED = Counter("libra_scheduler_routed_total", "turns routed", ["bucket", "reason"])
OUTSTANDING = Gauge("libra_scheduler_outstanding_tokens", "outstanding tokens", ["bucket"])
REPLAY_WINDOW = 200_000
"""Requests whose first reply the scheduler keeps for replays (in memory, like its routing state)."""
TREE_BLOB = "scheduler.tree"
TREE_SAVE_S = 5.0


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_id = config.run_id
        cfg = config.scheduler
        buckets = [(bucket.name, bucket.max_tokens) for bucket in config.planner.buckets]
        self.policy = make_policy(cfg, buckets)
        self.store = None
        self.replies = MemoryReplies(REPLAY_WINDOW)  # the boundary's replay window (module doc)
        self.finished = 0  # trajectories learned from; the tree is saved when this changes

    def service_names(self) -> list[str]:
        return [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

    def register(self, server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        blob = await self.store.load_blob("scheduler.workers")
        for item in json.loads(blob) if blob else []:
            self.policy.register(Worker(**item))
        forest = getattr(self.policy, "forest", None)
        tree = await self.store.load_blob(TREE_BLOB) if forest is not None else None
        if tree:
            from libra.routing.prefix_tree import PrefixForest

            self.policy.forest = PrefixForest.from_bytes(tree)
            _log.info("prefix tree restored from redis", bytes=len(tree))

    async def run(self) -> None:
        """Persist what C-MLFQ learned every few seconds (a restart keeps the tree)."""
        saved = 0
        while True:
            await asyncio.sleep(TREE_SAVE_S)
            saved = await self._save_tree(saved)

    async def _save_tree(self, saved: int) -> int:
        finished = self.finished
        if getattr(self.policy, "forest", None) is None or finished == saved:
            return saved
        await self.store.save_blob(TREE_BLOB, self.policy.forest.to_bytes())
        return finished

    async def drain(self) -> None:
        await self._save_tree(-1)
        _log.info("scheduler ready", policy=self.policy.name, workers=len(self.policy.state.workers))

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    def route(self, turn: Turn) -> Decision:
        decision = self.policy.route(turn)
        ROUTED.labels(decision.bucket, decision.reason).inc()
        if decision.reason.startswith("move:"):  # rare, and what people look for: log every move
            _log.info("move", trajectory_id=turn.trajectory_id, turn=turn.turn, bucket=decision.bucket,
                      reason=decision.reason, worker=decision.worker_id)
        self._update_gauges()
        return decision

    def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int = 0) -> None:
        self.policy.turn_done(trajectory_id, worker_id, output_tokens)
        self._update_gauges()

    def tool_returned(self, trajectory_id: str, tool: str, status: str, payload: int) -> None:
        self.policy.tool_returned(trajectory_id, tool, status, payload)
        self._update_gauges()

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        self.policy.finish(trajectory_id, prompt_id, output_tokens)
        self.finished += 1
        self._update_gauges()

    async def register_worker(self, worker: Worker) -> None:
        self.policy.register(worker)
        self._update_gauges()
        await self._save_workers()
        _log.info("worker registered", worker=worker.worker_id, bucket=worker.bucket, serving=worker.serving)

    async def deregister_worker(self, worker_id: str) -> None:
        self.policy.deregister(worker_id)
        self._update_gauges()
        await self._save_workers()

    async def _save_workers(self) -> None:
        fields = ("worker_id", "bucket", "address", "tp", "serving")
        items = [{f: getattr(w, f) for f in fields} for w in self.policy.state.workers.values()]
        await self.store.save_blob("scheduler.workers", json.dumps(items).encode())

    def _update_gauges(self) -> None:
        totals: dict[str, int] = {}
        for worker in self.policy.state.workers.values():
            totals[worker.bucket] = totals.get(worker.bucket, 0) + worker.outstanding_tokens
        for bucket, tokens in totals.items():
            OUTSTANDING.labels(bucket).set(tokens)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        state = self.policy.state
        buckets: dict[str, scheduler_pb2.BucketStats] = {}
        for worker in state.workers.values():
            stats = buckets.setdefault(worker.bucket, scheduler_pb2.BucketStats(bucket=worker.bucket))
            stats.workers += 1
            stats.outstanding_tokens += worker.outstanding_tokens
            stats.outstanding_requests += worker.outstanding_requests
            stats.routed += worker.routed
        return scheduler_pb2.SchedulerStats(
            policy=self.policy.name, buckets=list(buckets.values()),
            workers=[convert.worker_to_proto(w) for w in state.workers.values()],
            reasons=dict(state.reasons), active_trajectories=len(state.placements))


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(SchedulerService(config), port if port is not None else config.port_of("scheduler"),
                       config.metrics_port_of("scheduler"))
