"""Planner, scheduler and elastic coordinator as real gRPC servers over a real Redis."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from libra.services.elastic.server import ElasticService
from libra.services.planner.server import PlannerService
from libra.services.scheduler.server import SchedulerService
from libra.v1 import (common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, planner_pb2, planner_pb2_grpc,
                      scheduler_pb2 as spb, scheduler_pb2_grpc)
from tests.service.helpers import code_of, run_config, start


def meta(rid: str, run: str = "") -> common_pb2.RequestMeta:
    return common_pb2.RequestMeta(request_id=rid, run_id=run)


def test_planner_serves_config_plan_with_health_and_reflection(redis_url, run_id, tmp_path, arun, store):
    config = run_config(redis_url, run_id, tmp_path, planner={"buckets": [
        {"name": "short", "tp": 1, "max_tokens": 100, "replicas": 2}, {"name": "long", "tp": 2, "max_tokens": 900}]})
    running, chan = arun(start(PlannerService(config)))
    stub = planner_pb2_grpc.PlannerStub(chan)
    plan = arun(stub.GetPlan(planner_pb2.GetPlanRequest(run_id=run_id)))
    assert plan.generation == 1 and plan.source == "config"
    assert [(b.name, b.tp, b.max_tokens, b.replicas) for b in plan.buckets] == [("short", 1, 100, 2), ("long", 2, 900, 1)]
    decisions = arun(stub.Explain(planner_pb2.ExplainRequest(run_id=run_id))).decisions
    assert len(decisions) == 1 and decisions[0].applied and decisions[0].chosen.generation == 1
    health = arun(health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service="libra.v1.Planner")))
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    async def services():
        stream = reflection_pb2_grpc.ServerReflectionStub(chan).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for reply in stream:
            return sorted(s.name for s in reply.list_services_response.service)
    assert "libra.v1.Planner" in arun(services())
    assert code_of(arun, stub.GetPlan(planner_pb2.GetPlanRequest(run_id="other"))) == grpc.StatusCode.NOT_FOUND
    bad = planner_pb2.ObserveHistoryRequest(meta=meta("r1"), records=[common_pb2.HistoryRecord(kind="nope")])
    assert code_of(arun, stub.ObserveHistory(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    good = planner_pb2.ObserveHistoryRequest(meta=meta("r2"), records=[common_pb2.HistoryRecord(kind="turn")])
    first = arun(stub.ObserveHistory(good))
    assert first.applied
    assert arun(stub.ObserveHistory(good)) == first  # a replay answers the first reply...
    assert arun(store.history_length("turn")) == 1  # ...and appends nothing
    arun(running.stop())
    # a restarted planner keeps the plan in Redis (generation 1, not a new one)
    running, chan = arun(start(PlannerService(config)))
    assert arun(planner_pb2_grpc.PlannerStub(chan).GetPlan(planner_pb2.GetPlanRequest())).generation == 1
    assert len(arun(planner_pb2_grpc.PlannerStub(chan).Explain(planner_pb2.ExplainRequest())).decisions) == 1
    arun(running.stop())


def _worker(wid: str, bucket: str = "short") -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=wid, bucket=bucket, address=f"http://127.0.0.1:1/{wid}",
                                 state=common_pb2.WORKER_STATE_SERVING)


def test_scheduler_routes_least_loaded_with_affinity_and_replays(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    route = lambda rid, tid, **kw: stub.Route(spb.RouteRequest(meta=meta(rid), trajectory_id=tid, prompt_tokens=10,
                                                                max_new_tokens=20, **kw))
    assert code_of(arun, route("r0", "t0")) == grpc.StatusCode.FAILED_PRECONDITION  # no workers yet
    for wid in ("w-a", "w-b"):
        arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta(f"reg-{wid}"), worker=_worker(wid))))
    first = arun(route("r1", "t1"))
    second = arun(route("r2", "t2"))
    assert {first.worker_id, second.worker_id} == {"w-a", "w-b"}  # least outstanding spreads the load
    assert arun(route("r1", "t1")) == first  # a replayed Route returns the first decision
    arun(stub.ReportTurn(spb.TurnReport(meta=meta("d1"), trajectory_id="t1", worker_id=first.worker_id)))
    again = arun(route("r3", "t1"))
    assert again.worker_id == first.worker_id and again.reason == "affinity"
    load = lambda: sum(b.outstanding_requests for b in arun(stub.GetStats(spb.GetStatsRequest())).buckets)
    before = load()
    replayed = arun(stub.ReportTurn(spb.TurnReport(meta=meta("d1"), trajectory_id="t1", worker_id=first.worker_id)))
    assert replayed == common_pb2.Ack(applied=True) and load() == before  # the first Ack; no load released twice
    retried = arun(route("r4", "t1", exclude_workers=[first.worker_id]))
    assert retried.worker_id == second.worker_id and retried.moved
    no_status = spb.ToolReturnReport(meta=meta("x"), trajectory_id="t1", tool="calc")
    assert code_of(arun, stub.ReportToolReturn(no_status)) == grpc.StatusCode.INVALID_ARGUMENT
    unknown = spb.FinishReport(meta=meta("f0"), trajectory_id="nope")
    assert code_of(arun, stub.ReportFinish(unknown)) == grpc.StatusCode.NOT_FOUND
    assert code_of(arun, stub.Route(spb.RouteRequest(trajectory_id="t9"))) == grpc.StatusCode.INVALID_ARGUMENT
    stats = arun(stub.GetStats(spb.GetStatsRequest()))
    assert stats.policy == "load_balance" and stats.active_trajectories == 2
    shared = arun(route("d1", "t9"))  # a Route reusing a report's request id is a request of its own
    assert shared.worker_id in ("w-a", "w-b") and arun(route("d1", "t9")) == shared
    arun(running.stop())
    # the worker registry survives a restart
    running, chan = arun(start(SchedulerService(config)))
    stats = arun(scheduler_pb2_grpc.SchedulerStub(chan).GetStats(spb.GetStatsRequest()))
    assert sorted(w.worker_id for w in stats.workers) == ["w-a", "w-b"]
    arun(running.stop())


def test_elastic_membership_transitions_and_plan_races(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(ElasticService(config)))
    stub = elastic_pb2_grpc.ElasticCoordinatorStub(chan)
    member = epb.Member(member_id="short-0", role=epb.ROLE_ROLLOUT, bucket="short")
    registered = arun(stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("m1"), member=member)))
    assert registered.state == epb.MEMBER_STATE_ROLLOUT and registered.generation == 1
    assert arun(stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("m1"), member=member))) == registered
    listing = arun(stub.ListMembers(epb.ListMembersRequest()))
    assert [m.member_id for m in listing.members] == ["short-0"] and listing.membership_epoch >= 1
    joining = arun(stub.Transition(epb.TransitionRequest(meta=meta("t1"), member_id="short-0",
                                                         target=epb.MEMBER_STATE_JOINING, expected_generation=1)))
    assert joining.generation == 2
    stale = epb.TransitionRequest(meta=meta("t2"), member_id="short-0", target=epb.MEMBER_STATE_FETCHING_STATE,
                                  expected_generation=1)
    assert code_of(arun, stub.Transition(stale)) == grpc.StatusCode.ABORTED
    illegal = epb.TransitionRequest(meta=meta("t3"), member_id="short-0", target=epb.MEMBER_STATE_RELEASING)
    assert code_of(arun, stub.Transition(illegal)) == grpc.StatusCode.FAILED_PRECONDITION
    missing = epb.TransitionRequest(meta=meta("t4"), member_id="ghost", target=epb.MEMBER_STATE_JOINING)
    assert code_of(arun, stub.Transition(missing)) == grpc.StatusCode.NOT_FOUND
    plan = common_pb2.Plan(generation=5, buckets=[common_pb2.BucketSpec(name="short", tp=1, max_tokens=9, replicas=1)])
    arun(running.service.store.put_plan(plan))  # the planner stores a plan, then sends it
    progress = arun(stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta("p5"), plan=plan)))
    assert progress.generation == 5 and progress.steps_total == 1
    older = common_pb2.Plan(generation=4)
    assert code_of(arun, stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta("p4"), plan=older))) == grpc.StatusCode.ABORTED
    arun(running.stop())


def test_cmlfq_scheduler_keeps_its_prefix_tree_across_a_restart(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path, scheduler={"policy": {"type": "cmlfq", "min_visits": 1}})
    service = SchedulerService(config)
    running, chan = arun(start(service))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    for wid, bucket in (("w-s", "short"), ("w-l", "long")):
        arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta(f"reg-{wid}"), worker=_worker(wid, bucket))))
    first = arun(stub.Route(spb.RouteRequest(meta=meta("r1"), trajectory_id="t1", prompt_id="p", prompt_tokens=5,
                                             max_new_tokens=10)))
    assert first.bucket == "short" and first.reason == "new:shortest"
    arun(stub.ReportTurn(spb.TurnReport(meta=meta("d1"), trajectory_id="t1", worker_id=first.worker_id,
                                        output_tokens=10)))
    arun(stub.ReportToolReturn(spb.ToolReturnReport(meta=meta("x1"), trajectory_id="t1", tool="search",
                                                    status=common_pb2.TOOL_STATUS_SUCCESS, payload_tokens=3)))
    arun(stub.ReportFinish(spb.FinishReport(meta=meta("f1"), trajectory_id="t1", prompt_id="p", output_tokens=400)))
    arun(running.stop())  # drain saves the tree
    running, chan = arun(start(SchedulerService(config)))
    assert running.service.policy.forest.to_bytes() == service.policy.forest.to_bytes()
    assert running.service.policy.forest.lookup("p", ["search:small:success"])[0] is not None
    arun(running.stop())


def test_planner_preflight_rpc_searches_and_logs_without_applying(redis_url, run_id, tmp_path, arun):
    import pathlib

    running, chan = arun(start(PlannerService(run_config(redis_url, run_id, tmp_path))))
    stub = planner_pb2_grpc.PlannerStub(chan)
    request = planner_pb2.PreflightRequest(
        cluster_yaml=pathlib.Path("configs/hardware/h200-141g.yaml").read_text(),
        model_yaml=pathlib.Path("configs/models/qwen3-4b.yaml").read_text(), gpus=16, top_k=2,
        trace=[planner_pb2.LengthSample(prompt_tokens=500, output_tokens=o) for o in (100, 900, 3000, 9000)] * 8)
    decision = arun(stub.Preflight(request))
    assert decision.chosen.source == "search" and not decision.applied and len(decision.candidates) <= 2
    assert arun(stub.GetPlan(planner_pb2.GetPlanRequest())).source == "config"  # nothing applied
    assert len(arun(stub.Explain(planner_pb2.ExplainRequest())).decisions) == 2  # config + preflight, logged
    bad = planner_pb2.PreflightRequest(cluster_yaml="memory_gib: [", model_yaml="", gpus=16)
    assert code_of(arun, stub.Preflight(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    arun(running.stop())
