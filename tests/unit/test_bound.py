"""The makespan lower bound of the simple instance model: never beaten, exact where it must be, and
clear errors for bad input.

The brute force plays every schedule the simulator can express for a few trajectories on two or
three instances (every assignment of every turn to an instance, every release order) and checks
that the bound is at most the best of them; every routing policy run must also end at or above it.
"""

from __future__ import annotations

import itertools
import random

import pytest

from libra.routing.baselines import LAMLFQ, Clairvoyant, LengthAware, LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Placement, Policy, Turn, Worker
from libra.services.planner.sim.bound import lower_bound, trajectory_work
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.rollout import Window
from libra.services.planner.sim.simple import SimpleModel, SimpleParams
from libra.traces.spec import TrajectorySpec, TurnSpec
from libra.traces.synthetic import equal_depth, no_signal, signal

TOLERANCE = 1e-9  # relative: event times are sums of floats


class Scripted(Policy):
    """Sends turn k of trajectory t to the worker `plan[(t, k)]`: one schedule of the brute force."""

    name = "scripted"

    def __init__(self, plan: dict[tuple[str, int], str]):
        super().__init__(10**9, affinity=False)
        self.plan = plan

    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        wanted = self.plan[turn.trajectory_id, turn.turn]
        return next(w for w in candidates if w.worker_id == wanted), "scripted"


def random_case(rng: random.Random) -> tuple[list[Group], list[TrajectorySpec], SimpleParams]:
    params = SimpleParams(base_token_s=rng.choice((0.01, 0.02)), tp_exponent=rng.choice((0.5, 0.8, 1.0)),
                          batch_slowdown=rng.choice((0.0, 0.05, 0.3)), max_batch=rng.choice((1, 2, 3)),
                          prefill_tokens_per_step=rng.choice((4, 64)))
    layout = [Group(f"i{k}", tp, 1) for k, tp in enumerate(rng.sample((1, 2, 4), rng.choice((2, 3))))]
    trace, turns_left = [], 4  # at most 4 turns in all: 3^4 assignments x 3! orders
    for index in range(rng.choice((2, 3))):
        turns = 1 if turns_left <= 1 or rng.random() < 0.5 else 2
        turns_left -= turns
        specs = tuple(TurnSpec(rng.randint(1, 60), "search", "success", rng.randint(0, 40), rng.uniform(0, 0.5))
                      for _ in range(turns - 1)) + (TurnSpec(rng.randint(1, 60)),)
        trace.append(TrajectorySpec(f"t{index}", f"p{index}", 0, rng.randint(1, 80), specs))
    return layout, trace, params


def best_schedule(layout: list[Group], trace: list[TrajectorySpec], params: SimpleParams) -> float:
    """The least makespan over every turn assignment and release order the simulator can play."""
    workers = [f"{g.bucket}-tp{g.tp}-0" for g in layout]
    turns = [(spec.trajectory_id, k) for spec in trace for k in range(len(spec.turns))]
    best = float("inf")
    for order in itertools.permutations(trace):
        for choice in itertools.product(workers, repeat=len(turns)):
            result = Window(layout, list(order), SimpleModel(params)).run(Scripted(dict(zip(turns, choice))))
            best = min(best, result.makespan_s)
    return best


@pytest.mark.parametrize("seed", range(24))
def test_the_bound_never_exceeds_the_best_schedule_of_a_small_instance(seed):
    layout, trace, params = random_case(random.Random(seed))
    bound = lower_bound(layout, trace, params).makespan_s
    best = best_schedule(layout, trace, params)
    assert 0 < bound <= best * (1 + TOLERANCE)


def test_the_relaxation_binds_on_some_small_instances_and_never_exceeds_their_best_schedule():
    binding = 0
    for seed in range(100, 180):
        layout, trace, params = random_case(random.Random(seed))
        bound = lower_bound(layout, trace, params)
        closed_form = lower_bound(layout, trace, params, relaxation=False)
        assert bound.capacity_s == closed_form.capacity_s and bound.critical_path_s == closed_form.critical_path_s
        assert bound.relaxation_s >= max(bound.critical_path_s, bound.capacity_s) * 0.97  # tangents' spacing
        if bound.relaxation_s > closed_form.makespan_s * (1 + 1e-6):
            binding += 1
            assert bound.makespan_s == bound.relaxation_s and bound.binding.startswith("relaxation")
            assert bound.makespan_s <= best_schedule(layout, trace, params) * (1 + TOLERANCE)
    assert binding >= 5  # 10 of these 80 when written


def test_the_relaxation_sees_the_longest_trajectories_crowd_one_fast_instance():
    """One long trajectory and three shorter ones, a wide instance beside a narrow one: the critical
    path lets the long one run alone on the wide instance, the capacity term lets all four share
    it; the long one cannot have it alone while the others also finish in time."""
    params = SimpleParams(batch_slowdown=0.3, max_batch=4, prefill_tokens_per_step=64)
    layout = [Group("short", 1, 1), Group("long", 4, 1)]
    trace = [TrajectorySpec(f"t{i}", "p", 0, 8, (TurnSpec(output),)) for i, output in enumerate((150, 50, 50, 50))]
    bound = lower_bound(layout, trace, params)
    best = best_schedule(layout, trace, params)
    assert bound.binding.startswith("relaxation")
    assert max(bound.critical_path_s, bound.capacity_s) * 1.05 < bound.makespan_s <= best * (1 + TOLERANCE)


