"""The RPC boundary's contract (docs/rpc.md), for every RPC of every service in libra/v1.

The RPCs are enumerated from the generated descriptors, so an RPC added to protos/ fails here
until its servicer declares it, docs/rpc.md lists it and (if mutating) SAMPLES has a request for
it. Each real servicer class runs on a real gRPC server (port 0) over a real Redis; behind it a
small probe (rpc_probes.py) stands in for its service and counts what the servicer asks it to
do, so that "ran once" is observable for every mutating RPC, including those whose real service
needs engines and a model. The probe keeps its replies where the real service does.
The two defects an operator found (Trainer/Pause replayed after a Resume; a Route reusing a
report's request id) are tested against the real services too.
"""

from __future__ import annotations

import asyncio
import pathlib
import re

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass

from libra.boundary import is_mutating, once
from libra.errors import InvalidArgument
from libra.replay import MemoryReplies, RedisReplies
from libra.rpc import ServiceHost, channel, wire_services
from libra.v1 import common_pb2, elastic_pb2, rollout_pb2, trainer_pb2, trainer_pb2_grpc
from tests.service.helpers import run_config
from tests.service.rpc_probes import SERVICERS, Harness, real_replies

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "rpc.md"

# One valid request body per mutating RPC (meta is added by the test).
SAMPLES = {
    "Trainer.SaveCheckpoint": {},
    "Trainer.Pause": {},
    "Trainer.Resume": {},
    "Trainer.AdmitHybrid": {"replica_id": "h1", "generation": 1},
    "Trainer.ReleaseHybrid": {"replica_id": "h1", "generation": 1},
    "Rollout.SubmitPrompts": {"groups": [rollout_pb2.PromptGroup(group_id="g1", prompt_id="1", samples=2)]},
    "Rollout.UpdateWeights": {"version": 1, "path": "/weights/v1"},
    "Rollout.DrainWorker": {"worker_id": "w-a"},
    "Rollout.StartWorkers": {"buckets": [common_pb2.BucketSpec(name="short", tp=1, max_tokens=64, replicas=1)]},
    "Scheduler.Route": {"trajectory_id": "t1", "prompt_tokens": 4, "max_new_tokens": 8},
    "Scheduler.ReportTurn": {"trajectory_id": "t1", "worker_id": "w-a", "output_tokens": 3},
    "Scheduler.ReportToolReturn": {"trajectory_id": "t1", "tool": "calc", "payload_tokens": 2,
                                   "status": common_pb2.TOOL_STATUS_SUCCESS},
    "Scheduler.ReportFinish": {"trajectory_id": "t1", "prompt_id": "p"},
    "Scheduler.RegisterWorker": {"worker": common_pb2.WorkerInfo(worker_id="w-a", bucket="short",
                                                                 address="http://127.0.0.1:1")},
    "Scheduler.DeregisterWorker": {"worker_id": "w-a"},
    "Planner.ObserveHistory": {"records": [common_pb2.HistoryRecord(kind="turn")]},
    "Planner.SetPlan": {"buckets": [common_pb2.BucketSpec(name="short", tp=1, max_tokens=64, replicas=1)],
                        "training": common_pb2.TrainingLayout(dp=1, tp=1, pp=1), "reason": "by hand"},
    "ElasticCoordinator.RegisterMember": {"member": elastic_pb2.Member(member_id="m1", role=elastic_pb2.ROLE_ROLLOUT)},
    "ElasticCoordinator.Transition": {"member_id": "m1", "target": elastic_pb2.MEMBER_STATE_JOINING},
    "ElasticCoordinator.ApplyPlan": {"plan": common_pb2.Plan(generation=2)},
}
SYNC_HANDLERS = {"Scheduler.Route", "Scheduler.ReportTurn", "Scheduler.ReportToolReturn", "Scheduler.ReportFinish"}
"""Their service methods are synchronous (a Route adds well under a millisecond): two calls cannot
interleave on the event loop, so there is no concurrent duplicate to test."""


# --- the wire, the servicers, the docs ---------------------------------------------------------
RPCS = [(service, method) for service in wire_services() for method in service.methods]
MUTATING = [f"{s.name}.{m.name}" for s, m in RPCS if is_mutating(m)]
RUN_READS = [f"{s.name}.{m.name}" for s, m in RPCS
             if not is_mutating(m) and not m.client_streaming and "run_id" in m.input_type.fields_by_name]


def _rpc(name: str):
    return next((s, m) for s, m in RPCS if f"{s.name}.{m.name}" == name)


