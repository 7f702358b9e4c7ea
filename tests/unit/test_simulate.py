"""The simulator's rollout loop on the simple instance model (what the scheduler evaluation runs):
exact timing on a toy case, determinism, scaling, a bad policy loses, and the instance-model seam."""

from __future__ import annotations

import pytest

from libra.routing.baselines import Clairvoyant, LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Placement, Policy, Turn, Worker
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig
from libra.services.planner.sim.engines import CostModelEngines
from libra.services.planner.sim.instance import Group, SimulationError
from libra.services.planner.sim.rollout import Window
from libra.services.planner.sim.simple import SimpleModel, SimpleParams
from libra.traces.spec import TrajectorySpec, TurnSpec, check_spec
from libra.traces.synthetic import no_signal, signal

BUCKETS = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
MIXED = [Group("short", 1, 2), Group("medium", 2, 1), Group("long", 4, 1)]


class FirstWorker(Policy):
    """Sends every turn to the same worker: the worst placement there is."""

    name = "first_worker"

    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        return min(candidates, key=lambda w: w.worker_id), "first"


def single_turn_trace(n: int) -> list[TrajectorySpec]:
    return [TrajectorySpec(f"t{i}", "p", 0, 100, (TurnSpec(200 + 50 * (i % 5)),)) for i in range(n)]


def test_one_turn_on_one_instance_takes_prefill_plus_decode_steps():
    params = SimpleParams(base_token_s=0.01, tp_exponent=1.0, prefill_tokens_per_step=100)
    spec = TrajectorySpec("t", "p", 0, 300, (TurnSpec(100, "calc", "success", 200, 2.0), TurnSpec(50)))
    result = Window([Group("short", 2, 1)], [spec], SimpleModel(params)).run(LoadBalance(10**6))
    # turn 1: 3 prefill steps + 100 decode steps; tool 2 s; turn 2 (same worker): 2 + 50 steps
    assert result.makespan_s == pytest.approx(0.005 * 103 + 2.0 + 0.005 * 52)
    assert result.moves == 0 and result.tokens_per_s == pytest.approx(150 / result.makespan_s)


def test_the_simulator_is_deterministic_for_a_seed():
    def once(seed: int):
        result = Window(MIXED, signal(60, seed)).run(CMLFQ(10**6, buckets=BUCKETS))
        return result.makespan_s, result.moves, dict(result.reasons), result.busy
    assert once(3) == once(3)
    assert signal(60, 3) == signal(60, 3) and signal(60, 3) != signal(60, 4)


def test_no_signal_trace_keeps_the_lengths_and_scrambles_the_outcomes():
    with_signal, noise = signal(200, 5), no_signal(200, 5)
    assert [s.outputs for s in with_signal] == [s.outputs for s in noise]
    first_tools = lambda trace: [(s.turns[0].tool, s.turns[0].status) for s in trace if len(s.turns) > 1]
    assert first_tools(with_signal) != first_tools(noise)


def test_more_instances_never_increase_the_makespan():
    trace = single_turn_trace(200)
    makespans = [Window([Group("short", 1, count)], trace).run(LoadBalance(10**6)).makespan_s
                 for count in (1, 2, 4, 8)]
    assert makespans == sorted(makespans, reverse=True) and makespans[-1] < makespans[0]


def test_everything_on_one_instance_is_slower_than_load_balance():
    trace = single_turn_trace(400)  # throughput-bound: no single trajectory dominates the makespan
    layout = [Group("short", 1, 4)]
    lone = Window(layout, trace).run(FirstWorker(10**6))
    balanced = Window(layout, trace).run(LoadBalance(10**6))
    assert lone.makespan_s > 2.5 * balanced.makespan_s
    assert lone.busy["short"] == pytest.approx(0.25) and balanced.busy["short"] > 0.9  # 1 of 4 instances ran


def test_the_clairvoyant_heuristic_sees_the_true_remaining_output():
    trace = signal(80, 2)
    sim = Window(MIXED, trace)
    seen = []

    def remaining_of(tid: str) -> int:
        seen.append((tid, sim.remaining_of(tid)))
        return seen[-1][1]

    sim.run(Clairvoyant(10**6, buckets=BUCKETS, remaining_of=remaining_of))
    first = {spec.trajectory_id: sum(spec.outputs) for spec in trace}
    assert {tid: left for tid, left in reversed(seen)} == first  # the first ask per trajectory is the total
    assert len(seen) == sum(len(spec.outputs) for spec in trace)


def test_bad_trace_is_rejected():
    with pytest.raises(ValueError, match="needs a tool name"):
        check_spec(TrajectorySpec("t", "p", 0, 10, (TurnSpec(5), TurnSpec(5))), "t")
    with pytest.raises(ValueError, match="at least one instance group and one trajectory"):
        Window([], single_turn_trace(1))


def test_the_simple_model_runs_one_sequence_per_trajectory_and_no_pools():
    cohort = [TrajectorySpec("t", "p", 0, 10, (TurnSpec(5),), copies=2)]
    with pytest.raises(SimulationError, match="copies 1"):
        Window([Group("short", 1, 1)], cohort).run(LoadBalance(10**6))
    with pytest.raises(SimulationError, match="max_workers"):
        SimpleModel().instance("w", "short", 1, 4, 0.0)


def test_the_same_replay_runs_on_cost_model_engines():
    """The instance model is a seam: the same window, routed the same way, on the cost model's engines
    (a 3B model on H200s decodes far faster than the simple model's 20 ms per token)."""
    config = SearchConfig(total_gpus=8)
    engines = CostModelEngines(model_named("qwen2.5-3b"), gpu_named("h200-141g"), config.tp_choices, config.rollout)
    trace = signal(60, 1)
    layout = [Group("tp1", 1, 2), Group("tp2", 2, 1)]
    fast = Window(layout, trace, engines).run(LoadBalance(10**6))
    slow = Window(layout, trace).run(LoadBalance(10**6))
    assert fast.trajectories == slow.trajectories == 60 and fast.output_tokens == slow.output_tokens
    assert fast.routes == slow.routes == sum(len(s.turns) for s in trace)
    assert fast.makespan_s < slow.makespan_s


def test_calibrated_step_overheads_and_the_time_outside_the_engine():
    """One trajectory alone on an engine: each decode step costs the fitted fixed and per-sequence
    overheads on top of the roofline, and each of its two turns takes `request_s` more on its way back
    to the gateway (before the tool runs, before the trajectory finishes)."""
    model, gpu = model_named("qwen2.5-3b"), gpu_named("h200-141g")
    spec = TrajectorySpec("t", "p", 0, 300, (TurnSpec(100, "calc", "success", 20, 2.0), TurnSpec(50)))
    base = SearchConfig(total_gpus=8).rollout

    def makespan(**terms) -> float:
        engines = CostModelEngines(model, gpu, (1,), base.model_copy(update=terms))
        return Window([Group("tp1", 1, 1)], [spec], engines).run(LoadBalance(10**6)).makespan_s

    plain = makespan()
    assert makespan(request_s=0.25) == pytest.approx(plain + 2 * 0.25)
    # 150 decode steps of one sequence each: 150 x (fixed + per sequence)
    assert makespan(step_overhead_s=0.004, step_per_seq_s=0.001) == pytest.approx(plain + 150 * 0.005, rel=1e-3)
