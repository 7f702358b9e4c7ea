"""The gateway's Session stream to a real scheduler: order, errors, acknowledgements, reconnects."""

from __future__ import annotations

import asyncio

import pytest

from libra.errors import FailedPrecondition, InvalidArgument
from libra.runtime import RunningService
from libra.services.rollout.router import SchedulerRouter
from libra.services.scheduler.server import SchedulerService
from libra.v1 import common_pb2, scheduler_pb2 as spb, scheduler_pb2_grpc
from tests.service.helpers import run_config, start


def _worker(wid: str) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=wid, bucket="default", address=f"http://127.0.0.1:1/{wid}",
                                 state=common_pb2.WORKER_STATE_SERVING)


def test_session_routes_in_order_and_maps_errors(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    router = SchedulerRouter(chan, run_id)
    with pytest.raises(FailedPrecondition, match="worker"):  # no workers registered yet
        arun(router.route("t0", "p0", 0, 10, 20, []))
    for wid in ("w-a", "w-b"):
        arun(router.register(_worker(wid)))
    first = arun(router.route("t1", "p1", 0, 10, 20, []))
    second = arun(router.route("t2", "p2", 0, 10, 20, []))
    assert {first.worker_id, second.worker_id} == {"w-a", "w-b"}

    async def turn_then_route():
        # The report is only queued; the stream keeps it ahead of the next Route, so the scheduler
        # has released t1's load when it routes t1's next turn (affinity, not a move).
        await router.turn_done("t1", first.worker_id, 5, 0.1, False)
        await router.tool_returned("t1", "calculator", common_pb2.TOOL_STATUS_SUCCESS, 3)
        return await router.route("t1", "p1", 1, 18, 20, [])
    again = arun(turn_then_route())
    assert again.worker_id == first.worker_id and again.reason == "affinity"
    with pytest.raises(InvalidArgument, match="structured status"):
        arun(router.tool_returned("t1", "calculator", common_pb2.TOOL_STATUS_UNSPECIFIED, 3))
    arun(router.finished("nope", "p9", 0, common_pb2.TRAJECTORY_STATUS_COMPLETED))  # NOT_FOUND: ignored
    arun(router.finished("t2", "p2", 5, common_pb2.TRAJECTORY_STATUS_COMPLETED))
    assert arun(router.session.flush(5.0))
    stats = arun(scheduler_pb2_grpc.SchedulerStub(chan).GetStats(spb.GetStatsRequest()))
    assert stats.active_trajectories == 1  # t2 finished over the stream; t1 is still going
    arun(router.close())
    arun(running.stop())


def test_raw_session_answers_routes_and_acknowledges_reports(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    meta = lambda rid: common_pb2.RequestMeta(request_id=rid, run_id=run_id)
    arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta("reg"), worker=_worker("w-a"))))

    async def talk():
        call = stub.Session()
        msg = lambda seq, **body: spb.GatewayMessage(seq=seq, **body)
        await call.write(spb.GatewayBatch(messages=[msg(1, route=spb.RouteRequest(
            meta=meta("r1"), trajectory_id="t1", prompt_tokens=4, max_new_tokens=8))]))
        route = await call.read()
        await call.write(spb.GatewayBatch(messages=[
            msg(2, turn=spb.TurnReport(meta=meta("d1"), trajectory_id="t1", worker_id="w-a", output_tokens=8)),
            msg(3),  # no body
            msg(4, tool_return=spb.ToolReturnReport(meta=meta("x1"), trajectory_id="t1", tool="calc"))]))
        errors = await call.read()
        await call.write(spb.GatewayBatch(messages=[msg(5, finish=spb.FinishReport(meta=meta("f1"), trajectory_id="t1"))]))
        ack = await asyncio.wait_for(call.read(), 5)  # nothing to answer: a bare acknowledgement follows
        await call.done_writing()
        return route, errors, ack
    route, errors, ack = arun(talk())
    assert route.processed_seq == 1 and [a.seq for a in route.answers] == [1]
    assert route.answers[0].route.worker_id == "w-a"
    assert errors.processed_seq == 4 and [a.seq for a in errors.answers] == [3, 4]  # one batch, both answers
    empty, no_status = errors.answers
    assert empty.error.code == "INVALID_ARGUMENT" and "body" in empty.error.message
    assert no_status.error.code == "INVALID_ARGUMENT" and "status" in no_status.error.message
    assert not ack.answers and ack.processed_seq == 5
    stats = arun(stub.GetStats(spb.GetStatsRequest()))
    assert stats.active_trajectories == 0
    arun(running.stop())


