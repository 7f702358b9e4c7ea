"""The planner service: serves the plan in force and records every decision in Redis."""

from __future__ import annotations

import time

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import FailedPrecondition, InvalidArgument
from libra.plans import Plan, from_proto, to_proto
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.planner import core
from libra.services.planner.servicer import PlannerServicer
from libra.v1 import planner_pb2, planner_pb2_grpc

_log = liblog.get("libra.planner")


class PlannerService(Service):
    name = "planner"

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_id = config.run_id
        self.store = None

    def service_names(self) -> list[str]:
        return [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name]

    def register(self, server) -> None:
        planner_pb2_grpc.add_PlannerServicer_to_server(PlannerServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        existing = await self.store.get_plan()
        if existing is None:
            plan = core.static_plan(self.config.planner, time.time())
            await self.store.put_plan(to_proto(plan))
            await self._record_decision(plan, applied=True, reason=plan.reason)
            _log.info("plan", plan=core.describe(plan))
        else:
            _log.info("plan resumed from redis", plan=core.describe(from_proto(existing)))

    async def _record_decision(self, plan: Plan, applied: bool, reason: str) -> None:
        decision = planner_pb2.PlanDecision(
            timestamp=time.time(), chosen=to_proto(plan), applied=applied, reason=reason,
            candidates=[planner_pb2.Candidate(plan=to_proto(plan), feasible=True, note="configured")])
        await self.store.append_plan_decision(decision.SerializeToString())

    async def current_plan(self) -> Plan:
        message = await self.store.get_plan()
        if message is None:
            raise FailedPrecondition("no plan yet: the planner is still starting")
        return from_proto(message)

    async def preflight(self, request) -> planner_pb2.PlanDecision:
        """Search allocations for the given cluster, model and trace; the decision is logged, not applied."""
        import asyncio

        from libra.services.planner.hardware import GpuSpec, ModelSpec
        from libra.services.planner.preflight import preflight, spec_from_yaml

        gpu = spec_from_yaml(GpuSpec, request.cluster_yaml, "cluster_yaml")
        model = spec_from_yaml(ModelSpec, request.model_yaml, "model_yaml")
        trace = [(s.prompt_tokens, s.output_tokens) for s in request.trace]
        decision = await asyncio.to_thread(preflight, model, gpu, trace, request.gpus, request.top_k or 5)
        decision.reason = "preflight (not applied): " + decision.reason
        await self.store.append_plan_decision(decision.SerializeToString())
        return decision

    async def observe(self, request_id: str, records) -> bool:
        for record in records:
            if record.kind not in ("turn", "step"):
                raise InvalidArgument(f"records[].kind must be 'turn' or 'step', got {record.kind!r}")
        if not await self.store.once("planner.observe", request_id):
            return False
        for record in records:
            await self.store.append_history(record.kind, record)
        return True

    async def decisions(self, limit: int) -> list[planner_pb2.PlanDecision]:
        raw = await self.store.plan_decisions(limit)
        return [planner_pb2.PlanDecision.FromString(blob) for blob in raw]

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(PlannerService(config), port if port is not None else config.port_of("planner"),
                       config.metrics_port_of("planner"))