def _docs_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"^\| `(\w+\.\w+)` \|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_every_rpc_has_a_servicer_method_behind_the_boundary_with_the_wires_rule():
    assert RPCS and MUTATING
    assert set(SERVICERS) == {s.full_name for s in wire_services()}
    for service, method in RPCS:
        handler = getattr(SERVICERS[service.full_name], method.name)
        rule = getattr(handler, "__rpc_rule__", None)
        assert rule is not None, f"{service.name}.{method.name} is not decorated with libra.boundary.rpc"
        assert rule.mutating == is_mutating(method), f"{service.name}.{method.name}: rpc(mutating=...) != wire"
    assert sorted(SAMPLES) == sorted(MUTATING)  # a new mutating RPC needs a sample request here


def test_docs_table_lists_every_rpc_with_its_rule(tmp_path):
    rows = _docs_rows()
    config = run_config("redis://127.0.0.1:1", "contract", tmp_path)
    assert sorted(rows) == sorted(f"{s.name}.{m.name}" for s, m in RPCS)
    for service, method in RPCS:
        request_id, _, kept = rows[f"{service.name}.{method.name}"]
        assert request_id == ("required" if is_mutating(method) else "—"), service.name + "." + method.name
        where = ("memory" if isinstance(real_replies(service.name, config), MemoryReplies) else "Redis") \
            if is_mutating(method) else "—"
        assert kept == where, f"{service.name}.{method.name}: docs say {kept!r}, the service keeps {where!r}"


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    raise AssertionError("the call succeeded; expected an error status")


