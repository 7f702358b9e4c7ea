"""The elastic coordinator: the membership registry of the pool and the plans it executes.

```
 RegisterMember / Heartbeat / Transition ─▶ member records (CAS on generation)
 ApplyPlan ─▶ PlanRunner (plans.py) ─▶ ReplicaTasks (replicas.py) ─▶ ReplicaDriver (driver.py)
                                                                      ├─ trainer: Admit/ReleaseHybrid, manifests
 run(): every poll_interval_s                                         ├─ rollout: DrainWorker, StartWorkers
   heartbeats ─▶ OFFLINE;  ReplicaTasks.sweep ─▶ watch ACTIVE,         └─ hybrid processes
   resume or roll back replicas no task owns (a restart)
```

Every member is a Redis record with a generation (compare-and-set on every transition); the
membership epoch changes whenever the set of members or a role changes. A request id makes each
mutation idempotent: a replay returns the first answer.
"""

from __future__ import annotations

import asyncio
import time

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import Conflict, LibraError, NotFound
from libra.rpc import channel
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.elastic import core
from libra.services.elastic.driver import GrpcReplicaDriver, HybridProcesses, ReplicaDriver
from libra.services.elastic.plans import PlanRunner
from libra.services.elastic.replicas import ReplicaTasks
from libra.services.elastic.servicer import ElasticServicer
from libra.v1 import elastic_pb2 as pb, elastic_pb2_grpc

_log = liblog.get("libra.elastic")
ROLE_NAMES = {pb.ROLE_ROLLOUT: "rollout", pb.ROLE_TRAINING: "training", pb.ROLE_HYBRID: "hybrid"}


