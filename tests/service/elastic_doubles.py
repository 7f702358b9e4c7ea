"""Test doubles of the remote processes the elastic coordinator talks to, and the harness that
runs the coordinator between them (test_elastic_coordinator.py drives it).

`TrainerDouble` and `RolloutDouble` are in-process gRPC servers implementing the real `Trainer`
and `Rollout` services; their handlers record each call and can be told to fail, hang, or hold a
replica back from the step manifests. `Pool` starts them, a real Redis-backed coordinator with its
real driver (`GrpcReplicaDriver`) and real hybrid *processes* (a small Python child that lives,
dies or exits with the data plane's exit codes when told), and offers what the planner and the
gateway would do to it (register members, store and apply plans) and waits on its state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import grpc

from libra.services.elastic.driver import GrpcReplicaDriver, HybridProcesses
from libra.services.elastic.server import ElasticService
from libra.v1 import (common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, rollout_pb2, rollout_pb2_grpc,
                      trainer_pb2, trainer_pb2_grpc)
from tests.service.helpers import run_config, start

S = epb.MemberState
HYBRID_SCRIPT = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"


def meta(rid: str) -> common_pb2.RequestMeta:
    return common_pb2.RequestMeta(request_id=rid)


class TrainerDouble(trainer_pb2_grpc.TrainerServicer):
    """Trainer side of the elastic hooks, as services/trainer/elastic documents them: an admitted
    replica is JOINING, then SNAPSHOT at the next step, then ACTIVE and in the manifests, unless
    held back (stays SNAPSHOT) or told to fail (FAILED with a reason)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, float]] = []
        self.admitted: dict[str, int] = {}
        self.states: dict[str, tuple[int, int, str]] = {}   # replica -> (HybridState, generation, reason)
        self.hold_back: set[str] = set()
        self.fail_join: dict[str, str] = {}
        self.fail: dict[str, grpc.StatusCode] = {}
        self.step = 0

    async def _record(self, verb: str, request, context) -> None:
        self.calls.append((verb, request.replica_id, request.generation, time.monotonic()))
        if verb in self.fail:
            await context.abort(self.fail[verb], f"{verb} told to fail")

    async def AdmitHybrid(self, request, context):
        await self._record("admit", request, context)
        self.admitted[request.replica_id] = request.generation
        self.states[request.replica_id] = (trainer_pb2.HYBRID_STATE_JOINING, request.generation, "")
        return common_pb2.Ack(applied=True)

    async def ReleaseHybrid(self, request, context):
        await self._record("release", request, context)
        generation = self.admitted.pop(request.replica_id, None)
        if generation is not None:
            self.states[request.replica_id] = (trainer_pb2.HYBRID_STATE_RELEASED, generation, "")
        return common_pb2.Ack(applied=generation is not None)

    async def GetStepManifest(self, request, context):
        self.step += 1  # every poll sees a new step boundary
        H = trainer_pb2
        for replica, generation in list(self.admitted.items()):
            state = self.states[replica][0]
            if replica in self.fail_join and state != H.HYBRID_STATE_FAILED:
                self.states[replica] = (H.HYBRID_STATE_FAILED, generation, self.fail_join[replica])
                del self.admitted[replica]
            elif state == H.HYBRID_STATE_JOINING:
                self.states[replica] = (H.HYBRID_STATE_SNAPSHOT, generation, "")
            elif state == H.HYBRID_STATE_SNAPSHOT and replica not in self.hold_back:
                self.states[replica] = (H.HYBRID_STATE_ACTIVE, generation, "")
        active = [r for r in sorted(self.admitted) if self.states[r][0] == H.HYBRID_STATE_ACTIVE]
        hybrids = [H.HybridReplica(replica_id=r, state=st, generation=g, reason=why)
                   for r, (st, g, why) in sorted(self.states.items())]
        return H.StepManifest(step=self.step, active_replicas=["core-0", *active], hybrids=hybrids)


class RolloutDouble(rollout_pb2_grpc.RolloutServicer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, float]] = []
        self.drain_gate: asyncio.Event | None = None
        self.elastic: elastic_pb2_grpc.ElasticCoordinatorStub | None = None
        self.started = 0

    async def DrainWorker(self, request, context):
        self.calls.append(("drain", request.worker_id, time.monotonic()))
        if self.drain_gate is not None:
            await self.drain_gate.wait()
        self.calls.append(("drained", request.worker_id, time.monotonic()))
        return common_pb2.Ack(applied=True)

    async def StartWorkers(self, request, context):
        specs = [(b.name, b.replicas) for b in request.buckets]
        self.calls.append(("start", specs, time.monotonic()))
        workers = []
        for bucket in request.buckets:
            for _ in range(bucket.replicas):
                self.started += 1
                workers.append(common_pb2.WorkerInfo(worker_id=f"{bucket.name}-new{self.started}", bucket=bucket.name))
                # like the real gateway: a worker is a pool member once it serves, before the reply
                await self.elastic.RegisterMember(epb.RegisterMemberRequest(
                    meta=meta(f"reg-{workers[-1].worker_id}"),
                    member=epb.Member(member_id=workers[-1].worker_id, role=epb.ROLE_ROLLOUT, bucket=bucket.name)))
        return rollout_pb2.ListWorkersResponse(workers=workers)