@pytest.mark.parametrize("name", MUTATING)
def test_a_mutating_rpc_runs_once_per_request_id(name, run_id, store, arun, tmp_path):
    service, method = _rpc(name)
    request_type = GetMessageClass(method.input_type)

    def request(rid: str, run: str = ""):
        return request_type(meta=common_pb2.RequestMeta(request_id=rid, run_id=run or run_id), **SAMPLES[name])

    async def scenario():
        async with Harness(service, run_id, store, tmp_path) as h:
            call, probe = getattr(h.stub, method.name), h.probe
            first = await call(request("r1"), timeout=10)
            assert len(probe.calls) == 1
            assert await call(request("r1"), timeout=10) == first  # the first reply, not run again
            assert len(probe.calls) == 1
            await call(request("r2"), timeout=10)  # another request id is another request
            assert len(probe.calls) == 2
            assert await _code(call(request(""), timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
            assert await _code(call(request("r3", run="another-run"), timeout=10)) == grpc.StatusCode.NOT_FOUND
            assert len(probe.calls) == 2  # neither reached the service

            probe.fail = True  # an error keeps nothing: the same id runs again, then replays
            assert await _code(call(request("r4"), timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
            retried = await call(request("r4"), timeout=10)
            assert len(probe.calls) == 4
            assert await call(request("r4"), timeout=10) == retried and len(probe.calls) == 4

            if name in SYNC_HANDLERS:
                return
            probe.gate = asyncio.Event()  # two concurrent calls with one request id: one runs
            running = asyncio.ensure_future(call(request("r5"), timeout=10))
            duplicate = None
            try:
                while len(probe.calls) < 5:
                    await asyncio.sleep(0.01)
                duplicate = asyncio.ensure_future(call(request("r5"), timeout=10))
                await asyncio.sleep(0.3)
                assert not duplicate.done() and len(probe.calls) == 5  # it waits for the first
            finally:
                probe.gate.set()
                replies = await asyncio.gather(running, *([duplicate] if duplicate else []), return_exceptions=True)
            assert replies[0] == replies[1] and len(probe.calls) == 5
    arun(scenario())


@pytest.mark.parametrize("name", RUN_READS)
def test_a_read_rpc_checks_its_run(name, run_id, store, arun, tmp_path):
    service, method = _rpc(name)
    request_type = GetMessageClass(method.input_type)

    async def scenario():
        async with Harness(service, run_id, store, tmp_path) as h:
            call = getattr(h.stub, method.name)(request_type(run_id="another-run"), timeout=10)
            if method.server_streaming:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    async for _ in call:
                        pass
                assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            else:
                assert await _code(call) == grpc.StatusCode.NOT_FOUND
            assert h.probe.calls == []
    arun(scenario())


# --- the stores ---------------------------------------------------------------------------------
def test_a_claim_belongs_to_its_token_and_the_first_reply_stays(store, arun):
    async def scenario():
        assert await store.claim_request("Trainer.Pause", "r1", "a", 10) == ("claimed", None)
        assert await store.claim_request("Trainer.Pause", "r1", "b", 10) == ("running", None)
        assert not await store.release_claim("Trainer.Pause", "r1", "b")  # not b's to drop
        assert not await store.renew_claim("Trainer.Pause", "r1", "b", 10)
        assert await store.renew_claim("Trainer.Pause", "r1", "a", 10)
        await store.settle_request("Trainer.Pause", "r1", "a", b"first")
        assert await store.claim_request("Trainer.Pause", "r1", "b", 10) == ("reply", b"first")
        await store.settle_request("Trainer.Pause", "r1", "b", b"second")  # a late holder cannot replace it
        assert await store.claim_request("Trainer.Pause", "r1", "c", 10) == ("reply", b"first")
        assert await store.claim_request("Trainer.Pause", "r2", "a", 10) == ("claimed", None)
        assert await store.release_claim("Trainer.Pause", "r2", "a")  # failed: the next caller runs it
        assert await store.claim_request("Trainer.Pause", "r2", "b", 10) == ("claimed", None)
        assert await store.claim_request("Trainer.Resume", "r1", "a", 10) == ("claimed", None)  # own scope
        with pytest.raises(InvalidArgument, match="scope"):
            await store.claim_request("Trainer:Pause", "r3", "a", 10)
        with pytest.raises(InvalidArgument, match="lease_s"):
            await store.claim_request("Trainer.Pause", "r3", "a", 0)
    arun(scenario())


def test_a_claim_left_by_a_dead_call_expires_and_the_retry_runs(store, arun):
    replies = RedisReplies(store, lease_s=0.3)
    ran = []

    async def scenario():
        dead = await replies.claim("Trainer.Pause", "r1")  # its process dies: never settled or released
        assert dead.owned
        started = asyncio.get_running_loop().time()
        reply = await once(replies, "Trainer.Pause", "r1", lambda: ran.append(1) or common_pb2.Ack(applied=True),
                           common_pb2.Ack)
        waited = asyncio.get_running_loop().time() - started
        assert reply.applied and ran == [1] and 0.2 < waited < 5
        again = await once(replies, "Trainer.Pause", "r1", lambda: ran.append(2), common_pb2.Ack)
        assert again == reply and ran == [1]
    arun(scenario())


def test_a_long_call_keeps_its_claim(store, arun):
    replies = RedisReplies(store, lease_s=0.2)  # renewed every ~0.07 s while the call runs

    async def slow():
        await asyncio.sleep(0.8)
        return common_pb2.Ack(detail="slow")

    async def scenario():
        first = asyncio.ensure_future(once(replies, "Rollout.DrainWorker", "r1", slow, common_pb2.Ack))
        await asyncio.sleep(0.5)  # past the lease: only the renewals keep the claim
        duplicate = await replies.claim("Rollout.DrainWorker", "r1")
        assert not duplicate.owned and duplicate.reply is None
        assert (await first).detail == "slow"
        assert (await replies.claim("Rollout.DrainWorker", "r1")).reply is not None
    arun(scenario())


def test_the_memory_window_keeps_the_newest_requests(arun):
    replies = MemoryReplies(capacity=2)

    async def scenario():
        for rid in ("a", "b", "c"):
            await once(replies, "Scheduler.Route", rid, lambda r=rid: common_pb2.Ack(detail=r), common_pb2.Ack)
        assert len(replies) == 2
        assert (await replies.claim("Scheduler.Route", "a")).owned  # forgotten: it would run again
        assert (await replies.claim("Scheduler.Route", "c")).reply.detail == "c"
        assert (await replies.claim("Scheduler.ReportTurn", "c")).owned  # scopes are separate
    arun(scenario())


# --- the operator's defects, on the real services -----------------------------------------------
def test_trainer_pause_replayed_after_a_resume_does_not_pause_again(redis_url, run_id, store, arun, tmp_path):
    from libra.services.trainer.server import TrainerService

    service = TrainerService(run_config(redis_url, run_id, tmp_path))
    service.store = store  # its Redis (connected by run() in a real trainer)
    host = ServiceHost("trainer", service.service_names(), 0, "127.0.0.1")
    service.register(host.server)

    async def scenario():
        port = await host.start()
        async with channel(f"127.0.0.1:{port}") as chan:
            stub = trainer_pb2_grpc.TrainerStub(chan)
            meta = lambda rid: common_pb2.RequestMeta(request_id=rid, run_id=run_id)
            paused = await stub.Pause(trainer_pb2.PauseRequest(meta=meta("pause-1")))
            assert paused.applied
            resumed = await stub.Resume(trainer_pb2.PauseRequest(meta=meta("resume-1")))
            assert resumed.applied
            assert await stub.Pause(trainer_pb2.PauseRequest(meta=meta("pause-1"))) == paused  # a replay...
            assert not (await stub.Resume(trainer_pb2.PauseRequest(meta=meta("resume-2")))).applied  # ...paused nothing
            assert (await stub.Pause(trainer_pb2.PauseRequest(meta=meta("pause-2")))).applied  # a new id does
            assert await stub.Resume(trainer_pb2.PauseRequest(meta=meta("resume-1"))) == resumed  # no resume
            assert not (await stub.Pause(trainer_pb2.PauseRequest(meta=meta("pause-3")))).applied  # still paused
        await host.stop(0)
    arun(scenario())
