"""The elastic coordinator: the membership registry of the pool and the plans it executes.

```
 RegisterMember / Transition ─▶ member records (CAS on generation)
 ApplyPlan ─▶ PlanRunner (plans.py) ─▶ ReplicaTasks (replicas.py) ─▶ ReplicaDriver (driver.py)
                                                                      ├─ trainer: Admit/ReleaseHybrid, manifests
 run(): every poll_interval_s                                         ├─ rollout: DrainWorker, StartWorkers
   ReplicaTasks.sweep ─▶ watch ACTIVE, resume or roll back             └─ hybrid processes
   replicas no task owns (a restart)
 every min(5 s, heartbeat_timeout_s / 3): liveness ─▶ OFFLINE "missed heartbeats", or back
```

Liveness comes from the owners of the members, through what they already answer: a rollout
member is alive while the rollout gateway lists its worker as starting, serving or draining
(ListWorkers); a training member while the trainer answers its step manifest (the poll above);
any member while its owner sends Heartbeat RPCs. A member with no such report for
elastic.heartbeat_timeout_s goes OFFLINE ("missed heartbeats") and returns to its role's state
when reported again. Hybrid replicas are the replica tasks' to watch. Liveness is soft state,
kept in memory (not a CAS write per report, which would race every transition): a restarted
coordinator gives every member a full timeout.

Every member is a Redis record with a generation (compare-and-set on every transition); the
membership epoch changes whenever the set of members or a role changes. A request id makes each
mutation idempotent: the RPC boundary (libra.boundary) answers a replay with the first reply.
"""

from __future__ import annotations

import asyncio
import time

import grpc

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
from libra.v1 import common_pb2, elastic_pb2 as pb, elastic_pb2_grpc, rollout_pb2, rollout_pb2_grpc

_log = liblog.get("libra.elastic")
ROLE_NAMES = {pb.ROLE_ROLLOUT: "rollout", pb.ROLE_TRAINING: "training", pb.ROLE_HYBRID: "hybrid"}
MISSED = "missed heartbeats"  # the detail of an OFFLINE that liveness set (and may undo)
LIVE_WORKER_STATES = frozenset({common_pb2.WORKER_STATE_STARTING, common_pb2.WORKER_STATE_SERVING,
                                common_pb2.WORKER_STATE_DRAINING})
LIST_WORKERS_TIMEOUT_S = 5.0