class Pool:
    """Coordinator + doubles + a real Redis; `hybrid` sets how the hybrid processes behave."""

    def __init__(self, redis_url: str, run_id: str, tmp_path, hybrid=("60", "0"), **elastic: Any):
        deadlines = {"joining_s": 60, "fetching_state_s": 60, "aligned_s": 60, "releasing_s": 60,
                     "rollback_s": 60, "drain_s": 60, "exit_grace_s": 0.2, **elastic.pop("deadlines", {})}
        self.config = run_config(redis_url, run_id, tmp_path, elastic={
            "poll_interval_s": 0.05, "deadlines": deadlines, **elastic})
        self.tmp_path, self.run_id = tmp_path, run_id
        self.argv = ("{python}", "-c", HYBRID_SCRIPT, *hybrid)
        self.trainer, self.rollout = TrainerDouble(), RolloutDouble()
        self.pids: set[int] = set()

    async def start(self) -> "Pool":
        self.servers = []
        addresses = []
        for add, double in ((trainer_pb2_grpc.add_TrainerServicer_to_server, self.trainer),
                            (rollout_pb2_grpc.add_RolloutServicer_to_server, self.rollout)):
            server = grpc.aio.server()
            add(double, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        self.channels = [grpc.aio.insecure_channel(a) for a in addresses]
        await self.start_coordinator()
        return self

    async def start_coordinator(self) -> None:
        self.processes = HybridProcesses(self.argv, {"trainer": "unused:1", "run_id": self.run_id},
                                         self.tmp_path / "hybrids")
        driver = GrpcReplicaDriver(*self.channels, self.run_id, self.processes)
        self.running, chan = await start(ElasticService(self.config, driver=driver))
        self.stub = self.rollout.elastic = elastic_pb2_grpc.ElasticCoordinatorStub(chan)

    async def stop_coordinator(self) -> None:
        self.pids.update(self.processes.children)
        await self.running.stop()

    async def stop(self) -> None:
        await self.stop_coordinator()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for chan in self.channels:
            await chan.close()
        for server in self.servers:
            await server.stop(0)

    async def register(self, *workers: str) -> None:
        await self.stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("reg-core"), member=epb.Member(
            member_id="core", role=epb.ROLE_TRAINING)))
        for worker in workers:
            bucket = worker.split("-")[0]
            await self.stub.RegisterMember(epb.RegisterMemberRequest(meta=meta(f"reg-{worker}"), member=epb.Member(
                member_id=worker, role=epb.ROLE_ROLLOUT, bucket=bucket)))

    @staticmethod
    def plan(generation: int, dp: int, short: int) -> common_pb2.Plan:
        return common_pb2.Plan(generation=generation, training=common_pb2.TrainingLayout(dp=dp, tp=1, pp=1),
                               buckets=[common_pb2.BucketSpec(name="short", tp=1, max_tokens=64, replicas=short)])

    async def store_plan(self, plan: common_pb2.Plan) -> None:
        """Store `plan` as the planner does (its only writer), when it is newer than the stored one."""
        stored = await self.running.service.store.get_plan()
        if stored is None or stored.generation < plan.generation:
            await self.running.service.store.put_plan(plan)

    async def apply(self, generation: int, dp: int, short: int, rid: str = "") -> epb.PlanProgress:
        """What the planner does with a new plan: store it, then send it to ApplyPlan."""
        plan = self.plan(generation, dp, short)
        await self.store_plan(plan)
        return await self.stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta(rid or f"plan-{generation}"), plan=plan))

    async def member(self, member_id: str) -> epb.Member | None:
        members = (await self.stub.ListMembers(epb.ListMembersRequest())).members
        return next((m for m in members if m.member_id == member_id), None)

    async def wait_state(self, member_id: str, *states: int, timeout: float = 20.0) -> epb.Member:
        deadline = time.monotonic() + timeout
        while True:
            member = await self.member(member_id)
            if member is not None and member.state in states:
                return member
            assert time.monotonic() < deadline, f"{member_id} stuck: {member}"
            await asyncio.sleep(0.05)

    async def wait_plan(self, generation: int, *states: str, timeout: float = 20.0) -> epb.PlanProgress:
        deadline = time.monotonic() + timeout
        while True:
            progress = await self.stub.GetPlanProgress(epb.PlanProgressRequest(generation=generation))
            if progress.state in states:
                return progress
            assert time.monotonic() < deadline, f"plan {generation} stuck {progress.state}: {progress}"
            await asyncio.sleep(0.05)
