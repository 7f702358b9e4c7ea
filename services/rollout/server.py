"""The rollout service: gateway + agent runner in front of the engine workers.

```
 SubmitPrompts ─▶ groups + QUEUED trajectories in Redis ─▶ queue ─▶ N runner tasks
     runner: AgentRunner.play (Route ▸ generate ▸ tools …) ─▶ complete_trajectory (hash + stream, atomic)
 UpdateWeights ─▶ WorkerPool.update_weights (in place, no drain) ─▶ acks in Redis
 restart: every QUEUED/RUNNING trajectory of an unfinished group is queued again (none lost,
          none counted twice: a stream entry is written once, when a trajectory completes)
```
"""

from __future__ import annotations

import asyncio
import collections
import time

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import FailedPrecondition, InvalidArgument, LibraError
from libra.plans import Bucket, Plan, from_proto
from libra.rpc import channel, retry_until, wait_for_peers
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.rollout.agent import AgentRunner, TurnOutcome
from libra.services.rollout.membership import Membership
from libra.services.rollout.router import SchedulerRouter
from libra.services.rollout.servicer import RolloutServicer
from libra.services.rollout.workers import WorkerPool
from libra.v1 import common_pb2, planner_pb2, planner_pb2_grpc, rollout_pb2, rollout_pb2_grpc

_log = liblog.get("libra.rollout")
T = common_pb2


