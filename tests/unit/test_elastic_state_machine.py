"""The hybrid-pool state machine and the plan diff, as pure functions (no Redis, no clock)."""

from __future__ import annotations

import pytest

from libra.errors import FailedPrecondition
from libra.plans import Bucket, Plan, Training
from libra.services.elastic import core
from libra.services.elastic.config import ElasticConfig, PhaseDeadlines
from libra.v1 import elastic_pb2 as pb

S = pb.MemberState
DEADLINES = PhaseDeadlines(joining_s=10, fetching_state_s=100, aligned_s=50, releasing_s=20, rollback_s=5)
HAPPY_PATH = [S.MEMBER_STATE_JOINING, S.MEMBER_STATE_FETCHING_STATE, S.MEMBER_STATE_ALIGNED,
              S.MEMBER_STATE_ACTIVE, S.MEMBER_STATE_RELEASING, S.MEMBER_STATE_ROLLOUT]


def hybrid(state=S.MEMBER_STATE_ROLLOUT, generation=1, since=100.0, member_id="hybrid-0") -> pb.Member:
    return pb.Member(member_id=member_id, role=pb.ROLE_HYBRID, state=state, generation=generation, state_since=since)


def rollout(member_id: str, bucket: str, state=S.MEMBER_STATE_ROLLOUT) -> pb.Member:
    return pb.Member(member_id=member_id, role=pb.ROLE_ROLLOUT, state=state, bucket=bucket)


def plan(dp: int, tp: int = 1, pp: int = 1, **buckets: int) -> Plan:
    return Plan(2, Training(dp=dp, tp=tp, pp=pp), tuple(Bucket(n, 1, 100, r) for n, r in buckets.items()))


def test_every_allowed_transition_is_recorded_with_the_generation_it_produces():
    for current, targets in core.ALLOWED.items():
        for target in targets:
            member = hybrid(current, generation=7, since=10.0)
            moved = core.transitioned(member, target, 12.5, "why", keep=10, plan_generation=3)
            assert moved.state == target and moved.state_since == 12.5 and moved.plan_generation == 3
            record = moved.history[-1]
            assert (record.from_state, record.to_state, record.generation) == (current, target, 8)
            assert record.seconds_in_previous == 2.5 and record.detail == "why" and record.plan_generation == 3


def test_the_happy_path_builds_a_timeline_with_phase_durations():
    member = hybrid()
    for at, target in zip(range(101, 107), HAPPY_PATH):
        member = core.transitioned(member, target, float(at), "", keep=10)
        member.generation += 1  # what the compare-and-set does
    assert [r.to_state for r in member.history] == HAPPY_PATH
    assert [r.generation for r in member.history] == [2, 3, 4, 5, 6, 7]
    assert [r.seconds_in_previous for r in member.history] == [1.0] * 6


def test_disallowed_transitions_are_rejected_with_the_allowed_ones_named():
    all_states = [v.number for v in S.DESCRIPTOR.values if v.number]
    rejected = 0
    for current in all_states:
        for target in all_states:
            if target in core.ALLOWED.get(current, ()):
                continue
            with pytest.raises(FailedPrecondition) as caught:
                core.transitioned(hybrid(current), target, 1.0, "", keep=10)
            assert S.Name(current) in str(caught.value) and "allowed:" in str(caught.value)
            rejected += 1
    assert rejected > 50
    with pytest.raises(FailedPrecondition, match="allowed: MEMBER_STATE_FAILED, MEMBER_STATE_RELEASING"):
        core.check_transition(S.MEMBER_STATE_ACTIVE, S.MEMBER_STATE_ROLLOUT)


def test_history_is_capped_oldest_first_dropped():
    member = hybrid()
    for at in range(10):
        target = S.MEMBER_STATE_JOINING if member.state == S.MEMBER_STATE_ROLLOUT else S.MEMBER_STATE_ROLLOUT
        member = core.transitioned(member, target, float(at), str(at), keep=4)
    assert [r.detail for r in member.history] == ["6", "7", "8", "9"]


def test_phase_deadlines_and_expiry():
    assert core.deadline_s(S.MEMBER_STATE_FETCHING_STATE, DEADLINES) == 100
    assert core.deadline_s(S.MEMBER_STATE_ACTIVE, DEADLINES) is None
    assert core.deadline_s(S.MEMBER_STATE_ROLLOUT, DEADLINES) is None
    joining = hybrid(S.MEMBER_STATE_JOINING, since=100.0)
    assert not core.expired(joining, 110.0, DEADLINES) and core.expired(joining, 110.1, DEADLINES)
    assert not core.expired(hybrid(S.MEMBER_STATE_ACTIVE, since=0.1), 1e9, DEADLINES)


