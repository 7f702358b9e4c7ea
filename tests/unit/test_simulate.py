"""The rollout simulator: exact timing on a toy case, determinism, scaling, and a bad policy loses."""

from __future__ import annotations

import pytest

from libra.services.scheduler.baselines import Oracle
from libra.services.scheduler.cmlfq import CMLFQ
from libra.services.scheduler.core import LoadBalance, Placement, Policy, Turn, Worker
from libra.services.scheduler.simulate import (Group, SimParams, Simulator, Tool, TrajectorySpec, no_signal_trace,
                                               signal_trace)

BUCKETS = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
MIXED = [Group("short", 1, 2), Group("medium", 2, 1), Group("long", 4, 1)]


class FirstWorker(Policy):
    """Sends every turn to the same worker: the worst placement there is."""

    name = "first_worker"

    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        return min(candidates, key=lambda w: w.worker_id), "first"


def single_turn_trace(n: int) -> list[TrajectorySpec]:
    return [TrajectorySpec(f"t{i}", "p", 100, (200 + 50 * (i % 5),), ()) for i in range(n)]


def test_one_turn_on_one_instance_takes_prefill_plus_decode_steps():
    params = SimParams(base_token_s=0.01, tp_exponent=1.0, prefill_tokens_per_step=100)
    spec = TrajectorySpec("t", "p", 300, (100, 50), (Tool("calc", "success", 200, 2.0),))
    result = Simulator([Group("short", 2, 1)], [spec], params).run(LoadBalance(10**6))
    # turn 1: 3 prefill steps + 100 decode steps; tool 2 s; turn 2 (same worker): 2 + 50 steps
    assert result.makespan_s == pytest.approx(0.005 * 103 + 2.0 + 0.005 * 52)
    assert result.moves == 0 and result.tokens_per_s == pytest.approx(150 / result.makespan_s)


def test_the_simulator_is_deterministic_for_a_seed():
    def once(seed: int):
        result = Simulator(MIXED, signal_trace(60, seed)).run(CMLFQ(10**6, buckets=BUCKETS))
        return result.makespan_s, result.moves, dict(result.reasons), result.busy
    assert once(3) == once(3)
    assert signal_trace(60, 3) == signal_trace(60, 3) and signal_trace(60, 3) != signal_trace(60, 4)


def test_no_signal_trace_keeps_the_lengths_and_scrambles_the_outcomes():
    signal, noise = signal_trace(200, 5), no_signal_trace(200, 5)
    assert [s.outputs for s in signal] == [s.outputs for s in noise]
    first_tools = lambda trace: [(s.tools[0].name, s.tools[0].status) for s in trace if s.tools]
    assert first_tools(signal) != first_tools(noise)


def test_more_instances_never_increase_the_makespan():
    trace = single_turn_trace(200)
    makespans = [Simulator([Group("short", 1, count)], trace).run(LoadBalance(10**6)).makespan_s
                 for count in (1, 2, 4, 8)]
    assert makespans == sorted(makespans, reverse=True) and makespans[-1] < makespans[0]


def test_everything_on_one_instance_is_slower_than_load_balance():
    trace = single_turn_trace(400)  # throughput-bound: no single trajectory dominates the makespan
    layout = [Group("short", 1, 4)]
    lone = Simulator(layout, trace).run(FirstWorker(10**6))
    balanced = Simulator(layout, trace).run(LoadBalance(10**6))
    assert lone.makespan_s > 2.5 * balanced.makespan_s
    assert lone.busy["short"] == pytest.approx(0.25) and balanced.busy["short"] > 0.9  # 1 of 4 instances ran


def test_the_oracle_sees_the_true_remaining_output():
    trace = signal_trace(80, 2)
    sim = Simulator(MIXED, trace)
    seen = []

    def remaining_of(tid: str) -> int:
        seen.append((tid, sim.remaining_of(tid)))
        return seen[-1][1]

    sim.run(Oracle(10**6, buckets=BUCKETS, remaining_of=remaining_of))
    first = {spec.trajectory_id: sum(spec.outputs) for spec in trace}
    assert {tid: left for tid, left in reversed(seen)} == first  # the first ask per trajectory is the total
    assert len(seen) == sum(len(spec.outputs) for spec in trace)


def test_bad_trace_is_rejected():
    with pytest.raises(ValueError, match="one tool between turns"):
        TrajectorySpec("t", "p", 10, (5, 5), ())
