"""The elastic coordinator against the real rollout gateway and trainer code, over real Redis and gRPC.

The drain test uses the real rollout gateway code path (servicer, WorkerPool, Membership) with the
real scheduler and coordinator; the end-to-end test joins a real hybrid process to the trainer's
real elastic hooks. The phase-by-phase tests with doubles are in test_elastic_coordinator.py,
whose rollout double and request metadata these reuse.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libra.errors import Unavailable
from libra.services.rollout.engines.client import Generation
from libra.services.elastic.driver import GrpcReplicaDriver, HybridProcesses
from libra.services.elastic.server import ElasticService
from libra.v1 import common_pb2, elastic_pb2 as epb, elastic_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.service.elastic_doubles import S, RolloutDouble, meta
from tests.service.helpers import run_config, start


class StoppableEngine:
    """The engine process of a pool worker (a vLLM server in production): records when it is stopped."""

    def __init__(self, name: str) -> None:
        self.base_url, self.alive, self.stopped_at = f"http://127.0.0.1:1/{name}", True, None
        self.engine = "vllm"

    def stop(self) -> None:
        self.stopped_at, self.alive = time.monotonic(), False


class GatedEngineClient:
    """An engine's client whose generations finish when the test opens the gate."""

    def __init__(self) -> None:
        self.gate, self.calls = asyncio.Event(), 0

    async def generate(self, prompt_ids, **sampling):
        self.calls += 1
        await self.gate.wait()
        self.finished_at = time.monotonic()
        return Generation([7, 8], [-0.1, -0.1], "stop", 0.0)

    async def close(self) -> None:
        self.closed = True


def test_a_drained_worker_gets_no_new_turns_while_its_in_flight_turn_finishes(redis_url, run_id, tmp_path, arun,
                                                                             store):
    """The rollout gateway's DrainWorker (real servicer, pool and membership; real scheduler and
    coordinator): the scheduler stops routing to the worker at once, the gateway refuses new turns
    on it, the turn in flight finishes, and only then is the engine stopped."""
    from libra.services.rollout.membership import Membership
    from libra.services.rollout.router import SchedulerRouter
    from libra.services.rollout.server import RolloutService
    from libra.services.rollout.servicer import RolloutServicer
    from libra.services.rollout.workers import PoolWorker
    from libra.services.scheduler.server import SchedulerService
    from libra.v1 import scheduler_pb2 as spb, scheduler_pb2_grpc

    config = run_config(redis_url, run_id, tmp_path)

    async def scenario() -> None:
        scheduler, scheduler_chan = await start(SchedulerService(config))
        elastic, elastic_chan = await start(ElasticService(config))
        server = grpc.aio.server()
        try:
            gateway = RolloutService(config)
            gateway.store = store  # where the RPC boundary keeps DrainWorker's reply
            engines = {name: (StoppableEngine(name), GatedEngineClient()) for name in ("short-0", "short-1")}
            gateway.membership = Membership(gateway.pool, SchedulerRouter(scheduler_chan, run_id), elastic_chan,
                                            run_id)
            for name, (process, client) in engines.items():
                worker = PoolWorker(name, "short", 1, process, client, version=1,
                                    state=common_pb2.WORKER_STATE_SERVING)
                gateway.pool.workers[name] = worker
                await gateway.membership.join(worker)
            rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(gateway), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            rollout = rollout_pb2_grpc.RolloutStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            sampling = {"temperature": 1.0, "top_p": 1.0}
            process, client = engines["short-0"]
            in_flight = asyncio.create_task(gateway.pool.generate("short-0", [1, 2], 4, 0, sampling, []))
            while client.calls == 0:
                await asyncio.sleep(0.01)
            drain = asyncio.ensure_future(rollout.DrainWorker(rollout_pb2.DrainWorkerRequest(
                meta=meta("drain-1"), worker_id="short-0", timeout_seconds=30)))
            while gateway.pool.workers["short-0"].state != common_pb2.WORKER_STATE_DRAINING:
                await asyncio.sleep(0.01)
            router = scheduler_pb2_grpc.SchedulerStub(scheduler_chan)
            for i in range(6):  # new turns go elsewhere
                decision = await router.Route(spb.RouteRequest(meta=meta(f"r{i}"), trajectory_id=f"t{i}",
                                                               prompt_tokens=8, max_new_tokens=8))
                assert decision.worker_id == "short-1"
            with pytest.raises(Unavailable):  # a turn routed there before the drain is retried elsewhere
                await gateway.pool.generate("short-0", [1], 4, 0, sampling, [])
            await asyncio.sleep(0.2)
            assert not drain.done() and process.stopped_at is None  # it waits for the turn in flight
            client.gate.set()
            finished = await in_flight
            assert (await drain).applied
            assert finished.token_ids == [7, 8] and finished.batch >= 1  # the pool's mean batch over the turn
            assert process.stopped_at >= engines["short-0"][1].finished_at and engines["short-1"][0].alive
            assert getattr(engines["short-0"][1], "closed", False)  # the drained worker's client is closed
            members = (await elastic_pb2_grpc.ElasticCoordinatorStub(elastic_chan).ListMembers(
                epb.ListMembersRequest())).members
            assert {m.member_id: m.state for m in members}["short-0"] == S.MEMBER_STATE_OFFLINE
        finally:
            await server.stop(0)
            await elastic.stop()
            await scheduler.stop()
    arun(scenario())