@pytest.mark.parametrize("state, alive, now, expected", [
    (S.MEMBER_STATE_JOINING, None, 105.0, core.RESUME),       # process not started yet: admit again, start it
    (S.MEMBER_STATE_JOINING, None, 111.0, core.ROLLBACK),     # deadline passed while the coordinator was down
    (S.MEMBER_STATE_FETCHING_STATE, True, 150.0, core.RESUME),
    (S.MEMBER_STATE_FETCHING_STATE, False, 150.0, core.ROLLBACK),  # the hybrid died meanwhile
    (S.MEMBER_STATE_ALIGNED, True, 151.0, core.ROLLBACK),
    (S.MEMBER_STATE_RELEASING, False, 1e6, core.RESUME),     # a release is idempotent: finish it
    (S.MEMBER_STATE_FAILED, None, 1e6, core.RESUME),         # finish the rollback
    (S.MEMBER_STATE_ACTIVE, True, 1e6, core.WATCH),
    (S.MEMBER_STATE_ROLLOUT, None, 1e6, core.IDLE),
])
def test_recovery_after_a_coordinator_restart(state, alive, now, expected):
    assert core.recovery(hybrid(state, since=100.0), alive, now, DEADLINES) == expected


def test_grow_drains_rollout_workers_before_any_join_and_assigns_them_to_it():
    members = [rollout("s-0", "short"), rollout("s-1", "short"), rollout("l-0", "long"),
               pb.Member(member_id="core", role=pb.ROLE_TRAINING, state=S.MEMBER_STATE_TRAINING)]
    actions = core.diff_plan(plan(dp=2, tp=2, short=1, long=0), members, core_replicas=1)
    assert [(a.kind, a.target, a.phase) for a in actions] == [
        ("drain", "l-0", 0), ("drain", "s-1", 0), ("join", "hybrid-0", 1)]
    assert actions[-1].gpus == 2 and actions[-1].displaced == (("long", 1), ("short", 1))
    assert [a.phase for a in actions] == sorted(a.phase for a in actions)


def test_shrink_releases_before_rollout_workers_start():
    members = [rollout("s-0", "short"), hybrid(S.MEMBER_STATE_ACTIVE, member_id="hybrid-0"),
               hybrid(S.MEMBER_STATE_FETCHING_STATE, member_id="hybrid-1")]
    actions = core.diff_plan(plan(dp=2, short=3), members, core_replicas=1)
    # the replica that is still joining is cancelled first: it costs less than releasing an active one
    assert [(a.kind, a.target, a.phase) for a in actions] == [
        ("release", "hybrid-1", 0), ("start", "short", 1), ("start", "short", 1)]


def test_idle_hybrids_are_reused_and_new_ones_named_without_collisions():
    members = [hybrid(S.MEMBER_STATE_ROLLOUT, member_id="hybrid-1"),
               hybrid(S.MEMBER_STATE_ACTIVE, member_id="hybrid-0"), hybrid(S.MEMBER_STATE_FAILED, member_id="hybrid-2")]
    actions = core.diff_plan(plan(dp=5), members, core_replicas=1)
    assert [a.target for a in actions if a.kind == "join"] == ["hybrid-1", "hybrid-3", "hybrid-4"]


def test_a_plan_the_pool_already_matches_needs_no_action():
    members = [rollout("s-0", "short"), hybrid(S.MEMBER_STATE_ACTIVE)]
    assert core.diff_plan(plan(dp=2, short=1), members, core_replicas=1) == []
    assert core.summarize([]) == (0, 0, "applied")


def test_progress_summary():
    actions = [pb.PlanAction(state="done"), pb.PlanAction(state="failed")]
    assert core.summarize(actions) == (1, 2, "failed")
    assert core.summarize([pb.PlanAction(state="done"), pb.PlanAction(state="running")]) == (1, 2, "applying")


def test_config_rejects_unknown_placeholders_in_the_hybrid_command():
    with pytest.raises(ValueError, match="elastic.hybrid_command"):
        ElasticConfig(hybrid_command=("python", "{model_dir}"))
    assert ElasticConfig().hybrid_command[:3] == ("{python}", "-m", "libra.services.trainer.elastic.hybrid")


def test_the_timeline_and_the_status_lines_read_the_records():
    from libra.services.elastic.report import pool_lines, timeline

    member = hybrid()
    for at, target in zip((101.0, 103.0, 110.0), HAPPY_PATH):
        member = core.transitioned(member, target, at, core.name(target), keep=10, plan_generation=4)
        member.generation += 1
    rows = timeline([member])
    assert [(r[2], r[3], r[5]) for r in rows] == [("rollout", "joining", 1.0), ("joining", "fetching_state", 2.0),
                                                  ("fetching_state", "aligned", 7.0)]
    progress = pb.PlanProgress(generation=4, state="applying", steps_done=1, steps_total=2,
                               actions=[pb.PlanAction(kind="join", target="hybrid-0", state="running")])
    lines = pool_lines([member], 3, progress, now=115.0)
    assert lines[1].split()[:8] == ["hybrid-0", "hybrid", "aligned", "gen", "4", "since", "5s", "ago"]
    assert "  plan gen 4: applying, 1/2 actions done" in lines
