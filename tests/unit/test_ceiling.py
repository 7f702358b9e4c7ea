"""The throughput ceiling (services/planner/sim/ceiling.py): no simulated design trains a trace's
batches faster, colocated or disaggregated, whatever its routing, staleness or TP degrees, and
with full batches on a few GPUs a colocated run comes within 2x of it; each part grows with what it
counts; bad input is refused."""

from __future__ import annotations

import pytest

from libra.errors import InvalidArgument
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig
from libra.services.planner.sim import control
from libra.services.planner.sim.ceiling import ceiling
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.colocated import Colocated
from libra.traces import r2e
from libra.traces.spec import TrajectorySpec, TurnSpec

MODEL, GPU = model_named("qwen2.5-3b"), gpu_named("h200-141g")


def played(trace, config: SearchConfig, sim: SimConfig, colocated: bool = False) -> Simulator:
    controller = Colocated(MODEL, GPU, config) if colocated else control.static(MODEL, GPU, config)
    simulator = Simulator(MODEL, GPU, trace, controller, config, sim)
    simulator.run()
    return simulator


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("design", ["colocated", "cmlfq", "load_balance", "staleness 2", "tp 1 only"])
@pytest.mark.parametrize("gpus, prompts", [(16, 4), (2, 32), (4, 64)])
def test_no_simulated_design_beats_the_ceiling(gpus, prompts, design, seed):
    trace = r2e.r2e_like(3, prompts, 8, seed=seed, drift=0.5)
    config = SearchConfig(total_gpus=gpus, group_size=8, tp_choices=(1,) if design == "tp 1 only" else (1, 2, 4, 8))
    if design == "colocated":
        simulator = played(trace, config, SimConfig(staleness=0, colocated=True, policy="load_balance"), True)
    else:
        policy = "load_balance" if design == "load_balance" else "cmlfq"
        simulator = played(trace, config, SimConfig(staleness=2 if design == "staleness 2" else 1, policy=policy))
    assert simulator.feeder.rejected == 0  # it trained exactly the trace's batches
    steps = len(simulator.records)
    result_per_s = trace.batch * steps / simulator.events.now
    bound = ceiling(MODEL, GPU, config, trace.steps[:steps])
    assert bound.trajectories == trace.batch * steps
    assert result_per_s <= bound.trajectories_per_s
    assert simulator.events.now >= bound.makespan_floor_s
    if prompts >= 32 and design == "colocated":  # full batches on few GPUs: close to it, so a ceiling set
        assert result_per_s > 0.5 * bound.trajectories_per_s  # too low would show


def test_each_part_grows_with_what_it_counts():
    config = SearchConfig(total_gpus=8, group_size=8)

    def one(prompt: int, outputs: tuple[int, ...], payload: int = 0, copies: int = 1):
        turns = tuple(TurnSpec(n, "search", "success", payload, 1.0) for n in outputs[:-1]) + (TurnSpec(outputs[-1]),)
        return ceiling(MODEL, GPU, config, [[TrajectorySpec("t", "p", 0, prompt, turns, copies)]])

    base = one(500, (1_000,))
    longer, later = one(500, (2_000,)), one(5_000, (1_000,))
    assert longer.decode_gpu_s > 2 * base.decode_gpu_s  # each token also reads the tokens before it
    assert later.decode_gpu_s > base.decode_gpu_s and later.prefill_gpu_s == pytest.approx(10 * base.prefill_gpu_s)
    with_tool = one(500, (500, 500), payload=3_000)
    assert with_tool.prefill_gpu_s == pytest.approx(one(3_500, (1_000,)).prefill_gpu_s)  # the payload, once
    assert with_tool.decode_gpu_s > base.decode_gpu_s  # the second turn reads the payload too
    assert with_tool.train_gpu_s > base.train_gpu_s  # and trains on it
    doubled = one(500, (1_000,), copies=2)
    assert doubled.trajectories == 2 and doubled.gpu_s == pytest.approx(2 * base.gpu_s, rel=1e-3)
    assert base.trajectories_per_s == pytest.approx(8 / base.gpu_s)


def test_a_mixture_of_experts_is_never_beaten_either():
    moe = model_named("qwen3-30b-a3b")
    trace = r2e.r2e_like(3, 32, 8, seed=1, drift=0.5)
    config = SearchConfig(total_gpus=16, group_size=8)
    for colocated in (True, False):
        sim = SimConfig(staleness=0, colocated=True, policy="load_balance") if colocated else SimConfig(staleness=1)
        controller = Colocated(moe, GPU, config) if colocated else control.static(moe, GPU, config)
        simulator = Simulator(moe, GPU, trace, controller, config, sim)
        simulator.run()
        assert simulator.feeder.rejected == 0
        steps = len(simulator.records)
        assert trace.batch * steps / simulator.events.now <= ceiling(moe, GPU, config, trace.steps[:steps]).trajectories_per_s


def test_a_model_too_large_for_one_gpu_has_a_ceiling_too():
    big = model_named("qwen3-14b").model_copy(update={"bytes_per_param": 8.0})  # 110 GiB: no one GPU holds it
    trace = r2e.r2e_like(1, 2, 8, seed=1, drift=0.5)
    assert ceiling(big, gpu_named("a800-80g"), SearchConfig(total_gpus=64, group_size=8), trace.steps).gpu_s > 0


def test_bad_input_is_refused():
    config = SearchConfig(total_gpus=8, group_size=8)
    with pytest.raises(InvalidArgument, match="at least one batch"):
        ceiling(MODEL, GPU, config, [])
    with pytest.raises(InvalidArgument, match="no empty one"):
        ceiling(MODEL, GPU, config, [[]])
