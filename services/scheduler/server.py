"""The scheduler service: per-turn routing with replay-safe reports and metrics per bucket.

Routing state is in memory for speed; every applied batch of routing messages is saved to Redis
(services/scheduler/live.py: one MULTI per batch) before its answers and acknowledgements go out,
and the worker registry when it changes, so a restarted scheduler routes every live trajectory as
if it had never stopped: same placements, levels and loads, and the prefix tree with every finish
it had learned from (the tree blob every TREE_SAVE_S, plus the finishes since, replayed).

Replays (a request id seen before, on the Session stream or a unary RPC) are answered by the RPC
boundary from `replies`, a window of the last REPLAY_WINDOW requests kept in memory. Memory alone
would not be exact across a restart: a message applied and saved but not yet acknowledged is sent
again by the reconnecting gateway, and must be answered, not applied twice. So each live
trajectory's saved record carries the replies to its latest requests, and a restarted scheduler
puts them back into the window. Scopes are per RPC, so a Route and a report that share a request
id are two requests.
"""

from __future__ import annotations

import asyncio
import json

from prometheus_client import Counter, Gauge

from libra import log as liblog
from libra.config import RunConfig
from libra.replay import MemoryReplies
from libra.routing.policy import Decision, Turn, Worker
from libra.routing.prefix_tree import PrefixForest
from libra.routing.registry import make_policy
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.scheduler import convert
from libra.services.scheduler.live import LiveState, export_trajectory
from libra.services.scheduler.servicer import SchedulerServicer
from libra.services.scheduler.telemetry import scheduler_probe
from libra.v1 import scheduler_pb2, scheduler_pb2_grpc

_log = liblog.get("libra.scheduler")
ROUTED = Counter("libra_scheduler_routed_total", "turns routed", ["bucket", "reason"])
OUTSTANDING = Gauge("libra_scheduler_outstanding_tokens", "outstanding tokens", ["bucket"])
REPLAY_WINDOW = 200_000
"""Requests whose first reply the scheduler keeps for replays (in memory, like its routing state)."""
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
        self.live = LiveState(self.policy, learns=getattr(self.policy, "forest", None) is not None)
        self._saving = asyncio.Lock()  # saves in the order their changes were taken

    def service_names(self) -> list[str]:
        return [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

    def register(self, server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        blob = await self.store.load_blob("scheduler.workers")
        for item in json.loads(blob) if blob else []:
            self.policy.register(Worker(**item))
        saved = await self.store.load_routing()
        if saved.tree and getattr(self.policy, "forest", None) is not None:
            self.policy.forest = PrefixForest.from_bytes(saved.tree)
        replies = self.live.restore(saved.tree_learned, saved.learned, saved.live)
        for scope, request_id, reply in replies:
            self.replies.keep(scope, request_id, reply)
        self.policy.state.rotation = saved.rotation
        if saved.tree or saved.learned or saved.live:  # anything saved: a restart, not a fresh run
            _log.info("routing state restored from redis", tree_bytes=len(saved.tree or b""),
                      finishes_replayed=len(saved.learned), live_trajectories=len(saved.live))

    async def run(self) -> None:
        """Persist what C-MLFQ learned every few seconds (the finishes since are kept one by one)."""
        saved = self.live.learned_count
        while True:
            await asyncio.sleep(TREE_SAVE_S)
            saved = await self._save_tree(saved)

    async def _save_tree(self, saved: int) -> int:
        learned = self.live.learned_count
        if getattr(self.policy, "forest", None) is None or learned == saved:
            return saved
        payload = self.policy.forest.to_bytes()  # with `learned`, one consistent snapshot (no await between)
        async with self._saving:  # the finishes it includes are written first
            await self._persist_taken()
            await self.store.save_tree(payload, learned)
        return learned

    def replied(self, trajectory_id: str, scope: str, request_id: str, reply) -> None:
        """Keep the reply to a routing request with its trajectory's record (module doc)."""
        self.live.replied(trajectory_id, scope, request_id, reply)

    async def persist(self) -> None:
        """Save what the messages applied so far changed (before they are answered or acknowledged)."""
        if self.store is None:
            return
        async with self._saving:
            await self._persist_taken()

    async def _persist_taken(self) -> None:
        taken = self.live.take()
        if taken is not None:
            changed, finished, learned = taken
            await self.store.save_routing(changed, finished, learned, self.policy.state.rotation)

    async def drain(self) -> None:
        await self.persist()
        await self._save_tree(-1)
        _log.info("scheduler ready", policy=self.policy.name, workers=len(self.policy.state.workers))

    async def redis_back(self) -> None:
        """Redis came back: if it lost the scheduler's records (no persistence), write them again."""
        if self.policy.state.workers and await self.store.load_blob("scheduler.workers") is None:
            _log.warning("redis lost the scheduler's state; writing it again",
                         workers=len(self.policy.state.workers), live=len(self.policy.state.placements))
            await self._save_workers()
            self.live.mark_all()
            await self.persist()
            await self._save_tree(-1)

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    def route(self, turn: Turn) -> Decision:
        decision = self.policy.route(turn)
        self.live.touch(turn.trajectory_id)
        ROUTED.labels(decision.bucket, decision.reason).inc()
        scheduler_probe(self.config).routed(turn, decision, self.stats)
        if decision.reason.startswith("move:"):  # rare, and what people look for: log every move
            _log.info("move", trajectory_id=turn.trajectory_id, turn=turn.turn, bucket=decision.bucket,
                      reason=decision.reason, worker=decision.worker_id)
        self._update_gauges()
        return decision

    def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int = 0) -> None:
        self.policy.turn_done(trajectory_id, worker_id, output_tokens)
        self.live.touch(trajectory_id)
        self._update_gauges()

    def tool_returned(self, trajectory_id: str, tool: str, status: str, payload: int) -> None:
        self.policy.tool_returned(trajectory_id, tool, status, payload)
        self.live.touch(trajectory_id)
        self._update_gauges()

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        before = export_trajectory(self.policy, trajectory_id)
        self.policy.finish(trajectory_id, prompt_id, output_tokens)
        self.live.finished(trajectory_id, prompt_id, output_tokens, before)
        self._update_gauges()

    def forget(self, trajectory_id: str) -> bool:
        """Drop a trajectory without learning from it: a restarted gateway plays it again from its
        first turn. False when it was not routed (nothing to drop)."""
        if trajectory_id not in self.policy.state.placements:
            return False
        self.live.forget(trajectory_id)
        self._update_gauges()
        return True

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