def liveness_move(member: pb.Member, reported: bool, last_alive: float, now: float, timeout: float) -> int | None:
    """The state liveness moves `member` to, or None: OFFLINE after `timeout` seconds with no report
    of it alive; back to its role's state when reported again after liveness took it offline."""
    if reported and member.state == pb.MEMBER_STATE_OFFLINE and member.detail == MISSED:
        return core.initial_state(member.role)
    if not reported and now - last_alive > timeout and member.state not in (pb.MEMBER_STATE_OFFLINE,
                                                                              pb.MEMBER_STATE_FAILED):
        return pb.MEMBER_STATE_OFFLINE
    return None


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
        self._rollout = None  # the gateway's stub: which rollout members are alive
        self._alive_at: dict[str, float] = {}  # member id -> when its owner last reported it alive
        self._since = time.time()  # a restarted coordinator gives every member a full timeout

    def service_names(self) -> list[str]:
        return [pb.DESCRIPTOR.services_by_name["ElasticCoordinator"].full_name]

    def register(self, server) -> None:
        elastic_pb2_grpc.add_ElasticCoordinatorServicer_to_server(ElasticServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        self._since = time.time()
        self._channels = [channel(self.config.address_of(s)) for s in ("trainer", "rollout")]
        self._rollout = rollout_pb2_grpc.RolloutStub(self._channels[1])
        if self.driver is None:
            values = {"trainer": self.config.address_of("trainer"), "run_id": self.run_id}
            processes = HybridProcesses(self.config.elastic.hybrid_command, values,
                                        self.config.run_path / "logs" / "hybrids")
            self.driver = GrpcReplicaDriver(*self._channels, self.run_id, processes)
        self.replicas = ReplicaTasks(self.store, self.driver, self.config.elastic)
        self.plans = PlanRunner(self.store, self.replicas, self.driver, self.config.elastic)
        await self.replicas.sweep(None)  # resume or roll back replicas a previous coordinator left mid-phase
        await self.plans.resume()

    async def run(self) -> None:
        """Watch and recover hybrid replicas; judge the other members' liveness."""
        timeout = self.config.elastic.heartbeat_timeout_s
        every = min(5.0, timeout / 3, self.config.elastic.poll_interval_s)
        last_liveness_check = time.monotonic()
        trainer_answered = False  # since the last liveness check
        while True:
            await asyncio.sleep(every)
            try:
                view = await self.driver.view()
            except LibraError:
                view = None  # the trainer is not up (yet): processes are still watched
            trainer_answered = trainer_answered or view is not None
            await self.replicas.sweep(view)
            if time.monotonic() - last_liveness_check >= min(5.0, timeout / 3):
                last_liveness_check = time.monotonic()
                await self._judge_liveness(timeout, trainer_answered)
                trainer_answered = False

    async def _serving_workers(self) -> set[str]:
        """The rollout gateway's workers that are starting, serving or draining (none if it does not answer)."""
        try:
            reply = await self._rollout.ListWorkers(rollout_pb2.ListWorkersRequest(run_id=self.run_id),
                                                    timeout=LIST_WORKERS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return set()
        return {w.worker_id for w in reply.workers if w.state in LIVE_WORKER_STATES}

    async def _judge_liveness(self, timeout: float, trainer_answered: bool) -> None:
        now = time.time()
        workers = await self._serving_workers()
        for member in await self._members():
            if member.role == pb.ROLE_HYBRID:
                continue  # the replica tasks watch hybrids (their processes, the trainer's manifests)
            reported = trainer_answered if member.role == pb.ROLE_TRAINING else member.member_id in workers
            if reported:
                self._alive_at[member.member_id] = now
            last_alive = max(member.last_heartbeat, self._alive_at.get(member.member_id, 0.0), self._since)
            target = liveness_move(member, reported, last_alive, now, timeout)
            if target is None:
                continue
            try:
                await self._write(member, target, MISSED if target == pb.MEMBER_STATE_OFFLINE else "reported alive")
            except (Conflict, LibraError):
                pass  # it changed meanwhile (or may not move now); judge it again next round

    async def close(self) -> None:
        if self.plans is not None:
            await self.plans.close()
        if self.replicas is not None:
            await self.replicas.close()
        for chan in self._channels:
            await chan.close()
        if self.store is not None:
            await self.store.close()

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

    async def register_member(self, member: pb.Member) -> pb.Member:
        state = core.initial_state(member.role)
        fresh = pb.Member()
        fresh.CopyFrom(member)
        fresh.state, fresh.last_heartbeat = state, time.time()
        fresh.state_since = fresh.last_heartbeat
        existing = await self.store.get_member(member.member_id)
        expected = existing.generation if existing else 0
        fresh.generation = await self.store.put_member(member.member_id, fresh.SerializeToString(), expected,
                                                       ROLE_NAMES[member.role])
        _log.info("member registered", member=member.member_id, role=ROLE_NAMES[member.role], bucket=member.bucket,
                  generation=fresh.generation)
        return fresh

    async def heartbeat(self, member_id: str) -> pb.Member:
        """Its owner says the member is alive (an owner that the coordinator does not ask itself)."""
        record = await self.store.get_member(member_id)
        if record is None:
            raise NotFound(f"unknown member {member_id!r}: register it first")
        member = self._decode(record)
        now = self._alive_at[member_id] = time.time()
        if liveness_move(member, True, now, now, self.config.elastic.heartbeat_timeout_s) is not None:
            member = await self._write(member, core.initial_state(member.role), "heartbeat")
        member.last_heartbeat = now
        return member

    async def list_members(self, role: int) -> tuple[list[pb.Member], int]:
        members = [m for m in await self._members() if role in (pb.ROLE_UNSPECIFIED, m.role)]
        for member in members:  # the latest report of it alive (kept in memory, see the module doc)
            member.last_heartbeat = max(member.last_heartbeat, self._alive_at.get(member.member_id, 0.0))
        return members, await self.store.membership_epoch()

    async def transition(self, member_id: str, target: int, expected: int, detail: str) -> pb.Member:
        record = await self.store.get_member(member_id)
        if record is None:
            raise NotFound(f"unknown member {member_id!r}")
        member = self._decode(record)
        if expected and expected != member.generation:
            raise Conflict(f"member {member_id} is at generation {member.generation}, not {expected}")
        updated = await self._write(member, target, detail)
        _log.info("member transition", member=member_id, state=pb.MemberState.Name(target),
                  generation=updated.generation)
        return updated

    async def apply_plan(self, plan) -> pb.PlanProgress:
        progress = await self.plans.apply(plan)
        return progress

    async def plan_progress(self, generation: int) -> pb.PlanProgress:
        return await self.plans.progress(generation)


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(ElasticService(config), port if port is not None else config.port_of("elastic"),
                       config.metrics_port_of("elastic"))
