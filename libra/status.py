"""`libra status`: the services' health, the plan, the pool, the workers, the buckets and the
trainer of a running system, over gRPC; `--watch` refreshes it in place until the run is done.

On a terminal each refresh redraws the screen (cursor home, clear: what `watch` does); elsewhere
(a pipe, a log file) every refresh is printed as plain text under a time stamp, no escape codes.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import signal
import sys
import time
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.config import RunConfig
from libra.rpc import channel
from libra.services.elastic.report import pool_lines
from libra.v1 import (common_pb2, elastic_pb2, elastic_pb2_grpc, planner_pb2, planner_pb2_grpc, rollout_pb2,
                      rollout_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc)

SERVICES = ("planner", "scheduler", "rollout", "trainer", "elastic")


async def _health(config: RunConfig) -> dict[str, str]:
    """Each service's gRPC health (SERVING, NOT_SERVING) or why it did not answer (UNAVAILABLE, ...)."""

    async def check(service: str) -> str:
        async with channel(config.address_of(service)) as chan:
            try:
                reply = await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.aio.AioRpcError as error:
                return error.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    return dict(zip(SERVICES, await asyncio.gather(*(check(s) for s in SERVICES))))


async def _gather(config: RunConfig, health: dict[str, str] | None = None) -> list[str]:
    run = config.run_id
    health = health if health is not None else await _health(config)
    lines: list[str] = ["services  " + "  ".join(f"{service} {state}" for service, state in health.items())]

    async def section(service: str, call) -> None:
        if health.get(service) == "UNAVAILABLE":  # no answer a moment ago: do not wait for it again
            lines.append(f"{service:<9} {config.address_of(service)}: UNAVAILABLE (health check got no answer)")
            return
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
        rows = [f"scheduler {stats.policy}: {stats.active_trajectories} active trajectories; decisions: {reasons}"]
        for b in sorted(stats.buckets, key=lambda b: b.bucket):
            rows.append(f"  bucket {b.bucket:<8} {b.workers} workers, {b.outstanding_requests} requests and "
                        f"{b.outstanding_tokens} tokens in flight, {b.routed} turns routed")
        return rows

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


async def _watch(config: RunConfig, interval_s: float, stream: TextIO) -> int:
    """Until the trainer says done, or every service stopped answering after one did (the run ended),
    or Ctrl-C: taken by the event loop (a refresh in flight is cancelled), never raised inside a gRPC
    call, whose channel then may not close."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: Ctrl-C raises as usual
        pass
    stopped = asyncio.ensure_future(stop.wait())
    terminal, answered = stream.isatty(), False
    try:
        while True:
            refresh = asyncio.ensure_future(_refresh(config))
            await asyncio.wait({refresh, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                refresh.cancel()
                await asyncio.gather(refresh, return_exceptions=True)
                return 0
            health, lines = refresh.result()
            stamp = datetime.datetime.now().strftime("%H:%M:%S")
            header = f"libra status · run {config.run_id} · {stamp} · every {interval_s:g} s"
            if terminal:  # redraw in place; lines cut to the width so that nothing wraps
                width = shutil.get_terminal_size().columns
                stream.write("\x1b[H\x1b[J" + "\n".join(line[:width] for line in [header + " (Ctrl-C stops)", *lines])
                             + "\n")
            else:
                stream.write("\n".join([f"--- {header}", *lines]) + "\n")
            stream.flush()
            reachable = any(state != "UNAVAILABLE" for state in health.values())
            if any(line.startswith("trainer   done") for line in lines) or (answered and not reachable):
                return 0
            answered = answered or reachable
            await asyncio.wait({stopped}, timeout=interval_s)
            if stop.is_set():
                return 0
    finally:
        stopped.cancel()
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


async def _refresh(config: RunConfig) -> tuple[dict, list[str]]:
    health = await _health(config)
    return health, await _gather(config, health)


def watch_status(config: RunConfig, interval_s: float, stream: TextIO | None = None) -> int:
    """Refresh the status every `interval_s` until the trainer is done (0) or Ctrl-C (0)."""
    try:
        return asyncio.run(_watch(config, interval_s, stream or sys.stdout))
    except KeyboardInterrupt:
        return 0
