"""Pool members stay alive while their owners report them, and only then (real coordinator, real
Redis, real gRPC; the trainer and the rollout gateway are the in-process doubles of
test_elastic_coordinator.py, the gateway answering ListWorkers as the real one does).

A rollout member lives while the gateway lists its worker as starting, serving or draining; a
training member while the trainer answers its step manifest; any member while Heartbeat RPCs come.
With none of these for heartbeat_timeout_s it goes OFFLINE ("missed heartbeats"), and comes back
when reported again. Every wait below ends on an event (a member changing state), never a sleep:
a member that must stay alive is checked once another, registered with it, has timed out.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libra.services.elastic.report import pool_lines
from libra.services.elastic.server import ElasticService
from libra.v1 import common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2_grpc
from tests.service.elastic_doubles import Pool, RolloutDouble, TrainerDouble, meta
from tests.service.helpers import run_config, start

S = epb.MemberState
TIMEOUT_S = 0.6


class ListingRollout(RolloutDouble):
    """The gateway double, listing `serving` as its serving workers."""

    def __init__(self) -> None:
        super().__init__()
        self.serving: set[str] = set()

    async def ListWorkers(self, request, context):
        return rollout_pb2.ListWorkersResponse(workers=[
            common_pb2.WorkerInfo(worker_id=w, bucket=w.split("-")[0], state=common_pb2.WORKER_STATE_SERVING)
            for w in sorted(self.serving)])


class SilentTrainer(TrainerDouble):
    def __init__(self) -> None:
        super().__init__()
        self.answer = True

    async def GetStepManifest(self, request, context):
        if not self.answer:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "told to be silent")
        return await super().GetStepManifest(request, context)


class LivePool(Pool):
    """The coordinator with its own driver, talking to the doubles at the config's addresses."""

    def __init__(self, redis_url, run_id, tmp_path):
        super().__init__(redis_url, run_id, tmp_path)
        self.trainer, self.rollout = SilentTrainer(), ListingRollout()

    async def start(self) -> "LivePool":
        self.servers, addresses = [], {}
        for name, add, double in (("trainer", trainer_pb2_grpc.add_TrainerServicer_to_server, self.trainer),
                                  ("rollout", rollout_pb2_grpc.add_RolloutServicer_to_server, self.rollout)):
            server = grpc.aio.server()
            add(double, server)
            addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            self.servers.append(server)
        self.channels = []
        self.config = run_config(self.config.redis.url, self.run_id, self.tmp_path, addresses=addresses,
                                 elastic={"heartbeat_timeout_s": TIMEOUT_S, "poll_interval_s": 0.05})
        service = ElasticService(self.config)  # its own driver and channels, to the addresses above
        self.running, chan = await start(service)
        self.stub = self.rollout.elastic = elastic_pb2_grpc.ElasticCoordinatorStub(chan)
        self.processes = service.driver.processes
        return self


@pytest.fixture
def live(redis_url, run_id, tmp_path, arun):
    made = arun(LivePool(redis_url, run_id, tmp_path).start())
    yield made
    arun(made.stop())


def test_members_live_while_their_owners_report_them(live, arun):
    live.rollout.serving = {"short-0"}
    arun(live.register("short-0", "short-1"))  # plus "core", a training member
    gone = arun(live.wait_state("short-1", S.MEMBER_STATE_OFFLINE))  # not listed by the gateway
    assert gone.detail == "missed heartbeats"
    reply = arun(live.stub.ListMembers(epb.ListMembersRequest()))
    members = {m.member_id: m for m in reply.members}
    assert members["short-0"].state == S.MEMBER_STATE_ROLLOUT  # listed as serving
    assert members["core"].state == S.MEMBER_STATE_TRAINING  # the trainer answers its manifest
    assert members["short-0"].last_heartbeat > members["short-1"].last_heartbeat
    lines = pool_lines(list(reply.members), reply.membership_epoch, None, time.time())  # as `libra status` prints
    assert {line.split()[0]: line.split()[2] for line in lines[1:]} == {
        "core": "training", "short-0": "rollout", "short-1": "offline"}

    live.rollout.serving.add("short-1")  # the gateway serves it again: back in the pool
    back = arun(live.wait_state("short-1", S.MEMBER_STATE_ROLLOUT))
    assert back.history[-1].detail == "reported alive"

    live.trainer.answer = False  # the trainer stops answering: its member goes offline
    arun(live.wait_state("core", S.MEMBER_STATE_OFFLINE))
    assert arun(live.member("short-0")).state == S.MEMBER_STATE_ROLLOUT


def test_a_heartbeat_keeps_a_member_no_owner_lists_alive(live, arun):
    arun(live.stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("reg-x"), member=epb.Member(
        member_id="external-0", role=epb.ROLE_ROLLOUT, bucket="short"))))
    arun(live.stub.RegisterMember(epb.RegisterMemberRequest(meta=meta("reg-y"), member=epb.Member(
        member_id="external-1", role=epb.ROLE_ROLLOUT, bucket="short"))))

    async def beat_until_the_other_is_offline():
        while True:
            reply = await live.stub.Heartbeat(epb.HeartbeatRequest(member_id="external-0"))
            if (await live.member("external-1")).state == S.MEMBER_STATE_OFFLINE:
                return reply
            await asyncio.sleep(TIMEOUT_S / 4)  # the sender's heartbeat interval

    reply = arun(beat_until_the_other_is_offline())
    assert reply.state == S.MEMBER_STATE_ROLLOUT and reply.last_heartbeat > 0
    assert arun(live.member("external-0")).state == S.MEMBER_STATE_ROLLOUT
    revived = arun(live.stub.Heartbeat(epb.HeartbeatRequest(member_id="external-1")))
    assert revived.state == S.MEMBER_STATE_ROLLOUT  # a heartbeat brings it back
