"""The planner service: serves the plan in force and records every decision in Redis.

In `mode: online` a background loop also calibrates and replans:

```
 every cluster.tick_s:
   Redis history:turn / history:step ──(only entries after the cursor)──▶ HistoryFeeder ─▶ Replanner
   Replanner.consider(now) (in a thread) ─▶ decision ─▶ plan:decisions   (every decision, with reason)
        └ applied: put_plan(generation + 1) ─▶ ElasticCoordinator.ApplyPlan (gRPC retries UNAVAILABLE)
   blob planner.online ◀─ cursor + counters + Replanner state, written after the decision
```
The cursor and the Replanner's state are written together, so a restarted planner continues
where the last one stopped and never counts a history record twice. A plan whose ApplyPlan did
not get through stays `pending_apply` in that blob and is sent again on the next tick.

The planner is the plan record's only writer. A plan made by hand comes through `SetPlan`
(manual.py: checked, stored as generation + 1, recorded); it is then sent like an applied replan,
in the background: in mode online under the tick lock, the replanner adopting it as the plan in
force (its next decision may replace it) and the plan `pending_apply` until it got through; in mode
static once, and again when a restarted planner finds a hand-made plan stored.

The plan in force is also kept in memory: a Redis that comes back without it (no persistence)
gets it again (`redis_back`), and GetPlan answers it meanwhile; GetPlan says "no plan yet" only
before the planner first stored one (and the planner is not SERVING then).
"""

from __future__ import annotations

import asyncio
import json
import time

from prometheus_client import Counter, Gauge

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import Conflict, FailedPrecondition, InvalidArgument
from libra.plans import Plan, from_proto, to_proto
from libra.runtime import Service, serve as run_service
from libra.service_base import connect_store
from libra.services.planner import core, delivery, manual
from libra.services.planner.servicer import PlannerServicer
from libra.services.planner.telemetry import planner_probe
from libra.v1 import common_pb2, planner_pb2, planner_pb2_grpc

_log = liblog.get("libra.planner")
ONLINE_BLOB = "planner.online"
HISTORY_BATCH = 5000
PREDICTED = Gauge("libra_planner_predicted_step_seconds", "step time the calibrated model predicts (EWMA)")
MEASURED = Gauge("libra_planner_measured_step_seconds", "measured step time (EWMA)")
EFFICIENCY = Gauge("libra_planner_efficiency", "calibrated efficiency of the cost model", ["name"])
DECISIONS = Counter("libra_planner_decisions_total", "replanning decisions by outcome", ["outcome"])
IGNORED = Counter("libra_planner_history_ignored_total", "history records ignored as invalid", ["kind"])


