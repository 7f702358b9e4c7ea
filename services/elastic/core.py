"""The state machine of the elastic hybrid pool and the plan diff (pure: no Redis, no clock, no RPC).

```
 ROLLOUT ─▶ JOINING ─▶ FETCHING_STATE ─▶ ALIGNED ─▶ ACTIVE ─▶ RELEASING ─▶ ROLLOUT
    ▲          │             │              │          │           │
    └──────────┴─────────────┴──────────────┴──────────┴─ FAILED ◀─┘   (rollback, then ROLLOUT)
 TRAINING (core replicas) and OFFLINE (missed heartbeats, drained workers) sit beside it.
```

A hybrid replica in JOINING is registered with the trainer but its gradient counts as zero; in
FETCHING_STATE its process loads a snapshot while the core keeps stepping; ALIGNED means it holds
the current version and waits for a step boundary; ACTIVE means it is in the step manifests.
Every phase but ROLLOUT and ACTIVE has a deadline; past it the replica is rolled back.

Recovery after a coordinator restart (`recovery`): JOINING, FETCHING_STATE and ALIGNED resume when
the hybrid process is still alive (or was not started yet) and the phase's deadline has not
passed (admitting is a replay by request id, polling is read-only), else roll back; RELEASING
always resumes (a release is idempotent) and FAILED always finishes its rollback; ACTIVE is
watched like any active replica.

Plans: `diff_plan` turns a plan and the live members into actions, ordered by the swap rule for a
cluster with no spare GPUs: every action that frees GPUs (release a hybrid, drain a rollout
worker) runs before every action that takes GPUs (join a hybrid, start a rollout worker).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.errors import FailedPrecondition
from libra.plans import Plan
from libra.v1 import common_pb2, elastic_pb2 as pb

S = pb.MemberState
ALLOWED: dict[int, frozenset[int]] = {
    S.MEMBER_STATE_ROLLOUT: frozenset({S.MEMBER_STATE_JOINING, S.MEMBER_STATE_OFFLINE}),
    S.MEMBER_STATE_JOINING: frozenset({S.MEMBER_STATE_FETCHING_STATE, S.MEMBER_STATE_FAILED, S.MEMBER_STATE_ROLLOUT}),
    S.MEMBER_STATE_FETCHING_STATE: frozenset({S.MEMBER_STATE_ALIGNED, S.MEMBER_STATE_FAILED, S.MEMBER_STATE_ROLLOUT}),
    S.MEMBER_STATE_ALIGNED: frozenset({S.MEMBER_STATE_ACTIVE, S.MEMBER_STATE_FAILED, S.MEMBER_STATE_ROLLOUT}),
    S.MEMBER_STATE_ACTIVE: frozenset({S.MEMBER_STATE_RELEASING, S.MEMBER_STATE_FAILED}),
    S.MEMBER_STATE_RELEASING: frozenset({S.MEMBER_STATE_ROLLOUT, S.MEMBER_STATE_FAILED}),
    S.MEMBER_STATE_FAILED: frozenset({S.MEMBER_STATE_ROLLOUT, S.MEMBER_STATE_OFFLINE}),
    S.MEMBER_STATE_TRAINING: frozenset({S.MEMBER_STATE_OFFLINE}),
    S.MEMBER_STATE_OFFLINE: frozenset({S.MEMBER_STATE_ROLLOUT, S.MEMBER_STATE_TRAINING}),
}
INITIAL = {pb.ROLE_ROLLOUT: S.MEMBER_STATE_ROLLOUT, pb.ROLE_TRAINING: S.MEMBER_STATE_TRAINING,
           pb.ROLE_HYBRID: S.MEMBER_STATE_ROLLOUT}
JOIN_PHASES = (S.MEMBER_STATE_JOINING, S.MEMBER_STATE_FETCHING_STATE, S.MEMBER_STATE_ALIGNED)
IN_TRAINING = (*JOIN_PHASES, S.MEMBER_STATE_ACTIVE)
DEADLINE_FIELD = {
    S.MEMBER_STATE_JOINING: "joining_s",
    S.MEMBER_STATE_FETCHING_STATE: "fetching_state_s",
    S.MEMBER_STATE_ALIGNED: "aligned_s",
    S.MEMBER_STATE_RELEASING: "releasing_s",
    S.MEMBER_STATE_FAILED: "rollback_s",
}
RESUME, ROLLBACK, WATCH, IDLE = "resume", "rollback", "watch", "idle"


def name(state: int) -> str:
    return S.Name(state)[len("MEMBER_STATE_"):].lower()


def check_transition(current: int, target: int) -> None:
    """Raise FAILED_PRECONDITION for a move the state machine does not allow."""
    if target not in ALLOWED.get(current, frozenset()):
        raise FailedPrecondition(
            f"cannot move a member from {S.Name(current)} to {S.Name(target)}; allowed: "
            + (", ".join(sorted(S.Name(t) for t in ALLOWED.get(current, ()))) or "none"))


def initial_state(role: int) -> int:
    if role not in INITIAL:
        raise FailedPrecondition(f"role must be ROLE_ROLLOUT, ROLE_TRAINING or ROLE_HYBRID, got {role}")
    return INITIAL[role]


def transitioned(member: pb.Member, target: int, now: float, detail: str, keep: int,
                 plan_generation: int | None = None) -> pb.Member:
    """The record after moving `member` to `target`: state, since-when and one more history entry.

    The entry names the generation the compare-and-set will produce (the stored one plus one).
    """
    check_transition(member.state, target)
    updated = pb.Member()
    updated.CopyFrom(member)
    if plan_generation is not None:
        updated.plan_generation = plan_generation
    updated.state, updated.detail, updated.state_since = target, detail, now
    updated.history.append(pb.PhaseRecord(
        from_state=member.state, to_state=target, generation=member.generation + 1, at=now,
        seconds_in_previous=max(0.0, now - member.state_since) if member.state_since else 0.0,
        detail=detail, plan_generation=updated.plan_generation))
    if len(updated.history) > keep:
        del updated.history[: len(updated.history) - keep]
    return updated


def deadline_s(state: int, deadlines) -> float | None:
    """Seconds a replica may stay in `state` (None: no deadline)."""
    field = DEADLINE_FIELD.get(state)
    return getattr(deadlines, field) if field else None


def expired(member: pb.Member, now: float, deadlines) -> bool:
    limit = deadline_s(member.state, deadlines)
    return limit is not None and member.state_since > 0 and now - member.state_since > limit


def recovery(member: pb.Member, process_alive: bool | None, now: float, deadlines) -> str:
    """What a restarted coordinator does with a hybrid replica it finds in Redis.

    `process_alive` None: no process to check (not started yet, or started by someone else).
    """
    if member.state in JOIN_PHASES:
        return RESUME if process_alive is not False and not expired(member, now, deadlines) else ROLLBACK
    if member.state in (S.MEMBER_STATE_RELEASING, S.MEMBER_STATE_FAILED):
        return RESUME
    if member.state == S.MEMBER_STATE_ACTIVE:
        return WATCH
    return IDLE


# -- plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """One unit of a plan's work. phase 0 frees GPUs, phase 1 takes them."""

    kind: str          # release | drain | join | start
    target: str        # replica id, worker id, or bucket name (start: one worker each)
    phase: int
    gpus: int = 0
    displaced: tuple[tuple[str, int], ...] = ()   # join: (bucket, tp) of the workers drained for it


