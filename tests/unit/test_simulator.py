"""The cluster simulator: determinism, conservation, KV limits, plan-change cost, errors, the CLI."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from libra.errors import InvalidArgument
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.gaps import GAP_PROBS
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig, search
from libra.services.planner.sim import control, run as sim_run
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.colocated import Colocated
from libra.services.planner.sim.control import PlanChange
from libra.services.planner.sim.engines import pool
from libra.services.planner.sim.instance import SimulationError
from libra.services.planner.sim.simple import SimpleModel
from libra.traces import synthetic
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec

MODEL, GPU = model_named("qwen2.5-3b"), gpu_named("h200-141g")
CONFIG = SearchConfig(total_gpus=16, group_size=4)


def small_trace(seed: int = 1, steps: int = 3, copies: int = 1) -> Trace:
    return synthetic.drifting(steps, 8, 4, seed=seed, drift=0.5, copies=copies)


def run(trace: Trace, policy: str = "cmlfq", controller=None, config: SearchConfig = CONFIG, **sim):
    controller = controller or control.static(MODEL, GPU, config)
    simulator = Simulator(MODEL, GPU, trace, controller, config, SimConfig(policy=policy, **sim))
    return simulator, simulator.run()


def test_the_simulation_is_deterministic_for_a_seed():
    def once(seed):
        _, result = run(small_trace(seed))
        return [(s.time_s, s.rollout_s, s.train_s) for s in result.steps], dict(result.reasons), result.output_tokens
    assert once(1) == once(1)
    assert once(1) != once(2)


@pytest.mark.parametrize("policy", ["cmlfq", "load_balance"])
def test_every_trajectory_finishes_once_and_tokens_add_up(policy):
    trace = small_trace(copies=2)
    simulator, result = run(trace, policy)
    assert simulator.left == [0] * len(trace.steps)  # a second finish would have raised NotFound in the policy
    assert not simulator.rollout.policy.state.placements  # every routed trajectory was reported finished
    assert result.trajectories == trace.batch * len(trace.steps) == 32 * 3
    assert result.output_tokens == sum(s.output_tokens * s.copies for step in trace.steps for s in step)
    assert result.routes == sum(len(s.turns) for step in trace.steps for s in step)  # one route per turn
    assert [s.step for s in result.steps] == [0, 1, 2]
    assert all(s.rollout_s > 0 and s.train_s > 0 for s in result.steps)
    assert result.trajectories_per_s == pytest.approx(result.trajectories / result.makespan_s)


def test_an_engine_never_holds_more_kv_than_its_capacity():
    small = GPU.model_copy(update={"memory_gib": 40.0, "name": "small"})
    config = SearchConfig(total_gpus=16, group_size=4, rollout=RolloutEfficiency(memory_fraction=0.25))
    trace = synthetic.drifting(2, 32, 4, seed=1, drift=0.0)
    simulator = Simulator(MODEL, small, trace, control.static(MODEL, small, config), config,
                          SimConfig(policy="load_balance"))
    result = simulator.run()
    assert 0.8 < result.peak_kv <= 1.0 + 1e-9  # the cache was the binding limit, and it held
    assert all(i.reserved <= i.capacity + 1e-6 for i in simulator.rollout.instances.values())


def test_a_plan_change_costs_its_transition_time():
    trace = small_trace(steps=4)
    first = search(MODEL, GPU, trace.pairs(0), CONFIG).best
    other = search(MODEL, GPU, trace.pairs(0), CONFIG.model_copy(update={"tp_choices": (2,)})).best
    assert first.rollout != other.rollout and first.layout != other.layout

    def with_cost(seconds):
        controller = control.Scripted(first, {1: PlanChange(other, seconds, "test")})
        return run(trace, controller=controller)

    simulator, slow = with_cost(400.0)
    _, fast = with_cost(0.0)
    change = slow.plan_changes[0]
    assert change.step == 1 and change.ready_s == pytest.approx(change.time_s + 400.0)
    started = slow.steps[2].time_s - slow.steps[2].train_s
    assert started >= change.ready_s - 1e-6  # the new training layout waited for the transition
    assert all(i.up_at in (0.0, change.ready_s) for i in simulator.rollout.instances.values())
    assert any(i.up_at == change.ready_s for i in simulator.rollout.instances.values())  # new engines came up then
    assert slow.makespan_s > fast.makespan_s + 100
    assert slow.last_plan == other.describe() and slow.first_plan == first.describe()


def test_online_planner_decides_after_steps_with_reasons():
    trace = small_trace(steps=4)
    settings = ReplanSettings(warmup_steps=1, cooldown_s=0, recheck_s=0, interval_s=1)
    controller = control.Online(MODEL, GPU, CONFIG, settings, SimConfig())
    _, result = run(trace, controller=controller)
    assert controller.decisions and controller.decisions[0][0] == 0 and controller.decisions[0][2]
    applied = [(step, reason) for step, done, reason in controller.decisions if done]
    assert [(c.step, c.reason) for c in result.plan_changes] == applied


def test_pooling_keeps_every_engine():
    assert pool(((1, 10), (4, 3)), max_workers=100) == [(1, 1)] * 10 + [(4, 1)] * 3
    pooled = pool(((1, 1000), (4, 13)), max_workers=100)
    assert sum(n for tp, n in pooled if tp == 1) == 1000 and sum(n for tp, n in pooled if tp == 4) == 13
    assert len(pooled) <= 100 + 2 and max(n for _, n in pooled) - min(n for tp, n in pooled if tp == 1) <= 1


def test_bad_budgets_and_models_give_clear_errors():
    trace = small_trace()
    with pytest.raises(InvalidArgument, match="gpus must be >= 2"):
        sim_run.simulate(MODEL, GPU, 1, trace, "static", "cmlfq")
    huge = MODEL.model_copy(update={"name": "huge", "layers": 400, "hidden_size": 16384, "intermediate_size": 65536,
                                    "heads": 128, "kv_heads": 8})
    with pytest.raises(InvalidArgument, match="does not fit"):
        sim_run.simulate(huge, GPU, 16, trace, "static", "cmlfq")
    with pytest.raises(InvalidArgument, match="unknown planner"):
        sim_run.simulate(MODEL, GPU, 16, trace, "best", "cmlfq")
    with pytest.raises(InvalidArgument, match="policy"):
        sim_run.simulate(MODEL, GPU, 16, trace, "static", "fastest")
    endless = Trace(((TrajectorySpec("x", "p", 0, 9_000_000, (TurnSpec(10),)),),))
    with pytest.raises(SimulationError, match="'x' reaches 9000010 tokens"):
        sim_run.simulate(MODEL, GPU, 16, endless, "static", "cmlfq")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra.cli", "sim", "--cluster", "configs/hardware/h200-141g.yaml",
                           "--model", "configs/models/qwen2.5-3b.yaml", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_runs_a_small_simulation_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    done = cli("--gpus", "16", "--steps", "3", "--prompts", "4", "--group-size", "4", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "trajectories/s" in done.stdout and "plan at start" in done.stdout
    assert '"trajectories_per_s"' in out.read_text()


def test_cli_bad_trace_and_budget_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_tokens,output_tokens\n100,-5\n")
    done = cli("--gpus", "16", "--steps", "2", "--trace", str(bad))
    assert done.returncode == 2 and "output_tokens=-5" in done.stderr and "Traceback" not in done.stderr
    done = cli("--gpus", "1", "--steps", "2", "--prompts", "2")
    assert done.returncode == 2 and "gpus must be >= 2" in done.stderr


def test_run_plan_plays_a_trace_under_one_plan_in_one_call():
    trace = small_trace(steps=3)
    best = search(MODEL, GPU, trace.pairs(0), CONFIG).best
    held = sim_run.run_plan(MODEL, GPU, trace, best, CONFIG, SimConfig(policy="la_mlfq"))
    _, static = run(trace, "la_mlfq")  # the static controller searches the same plan and keeps it
    assert held.first_plan == held.last_plan == static.first_plan == best.describe()
    assert [(s.time_s, s.rollout_s, s.train_s) for s in held.steps] == \
           [(s.time_s, s.rollout_s, s.train_s) for s in static.steps]


def test_the_cluster_loop_runs_on_the_simple_instance_model_too():
    trace = small_trace(steps=2)
    simulator = Simulator(MODEL, GPU, trace, control.static(MODEL, GPU, CONFIG), CONFIG,
                          SimConfig(policy="load_balance"), instance_model=SimpleModel())
    result = simulator.run()
    assert result.trajectories == trace.batch * 2 and simulator.left == [0, 0]
    assert result.output_tokens == sum(s.output_tokens for step in trace.steps for s in step)
    assert all(type(i).__name__ == "SimpleInstance" for i in simulator.rollout.instances.values())


def test_the_gap_between_turns_is_charged_before_every_turn():
    """`RolloutEfficiency.turn_gap_s` (the gateway's time between a trajectory's turns, calibrated
    from the turns' `gap_seconds`) delays each turn, the first included: a lone trajectory of three
    turns takes 3 gaps longer, its tool latencies as before (the first batch: later ones also wait
    for weight syncs, which a gap can hide)."""
    turns = (TurnSpec(50, "search", "success", 20, 0.5), TurnSpec(40, "search", "success", 20, 0.5), TurnSpec(30))
    trace = Trace(tuple((TrajectorySpec(f"t{i}", f"p{i}", i, 200, turns),) for i in range(2)))
    config = SearchConfig(total_gpus=2, group_size=1)
    plan = search(MODEL, GPU, trace.pairs(0), config).best
    spans = {}
    for gap in (0.0, 2.0):
        gapped = config.model_copy(update={"rollout": RolloutEfficiency(turn_gap_s=gap)})
        spans[gap] = sim_run.run_plan(MODEL, GPU, trace, plan, gapped).steps[0].rollout_s
    assert spans[0.0] > 1.0  # the two tool calls and the decode
    assert spans[2.0] == pytest.approx(spans[0.0] + 3 * 2.0, abs=1e-6), spans


@pytest.mark.parametrize("colocated", [False, True])
def test_a_new_version_lets_batches_out_when_its_publish_ends(colocated):
    """The trainer submits the batches a new version lets out once the version is published: in the
    synchronous designs, batch k leaves when step k - 1's weight sync (colocated: the reload in
    place) ends, not when its training does (a sync of 30 s makes the difference plain)."""
    trace = small_trace(steps=4)
    controller = Colocated(MODEL, GPU, CONFIG) if colocated else control.static(MODEL, GPU, CONFIG)
    sim = SimConfig(policy="load_balance", staleness=0, colocated=colocated, sync_latency_s=30.0)
    simulator = Simulator(MODEL, GPU, trace, controller, CONFIG, sim)
    result = simulator.run()
    released = simulator.feeder.groups.released_s
    assert released[0] == 0.0
    for k in range(1, len(result.steps)):
        trained = result.steps[k - 1].time_s  # step k - 1's training ended here
        assert 30.0 <= released[k] - trained < 31.0, (k, released[k], trained)


def test_a_gateways_cap_on_trajectories_played_at_once_queues_the_rest_in_release_order():
    """`max_in_flight` (a gateway's rollout.max_concurrent_trajectories): at most that many
    trajectories play at once, the rest start as places free up, in release order. Four
    trajectories of two 1-second tool calls each: one at a time, the batch takes at least their
    eight seconds of tools end to end; two at a time, at least four; unbounded, about two."""
    turns = (TurnSpec(20, "search", "success", 10, 1.0), TurnSpec(20, "search", "success", 10, 1.0), TurnSpec(10))
    trace = Trace(tuple(tuple(TrajectorySpec(f"t{b}-{i}", f"p{b}", b, 100, turns) for i in range(4))
                        for b in range(2)))
    config = SearchConfig(total_gpus=2, group_size=4)

    class Watched(Simulator):  # records each start: which trajectory, how many then play
        def _start(self):
            if not hasattr(self, "started"):
                self.started, self.peak, start = [], 0, self.rollout.start

                def watched(spec):
                    self.started.append(spec.trajectory_id)
                    self.peak = max(self.peak, self.playing)
                    return start(spec)
                self.rollout.start = watched
            super()._start()
    spans, peaks, order = {}, {}, {}
    for cap in (0, 1, 2):
        simulator = Watched(MODEL, GPU, trace, control.static(MODEL, GPU, config), config,
                            SimConfig(policy="load_balance", max_in_flight=cap))
        spans[cap] = simulator.run().steps[0].rollout_s
        peaks[cap], order[cap] = simulator.peak, simulator.started
    assert 8.0 <= spans[1] < 9.0 and 4.0 <= spans[2] < 5.0 and 2.0 <= spans[0] < 3.0, spans
    assert peaks == {0: 8, 1: 1, 2: 2}, peaks  # unbounded: both batches (staleness 1) at once
    assert order[1] == order[2] == order[0] == [s.trajectory_id for step in trace.steps for s in step]


def test_with_a_calibrated_distribution_each_turn_draws_its_own_gap():
    """With gap quantiles (the calibration's, first turns apart) every turn waits its own draw:
    alike trajectories take different times, the same ones every run, about as long on average;
    with the mean alone they all take the same time. The same for a turn's way back from the
    engine (`request_quantiles`: a factor on request_s)."""
    turns = (TurnSpec(20, "search", "success", 10, 0.5), TurnSpec(20, "search", "success", 10, 0.5), TurnSpec(10))
    trace = Trace(tuple(tuple(TrajectorySpec(f"t{b}-{i}", f"p{b}", b, 100, turns) for i in range(4))
                        for b in range(30)))
    config = SearchConfig(total_gpus=2, group_size=4)
    first = tuple(0.2 * p for p in GAP_PROBS)  # uniform on [0, 0.2]: mean 0.1
    later = tuple(0.1 * p for p in GAP_PROBS)  # uniform on [0, 0.1]: mean 0.05
    mean = (0.1 + 2 * 0.05) / 3  # three turns: the mean gap alike

    class Timed(Simulator):  # each trajectory's time from its start to its end
        def _finished(self, unit):
            self.durations = getattr(self, "durations", [])
            self.durations.append(self.events.now - unit.released_s)
            super()._finished(unit)

    def durations(**drawn) -> list[float]:
        searched = config.model_copy(update={"rollout": RolloutEfficiency(turn_gap_s=mean, **drawn)})
        simulator = Timed(MODEL, GPU, trace, control.static(MODEL, GPU, searched), searched,
                          SimConfig(policy="load_balance", sync_latency_s=0.0, sync_gbps=100_000.0))
        simulator.run()
        return simulator.durations
    alike, drawn = durations(), durations(first_gap_quantiles=first, turn_gap_quantiles=later)
    assert durations(first_gap_quantiles=first, turn_gap_quantiles=later) == drawn
    assert statistics.pstdev(drawn) > 0.04 > 4 * statistics.pstdev(alike), (statistics.pstdev(drawn),
                                                                             statistics.pstdev(alike))
    # a turn's way back (request_s) drawn too: a factor uniform on [0, 2], mean 1
    back = durations(request_s=0.1)
    drawn_back = durations(request_s=0.1, request_quantiles=tuple(2.0 * p for p in GAP_PROBS))
    assert statistics.pstdev(drawn_back) > 0.04 > 4 * statistics.pstdev(back)
    assert statistics.fmean(drawn_back) == pytest.approx(statistics.fmean(back), abs=0.03)
    # the same gaps on average (the engines' batches differ a little once the trajectories spread out)
    assert statistics.fmean(drawn) == pytest.approx(statistics.fmean(alike), abs=0.03)


def test_with_calibrated_correlations_trajectories_released_together_move_together():
    """The draws of one moment correlated as calibrated (gaps.Moments): with correlation 1 the
    trajectories of a batch, released together onto one engine with the same turns, draw the same
    first gap, reply factors and later gaps, so they end together, while batches still differ from
    one another as much as independent draws make them; with correlation 0 each draws its own."""
    turns = (TurnSpec(20, "search", "success", 10, 0.5), TurnSpec(20, "search", "success", 10, 0.5), TurnSpec(10))
    trace = Trace(tuple(tuple(TrajectorySpec(f"t{b}-{i}", f"p{b}", b, 100, turns) for i in range(4))
                        for b in range(30)))
    config = SearchConfig(total_gpus=2, group_size=4)
    uniform = tuple(0.1 * p for p in GAP_PROBS)  # uniform on [0, 0.1]

    class Timed(Simulator):  # each trajectory's time from its start to its end, by batch
        def _finished(self, unit):
            self.durations = getattr(self, "durations", {})
            self.durations.setdefault(unit.spec.step, []).append(self.events.now - unit.released_s)
            super()._finished(unit)

    def durations(rho: float) -> dict[int, list[float]]:
        rollout = RolloutEfficiency(turn_gap_s=0.05, first_gap_quantiles=uniform, turn_gap_quantiles=uniform,
                                    request_s=0.05, request_quantiles=tuple(2.0 * p for p in GAP_PROBS),
                                    moment_s=0.01, first_gap_correlation=rho, gap_correlation=rho,
                                    reply_correlation=rho)
        searched = config.model_copy(update={"rollout": rollout})
        simulator = Timed(MODEL, GPU, trace, control.static(MODEL, GPU, searched), searched,
                          SimConfig(policy="load_balance", sync_latency_s=0.0, sync_gbps=100_000.0, staleness=0))
        simulator.run()
        assert len(simulator.rollout.instances) == 1
        return simulator.durations

    def within(batches) -> float:  # the mean spread of a batch's durations
        return statistics.fmean(max(d) - min(d) for d in batches.values())

    together, apart = durations(1.0), durations(0.0)
    assert within(together) < 1e-9 < 0.05 < within(apart)
    means = [statistics.fmean(d) for d in together.values()]
    assert statistics.pstdev(means) > 0.03  # batches differ: the moments' own draws
    assert statistics.fmean(means) == pytest.approx(statistics.fmean(x for d in apart.values() for x in d), rel=0.15)
