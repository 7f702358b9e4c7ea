"""Executing plans: the diff between the pool and a plan, run in the order of the swap rule.

```
 ApplyPlan(gen) ─▶ stale gen? ABORTED ─▶ not the stored plan? FAILED_PRECONDITION ─▶ diff ─▶ progress ─▶ reply
                                                                                            │
 executor task:  cancel the older plan's task (its joins roll back) ─▶ diff again on the live pool
                 phase 0 (frees GPUs):  release hybrids ‖ drain rollout workers   (all finish first)
                 phase 1 (takes GPUs):  join hybrids    ‖ start rollout workers
                 every action's state is saved in the progress blob as it changes (GetPlanProgress)
```

The planner is the plan record's only writer: it stores plan g (the stored one + 1: a replan, or
one set by hand with Planner.SetPlan) and then sends it here. The coordinator never writes the
record; it applies only the stored plan, i.e. a request of the stored generation and the stored
content. Anything else (a newer generation, other content, no plan stored) is FAILED_PRECONDITION
naming the fix; an older generation than the stored one or the one in force is ABORTED (a newer
plan won). So no request can move the generation at all (it once could, up to 2^64 - 1, which
locked out every later plan).

Growing training therefore drains and stops rollout workers before any replica joins, and
shrinking it releases replicas before any rollout worker starts: correct with no spare GPUs. A
release or drain that fails cancels phase 1 (its GPUs may still be busy). The progress blob
(`blob:elastic.plan_progress`, compare-and-set) survives a restart; an unfinished plan is diffed
again on the live pool and continued, replicas mid-join being resumed by `ReplicaTasks.sweep`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from libra import log as liblog
from libra.errors import Conflict, FailedPrecondition, LibraError, NotFound
from libra.plans import Plan, from_proto
from libra.services.elastic import core
from libra.services.elastic.config import ElasticConfig
from libra.services.elastic.driver import ReplicaDriver
from libra.services.elastic.replicas import ReplicaTasks
from libra.v1 import common_pb2, elastic_pb2 as pb

_log = liblog.get("libra.elastic")
S = pb.MemberState
PROGRESS_BLOB = "elastic.plan_progress"
FINAL = ("applied", "failed", "superseded")
STOPPED_EARLY = "its replica task stopped early (another writer, or see the coordinator log)"
SET_PLAN = "plans are stored by the planner; send one of your own with Planner.SetPlan"


def check_stored(message: common_pb2.Plan, stored: common_pb2.Plan | None) -> None:
    """`message` must be `stored`, the plan in Redis (see the module docstring); older generations
    are refused before this, as a Conflict."""
    if stored is None:
        raise FailedPrecondition(f"plan generation {message.generation} is not the stored plan: no plan is "
                                 f"stored yet; {SET_PLAN}")
    if stored.generation != message.generation:
        raise FailedPrecondition(f"plan generation {message.generation} is not the stored plan (generation "
                                 f"{stored.generation}); {SET_PLAN}")
    if stored.SerializeToString(deterministic=True) != message.SerializeToString(deterministic=True):
        raise FailedPrecondition(f"plan generation {message.generation} differs from the stored plan of that "
                                 f"generation; {SET_PLAN}")


class PlanRunner:
    def __init__(self, store, replicas: ReplicaTasks, driver: ReplicaDriver, config: ElasticConfig,
                 clock: Callable[[], float] = time.time):
        self.store, self.replicas, self.driver, self.config, self.clock = store, replicas, driver, config, clock
        self.task: asyncio.Task | None = None
        self._accept = asyncio.Lock()
        self._write = asyncio.Lock()
        self._blob_generation = 0
        self._superseded_by: dict[asyncio.Task, int] = {}

    # -- the progress record -----------------------------------------------------------------
    async def load(self, own: bool = False) -> pb.PlanProgress | None:
        """The stored progress; `own`: this runner writes it next (it takes the stored generation)."""
        record = await self.store.blob_record(PROGRESS_BLOB)
        if record is None:
            return None
        if own:
            self._blob_generation = record.generation
        return pb.PlanProgress.FromString(record.payload)

    async def _save(self, progress: pb.PlanProgress) -> None:
        async with self._write:
            progress.steps_done, progress.steps_total, state = core.summarize(list(progress.actions))
            if progress.state not in FINAL:
                progress.state = state
                if state in FINAL:
                    progress.finished_at = self.clock()
            stored = pb.PlanProgress()
            stored.CopyFrom(progress)
            del stored.replicas[:]  # live data, filled in when read
            self._blob_generation = await self.store.save_blob(PROGRESS_BLOB, stored.SerializeToString(),
                                                               self._blob_generation)

    async def _members(self) -> list[pb.Member]:
        members = []
        for record in await self.store.list_members():
            member = pb.Member.FromString(record.payload)
            member.generation = record.generation
            members.append(member)
        return members

    async def _diff(self, plan: Plan, previous: common_pb2.Plan | None) -> list[core.Action]:
        bucket_tp = {b.name: b.tp for b in previous.buckets} if previous is not None else {}
        return core.diff_plan(plan, await self._members(), self.config.core_replicas, bucket_tp)

    # -- accepting ---------------------------------------------------------------------------
    async def apply(self, message: common_pb2.Plan) -> pb.PlanProgress:
        async with self._accept:
            current = await self.load(own=True)
            if current is not None and message.generation < current.generation:
                raise Conflict(f"plan generation {message.generation} is older than the plan in force "
                               f"(generation {current.generation}); a newer plan won")
            stored = await self.store.get_plan()
            if stored is not None and stored.generation > message.generation:
                raise Conflict(f"plan generation {message.generation} is older than the stored plan "
                               f"(generation {stored.generation}); a newer plan won")
            check_stored(message, stored)
            if current is not None and message.generation == current.generation:
                return current  # the same plan again: its progress
            plan = from_proto(message)
            actions = await self._diff(plan, stored)
            progress = pb.PlanProgress(generation=plan.generation, state="applying", started_at=self.clock(),
                                       actions=[core.action_proto(a) for a in actions],
                                       detail=plan.reason or f"plan {plan.generation}")
            await self._save(progress)
            previous = self.task
            if previous is not None and not previous.done():
                self._superseded_by[previous] = plan.generation
            self.task = self._spawn(self._execute(plan, progress, previous, stored), plan.generation)
            _log.info("plan accepted", generation=plan.generation,
                      actions=[f"{a.kind}:{a.target}" for a in actions])
            return progress

    async def resume(self) -> None:
        """After a restart: continue an unfinished plan on the live pool."""
        progress = await self.load(own=True)
        if progress is None or progress.state in FINAL:
            return
        message = await self.store.get_plan()
        if message is None or message.generation != progress.generation:
            progress.state, progress.detail = "failed", "the stored plan changed while the coordinator was down"
            await self._save(progress)
            return
        _log.info("resuming plan", generation=progress.generation)
        self.task = self._spawn(self._execute(from_proto(message), progress, None, message, resumed=True),
                                progress.generation)

    @staticmethod
    def _spawn(work, generation: int) -> asyncio.Task:
        task = asyncio.create_task(work, name=f"plan-{generation}")

        def report(done: asyncio.Task) -> None:
            if not done.cancelled() and done.exception() is not None:
                error = done.exception()
                if isinstance(error, Conflict):  # another coordinator owns the plan now
                    _log.warning("plan progress taken over by another writer", generation=generation)
                else:
                    _log.error("plan executor died", generation=generation, error=repr(error), exc_info=error)
        task.add_done_callback(report)
        return task

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    # -- executing ---------------------------------------------------------------------------
    async def _execute(self, plan: Plan, progress: pb.PlanProgress, previous: asyncio.Task | None,
                       previous_plan: common_pb2.Plan | None, resumed: bool = False) -> None:
        """Run the plan's actions. `resumed`: after a restart, re-run the stored unfinished actions,
        each of which first checks what already happened (see the handlers)."""
        actions: list[core.Action] = []
        try:
            if previous is not None and not previous.done():
                previous.cancel()
                await asyncio.gather(previous, return_exceptions=True)
            if resumed:
                actions = [core.action_of(a) for a in progress.actions]
            else:  # diffed again on the live pool: an older plan's rollbacks changed it
                actions = await self._diff(plan, previous_plan)
                if [(a.kind, a.target) for a in progress.actions] != [(a.kind, a.target) for a in actions]:
                    del progress.actions[:]
                    progress.actions.extend(core.action_proto(a) for a in actions)
                    await self._save(progress)
            unfinished = [(i, a) for i, a in enumerate(actions) if progress.actions[i].state in ("pending", "running")]
            phase0 = [(i, a) for i, a in unfinished if a.phase == 0]
            await asyncio.gather(*(self._run(plan, progress, i, a) for i, a in phase0))
            later = [(i, a) for i, a in unfinished if a.phase == 1]
            if any(action.state == "failed" for action in progress.actions if action.phase == 0):
                for i, _ in later:
                    self._mark(progress, i, "cancelled", "a release or drain failed: its GPUs may still be busy")
                await self._save(progress)
                return
            starts = [(i, a) for i, a in later if a.kind == "start"]
            joins = [(i, a) for i, a in later if a.kind == "join"]
            await asyncio.gather(*(self._run(plan, progress, i, a) for i, a in joins),
                                 self._start(plan, progress, starts))
            await self._save(progress)
            _log.info("plan finished", generation=plan.generation, state=progress.state)
        except asyncio.CancelledError:
            newer = self._superseded_by.pop(asyncio.current_task(), None)
            if newer is None:
                raise  # shutdown: the next coordinator resumes the plan
            reason = f"superseded by plan {newer}"
            await asyncio.gather(*(self.replicas.cancel(a.target, reason) for a in actions if a.kind == "join"))
            _log.info("plan superseded", generation=plan.generation, by=newer)

    def _mark(self, progress: pb.PlanProgress, index: int, state: str, detail: str = "") -> None:
        action = progress.actions[index]
        action.state, action.detail = state, detail or action.detail
        if state == "running":
            action.started_at = self.clock()
        else:
            action.finished_at = self.clock()

    async def _run(self, plan: Plan, progress: pb.PlanProgress, index: int, action: core.Action) -> None:
        self._mark(progress, index, "running")
        await self._save(progress)
        try:
            ok, detail = await getattr(self, f"_{action.kind}")(plan, action)
        except (LibraError, OSError) as error:
            if isinstance(error, Conflict):
                raise
            ok, detail = False, str(error)
        self._mark(progress, index, "done" if ok else "failed", detail)
        await self._save(progress)

    async def _release(self, plan: Plan, action: core.Action) -> tuple[bool, str]:
        member = await self.replicas.load(action.target)
        if member.state == S.MEMBER_STATE_ROLLOUT and member.plan_generation == plan.generation:
            return member.detail.startswith("released"), member.detail  # finished before a restart
        result = await asyncio.shield(self.replicas.release(member, plan.generation))
        released = result is not None and result.state == S.MEMBER_STATE_ROLLOUT and result.detail.startswith(
            "released")
        return released, result.detail if result is not None else STOPPED_EARLY

    async def _drain(self, plan: Plan, action: core.Action) -> tuple[bool, str]:
        record = await self.store.get_member(action.target)
        if record is None or pb.Member.FromString(record.payload).state != S.MEMBER_STATE_ROLLOUT:
            return True, "already drained"  # before a restart, or by the gateway itself
        # shielded: a drain half done (deregistered, not stopped) must not be left behind
        await asyncio.shield(self.driver.drain_worker(action.target, self.config.deadlines.drain_s))
        record = await self.store.get_member(action.target)
        if record is not None:  # the gateway marks it OFFLINE itself; make sure the pool sees it gone
            member = pb.Member.FromString(record.payload)
            if member.state == S.MEMBER_STATE_ROLLOUT:
                member.state, member.detail = S.MEMBER_STATE_OFFLINE, f"drained for plan {plan.generation}"
                await self.store.put_member(action.target, member.SerializeToString(), record.generation,
                                            record.role)
        return True, "drained and stopped"

    async def _join(self, plan: Plan, action: core.Action) -> tuple[bool, str]:
        try:
            member = await self.replicas.load(action.target)
        except NotFound:
            member = await self.replicas.create(action.target, action.gpus)
        if member.state == S.MEMBER_STATE_ROLLOUT and member.plan_generation == plan.generation:
            return False, member.detail  # this plan's join was rolled back (before a restart)
        task = self.replicas.join(member, plan.generation, core.displaced_specs(action, plan))
        result = await asyncio.shield(task)
        if result is None:
            return False, STOPPED_EARLY
        return result.state == S.MEMBER_STATE_ACTIVE, result.detail

    async def _start(self, plan: Plan, progress: pb.PlanProgress, starts: list[tuple[int, core.Action]]) -> None:
        """All workers of phase 1 in one StartWorkers call (the gateway starts them concurrently)."""
        if not starts:
            return
        counts: dict[str, int] = {}
        for _, action in starts:
            counts[action.target] = counts.get(action.target, 0) + 1
        # only what is still missing: a start the previous coordinator finished is not repeated
        have = {bucket: done for bucket, (done, _) in self._serving(plan, await self._members()).items()}
        counts = {bucket: min(count, plan.bucket(bucket).replicas - have.get(bucket, 0))
                  for bucket, count in counts.items()}
        counts = {bucket: count for bucket, count in counts.items() if count > 0}
        if not counts:
            for index, _ in starts:
                self._mark(progress, index, "done", "already serving")
            return
        plan_buckets = {b.name: b for b in plan.buckets}
        specs = [common_pb2.BucketSpec(name=name, tp=plan_buckets[name].tp, max_tokens=plan_buckets[name].max_tokens,
                                       replicas=count) for name, count in sorted(counts.items())]
        for index, _ in starts:
            self._mark(progress, index, "running")
        await self._save(progress)
        try:
            started = await asyncio.wait_for(
                self.driver.start_workers(specs, f"plan-{progress.generation}-start"),
                self.config.deadlines.start_workers_s)
            outcome, detail = "done", f"started {', '.join(started)}"
        except (LibraError, OSError, asyncio.TimeoutError) as error:
            outcome, detail = "failed", str(error) or "start_workers passed its deadline"
        for index, _ in starts:
            self._mark(progress, index, outcome, detail)

    @staticmethod
    def _serving(plan: Plan, members: list[pb.Member]) -> dict[str, tuple[int, int]]:
        """Per bucket of the plan: (workers serving, workers wanted)."""
        return {b.name: core.plan_progress({b.name: b.replicas}, members) for b in plan.buckets}

    async def progress(self, generation: int) -> pb.PlanProgress:
        current = await self.load()
        if current is None:
            raise NotFound("no plan has been applied yet")
        if generation and generation != current.generation:
            state = "superseded" if generation < current.generation else "unknown"
            return pb.PlanProgress(generation=generation, state=state,
                                   detail=f"the plan in force is generation {current.generation}")
        current.replicas.extend(await self.replicas.hybrids())
        return current