def _serving(members: list[pb.Member]) -> dict[str, list[pb.Member]]:
    by_bucket: dict[str, list[pb.Member]] = {}
    for member in members:
        if member.role == pb.ROLE_ROLLOUT and member.state == S.MEMBER_STATE_ROLLOUT:
            by_bucket.setdefault(member.bucket, []).append(member)
    return by_bucket


def _next_ids(members: list[pb.Member], count: int) -> list[str]:
    taken = {m.member_id for m in members}
    found, index = [], 0
    while len(found) < count:
        if f"hybrid-{index}" not in taken:
            found.append(f"hybrid-{index}")
        index += 1
    return found


def diff_plan(plan: Plan, members: list[pb.Member], core_replicas: int,
              bucket_tp: dict[str, int] | None = None) -> list[Action]:
    """The actions that take the live pool to `plan`, releases and drains first.

    Hybrids wanted = training.dp - core_replicas. Releases pick the least advanced replicas first
    (cancelling a join costs less than releasing an active replica). Drained workers are assigned
    to joins until each join has its training.tp x training.pp GPUs, so a replica that rolls back
    restarts exactly the workers it displaced.
    """
    bucket_tp = {**(bucket_tp or {}), **{b.name: b.tp for b in plan.buckets}}
    hybrids = sorted((m for m in members if m.role == pb.ROLE_HYBRID), key=lambda m: m.member_id)
    training = [m for m in hybrids if m.state in IN_TRAINING]
    wanted = max(0, plan.training.dp - core_replicas)
    gpus = max(1, plan.training.tp * plan.training.pp)
    actions: list[Action] = []
    if len(training) > wanted:
        order = sorted(training, key=lambda m: (IN_TRAINING.index(m.state), m.member_id), reverse=False)
        actions += [Action("release", m.member_id, 0) for m in order[: len(training) - wanted]]
    serving = _serving(members)
    desired = {b.name: b.replicas for b in plan.buckets}
    drained: list[tuple[str, int]] = []
    for bucket in sorted(set(serving) | set(desired)):
        have = sorted(serving.get(bucket, []), key=lambda m: m.member_id)
        surplus = len(have) - desired.get(bucket, 0)
        for worker in reversed(have[len(have) - surplus:] if surplus > 0 else []):
            actions.append(Action("drain", worker.member_id, 0))
            drained.append((bucket, bucket_tp.get(bucket, 1)))
    if len(training) < wanted:
        idle = [m.member_id for m in hybrids if m.state == S.MEMBER_STATE_ROLLOUT]
        need = wanted - len(training)
        ids = (idle + _next_ids(members, need))[:need]
        for replica_id in ids:
            taken: list[tuple[str, int]] = []
            while drained and sum(tp for _, tp in taken) < gpus:
                taken.append(drained.pop(0))
            actions.append(Action("join", replica_id, 1, gpus=gpus, displaced=tuple(taken)))
    for bucket in sorted(desired):
        deficit = desired[bucket] - len(serving.get(bucket, []))
        actions += [Action("start", bucket, 1, gpus=bucket_tp.get(bucket, 1)) for _ in range(max(0, deficit))]
    return actions