def test_session_and_unary_rpcs_share_one_replay_scope_per_rpc(redis_url, run_id, tmp_path, arun):
    """A request id is applied once whichever path carried it; a Route that reuses a report's
    request id is a request of its own (it used to fail with INTERNAL)."""
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    meta = lambda rid: common_pb2.RequestMeta(request_id=rid, run_id=run_id)
    for wid in ("w-a", "w-b"):
        arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta(f"reg-{wid}"), worker=_worker(wid))))
    route = lambda rid, tid: spb.RouteRequest(meta=meta(rid), trajectory_id=tid, prompt_tokens=4, max_new_tokens=8)
    first = arun(stub.Route(route("r1", "t1")))
    arun(stub.ReportTurn(spb.TurnReport(meta=meta("x"), trajectory_id="t1", worker_id=first.worker_id)))

    async def talk():
        call = stub.Session()
        await call.write(spb.GatewayBatch(messages=[
            spb.GatewayMessage(seq=1, route=route("x", "t2")),  # the report's request id
            spb.GatewayMessage(seq=2, route=route("r1", "t1")),  # the unary Route's: a replay
            spb.GatewayMessage(seq=3, turn=spb.TurnReport(meta=meta("x"), trajectory_id="t1",
                                                          worker_id=first.worker_id))]))  # a replay
        answers = await call.read()
        await call.done_writing()
        return answers
    answers = arun(talk())
    assert [a.WhichOneof("body") for a in answers.answers] == ["route", "route"], answers
    assert answers.answers[0].route.worker_id in ("w-a", "w-b") and answers.answers[1].route == first
    stats = arun(stub.GetStats(spb.GetStatsRequest()))
    assert stats.active_trajectories == 2
    assert sum(b.outstanding_requests for b in stats.buckets) == 1  # t2's turn; t1's released once
    arun(running.stop())


def test_session_survives_a_scheduler_restart(redis_url, run_id, tmp_path, arun):
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    port = running.port
    router = SchedulerRouter(chan, run_id)
    arun(router.register(_worker("w-a")))
    first = arun(router.route("t1", "p1", 0, 10, 20, []))
    arun(running.stop())

    async def while_down_then_restart():
        # Sent while the scheduler is down: kept until a new stream confirms it.
        await router.turn_done("t1", first.worker_id, 5, 0.1, False)
        pending = asyncio.ensure_future(router.route("t2", "p2", 0, 10, 20, []))
        await asyncio.sleep(0.5)
        assert not pending.done()
        restarted = await RunningService(SchedulerService(config), port, host="127.0.0.1").start()
        decision = await asyncio.wait_for(pending, 30)
        return restarted, decision
    restarted, decision = arun(while_down_then_restart())
    assert decision.worker_id == "w-a"  # the registry came back from Redis; the Route was resent
    assert arun(router.session.flush(5.0))
    arun(router.close())
    arun(restarted.stop())


