"""The elastic coordinator driving hybrid replicas, over a real Redis and real gRPC.

The coordinator runs as a real gRPC service with its real driver (`GrpcReplicaDriver`): real
gRPC clients, real hybrid *processes* (a small Python child standing in for the hybrid replica:
it lives, dies or exits with the data plane's exit codes when told). The trainer and the rollout
gateway it talks to are in-process gRPC servers implementing the real `Trainer` and `Rollout`
services whose handlers record each call and can be told to fail, hang, or hold a replica back
from the step manifests: test doubles of the remote processes, so every phase, failure and
ordering can be forced. The coordinator against real rollout and trainer code (the drain
path, a real hybrid process joining the real trainer) is in test_elastic_coordinator_real.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import grpc
import pytest

from libra.services.elastic.driver import GrpcReplicaDriver, HybridProcesses
from libra.services.elastic.server import ElasticService
from libra.v1 import (common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, rollout_pb2, rollout_pb2_grpc,
                      trainer_pb2, trainer_pb2_grpc)
from tests.service.helpers import code_of, run_config, start

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


@pytest.fixture
def pool(redis_url, run_id, tmp_path, arun, request):
    options = getattr(request, "param", {})
    made = arun(Pool(redis_url, run_id, tmp_path, **options).start())
    yield made
    arun(made.stop())


def path(member: epb.Member) -> list[tuple[int, int]]:
    return [(r.to_state, r.generation) for r in member.history]


def test_grow_drains_first_then_joins_through_every_phase(pool, arun):
    arun(pool.register("short-0", "short-1"))
    progress = arun(pool.apply(2, dp=2, short=1))  # returns at once, the work runs in the background
    assert [(a.kind, a.target, a.phase) for a in progress.actions] == [("drain", "short-1", 0), ("join", "hybrid-0", 1)]
    done = arun(pool.wait_plan(2, "applied"))
    assert (done.steps_done, done.steps_total) == (2, 2) and done.finished_at >= done.started_at
    hybrid = arun(pool.member("hybrid-0"))
    assert hybrid.state == S.MEMBER_STATE_ACTIVE and hybrid.plan_generation == 2 and hybrid.pid > 0
    assert path(hybrid) == [(S.MEMBER_STATE_JOINING, 2), (S.MEMBER_STATE_FETCHING_STATE, 4),
                            (S.MEMBER_STATE_ALIGNED, 5), (S.MEMBER_STATE_ACTIVE, 6)]  # 3: the pid was saved
    assert [b.name for b in hybrid.displaced] == ["short"]
    assert [r.member_id for r in done.replicas] == ["hybrid-0"]
    drained = next(t for verb, _, t in pool.rollout.calls if verb == "drained")
    admitted = next(t for verb, *_, t in pool.trainer.calls if verb == "admit")
    assert drained < admitted  # swap rule: the rollout worker is stopped before the join starts
    assert pool.trainer.calls[0][2] == 2  # AdmitHybrid names the generation of the JOINING record
    assert arun(pool.member("short-1")).state == S.MEMBER_STATE_OFFLINE
    # `libra status` shows the pool and the plan's progress
    from libra.status import _gather
    status_config = run_config(pool.config.redis.url, pool.run_id, pool.tmp_path,
                               addresses={"elastic": f"127.0.0.1:{pool.running.port}"})
    lines = arun(_gather(status_config))
    assert any(line.split()[:3] == ["hybrid-0", "hybrid", "active"] for line in lines)
    assert "  plan gen 2: applied, 2/2 actions done" in lines
    # shrink: the release comes first, rollout workers start after
    arun(pool.apply(3, dp=1, short=2))
    arun(pool.wait_plan(3, "applied"))
    released = next(t for verb, *_, t in pool.trainer.calls if verb == "release")
    started = next(t for verb, _, t in pool.rollout.calls if verb == "start")
    assert released < started and ("start", [("short", 1)], started) in pool.rollout.calls
    back = arun(pool.member("hybrid-0"))
    assert back.state == S.MEMBER_STATE_ROLLOUT and back.pid == 0 and back.detail.startswith("released")
    assert [s for s, _ in path(back)][-2:] == [S.MEMBER_STATE_RELEASING, S.MEMBER_STATE_ROLLOUT]
    assert all(a.seconds_in_previous >= 0 and a.at > 0 for a in back.history)


@pytest.mark.parametrize("pool", [{"hybrid": ("0.3", "3")}], indirect=True)
def test_a_failed_snapshot_fetch_rolls_the_whole_replica_back(pool, arun):
    arun(pool.register("short-0"))
    pool.trainer.hold_back.add("hybrid-0")  # it never catches up; its process exits 3 (fetch failed)
    arun(pool.apply(2, dp=2, short=0))
    done = arun(pool.wait_plan(2, "failed"))
    join = next(a for a in done.actions if a.kind == "join")
    assert join.state == "failed" and "rolled back" in join.detail and "exited" in join.detail
    hybrid = arun(pool.member("hybrid-0"))
    assert [s for s, _ in path(hybrid)] == [S.MEMBER_STATE_JOINING, S.MEMBER_STATE_FETCHING_STATE,
                                            S.MEMBER_STATE_FAILED, S.MEMBER_STATE_ROLLOUT]
    assert [g for _, g in path(hybrid)] == sorted(g for _, g in path(hybrid))
    assert "release" in [c[0] for c in pool.trainer.calls]  # the trainer dropped it
    assert ("start", [("short", 1)]) in [c[:2] for c in pool.rollout.calls]  # its GPUs went back to rollout
    assert not hybrid.displaced and hybrid.pid == 0


def test_a_snapshot_failure_the_trainer_reports_rolls_back_and_a_new_join_starts_clean(pool, arun):
    arun(pool.register("short-0"))
    pool.trainer.fail_join["hybrid-0"] = "snapshot fetch failed: shard 3 missing"
    arun(pool.apply(2, dp=2, short=0))
    arun(pool.wait_plan(2, "failed"))
    hybrid = arun(pool.member("hybrid-0"))
    failed = next(r for r in hybrid.history if r.to_state == S.MEMBER_STATE_FAILED)
    assert "shard 3 missing" in failed.detail and hybrid.state == S.MEMBER_STATE_ROLLOUT
    # the trainer still reports the old FAILED admission; the next join (a new generation) ignores it
    del pool.trainer.fail_join["hybrid-0"]
    arun(pool.apply(3, dp=2, short=0))
    arun(pool.wait_plan(3, "applied"))
    admits = [(replica, generation) for verb, replica, generation, _ in pool.trainer.calls if verb == "admit"]
    assert len(admits) == 2 and admits[1][1] > admits[0][1]


@pytest.mark.parametrize("pool", [{"deadlines": {"aligned_s": 0.5, "fetching_state_s": 0.5}}], indirect=True)
def test_a_phase_deadline_rolls_back(pool, arun):
    arun(pool.register())
    pool.trainer.hold_back.add("hybrid-0")
    arun(pool.apply(2, dp=2, short=0))
    arun(pool.wait_plan(2, "failed"))
    hybrid = arun(pool.member("hybrid-0"))
    failed = next(r for r in hybrid.history if r.to_state == S.MEMBER_STATE_FAILED)
    assert failed.from_state == S.MEMBER_STATE_FETCHING_STATE and "deadline of 0.5 s" in failed.detail
    assert failed.seconds_in_previous >= 0.5 and hybrid.state == S.MEMBER_STATE_ROLLOUT
    assert not any(arun(asyncio.to_thread(pool.processes.alive, pid)) for pid in pool.processes.children)


def test_a_hybrid_that_dies_mid_step_is_failed_and_returned_to_rollout(pool, arun):
    arun(pool.register("short-0"))
    arun(pool.apply(2, dp=2, short=0))
    arun(pool.wait_plan(2, "applied"))
    active = arun(pool.member("hybrid-0"))
    os.kill(active.pid, signal.SIGKILL)
    back = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_ROLLOUT))
    assert [s for s, _ in path(back)][-3:] == [S.MEMBER_STATE_ACTIVE, S.MEMBER_STATE_FAILED, S.MEMBER_STATE_ROLLOUT]
    assert "died while active" in back.history[-2].detail
    assert ("start", [("short", 1)]) in [c[:2] for c in pool.rollout.calls]


def test_a_restarted_coordinator_resumes_a_join_whose_process_lives(pool, arun):
    arun(pool.register())
    pool.trainer.hold_back.add("hybrid-0")
    arun(pool.apply(2, dp=2, short=0))
    fetching = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_FETCHING_STATE))
    arun(pool.stop_coordinator())
    arun(pool.start_coordinator())
    resumed = arun(pool.member("hybrid-0"))  # neither shutdown nor restart touched the record
    assert (resumed.state, resumed.generation) == (S.MEMBER_STATE_FETCHING_STATE, fetching.generation)
    pool.trainer.hold_back.clear()
    active = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_ACTIVE))
    assert active.pid == fetching.pid and S.MEMBER_STATE_FAILED not in [s for s, _ in path(active)]
    assert arun(pool.wait_plan(2, "applied")).steps_done == 1


def test_a_restarted_coordinator_rolls_back_a_join_whose_process_died(pool, arun):
    arun(pool.register())
    pool.trainer.hold_back.add("hybrid-0")
    arun(pool.apply(2, dp=2, short=0))
    fetching = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_FETCHING_STATE))
    arun(pool.stop_coordinator())
    os.kill(fetching.pid, signal.SIGKILL)
    arun(pool.start_coordinator())
    back = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_ROLLOUT))
    failed = next(r for r in back.history if r.to_state == S.MEMBER_STATE_FAILED)
    assert "coordinator restart" in failed.detail or "exited" in failed.detail
    # the resumed plan re-runs its stored actions: the rolled-back join fails it, no other replica is tried
    progress = arun(pool.wait_plan(2, "failed"))
    assert [(a.kind, a.target, a.state) for a in progress.actions] == [("join", "hybrid-0", "failed")]
    assert arun(pool.member("hybrid-1")) is None


def test_racing_plans_the_newer_generation_wins(pool, arun):
    arun(pool.register("short-0", "short-1"))
    pool.trainer.hold_back.add("hybrid-0")  # plan 3's join stays in flight
    arun(pool.apply(3, dp=2, short=1))
    arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_FETCHING_STATE))
    arun(pool.apply(4, dp=1, short=2))  # supersedes plan 3: its join is cancelled and rolled back
    back = arun(pool.wait_state("hybrid-0", S.MEMBER_STATE_ROLLOUT))
    assert "superseded by plan 4" in back.history[-2].detail
    assert arun(pool.stub.GetPlanProgress(epb.PlanProgressRequest(generation=3))).state == "superseded"
    arun(pool.wait_plan(4, "applied"))
    # the rollback restarted the worker plan 3 drained; plan 4 was diffed after it, so it starts none
    assert [c[:2] for c in pool.rollout.calls if c[0] == "start"] == [("start", [("short", 1)])], (
        pool.rollout.calls, arun(pool.member("hybrid-0")), arun(pool.stub.GetPlanProgress(epb.PlanProgressRequest())))
    serving = [m for m in arun(pool.stub.ListMembers(epb.ListMembersRequest())).members
               if m.role == epb.ROLE_ROLLOUT and m.state == S.MEMBER_STATE_ROLLOUT]
    assert len(serving) == 2
    # the older generation arriving late is refused with the reason; the same plan again is a no-op
    late = pool.apply(3, dp=2, short=1, rid="late-3")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        arun(late)
    assert refused.value.code() == grpc.StatusCode.ABORTED and "newer plan won" in refused.value.details()
    assert arun(pool.apply(4, dp=1, short=2, rid="again-4")).generation == 4

    arun(pool.store_plan(pool.plan(5, dp=1, short=2)))  # the planner stores 5, then 6; the two ApplyPlans race
    arun(pool.store_plan(pool.plan(6, dp=1, short=2)))

    async def race():
        return await asyncio.gather(pool.apply(6, dp=1, short=2), pool.apply(5, dp=1, short=2),
                                    return_exceptions=True)
    outcomes = arun(race())
    assert not isinstance(outcomes[0], Exception)
    assert isinstance(outcomes[1], Exception) or arun(pool.stub.GetPlanProgress(
        epb.PlanProgressRequest(generation=5))).state == "superseded"
    assert arun(pool.stub.GetPlanProgress(epb.PlanProgressRequest())).generation == 6


def test_transitions_by_rpc_are_checked_and_recorded(pool, arun):
    arun(pool.register("short-0"))
    illegal = epb.TransitionRequest(meta=meta("t1"), member_id="short-0", target=S.MEMBER_STATE_ACTIVE)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        arun(pool.stub.Transition(illegal))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot move a member from MEMBER_STATE_ROLLOUT to MEMBER_STATE_ACTIVE" in refused.value.details()
    moved = arun(pool.stub.Transition(epb.TransitionRequest(meta=meta("t2"), member_id="short-0",
                                                            target=S.MEMBER_STATE_OFFLINE, detail="by hand")))
    assert path(moved) == [(S.MEMBER_STATE_OFFLINE, moved.generation)] and moved.history[0].detail == "by hand"
    assert code_of(arun, pool.stub.GetPlanProgress(epb.PlanProgressRequest())) == grpc.StatusCode.NOT_FOUND
