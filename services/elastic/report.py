"""How the pool reads on a terminal (`libra status`) and as a timeline (benchmarks): pure formatting.

`timeline` flattens the transition history kept in every member record into one list ordered by
time: one row per transition with the member, the states, the generation and the seconds spent in
the previous state, enough to draw the phases of every join and release.
"""

from __future__ import annotations

from libra.v1 import elastic_pb2 as pb


def _state(state: int) -> str:
    return pb.MemberState.Name(state)[len("MEMBER_STATE_"):].lower()


def _ago(now: float, then: float) -> str:
    if not then:
        return "-"
    seconds = max(0.0, now - then)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def pool_lines(members: list[pb.Member], epoch: int, progress: pb.PlanProgress | None, now: float) -> list[str]:
    rows = [f"pool      epoch {epoch}, {len(members)} members"]
    for m in members:
        role = pb.Role.Name(m.role)[5:].lower()
        plan = f" plan {m.plan_generation}" if m.plan_generation else ""
        detail = f"  {m.detail}" if m.detail else ""
        rows.append(f"  {m.member_id:<14} {role:<9} {_state(m.state):<14} gen {m.generation:<4} "
                    f"since {_ago(now, m.state_since):<8} {m.bucket}{plan}{detail}".rstrip())
    if progress is not None:
        rows.append(f"  plan gen {progress.generation}: {progress.state}, {progress.steps_done}/{progress.steps_total} "
                    f"actions done")
        for action in progress.actions:
            rows.append(f"    {action.kind:<8} {action.target:<14} {action.state:<9} {action.detail}".rstrip())
    return rows


def timeline(members: list[pb.Member]) -> list[tuple[float, str, str, str, int, float, str]]:
    """(at, member, from, to, generation, seconds in from, detail) for every kept transition, by time."""
    rows = [(r.at, m.member_id, _state(r.from_state), _state(r.to_state), r.generation, r.seconds_in_previous,
             r.detail) for m in members for r in m.history]
    return sorted(rows)