@pytest.mark.slow
def test_end_to_end_a_real_hybrid_process_joins_the_real_trainer_and_is_released(redis_url, run_id, tmp_path,
                                                                                   arun, store):
    """The coordinator with its default hybrid command against the trainer's real elastic hooks
    (services/trainer/elastic: ElasticControl over gRPC, a torch core stepping in the background)
    and a real `libra.services.trainer.elastic.hybrid` process; rollout stays a double."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from libra.rpc import ServiceHost
    from libra.services.elastic.config import DEFAULT_HYBRID_COMMAND
    from libra.services.trainer.elastic.control import ElasticControl
    from libra.services.trainer.elastic.core_hooks import ElasticCore
    from libra.services.trainer.server import TrainerService
    from libra.services.trainer.torch_backend import TorchBackend
    from tests.unit.test_elastic_math import GROUP, GROUPS, _config, _groups

    torch.manual_seed(0)
    model_dir = str(tmp_path / "tiny-llama")
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
                     ).save_pretrained(model_dir)
    config = run_config(redis_url, run_id, tmp_path, elastic={"poll_interval_s": 0.1})

    async def scenario() -> None:
        trainer = TrainerService(config)
        backend = TorchBackend(_config(), seed=0)
        backend.load(model_dir)
        core = ElasticCore(backend, snapshot_root=str(tmp_path / "snapshots"), verify_lockstep=True)
        backend.gradient_hook = core
        trainer.elastic = ElasticControl(core, store)
        trainer.store = store  # where the RPC boundary keeps replies
        host = ServiceHost("trainer", trainer.service_names(), 0, "127.0.0.1")
        trainer.register(host.server)
        port = await host.start()

        async def train_forever() -> None:
            step = 0
            while True:
                step += 1
                manifest = await trainer.elastic.begin_step(step)
                batch = _groups(step, trainer.elastic.widen(manifest, GROUPS))
                await asyncio.to_thread(backend.train_step, trainer.elastic.hand_out(batch, GROUP, manifest),
                                        _config())
                trainer.elastic.end_step()
                await asyncio.sleep(0.75)  # a real model's step: the hybrid process starts within a few
        stepping = asyncio.create_task(train_forever())
        rollout_double = RolloutDouble()
        rollout_server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServicer_to_server(rollout_double, rollout_server)
        rollout_port = rollout_server.add_insecure_port("127.0.0.1:0")
        await rollout_server.start()
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in (port, rollout_port)]
        processes = HybridProcesses(DEFAULT_HYBRID_COMMAND, {"trainer": f"127.0.0.1:{port}", "run_id": run_id},
                                    tmp_path / "hybrids")
        coordinator, chan = await start(ElasticService(config, GrpcReplicaDriver(*channels, run_id, processes)))
        stub = rollout_double.elastic = elastic_pb2_grpc.ElasticCoordinatorStub(chan)
        try:
            async def plan(generation: int, dp: int) -> epb.ApplyPlanRequest:
                """As the planner does: store the plan (its only writer), then send it to ApplyPlan."""
                request = epb.ApplyPlanRequest(meta=meta(f"p{generation}"), plan=common_pb2.Plan(
                    generation=generation, training=common_pb2.TrainingLayout(dp=dp, tp=1, pp=1)))
                await coordinator.service.store.put_plan(request.plan)
                return request

            async def wait_plan(generation: int) -> epb.PlanProgress:
                deadline = time.monotonic() + 180
                while True:
                    progress = await stub.GetPlanProgress(epb.PlanProgressRequest(generation=generation))
                    if progress.state in ("applied", "failed"):
                        return progress
                    assert time.monotonic() < deadline, f"plan {generation} stuck: {progress}"
                    await asyncio.sleep(0.2)

            await stub.ApplyPlan(await plan(2, dp=2))
            joined = await wait_plan(2)
            hybrid = joined.replicas[0]
            assert joined.state == "applied", joined
            assert [r.to_state for r in hybrid.history] == [
                S.MEMBER_STATE_JOINING, S.MEMBER_STATE_FETCHING_STATE, S.MEMBER_STATE_ALIGNED, S.MEMBER_STATE_ACTIVE]
            view = await GrpcReplicaDriver(*channels, run_id, processes).view()
            assert hybrid.member_id in view.active and view.hybrids[hybrid.member_id].state == "active"
            await stub.ApplyPlan(await plan(3, dp=1))
            released = await wait_plan(3)
            assert released.state == "applied", released
            back = released.replicas[0]
            assert back.state == S.MEMBER_STATE_ROLLOUT and back.detail.startswith("released")
            assert processes.children[hybrid.pid].wait(30) == 0  # told BYE, it exited by itself
            assert not core.failures
        finally:
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)
            await coordinator.stop()
            for child in processes.children.values():
                child.kill()
                child.wait()
            await rollout_server.stop(0)
            await host.stop(0)
            core.close()
    arun(scenario())
