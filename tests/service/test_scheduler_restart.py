"""A scheduler killed mid-run routes every live trajectory as if it had never stopped.

A real scheduler (gRPC, Redis) and a reference that never stops (the same policy, in memory) get
the same traffic: trajectories routed over several turns, tool returns, finishes that teach the
C-MLFQ tree. The real one is then killed without its drain (as SIGKILL would: nothing is saved on
the way out) and started again on the same Redis. From then on both get the same next messages:
every decision (worker, bucket, reason), every worker's load and the learned tree are equal. A
request applied before the kill but never acknowledged, sent again, is a replay (its first
reply), not applied twice; a report for a trajectory that finished meanwhile is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from libra.runtime import RunningService
from libra.services.scheduler.server import SchedulerService
from libra.routing.policy import Turn, Worker
from libra.v1 import common_pb2, scheduler_pb2 as spb, scheduler_pb2_grpc
from tests.service.helpers import run_config, start

BUCKETS = [{"name": "short", "tp": 1, "max_tokens": 40, "replicas": 2},
           {"name": "long", "tp": 1, "max_tokens": 4000, "replicas": 2}]
WORKERS = [("short-0", "short"), ("short-1", "short"), ("long-2", "long"), ("long-3", "long")]
STATUSES = [common_pb2.TOOL_STATUS_SUCCESS, common_pb2.TOOL_STATUS_FAILURE]


def _config(redis_url, run_id, tmp_path):
    return run_config(redis_url, run_id, tmp_path, planner={"buckets": BUCKETS},
                      scheduler={"policy": {"type": "cmlfq", "min_visits": 1}, "per_worker_cap_tokens": 400})


class Traffic:
    """The same messages, in the same order, to the real scheduler (unary RPCs) and the reference."""

    def __init__(self, stub, reference: SchedulerService, run_id: str):
        self.stub, self.reference, self.run_id = stub, reference, run_id
        self.count = 0
        self.last_route: dict[str, spb.RouteRequest] = {}  # trajectory -> its latest Route, to send again

    def meta(self) -> common_pb2.RequestMeta:
        self.count += 1
        return common_pb2.RequestMeta(request_id=f"m{self.count}", run_id=self.run_id)

    async def route(self, tid: str, prompt: str, turn: int, tokens: int) -> tuple:
        request = spb.RouteRequest(meta=self.meta(), trajectory_id=tid, prompt_id=prompt, turn=turn,
                                   prompt_tokens=tokens, max_new_tokens=20)
        self.last_route[tid] = request
        got = await self.stub.Route(request, timeout=10)
        want = self.reference.route(Turn(tid, prompt, turn, tokens, 20))
        assert (got.worker_id, got.bucket, got.reason) == (want.worker_id, want.bucket, want.reason), (tid, turn)
        return got.worker_id, got.reason

    async def turn_done(self, tid: str, worker: str, output: int) -> None:
        await self.stub.ReportTurn(spb.TurnReport(meta=self.meta(), trajectory_id=tid, worker_id=worker,
                                                  output_tokens=output), timeout=10)
        self.reference.turn_done(tid, worker, output)

    async def tool(self, tid: str, status: int, payload: int) -> None:
        await self.stub.ReportToolReturn(spb.ToolReturnReport(meta=self.meta(), trajectory_id=tid, tool="calc",
                                                              status=status, payload_tokens=payload), timeout=10)
        self.reference.tool_returned(tid, "calc", {1: "success", 2: "failure"}[status], payload)

    async def finish(self, tid: str, prompt: str, output: int) -> None:
        await self.stub.ReportFinish(spb.FinishReport(meta=self.meta(), trajectory_id=tid, prompt_id=prompt,
                                                      output_tokens=output), timeout=10)
        self.reference.finish(tid, prompt, output)


async def _play(traffic: Traffic, rng: random.Random, live: dict, finished: int, start: int, count: int) -> int:
    """Advance `count` random steps of a few concurrent trajectories: each a turn, a tool return, or a finish."""
    for step in range(start, start + count):
        if len(live) < 6:
            tid, prompt = f"t{step}", f"p{step % 3}"
            worker, _ = await traffic.route(tid, prompt, 0, 10)
            live[tid] = [prompt, 0, worker, 0]
            continue
        tid = rng.choice(sorted(live))
        prompt, turn, worker, produced = live[tid]
        output = rng.choice([5, 30, 60])
        await traffic.turn_done(tid, worker, output)
        produced += output
        if turn >= 2 or rng.random() < 0.2:
            await traffic.finish(tid, prompt, produced)
            del live[tid]
            finished += 1
            continue
        await traffic.tool(tid, rng.choice(STATUSES), rng.choice([3, 300]))
        worker, _ = await traffic.route(tid, prompt, turn + 1, 10 + produced)
        live[tid] = [prompt, turn + 1, worker, produced]
    return finished


def _loads(service: SchedulerService) -> dict:
    return {w.worker_id: (w.outstanding_tokens, w.outstanding_requests) for w in service.policy.state.workers.values()}


async def _crash(running: RunningService) -> None:
    """Stop the server as SIGKILL would: no drain, nothing saved on the way out."""
    for task in (running.main, running._watch):
        task.cancel()
    await asyncio.gather(running.main, running._watch, return_exceptions=True)
    await running.host.server.stop(0)
    await running.service.store.close()


def test_a_killed_scheduler_routes_live_trajectories_as_if_it_had_never_stopped(redis_url, run_id, tmp_path, arun):
    config = _config(redis_url, run_id, tmp_path)
    reference = SchedulerService(config)
    for wid, bucket in WORKERS:
        reference.policy.register(Worker(wid, bucket, f"http://127.0.0.1:1/{wid}"))
    running, chan = arun(start(SchedulerService(config)))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    traffic = Traffic(stub, reference, run_id)
    for wid, bucket in WORKERS:
        arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=traffic.meta(), worker=common_pb2.WorkerInfo(
            worker_id=wid, bucket=bucket, address=f"http://127.0.0.1:1/{wid}", state=common_pb2.WORKER_STATE_SERVING))))
    rng, live = random.Random(7), {}
    finished = arun(_play(traffic, rng, live, 0, 0, 60))
    arun(running.service._save_tree(0))  # the periodic save: the tree, the finishes it includes dropped
    finished = arun(_play(traffic, rng, live, finished, 60, 60))  # these are replayed at restart
    assert finished >= 10 and live
    assert _loads(running.service) == _loads(reference)
    gone = next(tid for tid in traffic.last_route if tid not in live)  # finished before the kill
    arun(_crash(running))

    restarted = RunningService(SchedulerService(config), 0, host="127.0.0.1")
    arun(restarted.start())
    chan = grpc.aio.insecure_channel(f"127.0.0.1:{restarted.port}")
    traffic.stub = scheduler_pb2_grpc.SchedulerStub(chan)
    service = restarted.service
    assert _loads(service) == _loads(reference)
    assert service.policy.forest.to_bytes() == reference.policy.forest.to_bytes()
    assert set(service.policy.state.placements) == set(reference.policy.state.placements) == set(live)
    for tid in sorted(live):  # each one's latest Route sent again (as if never acknowledged): replays
        again = arun(traffic.stub.Route(traffic.last_route[tid], timeout=10))
        assert again.worker_id == live[tid][2]
    assert _loads(service) == _loads(reference)
    late = spb.TurnReport(meta=traffic.meta(), trajectory_id=gone, worker_id="short-0", output_tokens=1)
    try:
        arun(traffic.stub.ReportTurn(late, timeout=10))
        raise AssertionError("a report for a finished trajectory was accepted")
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
    arun(_play(traffic, rng, live, finished, 1000, 120))  # every decision compared inside
    assert _loads(service) == _loads(reference)
    assert service.policy.forest.to_bytes() == reference.policy.forest.to_bytes()
    moves = sum(n for reason, n in reference.policy.state.reasons.items() if reason.startswith("move:"))
    assert moves > 0  # the tree was used: predictions moved trajectories between buckets
    arun(restarted.stop())


def test_a_trajectory_played_again_from_its_start_is_forgotten_not_learned(redis_url, run_id, tmp_path, arun):
    """A restarted gateway plays its dead predecessor's running trajectories again from turn 0 and
    first reports them with status QUEUED: the scheduler drops their placement and load without
    teaching the tree, so the new play starts clean."""
    config = _config(redis_url, run_id, tmp_path)
    running, chan = arun(start(SchedulerService(config)))
    stub = scheduler_pb2_grpc.SchedulerStub(chan)
    meta = lambda rid: common_pb2.RequestMeta(request_id=rid, run_id=run_id)
    for wid, bucket in WORKERS:
        arun(stub.RegisterWorker(spb.RegisterWorkerRequest(meta=meta(f"reg-{wid}"), worker=common_pb2.WorkerInfo(
            worker_id=wid, bucket=bucket, address=f"http://127.0.0.1:1/{wid}", state=common_pb2.WORKER_STATE_SERVING))))
    first = arun(stub.Route(spb.RouteRequest(meta=meta("r1"), trajectory_id="t1", prompt_id="p1", prompt_tokens=10,
                                             max_new_tokens=20), timeout=10))
    arun(stub.ReportTurn(spb.TurnReport(meta=meta("d1"), trajectory_id="t1", worker_id=first.worker_id,
                                        output_tokens=30), timeout=10))
    arun(stub.ReportToolReturn(spb.ToolReturnReport(meta=meta("x1"), trajectory_id="t1", tool="calc",
                                                    status=common_pb2.TOOL_STATUS_SUCCESS, payload_tokens=3), timeout=10))
    arun(stub.Route(spb.RouteRequest(meta=meta("r2"), trajectory_id="t1", prompt_id="p1", turn=1, prompt_tokens=40,
                                     max_new_tokens=20), timeout=10))
    service = running.service
    tree = service.policy.forest.to_bytes()
    forgotten = arun(stub.ReportFinish(spb.FinishReport(meta=meta("f1"), trajectory_id="t1", prompt_id="p1",
                                                        status=common_pb2.TRAJECTORY_STATUS_QUEUED), timeout=10))
    assert forgotten.applied and "t1" not in service.policy.state.placements and "t1" not in service.policy.progress
    assert _loads(service) == {wid: (0, 0) for wid, _ in WORKERS} and service.policy.forest.to_bytes() == tree
    again = arun(stub.Route(spb.RouteRequest(meta=meta("r3"), trajectory_id="t1", prompt_id="p1", prompt_tokens=10,
                                             max_new_tokens=20), timeout=10))
    assert again.reason.startswith("new:")  # a new play: routed as a new trajectory, nothing carried over
    unknown = arun(stub.ReportFinish(spb.FinishReport(meta=meta("f2"), trajectory_id="never", prompt_id="p1",
                                                      status=common_pb2.TRAJECTORY_STATUS_QUEUED), timeout=10))
    assert not unknown.applied  # nothing to forget: no error either
    arun(running.stop())
