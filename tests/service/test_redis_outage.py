"""A Redis outage is a pause, not a crash: a service answers NOT_SERVING while its Redis is down,
its calls wait for Redis instead of failing, and it is SERVING again once Redis is back. A Redis
that comes back empty gets back what the service owns there (the planner's plan); policy versions
never go backwards across it. Real Redis (a private one, killed and started again on its port),
real gRPC, the real planner service."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.errors import Conflict
from libra.redis_server import PrivateRedis
from libra.services.planner.server import PlannerService
from libra.services.trainer.publisher import WeightPublisher
from libra.state import StateStore
from libra.v1 import planner_pb2, planner_pb2_grpc
from tests.service.helpers import run_config, start

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(params=[True, False], ids=["persistent", "empty-after-restart"])
def own_redis(request, tmp_path):
    redis = PrivateRedis(tmp_path / "redis", persistent=request.param).start()
    yield redis
    redis.stop()


async def _health(chan) -> int:
    return (await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def _until(predicate, timeout: float = 15.0) -> float:
    started = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started < timeout, "condition not reached"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


def test_a_redis_outage_makes_the_planner_not_serving_then_serving_again(own_redis, run_id, tmp_path, arun):
    config = run_config(own_redis.url, run_id, tmp_path)

    async def scenario():
        running, chan = await start(PlannerService(config))
        stub = planner_pb2_grpc.PlannerStub(chan)
        plan = await stub.GetPlan(planner_pb2.GetPlanRequest(run_id=run_id), timeout=5)
        assert await _health(chan) == SERVING
        own_redis.process.kill()
        own_redis.process.wait()
        await _until(lambda: _is(chan, NOT_SERVING))
        during = asyncio.create_task(running.service.store.get_plan())  # a call made during the outage
        await asyncio.sleep(1.5)
        assert not during.done() and not running.main.done()  # waiting for Redis, not failed, still running
        await asyncio.to_thread(own_redis.restart)
        await _until(lambda: _is(chan, SERVING))
        await asyncio.wait_for(during, 10)
        again = await stub.GetPlan(planner_pb2.GetPlanRequest(run_id=run_id), timeout=5)
        assert again == plan  # the same plan, whether Redis kept it or got it back from the planner
        assert await running.service.store.get_plan() is not None
        await running.stop()
        await chan.close()
    arun(scenario())


async def _is(chan, status: int) -> bool:
    try:
        return await _health(chan) == status
    except grpc.aio.AioRpcError:
        return False


def test_versions_never_go_backwards_when_redis_is_behind(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)

    async def scenario():
        store = await StateStore.connect(redis_url, run_id)
        publisher = WeightPublisher(config, backend=None, store=store, rollout=None)
        (config.run_path / "weights" / "v7").mkdir(parents=True)  # written before Redis lost its counter
        assert await publisher.first_version(checkpoint_version=5) == 8  # above Redis (0), checkpoint, disk
        assert await store.raise_version(7) == 7 and await store.raise_version(3) == 7  # never lowered
        await publisher.record(8, write=False)
        await store._redis.delete(store.keys.policy_version)  # Redis comes back without the counter
        await publisher.record(9, write=False)  # raised to 8 first, then published: no version used twice
        assert await store.current_version() == 9
        with pytest.raises(Conflict):
            await publisher.record(6, write=False)  # below the counter: another trainer's, never overwritten
        await store.close()
    arun(scenario())


def test_a_killed_persistent_redis_comes_back_with_what_it_acknowledged(tmp_path):
    import redis as redis_client

    server = PrivateRedis(tmp_path / "redis", persistent=True).start()
    try:
        client = redis_client.Redis.from_url(server.url)
        for index in range(200):
            client.xadd("stream", {"n": index})
        client.close()
        server.process.kill()  # SIGKILL: no shutdown save; only the append-only file is left
        server.process.wait()
        server.restart()
        client = redis_client.Redis.from_url(server.url)
        assert client.xlen("stream") == 200 and client.config_get("appendfsync")["appendfsync"] == "always"
        client.close()
    finally:
        server.stop()
