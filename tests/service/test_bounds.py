"""Inputs are bounded (docs/operations.md, "Security"): the coordinator applies only the plan the
planner stored, Preflight is capped in GPUs, size and time (and a SIGTERM still stops the planner),
StartWorkers by security.limits.max_workers, and requests that once crashed a service or locked
it up get INVALID_ARGUMENT instead. Real services and servicers, real gRPC, real Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import yaml

from libra.redis_server import free_port
from libra.rpc import wire_services
from libra.services.elastic.server import ElasticService
from libra.services.planner.server import PlannerService
from libra.services.scheduler.server import SchedulerService
from libra.v1 import (common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, planner_pb2, planner_pb2_grpc, rollout_pb2,
                      scheduler_pb2, scheduler_pb2_grpc)
from tests.service.helpers import code_of, run_config, start
from tests.service.rpc_probes import Harness

CODES = grpc.StatusCode
CLUSTER = open("configs/hardware/h200-141g.yaml").read()
MODEL = open("configs/models/qwen3-4b.yaml").read()


def meta(rid: str) -> common_pb2.RequestMeta:
    return common_pb2.RequestMeta(request_id=rid)


def _bucket(**fields) -> common_pb2.BucketSpec:
    return common_pb2.BucketSpec(**{"name": "short", "tp": 1, "max_tokens": 64, "replicas": 1, **fields})


def test_the_coordinator_applies_only_the_plan_the_planner_stored(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path, elastic={"hybrid_command": []},
                        addresses={"trainer": f"127.0.0.1:{free_port()}", "rollout": f"127.0.0.1:{free_port()}"})
    running, chan = arun(start(ElasticService(config)))
    stub = elastic_pb2_grpc.ElasticCoordinatorStub(chan)
    store = running.service.store

    def apply(rid: str, **plan) -> grpc.StatusCode:
        try:
            arun(stub.ApplyPlan(epb.ApplyPlanRequest(meta=meta(rid), plan=common_pb2.Plan(**plan)), timeout=10))
        except grpc.aio.AioRpcError as error:
            return error.code()
        return CODES.OK

    def planner_stores(generation: int, **plan) -> None:
        arun(store.put_plan(common_pb2.Plan(generation=generation, **plan)))  # the planner: the only writer

    try:
        assert apply("lockout", generation=2**64 - 1) == CODES.FAILED_PRECONDITION  # once locked out every plan
        assert apply("first", generation=2, buckets=[_bucket()]) == CODES.FAILED_PRECONDITION  # nothing stored
        assert arun(store.get_plan()) is None
        planner_stores(2, buckets=[_bucket()])
        assert apply("g2", generation=2, buckets=[_bucket()]) == CODES.OK
        assert apply("g3", generation=3, buckets=[_bucket()]) == CODES.FAILED_PRECONDITION  # a hand-made jump
        assert apply("far", generation=2**63, buckets=[_bucket()]) == CODES.FAILED_PRECONDITION
        planner_stores(3, buckets=[_bucket()], source="replan")
        assert apply("g3-stored", generation=3, buckets=[_bucket()], source="replan") == CODES.OK
        assert apply("older", generation=2, buckets=[_bucket()]) == CODES.ABORTED
        stored = arun(store.get_plan())
        assert stored.generation == 3
        planner_next = common_pb2.Plan(generation=stored.generation + 1, buckets=[_bucket(replicas=2)], source="replan")
        arun(store.put_plan(planner_next))  # the planner stores its plan, then applies it
        assert apply("other", generation=planner_next.generation, buckets=[_bucket(replicas=3)]) == \
            CODES.FAILED_PRECONDITION  # the stored generation with other content
        assert arun(store.get_plan()) == planner_next
        assert apply("planner", generation=planner_next.generation, buckets=[_bucket(replicas=2)],
                     source="replan") == CODES.OK
        for bad in ({"buckets": [_bucket(replicas=10**6)]}, {"buckets": [_bucket(tp=1000)]},
                    {"buckets": [_bucket(name="Bad Name")]}, {"buckets": [_bucket(), _bucket()]},
                    {"training": common_pb2.TrainingLayout(dp=2**32 - 1)},
                    {"buckets": [_bucket(tp=64, replicas=4096)]},  # 262,144 GPUs > security.limits.max_gpus
                    {"predicted_step_seconds": float("nan")}):
            assert apply(f"bad-{len(bad)}-{sorted(bad)}", generation=planner_next.generation + 1, **bad) == \
                CODES.INVALID_ARGUMENT, bad
        ghost = epb.Member(member_id="m1", role=99)  # once: KeyError, INTERNAL
        assert code_of(arun, stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("m1"), member=ghost))) == \
            CODES.INVALID_ARGUMENT
        spaced = epb.Member(member_id="m 1", role=epb.ROLE_ROLLOUT)
        assert code_of(arun, stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("m2"), member=spaced))) == \
            CODES.INVALID_ARGUMENT
        unknown = epb.TransitionRequest(meta=meta("t1"), member_id="m1", target=77)
        assert code_of(arun, stub.Transition(unknown)) == CODES.INVALID_ARGUMENT
    finally:
        arun(running.stop())


def _preflight(gpus: int, samples: int = 64, **fields) -> planner_pb2.PreflightRequest:
    trace = [planner_pb2.LengthSample(prompt_tokens=200 + i % 700, output_tokens=100 + (i * 37) % 8000)
             for i in range(samples)]
    return planner_pb2.PreflightRequest(**{"cluster_yaml": CLUSTER, "model_yaml": MODEL, "gpus": gpus,
                                           "trace": trace, **fields})


def test_preflight_is_bounded_in_gpus_size_and_time(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path, security={"limits": {"preflight_timeout_s": 3}})
    running, chan = arun(start(PlannerService(config)))
    stub = planner_pb2_grpc.PlannerStub(chan)
    try:
        decision = arun(stub.Preflight(_preflight(16), timeout=60))
        assert decision.chosen.buckets and decision.reason.startswith("preflight (not applied)")
        assert code_of(arun, stub.Preflight(_preflight(1_000_000), timeout=10)) == CODES.INVALID_ARGUMENT
        bomb = "a: &a [1, 1]\nb: &b [*a, *a]\nc: [*b, *b]\n"
        assert code_of(arun, stub.Preflight(_preflight(16, cluster_yaml=bomb), timeout=10)) == CODES.INVALID_ARGUMENT
        assert code_of(arun, stub.Preflight(_preflight(16, model_yaml="x" * 70_000), timeout=10)) == \
            CODES.INVALID_ARGUMENT

        async def two_at_once():
            # ~33 CPU-s of search on the dev machine (2,000 samples took ~2 s once the greedy got faster,
            # under the 3 s limit): far past the limit on any machine, and the child is killed at 3 s
            slow = asyncio.ensure_future(stub.Preflight(_preflight(16_384, 40_000), timeout=60))
            await asyncio.sleep(1.0)  # the first one is searching
            try:
                await stub.Preflight(_preflight(16), timeout=10)
                second = CODES.OK
            except grpc.aio.AioRpcError as error:
                second = error.code()
            started = time.monotonic()
            try:
                await slow
                first = CODES.OK
            except grpc.aio.AioRpcError as error:
                first = error.code()
            return second, first, time.monotonic() - started
        second, first, waited = arun(two_at_once())
        assert second == CODES.RESOURCE_EXHAUSTED
        assert first == CODES.DEADLINE_EXCEEDED and waited < 10  # security.limits.preflight_timeout_s: 3
        assert not _children_named(os.getpid(), b"libra.services.planner.preflight")  # killed with its call
    finally:
        arun(running.stop())


def test_sigterm_stops_a_planner_in_the_middle_of_a_preflight(tmp_path, redis_url, run_id):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    env["LIBRA_TOKEN"] = token = "bounds-test-token-0123456789"
    port = free_port()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"run_id": run_id, "run_dir": str(tmp_path / "run"),
                                                       "metrics": {"base_port": 0}}))
    log = tmp_path / "planner.log"
    with open(log, "wb") as sink:
        planner = subprocess.Popen([sys.executable, "-m", "libra.cli", "serve", "planner", "--config",
                                    str(tmp_path / "run.yaml"), "--redis-url", redis_url, "--port", str(port)],
                                   stdout=sink, stderr=subprocess.STDOUT, env=env)
    outcome: list = []

    def search() -> None:  # a search that would run for minutes
        with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
            try:
                planner_pb2_grpc.PlannerStub(chan).Preflight(_preflight(16_384, 20_000), timeout=120,
                                                             wait_for_ready=True,
                                                             metadata=(("authorization", f"Bearer {token}"),))
                outcome.append(CODES.OK)
            except grpc.RpcError as error:
                outcome.append(error.code())
    caller = threading.Thread(target=search, daemon=True)
    try:
        caller.start()
        deadline = time.monotonic() + 60
        while not _children_named(planner.pid, b"libra.services.planner.preflight"):
            assert planner.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        started = time.monotonic()
        planner.send_signal(signal.SIGTERM)
        code = planner.wait(timeout=20)
        assert code == 0 and time.monotonic() - started < 15, log.read_text()
        caller.join(10)
        assert outcome and outcome[0] != CODES.OK
    finally:
        if planner.poll() is None:
            planner.kill()
            planner.wait()


def _children_named(parent: int, marker: bytes) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:
            continue
        if ppid == parent and marker in command:
            found.append(int(pid))
    return found


def test_rollout_and_scheduler_requests_are_bounded(redis_url, run_id, store, tmp_path, arun):
    services = {s.name: s for s in wire_services()}

    async def rollout_codes():
        codes = []
        async with Harness(services["Rollout"], run_id, store, tmp_path) as harness:
            calls = [
                harness.stub.StartWorkers(rollout_pb2.StartWorkersRequest(meta=meta("s1"), buckets=[
                    _bucket(replicas=4000), _bucket(name="long", replicas=4000)])),  # > max_workers (1024)
                harness.stub.StartWorkers(rollout_pb2.StartWorkersRequest(meta=meta("s2"), buckets=[
                    _bucket(replicas=2**32 - 1)])),
                harness.stub.SubmitPrompts(rollout_pb2.SubmitPromptsRequest(meta=meta("p1"), groups=[
                    rollout_pb2.PromptGroup(group_id="g", prompt_id="1", samples=10**9)])),
                harness.stub.SubmitPrompts(rollout_pb2.SubmitPromptsRequest(meta=meta("p2"), groups=[
                    rollout_pb2.PromptGroup(group_id="g", prompt_id="../1", samples=2)])),
                harness.stub.DrainWorker(rollout_pb2.DrainWorkerRequest(meta=meta("d1"), worker_id="w",
                                                                        timeout_seconds=float("inf"))),
            ]
            for call in calls:
                try:
                    await call
                    codes.append(CODES.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
            return codes, harness.probe.calls
    codes, work = arun(rollout_codes())
    assert codes == [CODES.INVALID_ARGUMENT] * 5 and work == []  # refused before the service did anything

    running, chan = arun(start(SchedulerService(run_config(redis_url, run_id, tmp_path))))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    try:
        for address in ("", "ftp://127.0.0.1:8100", "http://127.0.0.1", "http://127.0.0.1:99999", "x" * 3000):
            worker = common_pb2.WorkerInfo(worker_id="w-a", bucket="short", address=address)
            request = scheduler_pb2.RegisterWorkerRequest(meta=meta(f"r-{address[:20]}"), worker=worker)
            assert code_of(arun, stub.RegisterWorker(request)) == CODES.INVALID_ARGUMENT, address
        good = common_pb2.WorkerInfo(worker_id="w-a", bucket="short", address="http://127.0.0.1:8100")
        arun(stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(meta=meta("ok"), worker=good)))
    finally:
        arun(running.stop())
