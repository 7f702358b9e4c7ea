"""One background task per hybrid replica: join, release, roll back, each phase under a deadline.

```
 join:     ROLLOUT ─CAS▶ JOINING ─admit─launch─CAS▶ FETCHING_STATE ─trainer: caught up─CAS▶ ALIGNED
                                                           ─in a step manifest─CAS▶ ACTIVE
 release:  ACTIVE ─CAS▶ RELEASING ─ReleaseHybrid─ process exits ─CAS▶ ROLLOUT
 rollback: any ─CAS▶ FAILED ─release─stop process─restart displaced workers─CAS▶ ROLLOUT
 watch:    ACTIVE and process dead or trainer says FAILED ─▶ rollback
```

Every transition is one compare-and-set of the member record (generation + 1) that also appends
a `PhaseRecord` (when, how long the previous phase took, why), so the record alone tells the
replica's timeline. A deadline is measured from `state_since` in Redis, so a restarted coordinator
keeps the original one. A lost compare-and-set means another writer owns the replica: the task
stops without touching it. Cancelling a join (a newer plan) rolls it back; shutting down does not
(the next coordinator resumes it, see `core.recovery`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from prometheus_client import Counter, Histogram

from libra import log as liblog
from libra.errors import Conflict, LibraError, NotFound
from libra.services.elastic import core
from libra.services.elastic.config import ElasticConfig
from libra.services.elastic.driver import ReplicaDriver, TrainerView
from libra.v1 import common_pb2, elastic_pb2 as pb

_log = liblog.get("libra.elastic")
S = pb.MemberState
TRANSITIONS = Counter("libra_elastic_transitions_total", "hybrid replica transitions", ["to"])
PHASE_SECONDS = Histogram("libra_elastic_phase_seconds", "time hybrid replicas spent in a phase", ["phase"],
                          buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))


class ReplicaFailed(LibraError):
    """A phase of a replica failed (the trainer, its process, or a deadline); it is rolled back."""


def join_generation(member: pb.Member) -> int:
    """The generation its last JOINING transition produced: names the trainer calls of this join."""
    for record in reversed(member.history):
        if record.to_state == S.MEMBER_STATE_JOINING:
            return record.generation
    return member.generation


class ReplicaTasks:
    def __init__(self, store, driver: ReplicaDriver, config: ElasticConfig, clock: Callable[[], float] = time.time):
        self.store, self.driver, self.config, self.clock = store, driver, config, clock
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelling: dict[str, str] = {}

    # -- records -----------------------------------------------------------------------------
    async def load(self, replica_id: str) -> pb.Member:
        record = await self.store.get_member(replica_id)
        if record is None:
            raise NotFound(f"unknown hybrid replica {replica_id!r}")
        member = pb.Member.FromString(record.payload)
        member.generation = record.generation
        return member

    async def create(self, replica_id: str, gpus: int) -> pb.Member:
        member = pb.Member(member_id=replica_id, role=pb.ROLE_HYBRID, state=S.MEMBER_STATE_ROLLOUT, gpus=gpus,
                           state_since=self.clock())
        member.generation = await self.store.put_member(replica_id, member.SerializeToString(), 0, "hybrid")
        return member

    async def save(self, member: pb.Member) -> pb.Member:
        """Write fields that are no transition (the pid); compare-and-set all the same."""
        member.generation = await self.store.put_member(member.member_id, member.SerializeToString(),
                                                        member.generation, "hybrid")
        return member

    async def move(self, member: pb.Member, target: int, detail: str, plan_generation: int | None = None,
                   **fields) -> pb.Member:
        updated = core.transitioned(member, target, self.clock(), detail, self.config.history_per_replica,
                                    plan_generation)
        for name, value in fields.items():
            if name == "displaced":
                del updated.displaced[:]
                updated.displaced.extend(value)
            else:
                setattr(updated, name, value)
        updated.generation = await self.store.put_member(member.member_id, updated.SerializeToString(),
                                                         member.generation, "hybrid")
        TRANSITIONS.labels(core.name(target)).inc()
        PHASE_SECONDS.labels(core.name(member.state)).observe(updated.history[-1].seconds_in_previous)
        _log.info("hybrid transition", replica=member.member_id, state=core.name(target),
                  was=core.name(member.state), generation=updated.generation, detail=detail)
        return updated

    # -- tasks -------------------------------------------------------------------------------
    def running(self, replica_id: str) -> asyncio.Task | None:
        task = self.tasks.get(replica_id)
        return task if task is not None and not task.done() else None

    def _spawn(self, replica_id: str, work: Awaitable[pb.Member | None]) -> asyncio.Task:
        existing = self.running(replica_id)
        if existing is not None:
            work.close()  # type: ignore[attr-defined]  # never started: the running task owns the replica
            return existing
        task = asyncio.create_task(self._guarded(replica_id, work), name=f"hybrid-{replica_id}")
        self.tasks[replica_id] = task
        return task

    async def _guarded(self, replica_id: str, work: Awaitable[pb.Member | None]) -> pb.Member | None:
        try:
            return await work
        except Conflict as error:
            _log.warning("hybrid record changed under this task; leaving it to its writer", replica=replica_id,
                         error=str(error))
            return None
        except Exception as error:  # noqa: BLE001 - e.g. Redis gone: the record is unchanged, `sweep` retries
            _log.error("hybrid task failed; the watcher retries it", replica=replica_id, error=repr(error),
                       exc_info=error)
            return None

    def join(self, member: pb.Member, plan_generation: int,
             displaced: list[common_pb2.BucketSpec] | None = None) -> asyncio.Task:
        return self._spawn(member.member_id, self._join(member, plan_generation, displaced or []))

    def release(self, member: pb.Member, plan_generation: int) -> asyncio.Task:
        return self._spawn(member.member_id, self._release(member, plan_generation))

    def rollback(self, member: pb.Member, reason: str) -> asyncio.Task:
        return self._spawn(member.member_id, self._rollback(member, reason))

    async def cancel(self, replica_id: str, reason: str) -> pb.Member | None:
        """Cancel a join in flight; it rolls the replica back before the task ends."""
        task = self.running(replica_id)
        if task is None:
            return None
        self.cancelling[replica_id] = reason
        task.cancel()
        try:
            # asyncio.wait, not shield: our own cancellation (shutdown) must propagate, and a task
            # that ended cancelled must not be mistaken for it (that swallowed the shutdown).
            await asyncio.wait({task})
        finally:
            self.cancelling.pop(replica_id, None)
        return None if task.cancelled() else task.result()

    async def close(self) -> None:
        """Stop every task without rolling back (a restarted coordinator resumes from Redis)."""
        tasks = [t for t in self.tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- phases ------------------------------------------------------------------------------
    def _remaining(self, member: pb.Member) -> float:
        limit = core.deadline_s(member.state, self.config.deadlines)
        assert limit is not None, f"{core.name(member.state)} has no deadline"
        return max(0.0, member.state_since + limit - self.clock())

    async def _within(self, member: pb.Member, work: Awaitable) -> object:
        try:
            return await asyncio.wait_for(work, self._remaining(member))
        except asyncio.TimeoutError as error:
            raise ReplicaFailed(f"{core.name(member.state)} passed its deadline of "
                                f"{core.deadline_s(member.state, self.config.deadlines):g} s") from error

    async def _until(self, member: pb.Member, reached: Callable[[TrainerView], bool]) -> TrainerView:
        """Poll the trainer until `reached`, failing fast when the replica or its process fails."""
        async def poll() -> TrainerView:
            while True:
                if self.driver.alive(member.member_id, member.pid) is False:
                    raise ReplicaFailed(f"hybrid process {member.pid} exited")
                view = await self.driver.view()
                hybrid = view.hybrids.get(member.member_id)
                if hybrid is not None and hybrid.generation not in (0, join_generation(member)):
                    hybrid = None  # what the trainer says about an earlier admission of this replica
                if hybrid is not None and hybrid.state == "failed":
                    raise ReplicaFailed(f"trainer marked it failed: {hybrid.reason or 'no reason given'}")
                if reached(view):
                    return view
                await asyncio.sleep(self.config.poll_interval_s)
        return await self._within(member, poll())

    async def _join(self, member: pb.Member, plan_generation: int,
                    displaced: list[common_pb2.BucketSpec]) -> pb.Member | None:
        replica_id = member.member_id
        try:
            if member.state == S.MEMBER_STATE_ROLLOUT:
                member = await self.move(member, S.MEMBER_STATE_JOINING, f"joining for plan {plan_generation}",
                                         plan_generation, displaced=displaced, pid=0, step=0)
            generation = join_generation(member)
            if member.state == S.MEMBER_STATE_JOINING:
                await self._within(member, self.driver.admit(replica_id, generation))
                if not member.pid or self.driver.alive(replica_id, member.pid) is False:
                    member.pid = await self._within(member, self.driver.launch(replica_id, generation))
                    member = await self.save(member)
                member = await self.move(member, S.MEMBER_STATE_FETCHING_STATE, "fetching the snapshot")
            if member.state == S.MEMBER_STATE_FETCHING_STATE:
                def caught_up(view: TrainerView) -> bool:
                    hybrid = view.hybrids.get(replica_id)
                    return replica_id in view.active or (hybrid is not None and hybrid.state == "active")
                view = await self._until(member, caught_up)
                member = await self.move(member, S.MEMBER_STATE_ALIGNED, f"caught up at step {view.step}",
                                         step=view.step)
            if member.state == S.MEMBER_STATE_ALIGNED:
                view = await self._until(member, lambda v: replica_id in v.active)
                member = await self.move(member, S.MEMBER_STATE_ACTIVE, f"in the manifest of step {view.step}",
                                         step=view.step)
            return member
        except asyncio.CancelledError:
            reason = self.cancelling.get(replica_id)
            if reason is None:
                raise  # shutdown: the next coordinator resumes it from Redis
            return await self._rollback(await self.load(replica_id), reason)
        except (LibraError, OSError) as error:
            if isinstance(error, Conflict):
                raise
            return await self._rollback(await self.load(replica_id), str(error))

    async def _release(self, member: pb.Member, plan_generation: int) -> pb.Member | None:
        replica_id = member.member_id
        try:
            if member.state == S.MEMBER_STATE_ACTIVE:
                member = await self.move(member, S.MEMBER_STATE_RELEASING, f"released by plan {plan_generation}",
                                         plan_generation)
            await self._within(member, self.driver.release(replica_id, join_generation(member)))

            def gone(view: TrainerView) -> bool:
                hybrid = view.hybrids.get(replica_id)
                return replica_id not in view.active and (hybrid is None or hybrid.state in ("released", "failed"))
            view = await self._within(member, self._poll(gone))
            await self._within(member, self._exited(member))
            return await self.move(member, S.MEMBER_STATE_ROLLOUT, f"released at step {view.step}", step=view.step,
                                   pid=0, displaced=[])
        except (LibraError, OSError) as error:
            if isinstance(error, Conflict):
                raise
            return await self._rollback(await self.load(replica_id), f"release failed: {error}")

    async def _exited(self, member: pb.Member) -> None:
        """A released hybrid exits by itself (told BYE); stop it if it outstays the grace period."""
        waited = 0.0
        while self.driver.alive(member.member_id, member.pid) and waited < self.config.deadlines.exit_grace_s:
            await asyncio.sleep(self.config.poll_interval_s)
            waited += self.config.poll_interval_s
        await self.driver.stop(member.member_id, member.pid)

    async def _poll(self, reached: Callable[[TrainerView], bool]) -> TrainerView:
        while True:
            view = await self.driver.view()
            if reached(view):
                return view
            await asyncio.sleep(self.config.poll_interval_s)

    async def _rollback(self, member: pb.Member, reason: str) -> pb.Member:
        """Undo the replica whatever phase it reached; stays FAILED (retried later) if undoing fails."""
        replica_id = member.member_id
        if member.state == S.MEMBER_STATE_ROLLOUT:
            return member
        if member.state != S.MEMBER_STATE_FAILED:
            member = await self.move(member, S.MEMBER_STATE_FAILED, reason)
        else:  # claim it before any effect: a stale copy (another task finished meanwhile) stops here
            member = await self.save(member)

        async def undo() -> None:
            await self.driver.release(replica_id, join_generation(member))
            await self.driver.stop(replica_id, member.pid)
            if member.displaced:
                await self.driver.start_workers(list(member.displaced), f"restore-{replica_id}-{member.generation}")
        try:  # a fresh deadline per attempt: a rollback retried by `sweep` gets its full time again
            await asyncio.wait_for(undo(), self.config.deadlines.rollback_s)
        except (LibraError, OSError, asyncio.TimeoutError) as error:
            _log.error("rollback incomplete; retried later", replica=replica_id, error=str(error))
            return member
        return await self.move(member, S.MEMBER_STATE_ROLLOUT, f"rolled back: {reason}", pid=0, displaced=[])

    # -- watching and recovery ---------------------------------------------------------------
    async def hybrids(self) -> list[pb.Member]:
        members = []
        for record in await self.store.list_members():
            if record.role == "hybrid":
                member = pb.Member.FromString(record.payload)
                member.generation = record.generation
                members.append(member)
        return members

    async def sweep(self, view: TrainerView | None) -> None:
        """One round of the watcher: resume or roll back replicas no task owns (start, failures)."""
        now = self.clock()
        for listed in await self.hybrids():
            if self.running(listed.member_id) is not None:
                continue
            try:
                member = await self.load(listed.member_id)  # fresh: a task may have finished since the listing
            except NotFound:
                continue  # removed meanwhile
            if self.running(member.member_id) is not None:
                continue
            alive = self.driver.alive(member.member_id, member.pid) if member.pid else None
            action = core.recovery(member, alive, now, self.config.deadlines)
            if action == core.WATCH:
                hybrid = view.hybrids.get(member.member_id) if view is not None else None
                if alive is False:
                    self.rollback(member, f"hybrid process {member.pid} died while active")
                elif hybrid is not None and hybrid.state == "failed" and hybrid.generation in (
                        0, join_generation(member)):
                    self.rollback(member, f"trainer marked it failed: {hybrid.reason or 'no reason given'}")
            elif action == core.ROLLBACK:
                why = "deadline passed" if core.expired(member, now, self.config.deadlines) else "process gone"
                self.rollback(member, f"coordinator restart found it {core.name(member.state)}, {why}")
            elif action == core.RESUME:
                if member.state in core.JOIN_PHASES:
                    self.join(member, member.plan_generation)
                elif member.state == S.MEMBER_STATE_RELEASING:
                    self.release(member, member.plan_generation)
                else:
                    self.rollback(member, member.detail or "resuming a rollback")