def test_session_keeps_order_under_many_concurrent_trajectories(redis_url, run_id, tmp_path, arun):
    """Routes waiting for the stream while reports are posted: every message arrives once, in order."""
    config = run_config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    router = SchedulerRouter(chan, run_id)
    for wid in ("w-a", "w-b", "w-c"):
        arun(router.register(_worker(wid)))

    async def trajectory(i: int) -> list[str]:
        reasons = []
        for turn in range(3):
            decision = await router.route(f"t{i}", f"p{i % 7}", turn, 10 + turn, 20, [])
            reasons.append(decision.reason)
            await router.turn_done(f"t{i}", decision.worker_id, 5, 0.0, False)
            if turn < 2:
                await router.tool_returned(f"t{i}", "calculator", common_pb2.TOOL_STATUS_SUCCESS, 3)
        await router.finished(f"t{i}", f"p{i % 7}", 15, common_pb2.TRAJECTORY_STATUS_COMPLETED)
        return reasons

    async def everyone():
        return await asyncio.wait_for(asyncio.gather(*(trajectory(i) for i in range(200))), 60)
    reasons = arun(everyone())
    assert all(r[1:] == ["affinity", "affinity"] for r in reasons)  # each report landed before the next Route
    assert arun(router.session.flush(10.0))
    stats = arun(scheduler_pb2_grpc.SchedulerStub(chan).GetStats(spb.GetStatsRequest()))
    assert stats.active_trajectories == 0
    assert sum(b.outstanding_requests for b in stats.buckets) == 0  # every turn's load was released once
    arun(router.close())
    arun(running.stop())


@pytest.mark.parametrize("read_ahead", [None, 3])
def test_batches_arriving_during_a_save_are_saved_together_and_answered_after_it(redis_url, run_id, tmp_path,
                                                                                   arun, monkeypatch, read_ahead):
    """Under load the session takes every batch that arrived while it was saving as one: the Routes of
    ten batches written back to back are answered after fewer than ten saves, and never before the save
    that holds them (each answered trajectory's routing record is in Redis when its answer arrives).
    It reads at most MAX_WAITING_BYTES ahead (then gRPC's flow control holds the gateway back): with
    room for 3 of these batches, a save holds at most 3, so ten take at least 1 + 3 saves."""
    import redis.asyncio as aioredis

    from libra.services.scheduler import servicer
    from libra.state import Keys
    one = spb.GatewayBatch(messages=[spb.GatewayMessage(seq=10, route=spb.RouteRequest(
        meta=common_pb2.RequestMeta(request_id="r10", run_id=run_id), trajectory_id="t10", prompt_tokens=4,
        max_new_tokens=8))]).ByteSize()
    if read_ahead:
        monkeypatch.setattr(servicer, "MAX_WAITING_BYTES", read_ahead * one)
    config = run_config(redis_url, run_id, tmp_path)
    service = SchedulerService(config)
    running, chan = arun(start(service))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    meta = lambda rid: common_pb2.RequestMeta(request_id=rid, run_id=run_id)
    arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta("reg"), worker=_worker("w-a"))))
    saves = []
    persist = service.persist

    async def slow_persist():
        await asyncio.sleep(0.05)  # a Redis round trip on a busy machine
        await persist()
        saves.append(1)
    service.persist = slow_persist
    client = aioredis.from_url(redis_url)
    live = Keys(run_id).scheduler_live

    async def talk():
        call = stub.Session()
        for seq in range(1, 11):
            await call.write(spb.GatewayBatch(messages=[spb.GatewayMessage(seq=seq, route=spb.RouteRequest(
                meta=meta(f"r{seq}"), trajectory_id=f"t{seq}", prompt_tokens=4, max_new_tokens=8))]))
        answered, unsaved = [], []
        while len(answered) < 10:
            batch = await asyncio.wait_for(call.read(), 10)
            stored = {key.decode() for key in await client.hkeys(live)}
            for answer in batch.answers:
                answered.append(answer.seq)
                if f"t{answer.seq}" not in stored:
                    unsaved.append(answer.seq)
            assert batch.processed_seq == answered[-1]
        await call.done_writing()
        return answered, unsaved
    answered, unsaved = arun(talk())
    arun(client.aclose())
    assert answered == list(range(1, 11)) and unsaved == []
    if read_ahead is None:
        assert 1 <= len(saves) < 10, saves  # the first batch alone, the rest together
    else:
        assert 4 <= len(saves) < 10, saves
    arun(running.stop())
