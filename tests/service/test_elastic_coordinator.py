"""The elastic coordinator driving hybrid replicas, over a real Redis and real gRPC.

The coordinator runs as a real gRPC service with its real driver (`GrpcReplicaDriver`): real
gRPC clients, real hybrid *processes* (a small Python child standing in for the hybrid replica:
it lives, dies or exits with the data plane's exit codes when told). The trainer and the rollout
gateway it talks to are in-process gRPC servers implementing the real `Trainer` and `Rollout`
services whose handlers record each call and can be told to fail, hang, or hold a replica back
from the step manifests: test doubles of the remote processes, so every phase, failure and
ordering can be forced (the doubles and the harness: elastic_doubles.py). The coordinator
against real rollout and trainer code (the drain path, a real hybrid process joining the real
trainer) is in test_elastic_coordinator_real.py.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from libra.v1 import elastic_pb2 as epb
from tests.service.elastic_doubles import S, Pool, meta
from tests.service.helpers import code_of, run_config


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
