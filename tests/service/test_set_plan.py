"""Plans made by hand go through the planner (Planner.SetPlan), the plan record's only writer: it
stores them as the next generation, records them (Explain) and sends them to the coordinator, which
applies only the stored plan. Real planner, real elastic coordinator, real gRPC, real Redis (the
coordinator's trainer and rollout gateway are the doubles of test_elastic_coordinator.py)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import redis.asyncio as aioredis

from libra.runtime import RunningService
from libra.services.elastic.server import ElasticService
from libra.services.planner.delivery import request_id
from libra.services.planner.observation import candidate_from_plan
from libra.services.planner.server import PlannerService
from libra.v1 import common_pb2, elastic_pb2 as epb, planner_pb2, planner_pb2_grpc
from tests.service.elastic_doubles import Pool, meta
from tests.service.helpers import code_of, run_config, start
from tests.service.test_grpcurl import grpcurl, needs_grpcurl
from tests.service.test_planner_online import free_port, planner_config


def _short(replicas: int) -> common_pb2.BucketSpec:
    return common_pb2.BucketSpec(name="short", tp=1, max_tokens=64, replicas=replicas)


def set_plan(rid: str, dp: int, short: int, reason: str = "room for a hybrid") -> planner_pb2.SetPlanRequest:
    return planner_pb2.SetPlanRequest(meta=meta(rid), buckets=[_short(short)], reason=reason,
                                      training=common_pb2.TrainingLayout(dp=dp, tp=1, pp=1))


async def _until(check, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return result


@pytest.fixture
def pool(redis_url, run_id, tmp_path, arun):
    made = arun(Pool(redis_url, run_id, tmp_path).start())
    yield made
    arun(made.stop())


def test_set_plan_stores_the_next_generation_and_the_coordinator_applies_it(pool, arun, store, tmp_path):
    arun(pool.register("short-0", "short-1"))
    config = run_config(pool.config.redis.url, pool.run_id, tmp_path,
                        addresses={"elastic": f"127.0.0.1:{pool.running.port}"})
    running, chan = arun(start(PlannerService(config)))
    planner = planner_pb2_grpc.PlannerStub(chan)
    try:
        assert arun(store.get_plan()).generation == 1  # the config's plan
        stored = arun(planner.SetPlan(set_plan("s1", dp=2, short=1)))
        assert (stored.generation, stored.source, stored.reason) == (2, "manual", "room for a hybrid")
        assert arun(store.get_plan()) == stored
        # sent as an applied replan is (in the background): the coordinator applies it, draining first
        arun(_until(lambda: store.recall_result("ElasticCoordinator.ApplyPlan", request_id(2)), "the send"))
        done = arun(pool.wait_plan(2, "applied"))
        assert [(a.kind, a.target) for a in done.actions] == [("drain", "short-1"), ("join", "hybrid-0")]
        # Explain shows it, with its reason, marked as set by hand
        reply = arun(planner.Explain(planner_pb2.ExplainRequest(limit=10)))
        assert [(d.trigger, d.applied) for d in reply.decisions] == [("config", True), ("manual", True)]
        manual = reply.decisions[-1]
        assert manual.reason == "set by hand: room for a hybrid" and manual.chosen == stored
        assert manual.current.generation == 1 and reply.plan == stored
        # mutating: the same request id replays the first reply; a new one is a new generation
        assert arun(planner.SetPlan(set_plan("s1", dp=1, short=2))) == stored
        assert arun(store.get_plan()) == stored
        again = arun(planner.SetPlan(set_plan("s2", dp=1, short=2, reason="give it back")))
        assert again.generation == 3
        arun(_until(lambda: store.recall_result("ElasticCoordinator.ApplyPlan", request_id(3)), "the send"))
        assert arun(pool.wait_plan(3, "applied")).generation == 3
        assert arun(planner.GetPlan(planner_pb2.GetPlanRequest())) == again
    finally:
        arun(running.stop())


def test_apply_plan_refuses_a_plan_that_is_not_the_stored_one_and_changes_nothing(pool, arun, store, redis_url,
                                                                                  run_id):
    stored = pool.plan(2, dp=1, short=1)
    arun(pool.store_plan(stored))  # as the planner does

    async def snapshot() -> dict:
        client = aioredis.from_url(redis_url)
        try:
            keys = sorted([k async for k in client.scan_iter(match=f"libra:{{{run_id}}}:*")])
            return {key: await client.dump(key) for key in keys}
        finally:
            await client.aclose()

    before = arun(snapshot())
    refusals = {
        "newer": pool.plan(3, dp=1, short=1),                                  # a generation nobody stored
        "other content": pool.plan(2, dp=1, short=2),                          # the stored generation, changed
        "far": pool.plan(2**63, dp=1, short=1),
    }
    for rid, plan in refusals.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            arun(pool.stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta(rid.replace(" ", "-")), plan=plan)))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, rid
        assert "send one of your own with Planner.SetPlan" in refused.value.details(), rid
    assert arun(snapshot()) == before  # no plan, no progress, no reply, no claim: nothing changed
    assert code_of(arun, pool.stub.GetPlanProgress(epb.PlanProgressRequest())) == grpc.StatusCode.NOT_FOUND
    # the stored plan itself is applied
    assert arun(pool.stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta("stored"), plan=stored))).generation == 2


def test_set_plan_is_bounded_and_needs_a_request_id_and_a_reason(redis_url, run_id, tmp_path, arun, store):
    config = run_config(redis_url, run_id, tmp_path, addresses={"elastic": f"127.0.0.1:{free_port()}"})
    running, chan = arun(start(PlannerService(config)))
    planner = planner_pb2_grpc.PlannerStub(chan)
    try:
        first = arun(store.get_plan())
        bad = [planner_pb2.SetPlanRequest(buckets=[_short(1)], reason="no id"),
               set_plan("no-reason", dp=1, short=1, reason="  "),
               set_plan("long-reason", dp=1, short=1, reason="x" * 1001),
               set_plan("replicas", dp=1, short=10**6),
               planner_pb2.SetPlanRequest(meta=meta("gpus"), reason="too big", buckets=[common_pb2.BucketSpec(
                   name="short", tp=64, max_tokens=64, replicas=4096)]),  # > security.limits.max_gpus
               planner_pb2.SetPlanRequest(meta=meta("name"), reason="bad name", buckets=[
                   common_pb2.BucketSpec(name="Bad Name", tp=1, max_tokens=64, replicas=1)]),
               planner_pb2.SetPlanRequest(meta=meta("dp"), reason="dp", training=common_pb2.TrainingLayout(
                   dp=2**32 - 1))]
        for request in bad:
            assert code_of(arun, planner.SetPlan(request)) == grpc.StatusCode.INVALID_ARGUMENT, request.reason
        assert arun(store.get_plan()) == first  # none was stored
        assert len(arun(store.plan_decisions(10))) == 1  # nor recorded
    finally:
        arun(running.stop())


def test_a_hand_made_plan_not_delivered_is_sent_again_by_a_restarted_planner(redis_url, run_id, tmp_path, arun,
                                                                             store):
    port = free_port()  # nothing listens here yet
    config = run_config(redis_url, run_id, tmp_path, addresses={"elastic": f"127.0.0.1:{port}"})
    service = PlannerService(config)
    running, chan = arun(start(service))
    stored = arun(planner_pb2_grpc.PlannerStub(chan).SetPlan(set_plan("s1", dp=1, short=0)))
    assert stored.generation == 2 and arun(store.get_plan()) == stored  # stored regardless
    arun(asyncio.gather(*service._handovers))  # the one attempt: unavailable
    assert arun(store.recall_result("ElasticCoordinator.ApplyPlan", request_id(2))) is None
    arun(running.stop())
    elastic = arun(RunningService(ElasticService(run_config(redis_url, run_id, tmp_path)), port,
                                  host="127.0.0.1").start())
    running, _ = arun(start(PlannerService(config)))
    try:
        arun(_until(lambda: store.recall_result("ElasticCoordinator.ApplyPlan", request_id(2)), "the resend"))
        progress = arun(_until(lambda: elastic.service.plan_progress(0), "the plan's progress"))
        assert progress.generation == 2
    finally:
        arun(running.stop())
        arun(elastic.stop())


def test_online_the_replanner_adopts_a_hand_made_plan(redis_url, run_id, tmp_path, arun, store):
    elastic, _ = arun(start(ElasticService(run_config(redis_url, run_id, tmp_path))))
    service = PlannerService(planner_config(redis_url, run_id, tmp_path, elastic.port))
    running, chan = arun(start(service))
    try:
        request = planner_pb2.SetPlanRequest(
            meta=meta("s1"), reason="operator's layout", buckets=[_short(4)],
            training=common_pb2.TrainingLayout(gpus=8, dp=2, tp=4, pp=1, micro_batch=8))
        stored = arun(planner_pb2_grpc.PlannerStub(chan).SetPlan(request))
        assert stored.generation == 2
        arun(_until(lambda: store.recall_result("ElasticCoordinator.ApplyPlan", request_id(2)), "the send"))
        adopted, wanted = service.replanner.current, candidate_from_plan(stored)
        assert (adopted.layout, adopted.rollout) == (wanted.layout, wanted.rollout)  # in force for its next decision
        assert "pending_apply" not in service.online
        assert arun(service.tick()) is None  # no history: nothing decided, the hand-made plan stays
        assert arun(store.get_plan()) == stored
    finally:
        arun(running.stop())
        arun(elastic.stop())


@needs_grpcurl
def test_set_plan_by_grpcurl(pool, arun, store, tmp_path):
    """The example of docs/operations.md ("Setting a plan by hand"), with the real grpcurl binary."""
    arun(pool.register("short-0"))
    config = run_config(pool.config.redis.url, pool.run_id, tmp_path,
                        addresses={"elastic": f"127.0.0.1:{pool.running.port}"})
    running, _ = arun(start(PlannerService(config)))
    try:
        body = {"meta": {"request_id": "by-hand-1", "run_id": pool.run_id},
                "reason": "a second short worker",
                "training": {"dp": 1, "tp": 1, "pp": 1, "micro_batch": 16},
                "buckets": [{"name": "short", "tp": 1, "max_tokens": 10, "replicas": 2},
                            {"name": "long", "tp": 1, "max_tokens": 512, "replicas": 1}]}
        called = arun(asyncio.to_thread(grpcurl, "-plaintext", "-d", json.dumps(body),
                                        f"127.0.0.1:{running.port}", "libra.v1.Planner/SetPlan"))
        assert called.returncode == 0, called.stderr
        plan = json.loads(called.stdout)
        assert (plan["generation"], plan["source"]) == ("2", "manual")
        arun(_until(lambda: store.recall_result("ElasticCoordinator.ApplyPlan", request_id(2)), "the send"))
        progress = arun(pool.wait_plan(2, "applied"))
        assert sorted((a.kind, a.target) for a in progress.actions) == [("start", "long"), ("start", "short")]
    finally:
        arun(running.stop())