class RolloutService(Service):
    name = "rollout"
    drain_s = 20.0

    def __init__(self, config: RunConfig):
        self.config, self.cfg, self.run_id = config, config.rollout, config.run_id
        self.store = None
        self.pool = WorkerPool(self.cfg.worker, config.run_path / "logs" / "workers")
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.queued: set[str] = set()
        self.counters = collections.Counter()
        self.rewards: collections.deque[float] = collections.deque(maxlen=256)
        self.runner: AgentRunner | None = None
        self.membership: Membership | None = None
        self._channels: list = []

    def service_names(self) -> list[str]:
        return [rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name]

    def register(self, server) -> None:
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self), server)

    def _channel(self, service: str):
        chan = channel(self.config.address_of(service))
        self._channels.append(chan)
        return chan

    async def start(self) -> None:
        from libra.tiny_model import load_tokenizer, stop_token_ids
        from libra.workloads.base import build_workload

        self.store = await connect_store(self.config.redis.url, self.run_id)
        await wait_for_peers({s: self.config.address_of(s) for s in ("planner", "scheduler", "elastic")})
        plan = from_proto(await planner_pb2_grpc.PlannerStub(self._channel("planner")).GetPlan(
            planner_pb2.GetPlanRequest(run_id=self.run_id), timeout=10))
        version, path = await self._wait_for_weights()
        workload = build_workload(self.config.workload)
        tokenizer = load_tokenizer(path)
        router = SchedulerRouter(self._channel("scheduler"), self.run_id)
        self.membership = Membership(self.pool, router, self._channel("elastic"), self.run_id)
        self.runner = AgentRunner(workload, tokenizer, router, self._generate, self.pool.version_of, self.cfg,
                                  stop_token_ids(tokenizer, workload) + [tokenizer.eos_token_id], self.config.seed)
        self.runner.on_turn = self._record_turn
        await self._start_plan(plan, path, version)
        await self.membership.forget_others()
        await self._recover()

    async def _wait_for_weights(self) -> tuple[int, str]:
        """The latest published policy version (the trainer publishes the warm-started model first)."""
        found: dict[str, tuple[int, str]] = {}

        async def published() -> bool:
            version = await self.store.current_version()
            if version >= 1:
                found["v"] = (version, await self.store.weights_path(version))
            return version >= 1

        _log.info("waiting for the first published policy version")
        await retry_until(published, "the trainer's first weights", max_backoff_s=2.0)
        return found["v"]

    async def _start_plan(self, plan: Plan, path: str, version: int) -> list:
        workers = await self.pool.start(plan, path, version)
        for worker in workers:
            await self.membership.join(worker)
        return workers

    async def _recover(self) -> None:
        """Queue every unfinished trajectory of every unfinished group again."""
        recovered = 0
        for group_id in await self.store.inflight_group_ids():
            info = await self.store.group_info(group_id)
            recovered += await self._queue_group(group_id, info.prompt_id, info.samples)
        if recovered:
            _log.info("recovered unfinished trajectories", trajectories=recovered)

    async def _queue_group(self, group_id: str, prompt_id: str, samples: int) -> int:
        ids = [f"{group_id}-s{i}" for i in range(samples)]
        existing = {t.trajectory_id: t for t in await self.store.get_trajectories(ids, missing_ok=True) if t}
        queued = 0
        for index, tid in enumerate(ids):
            traj = existing.get(tid)
            if traj is not None and traj.status not in (T.TRAJECTORY_STATUS_QUEUED, T.TRAJECTORY_STATUS_RUNNING):
                continue
            if traj is None:
                traj = T.Trajectory(trajectory_id=tid, prompt_id=prompt_id, group_id=group_id, sample_index=index,
                                    status=T.TRAJECTORY_STATUS_QUEUED)
                await self.store.put_trajectory(traj)
            if tid not in self.queued:
                self.queued.add(tid)
                self.queue.put_nowait(tid)
                queued += 1
        return queued

    async def submit(self, groups: list[rollout_pb2.PromptGroup]) -> tuple[int, int, int]:
        if self.runner is None:
            raise FailedPrecondition("rollout is still starting its workers")
        accepted = duplicates = queued = 0
        num_prompts = self.runner.workload.num_prompts
        for group in groups:
            if not group.prompt_id.isdigit() or int(group.prompt_id) >= num_prompts:
                raise InvalidArgument(f"groups[{group.group_id}].prompt_id must be an integer in "
                                      f"0..{num_prompts - 1}, got {group.prompt_id!r}")
        for group in groups:
            if await self.store.register_group(group.group_id, group.prompt_id, group.samples, group.min_version):
                accepted += 1
            else:
                duplicates += 1
            queued += await self._queue_group(group.group_id, group.prompt_id, group.samples)
        return accepted, duplicates, queued

    async def _generate(self, decision, ids: list[int], budget: int, seed: int):
        sampling = {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p}
        return await asyncio.wait_for(
            self.pool.generate(decision.worker_id, ids, budget, seed, sampling, self.runner.stop_ids),
            self.cfg.turn_timeout_s)

    async def _record_turn(self, outcome: TurnOutcome, context_tokens: int) -> None:
        self.counters["turns"] += 1
        self.counters["retried_turns"] += outcome.retries
        self.counters["generated_tokens"] += len(outcome.token_ids)
        await self.store.append_history("turn", T.HistoryRecord(
            kind="turn", timestamp=time.time(), bucket=outcome.bucket, prompt_tokens=context_tokens,
            output_tokens=len(outcome.token_ids), seconds=outcome.seconds, queue_depth=self.queue.qsize()))

    async def run(self) -> None:
        runners = [asyncio.create_task(self._run_trajectories(), name=f"runner-{i}")
                   for i in range(self.cfg.max_concurrent_trajectories)]
        monitor = asyncio.create_task(self._monitor(), name="monitor")
        done, _ = await asyncio.wait([*runners, monitor], return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a runner that died takes the service down (never a silent dead task)

    async def _run_trajectories(self) -> None:
        while True:
            tid = await self.queue.get()
            self.queued.discard(tid)
            traj = await self.store.get_trajectory(tid)
            if traj.status not in (T.TRAJECTORY_STATUS_QUEUED, T.TRAJECTORY_STATUS_RUNNING):
                continue
            traj.status = T.TRAJECTORY_STATUS_RUNNING
            await self.store.put_trajectory(traj)
            try:
                traj = await self.runner.play(traj)
            except (LibraError, asyncio.TimeoutError) as error:  # the trajectory fails, the gateway goes on
                traj.status, traj.error, traj.finished_at = T.TRAJECTORY_STATUS_FAILED, str(error), time.time()
                self.counters["failed"] += 1
                _log.warning("trajectory failed", trajectory_id=tid, error=str(error))
            await self.store.complete_trajectory(traj)
            if traj.status == T.TRAJECTORY_STATUS_COMPLETED:
                self.counters["completed"] += 1
                self.rewards.append(traj.reward)
            generated = sum(traj.loss_mask)
            await self.runner.router.finished(tid, traj.prompt_id, generated, traj.status)

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(2.0)
            for worker in await self.pool.check_health():
                await self.membership.leave(worker, "unhealthy")

    async def update_weights(self, version: int, path: str) -> list[rollout_pb2.WorkerAck]:
        import os

        if not os.path.isdir(path):
            raise InvalidArgument(f"path {path!r} is not a directory of this machine (weights of v{version})")
        acks = await self.pool.update_weights(version, path)
        for ack in acks:
            if ack.ok:
                await self.store.record_worker_ack(version, ack.worker_id, ack.seconds)
        _log.info("weights updated", version=version, ok=sum(a.ok for a in acks), workers=len(acks))
        return acks

    async def drain_worker(self, worker_id: str, timeout_s: float) -> None:
        worker = self.pool.get(worker_id)
        await self.membership.leave(worker, "drained")
        await self.pool.drain(worker_id, timeout_s)

    async def start_workers(self, buckets: list[T.BucketSpec]) -> list:
        if self.runner is None:
            raise FailedPrecondition("rollout is still starting")
        version = await self.store.current_version()
        plan = Plan(0, None, tuple(Bucket(b.name, b.tp or 1, b.max_tokens, b.replicas or 1) for b in buckets))
        return await self._start_plan(plan, await self.store.weights_path(version), version)

    def stats(self) -> rollout_pb2.RolloutStats:
        running = sum(w.inflight for w in self.pool.workers.values())
        return rollout_pb2.RolloutStats(
            queued=self.queue.qsize(), running=running, completed=self.counters["completed"],
            failed=self.counters["failed"], turns=self.counters["turns"],
            retried_turns=self.counters["retried_turns"], generated_tokens=self.counters["generated_tokens"],
            mean_reward=sum(self.rewards) / len(self.rewards) if self.rewards else 0.0)

    async def close(self) -> None:
        await self.pool.stop_all()
        for chan in self._channels:
            await chan.close()
        if self.store is not None:
            await self.store.close()


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(RolloutService(config), port if port is not None else config.port_of("rollout"),
                       config.metrics_port_of("rollout"))
