"""Probes for the RPC contract test (test_rpc_contract.py): each real servicer class on a real gRPC
server (port 0) over a real Redis, with a small probe in place of its service that counts the work
the servicer asks of it. The probe keeps its replies where the real service does."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import pkgutil
from types import SimpleNamespace

import libra.services
from libra.errors import FailedPrecondition
from libra.rpc import ServiceHost, channel
from libra.services.scheduler import convert
from libra.services.trainer.status import TrainerStatus
from libra.v1 import common_pb2, elastic_pb2, rollout_pb2, scheduler_pb2, trainer_pb2
from tests.service.helpers import run_config


def servicers() -> dict[str, type]:
    """Full service name -> the servicer class of services/*/servicer.py that implements it."""
    found: dict[str, type] = {}
    for package in pkgutil.iter_modules(libra.services.__path__):
        name = f"libra.services.{package.name}.servicer"
        if not package.ispkg or importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            generated = [k for k in getattr(value, "__mro__", ())[1:] if k.__module__.endswith("_pb2_grpc")]
            if isinstance(value, type) and generated and value.__module__ == module.__name__:
                found[f"libra.v1.{generated[0].__name__.removesuffix('Servicer')}"] = value
    return found


SERVICERS = servicers()


class Probe:
    """Stands in for a service behind its real servicer; `calls` counts the work it was asked for."""

    name = "probe"

    def __init__(self, run_id: str, store, replies):
        self.run_id, self.store = run_id, store
        if replies is not None:
            self.replies = replies
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None  # set: async work waits for it (a call in progress)
        self.fail = False  # set: the next piece of work fails once

    def _do(self, what: str) -> int:
        self.calls.append(what)
        if self.fail:
            self.fail = False
            raise FailedPrecondition(f"probe: {what} fails once")
        return len(self.calls)

    async def _do_async(self, what: str) -> int:
        n = self._do(what)
        if self.gate is not None:
            await self.gate.wait()
        return n


class TrainerProbe(Probe):
    def __init__(self, *args):
        super().__init__(*args)
        self.status = TrainerStatus(total_steps=10)  # the real one, as the trainer's servicer reads it

    async def manifest(self, step):
        return trainer_pb2.StepManifest(step=step)

    async def save_checkpoint(self):
        n = await self._do_async("save_checkpoint")
        return trainer_pb2.CheckpointInfo(step=n, path=f"/checkpoints/{n}")

    async def pause(self, paused: bool) -> bool:
        return await self._do_async("pause" if paused else "resume") % 2 == 1

    def elastic_control(self):
        return self

    async def admit(self, replica_id, generation) -> bool:
        return await self._do_async("admit") % 2 == 1

    async def release(self, replica_id, generation) -> bool:
        return await self._do_async("release") % 2 == 1


class _Listed:
    def __init__(self, n: int):
        self.n = n

    def to_proto(self):
        return common_pb2.WorkerInfo(worker_id=f"w{self.n}") if self.n else []  # 0: an empty roster


class RolloutProbe(Probe):
    pool = SimpleNamespace(workers={})  # StartWorkers counts the running workers (none here)

    def stats(self):
        return rollout_pb2.RolloutStats(turns=len(self.calls))

    async def submit(self, groups):
        n = await self._do_async("submit")
        return n, 0, n

    async def update_weights(self, version, path, group, colocated=""):
        n = await self._do_async("update_weights")
        return SimpleNamespace(acks=[rollout_pb2.WorkerAck(worker_id=f"w{n}", version=version, ok=True)],
                               serving=_Listed(0), group_unusable="")

    async def drain_worker(self, worker_id, timeout_s) -> None:
        await self._do_async("drain_worker")

    async def start_workers(self, buckets):
        return [_Listed(await self._do_async("start_workers"))]


class SchedulerProbe(Probe):
    def route(self, turn):
        n = self._do("route")
        return convert.decision_from_proto(scheduler_pb2.RouteDecision(worker_id=f"w{n}", reason=f"probe {n}"))

    def turn_done(self, *args) -> None:
        self._do("turn_done")

    def tool_returned(self, *args) -> None:
        self._do("tool_returned")

    def finish(self, *args) -> None:
        self._do("finish")

    def forget(self, *args) -> bool:
        self._do("forget")
        return True

    def replied(self, *args) -> None:
        pass  # the real service keeps it with the trajectory's record in Redis (not probed here)

    async def persist(self) -> None:
        pass

    async def register_worker(self, worker) -> None:
        await self._do_async("register_worker")

    async def deregister_worker(self, worker_id) -> None:
        await self._do_async("deregister_worker")


class PlannerProbe(Probe):
    clock = staticmethod(lambda: 1000.0)  # the servicer stamps a hand-made plan with the service's clock

    async def observe(self, records) -> bool:
        return await self._do_async("observe") % 2 == 1

    async def set_plan(self, plan):
        stored = common_pb2.Plan()
        stored.CopyFrom(plan)
        stored.generation = await self._do_async("set_plan")
        return stored


class ElasticProbe(Probe):
    async def register_member(self, member):
        return elastic_pb2.Member(member_id=member.member_id, generation=await self._do_async("register_member"))

    async def transition(self, member_id, target, expected, detail):
        return elastic_pb2.Member(member_id=member_id, state=target, generation=await self._do_async("transition"))

    async def apply_plan(self, plan):
        return elastic_pb2.PlanProgress(generation=plan.generation, steps_total=await self._do_async("apply_plan"))


PROBES = {"Trainer": TrainerProbe, "Rollout": RolloutProbe, "Scheduler": SchedulerProbe, "Planner": PlannerProbe,
          "ElasticCoordinator": ElasticProbe}
SERVICES = {"Trainer": "trainer.server.TrainerService", "Rollout": "rollout.server.RolloutService",
            "Scheduler": "scheduler.server.SchedulerService", "Planner": "planner.server.PlannerService",
            "ElasticCoordinator": "elastic.server.ElasticService"}


def real_replies(service_name: str, config):
    """The `replies` the real service keeps (None: its run's Redis, the boundary's default)."""
    module, _, name = SERVICES[service_name].rpartition(".")
    real = getattr(importlib.import_module(f"libra.services.{module}"), name)
    return getattr(real(config), "replies", None)


class Harness:
    """One real servicer on a real gRPC server (port 0) with a probe behind it, over a real Redis;
    `security`: the server's token and TLS (libra.security.Security), its channel's too."""

    def __init__(self, service, run_id: str, store, tmp_path, security=None):
        servicer_class = SERVICERS[service.full_name]
        config = run_config("redis://127.0.0.1:1", run_id, tmp_path)
        replies = real_replies(service.name, config)
        self.probe = PROBES[service.name](run_id, store, replies)
        self.probe.config = config  # servicers bound requests by its security.limits
        self.security = security
        self.host = ServiceHost(service.name, [service.full_name], 0, "127.0.0.1", security)
        grpc_module = importlib.import_module(servicer_class.__mro__[1].__module__)
        getattr(grpc_module, f"add_{service.name}Servicer_to_server")(servicer_class(self.probe), self.host.server)
        self.stub_class = getattr(grpc_module, f"{service.name}Stub")

    async def __aenter__(self):
        self.port = port = await self.host.start()
        self.channel = channel(f"127.0.0.1:{port}", security=self.security)
        self.stub = self.stub_class(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.host.stop(0)