class PlannerService(Service):
    name = "planner"

    def __init__(self, config: RunConfig):
        self.config = config
        self.run_id = config.run_id
        self.store = None
        self.replanner = None
        self.feeder = core.HistoryFeeder()
        self.online: dict = {}  # the planner.online blob: cursor, counters, pending_apply, replanner state
        self.plan: common_pb2.Plan | None = None  # the plan in force, as last read or written
        self.clock = time.time
        self._tick_lock = asyncio.Lock()
        self._handovers: set[asyncio.Task] = set()  # hand-made plans being sent (SetPlan)

    def service_names(self) -> list[str]:
        return [planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name]

    def register(self, server) -> None:
        planner_pb2_grpc.add_PlannerServicer_to_server(PlannerServicer(self), server)

    async def start(self) -> None:
        self.store = await connect_store(self.config.redis.url, self.run_id)
        existing = await self.store.get_plan()
        if existing is None:
            plan = core.static_plan(self.config.planner, time.time())
            self.plan = to_proto(plan)
            await self.store.put_plan(self.plan)
            await self._record_decision(plan, applied=True, reason=plan.reason)
            _log.info("plan", plan=core.describe(plan))
        else:
            self.plan = existing
            _log.info("plan resumed from redis", plan=core.describe(from_proto(existing)))
        if self.config.planner.mode == "online":
            await self._start_online()
        if existing is not None and existing.source == manual.SOURCE:  # maybe not sent before a restart
            self._hand_over(existing)  # a replay at the coordinator if it was

    async def _record_decision(self, plan: Plan, applied: bool, reason: str) -> None:
        decision = planner_pb2.PlanDecision(
            timestamp=time.time(), chosen=to_proto(plan), applied=applied, reason=reason, trigger="config",
            candidates=[planner_pb2.Candidate(plan=to_proto(plan), feasible=True, note="configured")])
        await self.store.append_plan_decision(decision.SerializeToString())
        planner_probe(self.config).decision(decision)

    # -- online mode -------------------------------------------------------------------------
    async def _start_online(self) -> None:
        from libra.services.planner.hardware import gpu_named, model_named
        from libra.services.planner.replan import Replanner, candidate_from_plan
        from libra.services.planner.search import SearchConfig
        from libra.services.planner.sim.cluster import SimConfig
        from libra.services.planner.sim.rank import SimRanker

        cluster, trainer, scheduler = self.config.planner.cluster, self.config.trainer, self.config.scheduler
        settings = self.config.planner.replan
        if not settings.batch_sequences:
            settings = settings.model_copy(update={"batch_sequences": trainer.groups_per_step * trainer.group_size})
        search_config = SearchConfig(total_gpus=cluster.gpus, group_size=trainer.group_size,
                                     tp_choices=cluster.tp_choices, min_train_gpus=cluster.min_train_gpus,
                                     min_rollout_gpus=cluster.min_rollout_gpus, whole_nodes=cluster.whole_nodes,
                                     uneven_splits_up_to=cluster.uneven_splits_up_to)
        model, gpu = model_named(cluster.model), gpu_named(cluster.hardware)
        # the replay runs the loop as this run does: its staleness bound, its routing policy, its
        # gateway's cap on trajectories played at once (a first turn's measured gap leaves the queue
        # out: the replay queues) and its elastic pool (a change of the training dp alone joins or
        # releases hybrids, the core steps on)
        sim = SimConfig(staleness=min(trainer.max_staleness, 64), policy=scheduler.policy.type,
                        per_worker_cap_tokens=scheduler.per_worker_cap_tokens,
                        max_in_flight=self.config.rollout.max_concurrent_trajectories,
                        core_replicas=self.config.elastic.core_replicas)
        ranker = SimRanker(model, gpu, search_config, sim, settings.sim_window_steps, settings.sim_warmup_steps,
                           workers=settings.sim_workers)
        self.replanner = Replanner(model, gpu, cluster.gpus, settings, search_config,
                                   candidate_from_plan(await self.store.get_plan()), ranker, total_steps=trainer.steps)
        blob = await self.store.load_blob(ONLINE_BLOB)
        self.online = json.loads(blob) if blob else {"cursor": {"turn": "", "step": ""},
                                                      "read": {"turn": 0, "step": 0}, "decisions": 0}
        if "replanner" in self.online:
            self.replanner.restore(self.online["replanner"])
        _log.info("online replanning", cluster=cluster.hardware, model=cluster.model, gpus=cluster.gpus,
                  resumed_reads=self.online["read"])

    async def run(self) -> None:
        if self.config.planner.mode != "online":
            await asyncio.Event().wait()
        while True:
            await self.tick()
            await asyncio.sleep(self.config.planner.cluster.tick_s)

    async def tick(self) -> planner_pb2.PlanDecision | None:
        """Read new history, feed it, consider replanning; returns the decision stored (if any)."""
        async with self._tick_lock:  # the loop and a test (or a future RPC) never interleave ticks
            return await self._tick()

    async def redis_back(self) -> None:
        """Redis came back: if it lost the plan in force, store it again (the same generation)."""
        if self.plan is not None and await self.store.get_plan() is None:
            await self.store.put_plan(self.plan)
            _log.warning("redis had lost the plan in force; stored it again", generation=self.plan.generation)

    async def _tick(self) -> planner_pb2.PlanDecision | None:
        plan = await self.store.get_plan() or self.plan
        records = {}
        for kind in ("turn", "step"):
            rows = await self.store.read_history_after(kind, self.online["cursor"][kind], HISTORY_BATCH)
            records[kind] = [record for _, record in rows]
            if rows:
                self.online["cursor"][kind] = rows[-1][0]
        fed = self.feeder.feed(self.replanner, records["turn"], records["step"], plan)
        for kind, reason in fed.rejected:
            IGNORED.labels(kind).inc()
            _log.warning("history record ignored", kind=kind, reason=reason)
        for kind in ("turn", "step"):
            self.online["read"][kind] += len(records[kind])
        now = self.clock()
        decision = await asyncio.to_thread(self.replanner.consider, now)
        stored = None
        if decision.trigger:
            DECISIONS.labels("applied" if decision.applied else "gated" if decision.reason.startswith(
                "not evaluated") else "rejected").inc()
        if decision.record and decision.trigger:
            stored = await self._store_decision(decision, plan, now)
        self._export_metrics()
        await self._save_online()
        if self.online.get("pending_apply"):
            await self._send_pending()
        return stored

    async def _store_decision(self, decision, plan, now: float) -> planner_pb2.PlanDecision:
        chosen = None
        if decision.applied:
            chosen = core.replan_plan(decision, (plan.generation if plan else 0) + 1, now)
            try:
                await self.store.put_plan(chosen)
                self.plan = chosen
            except Conflict as error:  # another writer took the generation: the decision stands, not applied
                decision.applied = False
                decision.reason = f"not applied: {error}; was: {decision.reason}"
                self.replanner.adopt(decision.current)
        elif decision.chosen is not None and decision.trace:
            chosen = core.replan_plan(decision, 0, now)
        self.online["decisions"] = self.online.get("decisions", 0) + 1
        record = core.decision_proto(decision, plan, chosen, now, self.online["decisions"])
        await self.store.append_plan_decision(record.SerializeToString())
        planner_probe(self.config).decision(record)
        _log.info("replan decision", trigger=decision.trigger, applied=decision.applied, reason=decision.reason)
        if decision.applied:
            self.online["pending_apply"] = chosen.generation
        return record

    async def _send_pending(self) -> None:
        """Send the plan in force to the elastic coordinator (delivery.py); a coordinator still
        unreachable keeps the plan pending and the next tick sends it again, with the same request
        id (a replay if it got through)."""
        plan = await self.store.get_plan()
        generation = self.online["pending_apply"]
        if plan is None or plan.generation != generation:
            self.online.pop("pending_apply", None)  # superseded: a newer plan is in force
            await self._save_online()
            return
        if await delivery.send_plan(self.config.address_of("elastic"), self.run_id, plan) is None:
            return
        self.online.pop("pending_apply", None)
        await self._save_online()

    # -- plans made by hand (manual.py) ------------------------------------------------------
    async def set_plan(self, requested: common_pb2.Plan) -> common_pb2.Plan:
        """Planner.SetPlan: store `requested` (checked by the servicer) as the next generation and
        record it; it is sent to the elastic coordinator in the background."""
        plan, previous = await manual.store_next(self.store, requested)
        self.plan = plan
        record = manual.decision(plan, previous, self.clock())
        await self.store.append_plan_decision(record.SerializeToString())
        planner_probe(self.config).decision(record)
        _log.info("plan set by hand", plan=core.describe(from_proto(plan)), reason=plan.reason)
        self._hand_over(plan)
        return plan

    def _hand_over(self, plan: common_pb2.Plan) -> None:
        task = asyncio.create_task(self._send_hand_made(plan), name=f"planner-set-plan-{plan.generation}")
        self._handovers.add(task)
        task.add_done_callback(self._handed_over)

    def _handed_over(self, task: asyncio.Task) -> None:
        self._handovers.discard(task)
        if not task.cancelled() and task.exception() is not None:  # e.g. Redis down: a restart sends it
            _log.error("could not send the plan set by hand", task=task.get_name(), error=repr(task.exception()))

    async def _send_hand_made(self, plan: common_pb2.Plan) -> None:
        if self.replanner is None:  # mode static: once (a restarted planner sends it again)
            await delivery.send_plan(self.config.address_of("elastic"), self.run_id, plan)
            return
        from libra.services.planner.observation import candidate_from_plan

        async with self._tick_lock:  # never while a decision runs in its thread
            stored = await self.store.get_plan()
            if stored is None or stored.generation != plan.generation:
                return  # superseded meanwhile: the newer plan is sent by its own writer
            self.replanner.adopt(candidate_from_plan(plan))
            self.online["pending_apply"] = plan.generation
            await self._save_online()
            await self._send_pending()

    async def _save_online(self) -> None:
        self.online["replanner"] = self.replanner.state()
        self.online["calibration"] = {**self.replanner.calibration.snapshot(),
                                      "rejected": self.replanner.rejected_inputs()}
        self.online["updated_at"] = self.clock()
        await self.store.save_blob(ONLINE_BLOB, json.dumps(self.online).encode())

    def _export_metrics(self) -> None:
        snapshot = self.replanner.calibration.snapshot()
        planner_probe(self.config).tick(snapshot)
        PREDICTED.set(snapshot["step_time"]["predicted_s"])
        MEASURED.set(snapshot["step_time"]["measured_s"])
        for name, values in snapshot["efficiency"].items():
            EFFICIENCY.labels(name).set(values["calibrated"])

    async def explain(self, limit: int) -> planner_pb2.ExplainResponse:
        """Recent decisions, the plan in force and (online) the calibration, from Redis."""
        response = planner_pb2.ExplainResponse(decisions=await self.decisions(limit),
                                               mode=self.config.planner.mode)
        plan = await self.store.get_plan()
        if plan is not None:
            response.plan.CopyFrom(plan)
        blob = await self.store.load_blob(ONLINE_BLOB)
        if blob:
            online = json.loads(blob)
            response.calibration.CopyFrom(core.calibration_report(
                online.get("calibration", {}), online.get("read", {}), online.get("updated_at", 0.0)))
        return response

    async def current_plan(self) -> Plan:
        message = await self.store.get_plan()
        if message is None and self.plan is not None:  # Redis lost it: put it back, answer meanwhile
            await self.redis_back()
            message = self.plan
        if message is None:
            raise FailedPrecondition("no plan yet: the planner is still starting")
        self.plan = message  # a newer one may have been stored meanwhile (another planner process)
        return from_proto(message)

    async def preflight(self, request) -> planner_pb2.PlanDecision:
        """Search allocations for the given cluster, model and trace (bounded in size and time:
        preflight.bounded_preflight); the decision is logged, not applied."""
        from libra.services.planner.preflight import bounded_preflight

        decision = await bounded_preflight(request, self.config.security.limits)
        await self.store.append_plan_decision(decision.SerializeToString())
        return decision

    async def observe(self, records) -> bool:
        """Append history records (a repeated request id is the RPC boundary's replay, not a second append)."""
        for record in records:
            if record.kind not in ("turn", "step"):
                raise InvalidArgument(f"records[].kind must be 'turn' or 'step', got {record.kind!r}")
        for record in records:
            await self.store.append_history(record.kind, record)
        return True

    async def decisions(self, limit: int) -> list[planner_pb2.PlanDecision]:
        raw = await self.store.plan_decisions(limit)
        return [planner_pb2.PlanDecision.FromString(blob) for blob in raw]

    async def close(self) -> None:
        for task in list(self._handovers):
            task.cancel()
        await asyncio.gather(*self._handovers, return_exceptions=True)
        ranker = getattr(self.replanner, "ranker", None)
        if ranker is not None:  # its replay workers, if any
            await asyncio.to_thread(ranker.close)
        if self.store is not None:
            await self.store.close()


def serve(config: RunConfig, port: int | None = None) -> int:
    return run_service(PlannerService(config), port if port is not None else config.port_of("planner"),
                       config.metrics_port_of("planner"))
