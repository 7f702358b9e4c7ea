"""benchmarks/scheduler_eval.py's reference partitions: each trajectory stays in the bucket given to
it, the best split of the clairvoyant grid is at least the lower bound and no worse than any one
split, a layout with more buckets than the grid knows is refused with the reason, and the outcome
partition gives each trajectory the bucket its first tool outcome points to."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

from libra.errors import InvalidArgument
from libra.services.planner.sim.bound import lower_bound
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.rollout import Window
from libra.traces.spec import TurnSpec
from libra.traces.synthetic import signal

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scheduler_eval  # noqa: E402


def _case(layout_name: str = "TP1x4+TP2x2+TP4x1") -> "scheduler_eval.Case":
    return next(case for case in scheduler_eval.cases({})
                if case.trace == "signal" and case.layout_name == layout_name)


def test_a_partition_keeps_every_trajectory_in_its_bucket():
    case = _case()
    specs = signal(40, 7, prefix="p")
    level_of = {spec.trajectory_id: index % 3 for index, spec in enumerate(specs)}
    policy = scheduler_eval.Partition(scheduler_eval.CAP, case.buckets, level_of)
    routes = []
    choose = policy.choose

    def recording(turn, placement, candidates):
        worker, reason = choose(turn, placement, candidates)
        routes.append((turn.trajectory_id, worker.bucket, reason))
        return worker, reason

    policy.choose = recording
    Window(case.layout, specs).run(policy)
    buckets = [name for name, _ in case.buckets]
    assert buckets == ["short", "medium", "long"]
    assert len(routes) == sum(len(spec.turns) for spec in specs)  # every turn of every trajectory
    for trajectory, bucket, reason in routes:
        assert bucket == buckets[level_of[trajectory]] and reason in ("partition", "affinity")


def test_the_best_partition_is_above_the_bound_and_the_best_of_its_grid():
    case = _case("TP1x8+TP2x2+TP4x2")
    specs = signal(60, 3, prefix="b")
    makespan, shares = scheduler_eval.best_partition(case, specs, scheduler_eval.CAP)
    assert shares in scheduler_eval.PARTITION_SHARES[3]
    assert makespan >= lower_bound(case.layout, specs).makespan_s * (1 - 1e-9)
    everything_short = {spec.trajectory_id: 0 for spec in specs}
    alone = Window(case.layout, specs).run(scheduler_eval.Partition(scheduler_eval.CAP, case.buckets,
                                                                     everything_short)).makespan_s
    assert makespan < alone  # the long ones on the short TP1 bucket: far slower than the best split


def test_more_buckets_than_the_grid_knows_are_refused():
    case = _case()
    four = scheduler_eval.Case("signal", "four", case.layout + [Group("huge", 8, 1)],
                               case.buckets + [("huge", 64_000)], case.draw)
    with pytest.raises(InvalidArgument, match="1 to 3 buckets"):
        scheduler_eval.best_partition(four, signal(10, 1), scheduler_eval.CAP)


def test_the_outcome_partition_puts_each_trajectory_in_its_first_outcomes_bucket():
    """On the signal trace the first tool outcome is the class: long trajectories (a large search
    result first) in the long bucket, medium ones in the medium one, short ones in the short one;
    a trajectory without a tool call is judged with the others that have none."""
    case = _case()
    specs = signal(200, 5, prefix="o")
    levels = scheduler_eval.outcome_levels(specs, case.buckets)
    assert set(levels) == {spec.trajectory_id for spec in specs}
    for spec in specs:
        first = spec.turns[0]
        want = 2 if first.payload_tokens >= 3000 else 1 if first.tool == "search" else 0
        assert levels[spec.trajectory_id] == want, (spec.trajectory_id, first)
    assert {2, 1, 0} == set(levels.values())
    untooled = [dataclasses.replace(spec, trajectory_id=f"u{n}", turns=(TurnSpec(output),))
                for n, (spec, output) in enumerate(zip(specs, (9_000, 12_000)))]
    assert scheduler_eval.outcome_levels(untooled + specs[:3], case.buckets)["u0"] == 2  # mean 10,500: long
