"""The membership state machine of the elastic hybrid pool (pure: no Redis, no clock).

```
 ROLLOUT ─▶ JOINING ─▶ FETCHING_STATE ─▶ ALIGNED ─▶ ACTIVE ─▶ RELEASING ─▶ ROLLOUT
    ▲          │             │              │                       │
    └──────────┴─────────────┴──────────────┴──── FAILED ◀──────────┘   (rollback)
 TRAINING (core replicas) and OFFLINE (missed heartbeats) sit beside it.
```
"""

from __future__ import annotations

from libra.errors import FailedPrecondition
from libra.v1 import elastic_pb2 as pb

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


def plan_progress(desired: dict[str, int], members: list[pb.Member]) -> tuple[int, int]:
    """(replicas in place, replicas wanted) of a plan's rollout layout given the live members."""
    have: dict[str, int] = {}
    for member in members:
        if member.role == pb.ROLE_ROLLOUT and member.state == S.MEMBER_STATE_ROLLOUT:
            have[member.bucket] = have.get(member.bucket, 0) + 1
    done = sum(min(count, have.get(bucket, 0)) for bucket, count in desired.items())
    return done, sum(desired.values())
