"""`libra status`: the plan, the pool, the workers and the trainer of a running system, over gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc

from libra.config import RunConfig
from libra.rpc import channel
from libra.services.elastic.report import pool_lines
from libra.v1 import (common_pb2, elastic_pb2, elastic_pb2_grpc, planner_pb2, planner_pb2_grpc, rollout_pb2,
                      rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc)


async def _gather(config: RunConfig) -> list[str]:
    run = config.run_id
    lines: list[str] = []

    async def section(service: str, call) -> None:
        async with channel(config.address_of(service)) as chan:
            try:
                lines.extend(await call(chan))
            except grpc.aio.AioRpcError as error:
                lines.append(f"{service:<9} {config.address_of(service)}: {error.code().name} {error.details() or ''}")

    async def planner(chan):
        plan = await planner_pb2_grpc.PlannerStub(chan).GetPlan(planner_pb2.GetPlanRequest(run_id=run), timeout=3)
        buckets = ", ".join(f"{b.name}(tp{b.tp}, ≤{b.max_tokens} tok) x{b.replicas}" for b in plan.buckets)
        t = plan.training
        return [f"plan      gen {plan.generation} [{plan.source}]: training {t.gpus} GPU tp{t.tp} pp{t.pp} dp{t.dp}; "
                f"rollout {buckets}"]

    async def elastic(chan):
        stub = elastic_pb2_grpc.ElasticCoordinatorStub(chan)
        reply = await stub.ListMembers(elastic_pb2.ListMembersRequest(run_id=run), timeout=3)
        try:
            progress = await stub.GetPlanProgress(elastic_pb2.PlanProgressRequest(run_id=run), timeout=3)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: no plan applied yet
                raise
            progress = None
        return pool_lines(list(reply.members), reply.membership_epoch, progress, time.time())

    async def rollout(chan):
        stub = rollout_pb2_grpc.RolloutStub(chan)
        workers = await stub.ListWorkers(rollout_pb2.ListWorkersRequest(run_id=run), timeout=3)
        stats = await stub.GetStats(rollout_pb2.RolloutStatsRequest(run_id=run), timeout=3)
        rows = [f"rollout   {stats.completed} completed, {stats.failed} failed, {stats.queued} queued, "
                f"{stats.turns} turns ({stats.retried_turns} retried), recent reward {stats.mean_reward:.3f}"]
        for w in workers.workers:
            rows.append(f"  {w.worker_id:<14} {w.bucket:<8} {common_pb2.WorkerState.Name(w.state)[13:].lower():<9} "
                        f"v{w.policy_version} {w.address} in-flight {w.outstanding_requests}")
        return rows

    async def scheduler(chan):
        stats = await scheduler_pb2_grpc.SchedulerStub(chan).GetStats(
            scheduler_pb2.GetStatsRequest(run_id=run), timeout=3)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items()))
        return [f"scheduler {stats.policy}: {stats.active_trajectories} active trajectories; decisions: {reasons}"]

    async def trainer(chan):
        status = await trainer_pb2_grpc.TrainerStub(chan).GetStatus(
            trainer_pb2.TrainerStatusRequest(run_id=run), timeout=3)
        phase = trainer_pb2.TrainerPhase.Name(status.phase)[14:].lower()
        return [f"trainer   {phase} step {status.step}/{status.total_steps} policy v{status.policy_version} "
                f"reward {status.last_mean_reward:.3f} {status.detail}".rstrip()]

    for name, call in (("planner", planner), ("elastic", elastic), ("rollout", rollout),
                       ("scheduler", scheduler), ("trainer", trainer)):
        await section(name, call)
    return lines


def print_status(config: RunConfig) -> int:
    lines = asyncio.run(_gather(config))
    print("\n".join(lines))
    return 0 if not any(": UNAVAILABLE" in line for line in lines) else 1