class ElasticService(Service):
    name = "elastic"

    def __init__(self, config: RunConfig, driver: ReplicaDriver | None = None):
        self.config = config
        self.run_id = config.run_id
        self.store = None
        self.driver = driver
        self.replicas: ReplicaTasks | None = None
        self.plans: PlanRunner | None = None
        self._channels: list = []

    def service_names(self) -> list[str]:
        return [pb.DESCRIPTOR.services_by_name["ElasticCoordinator"].full_name]

    def register(self, server) -> None:
        elastic_pb2_grpc.add_ElasticCoordinatorServicer_to_server(ElasticServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        if self.driver is None:
            self._channels = [channel(self.config.address_of(s)) for s in ("trainer", "rollout")]
            values = {"trainer": self.config.address_of("trainer"), "run_id": self.run_id}
            processes = HybridProcesses(self.config.elastic.hybrid_command, values,
                                        self.config.run_path / "logs" / "hybrids")
            self.driver = GrpcReplicaDriver(*self._channels, self.run_id, processes)
        self.replicas = ReplicaTasks(self.store, self.driver, self.config.elastic)
        self.plans = PlanRunner(self.store, self.replicas, self.driver, self.config.elastic)
        await self.replicas.sweep(None)  # resume or roll back replicas a previous coordinator left mid-phase
        await self.plans.resume()

    async def run(self) -> None:
        """Mark members whose heartbeats stopped as OFFLINE; watch and recover hybrid replicas."""
        timeout = self.config.elastic.heartbeat_timeout_s
        every = min(5.0, timeout / 3, self.config.elastic.poll_interval_s)
        last_heartbeat_check = time.monotonic()
        while True:
            await asyncio.sleep(every)
            try:
                view = await self.driver.view()
            except LibraError:
                view = None  # the trainer is not up (yet): processes are still watched
            await self.replicas.sweep(view)
            if time.monotonic() - last_heartbeat_check >= min(5.0, timeout / 3):
                last_heartbeat_check = time.monotonic()
                await self._mark_offline(timeout)

    async def _mark_offline(self, timeout: float) -> None:
        now = time.time()
        for member in await self._members():
            stale = member.last_heartbeat and now - member.last_heartbeat > timeout
            if stale and member.state not in (pb.MEMBER_STATE_OFFLINE, pb.MEMBER_STATE_FAILED):
                try:
                    await self._write(member, pb.MEMBER_STATE_OFFLINE, "missed heartbeats")
                except (Conflict, LibraError):
                    pass  # it changed meanwhile (or may not go OFFLINE now); judge it again next round

    async def close(self) -> None:
        if self.plans is not None:
            await self.plans.close()
        if self.replicas is not None:
            await self.replicas.close()
        for chan in self._channels:
            await chan.close()
        if self.store is not None:
            await self.store.close()

    async def _replayed(self, scope: str, request_id: str, message_type):
        blob = await self.store.recall_result(scope, request_id)
        return message_type.FromString(blob) if blob is not None else None

    async def _members(self) -> list[pb.Member]:
        return [self._decode(r) for r in await self.store.list_members()]

    @staticmethod
    def _decode(record) -> pb.Member:
        member = pb.Member.FromString(record.payload)
        member.generation = record.generation
        return member

    async def _write(self, member: pb.Member, state: int, detail: str) -> pb.Member:
        updated = core.transitioned(member, state, time.time(), detail, self.config.elastic.history_per_replica)
        updated.generation = await self.store.put_member(
            member.member_id, updated.SerializeToString(), member.generation, ROLE_NAMES.get(member.role, ""))
        return updated

    async def register_member(self, request_id: str, member: pb.Member) -> pb.Member:
        if (replay := await self._replayed("elastic.register", request_id, pb.Member)) is not None:
            return replay
        state = core.initial_state(member.role)
        fresh = pb.Member()
        fresh.CopyFrom(member)
        fresh.state, fresh.last_heartbeat = state, time.time()
        existing = await self.store.get_member(member.member_id)
        expected = existing.generation if existing else 0
        fresh.generation = await self.store.put_member(member.member_id, fresh.SerializeToString(), expected,
                                                       ROLE_NAMES[member.role])
        await self.store.remember_result("elastic.register", request_id, fresh.SerializeToString())
        _log.info("member registered", member=member.member_id, role=ROLE_NAMES[member.role], bucket=member.bucket,
                  generation=fresh.generation)
        return fresh

    async def heartbeat(self, member_id: str) -> pb.Member:
        record = await self.store.get_member(member_id)
        if record is None:
            raise NotFound(f"unknown member {member_id!r}: register it first")
        member = self._decode(record)
        member.last_heartbeat = time.time()
        member.generation = await self.store.put_member(member_id, member.SerializeToString(), record.generation,
                                                        record.role)
        return member

    async def list_members(self, role: int) -> tuple[list[pb.Member], int]:
        members = [m for m in await self._members() if role in (pb.ROLE_UNSPECIFIED, m.role)]
        return members, await self.store.membership_epoch()

    async def transition(self, request_id: str, member_id: str, target: int, expected: int, detail: str) -> pb.Member:
        if (replay := await self._replayed("elastic.transition", request_id, pb.Member)) is not None:
            return replay
        record = await self.store.get_member(member_id)
        if record is None:
            raise NotFound(f"unknown member {member_id!r}")
        member = self._decode(record)
        if expected and expected != member.generation:
            raise Conflict(f"member {member_id} is at generation {member.generation}, not {expected}")
        updated = await self._write(member, target, detail)
        await self.store.remember_result("elastic.transition", request_id, updated.SerializeToString())
        _log.info("member transition", member=member_id, state=pb.MemberState.Name(target),
                  generation=updated.generation)
        return updated

    async def apply_plan(self, request_id: str, plan) -> pb.PlanProgress:
        if (replay := await self._replayed("elastic.apply", request_id, pb.PlanProgress)) is not None:
            return replay
        progress = await self.plans.apply(plan)
        await self.store.remember_result("elastic.apply", request_id, progress.SerializeToString())
        return progress

    async def plan_progress(self, generation: int) -> pb.PlanProgress:
        return await self.plans.progress(generation)


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(ElasticService(config), port if port is not None else config.port_of("elastic"),
                       config.metrics_port_of("elastic"))