def action_proto(action: Action) -> pb.PlanAction:
    detail = ""
    if action.kind == "join":
        detail = f"{action.gpus} GPUs" + (f", displaces {', '.join(b for b, _ in action.displaced)}"
                                          if action.displaced else "")
    return pb.PlanAction(kind=action.kind, target=action.target, state="pending", phase=action.phase,
                         detail=detail, gpus=action.gpus,
                         displaced=[common_pb2.BucketSpec(name=b, tp=tp, replicas=1) for b, tp in action.displaced])


def action_of(message: pb.PlanAction) -> Action:
    return Action(message.kind, message.target, message.phase, message.gpus,
                  tuple((b.name, b.tp) for b in message.displaced))


def displaced_specs(action: Action, plan: Plan) -> list[common_pb2.BucketSpec]:
    """The bucket specs that restart the workers a join displaced (one replica each)."""
    limits = {b.name: b.max_tokens for b in plan.buckets}
    return [common_pb2.BucketSpec(name=bucket, tp=tp, max_tokens=limits.get(bucket, 0), replicas=1)
            for bucket, tp in action.displaced]


def plan_progress(desired: dict[str, int], members: list[pb.Member]) -> tuple[int, int]:
    """(replicas in place, replicas wanted) of a plan's rollout layout given the live members."""
    have = {bucket: len(workers) for bucket, workers in _serving(members).items()}
    done = sum(min(count, have.get(bucket, 0)) for bucket, count in desired.items())
    return done, sum(desired.values())


def summarize(actions: list[pb.PlanAction]) -> tuple[int, int, str]:
    """(done, total, overall state) of a plan's actions."""
    done = sum(a.state == "done" for a in actions)
    if any(a.state == "failed" for a in actions) and all(a.state in ("done", "failed", "cancelled")
                                                         for a in actions):
        return done, len(actions), "failed"
    return done, len(actions), "applied" if done == len(actions) else "applying"