def test_one_trajectory_alone_on_the_widest_instance_meets_the_bound_exactly():
    params = SimpleParams(prefill_tokens_per_step=16)
    spec = TrajectorySpec("t", "p", 0, 64, (TurnSpec(30, "search", "success", 32, 1.5), TurnSpec(50)))
    layout = [Group("short", 1, 2), Group("long", 4, 1)]
    bound = lower_bound(layout, [spec], params)
    plan = {("t", 0): "long-tp4-0", ("t", 1): "long-tp4-0"}
    played = Window(layout, [spec], SimpleModel(params)).run(Scripted(plan)).makespan_s
    expected = (30 + 50 + (64 + 32) / 16) * params.base_token_s / 4 ** params.tp_exponent + 1.5
    assert bound.critical_path_s == pytest.approx(expected) and played == pytest.approx(bound.makespan_s)
    assert bound.binding == "critical path of t"


def test_identical_trajectories_batched_on_one_instance_meet_the_capacity_term_exactly():
    params = SimpleParams(batch_slowdown=0.1, max_batch=8)
    trace = [TrajectorySpec(f"t{i}", "p", 0, 1, (TurnSpec(100),)) for i in range(8)]
    layout = [Group("only", 2, 1)]
    bound = lower_bound(layout, trace, params)
    played = Window(layout, trace, SimpleModel(params)).run(LoadBalance(10**9)).makespan_s
    assert played == pytest.approx(bound.makespan_s) and bound.capacity_k == 8
    assert bound.capacity_s > bound.critical_path_s  # eight at once run 1.7x slower than one alone


def test_work_counts_outputs_and_each_prefill_once():
    spec = TrajectorySpec("t", "p", 0, 100, (TurnSpec(10, "calc", "failure", 28, 0.2), TurnSpec(5)))
    assert trajectory_work(spec, SimpleParams(prefill_tokens_per_step=64)) == 15 + 128 / 64


@pytest.mark.parametrize("make_trace", [signal, no_signal, equal_depth])
def test_no_policy_beats_the_bound(make_trace):
    buckets = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
    layouts = ([Group("short", 1, 2), Group("medium", 2, 1), Group("long", 4, 1)],
               [Group("short", 1, 1), Group("long", 4, 2)])
    trace = make_trace(60, 7)
    for layout in layouts:
        bound = lower_bound(layout, trace).makespan_s
        window = Window(layout, trace)
        policies = [LoadBalance(10**6), LengthAware(10**6, buckets=buckets), LAMLFQ(10**6, buckets=buckets),
                    CMLFQ(10**6, buckets=buckets),
                    Clairvoyant(10**6, buckets=buckets, remaining_of=lambda tid: window.remaining_of(tid))]
        for policy in policies:
            assert window.run(policy).makespan_s >= bound * (1 - TOLERANCE), policy.name


def test_bad_input_gets_clear_errors():
    spec = TrajectorySpec("t", "p", 0, 10, (TurnSpec(5),))
    layout = [Group("short", 1, 1)]
    with pytest.raises(ValueError, match="the trace is empty"):
        lower_bound(layout, [])
    with pytest.raises(ValueError, match="layout has no instances"):
        lower_bound([], [spec])
    with pytest.raises(ValueError, match="layout has no instances"):
        lower_bound([Group("short", 1, 0)], [spec])
    with pytest.raises(ValueError, match="output_tokens=-5"):
        lower_bound(layout, [TrajectorySpec("t", "p", 0, 10, (TurnSpec(-5),))])
    with pytest.raises(ValueError, match="prompt_tokens=-1"):
        lower_bound(layout, [TrajectorySpec("t", "p", 0, -1, (TurnSpec(5),))])
    with pytest.raises(ValueError, match="copies 1"):
        lower_bound(layout, [TrajectorySpec("t", "p", 0, 10, (TurnSpec(5),), copies=2)])
    with pytest.raises(ValueError, match="batch_slowdown"):
        lower_bound(layout, [spec], SimpleParams(batch_slowdown=-0.1))
    with pytest.raises(ValueError, match="tp must be >= 1"):
        lower_bound([Group("short", 0, 1)], [spec])


def test_the_window_refuses_what_the_bound_refuses():
    spec = TrajectorySpec("t", "p", 0, 10, (TurnSpec(5),))
    with pytest.raises(ValueError, match="has no instances"):
        Window([Group("short", 1, 0)], [spec])
    with pytest.raises(ValueError, match="output_tokens=-5"):
        Window([Group("short", 1, 1)], [TrajectorySpec("t", "p", 0, 10, (TurnSpec(-5),))])
