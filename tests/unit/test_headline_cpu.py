"""benchmarks/headline_cpu.py, sim_vs_real.py and sim_probes.py without a run: every design's `libra up` command
is a valid config with its overrides applied, the reward helpers, the plan parsing and the
engine wrapper that times turns in the simulator."""

from __future__ import annotations

import pathlib
import sys

import pytest
import yaml

from libra.config import load_run_config
from libra.services.planner.cost_train import Layout
from libra.services.planner.search import Candidate
from libra.services.planner.sim.simple import SimpleModel
from libra.services.planner.sim.instance import Unit
from libra.traces.spec import TrajectorySpec, TurnSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import headline_cpu  # noqa: E402
import sim_probes  # noqa: E402
import sim_vs_real  # noqa: E402


def _config_of(argv: list[str]):
    sets = {}
    for flag, value in zip(argv, argv[1:]):
        if flag == "--set":
            key, _, raw = value.partition("=")
            sets[key] = yaml.safe_load(raw)
    return load_run_config(argv[argv.index("--config") + 1], sets)


def test_every_design_command_is_a_valid_config_with_the_cap(tmp_path):
    for design in headline_cpu.DESIGNS:
        config = _config_of(headline_cpu.command(design, tmp_path / design, f"t-{design}", 7))
        assert config.trainer.steps == 7
        assert config.telemetry.sample_s == 1
        assert config.trainer.groups_per_step * config.trainer.group_size == 64
    d = _config_of(headline_cpu.command("d", tmp_path / "d", "t-d", 7))
    assert d.planner.mode == "online" and d.planner.cluster.gpus == 3 and d.planner.cluster.tp_choices == (1,)
    assert d.planner.training.gpus == 1
    a = _config_of(headline_cpu.command("a", tmp_path / "a", "t-a", 7))
    assert a.trainer.max_staleness == 0 and a.planner.cluster.gpus == 48  # (a) runs as written


def test_smoothed_is_a_trailing_mean():
    assert headline_cpu.smoothed([0.0, 1.0, 1.0]) == [0.0, 0.5, 2 / 3]
    rewards = [float(i) for i in range(15)]
    assert headline_cpu.smoothed(rewards)[-1] == sum(rewards[-10:]) / 10


class _Record:
    def __init__(self, versions):
        self.versions = versions

    def trainer_version_at(self, t):
        return self.versions[t]


class _Run:
    def __init__(self, decisions, versions):
        self.record = _Record(versions)
        self.record.decisions = decisions


def test_applied_plans_become_scripted_changes_after_the_step_they_followed():
    first = Candidate(Layout(1, 1, 1, 16), ((1, 2),), 0.0, 0.0)
    decisions = [{"t": 0, "applied": True, "trigger": "config", "plan": "gen 1: train 1 GPU tp1 pp1 dp1 | short tp1x1"},
                 {"t": 1, "applied": False, "trigger": "ratio", "plan": ""},
                 {"t": 2, "applied": True, "trigger": "ratio", "reason": "gain",
                  "plan": "gen 2: train 2 GPU tp1 pp1 dp2 | tp1 tp1x1"}]
    changes = sim_vs_real.plans(_Run(decisions, {0: 1, 1: 3, 2: 5}), first)
    assert list(changes) == [3]  # version 5 at the decision: steps 0..3 done
    change = changes[3]
    assert change.candidate.layout == Layout(1, 1, 2, 16) and change.candidate.rollout == ((1, 1),)


def test_timed_engine_records_arrival_to_last_token():
    latencies: list[float] = []
    batches: list[float] = []
    engine = sim_probes.Timed(SimpleModel().instance("w", "b", 1, 1, 0.0), latencies, batches)
    spec = TrajectorySpec("t0", "p", 0, 4, (TurnSpec(10),))
    unit = Unit(spec, 1, 4.0, 0, 10.0, 4.0)
    engine.advance(2.0)
    engine.enqueue(unit)
    engine.admit()
    done = engine.next_completion()
    engine.advance(done)
    assert engine.complete() is unit
    assert latencies == [done - 2.0] and done > 2.0
    assert batches == [pytest.approx(1.0)]  # the one sequence ran alone from its admission to its end
    engine.up = True  # attributes the simulator sets land on the engine itself
    assert engine._inner.up is True


def test_timed_engines_take_the_runs_bucket_names_in_creation_order():
    engines = sim_probes.TimedEngines(SimpleModel(), ["short", "long"])
    names = [engines.instance(f"w{i}", "tp1", 1, 1, 0.0).bucket for i in range(3)]
    assert names == ["short", "long", "tp1"]  # past the run's buckets: the plan's own name
    assert len(engines.engines) == 3


def test_turns_recorded_before_their_place_was_reported_get_it_from_their_start_order():
    import kept_runs
    turns = [{"trajectory_id": "g0-s0", "timestamp": 5.0, "seconds": 1.0},
             {"trajectory_id": "g0-s1", "timestamp": 2.0, "seconds": 1.0},
             {"trajectory_id": "g0-s0", "timestamp": 2.5, "seconds": 0.5},
             {"trajectory_id": "", "timestamp": 3.0, "seconds": 1.0}]
    assert [t["turn_number"] for t in kept_runs.number_turns(turns)] == [2, 1, 1, 0]
    reported = [{"trajectory_id": "x", "timestamp": 1.0, "seconds": 0.1, "turn_number": 3}]
    assert kept_runs.number_turns(reported)[0]["turn_number"] == 3  # the gateway's own stands


def test_the_rollout_workers_busy_share_comes_from_their_busy_seconds_where_recorded():
    import kept_runs

    def sample(t, busy_s=None, inflight=0, state="serving"):
        row = {"id": "w0", "inflight": inflight, "state": state}
        if busy_s is not None:
            row["busy_s"] = busy_s
        return {"t": t, "workers": [row]}
    exact = [sample(0.0, 0.0), sample(1.0, 0.5, 1), sample(4.0, 2.5), sample(9.0, 8.0, 1)]
    assert kept_runs.busy_rollout(exact, 1.0, 5.0) == pytest.approx((2.5 - 0.5) / 3.0)  # in the span only
    sampled = [sample(1.0, inflight=1), sample(2.0), sample(3.0, inflight=1), sample(4.0, inflight=1)]
    assert kept_runs.busy_rollout(sampled, 0.0, 10.0) == 0.75  # runs recorded before busy_s
    assert kept_runs.busy_rollout([sample(1.0, 0.0, state="starting"), sample(2.0, 1.0), sample(4.0, 2.0)], 0, 5) == 0.5


def test_the_measured_busy_fractions_cover_the_steady_state_of_the_step_time():
    """Step 0 holds the start-up (the engines' first passes, the first routes), which the step time,
    the calibration and the simulator all leave out: the busy fractions run from its end too (the
    whole RL phase on request, as before)."""
    import types

    import kept_runs
    steps = [{"t": 2.0, "scalars": {"time/step_s": 2.0, "time/train_s": 0.5}},  # step 0 started at t = 0
             {"t": 3.0, "scalars": {"time/step_s": 1.0, "time/train_s": 0.25}},
             {"t": 4.0, "scalars": {"time/step_s": 1.0, "time/train_s": 0.25}}]
    rollout = [{"t": t, "workers": [{"id": "w0", "state": "serving", "busy_s": busy}]}
               for t, busy in ((0.0, 0.0), (2.0, 0.5), (4.0, 1.5))]
    run = types.SimpleNamespace(record=types.SimpleNamespace(steps=steps, rollout=rollout),
                                turns=[{"seconds": 0.1}, {"seconds": 0.3}])
    steady, whole = kept_runs.measured(run), kept_runs.measured(run, steady=False)
    assert steady["step_s"] == whole["step_s"] == 1.0
    assert steady["busy_train"] == pytest.approx(0.5 / 2.0) and whole["busy_train"] == pytest.approx(1.0 / 4.0)
    assert steady["busy_rollout"] == pytest.approx(1.0 / 2.0) and whole["busy_rollout"] == pytest.approx(1.5 / 4.0)


def test_shared_deviation_tells_a_slow_moment_from_a_slow_trajectory():
    """Turns that run at a slow moment are slow together, whichever trajectory they belong to: the
    correlation between turns of different trajectories starting within 20 ms is high, between
    consecutive turns of one trajectory low."""
    import random
    from types import SimpleNamespace
    rng = random.Random(0)
    turns, fitted = [], []
    for moment in range(300):  # every 0.1 s four turns of four trajectories start together
        shock = rng.gauss(0.0, 0.05)
        for k in range(4):
            start = moment * 0.1 + 0.001 * k
            seconds = 0.1 + shock + rng.gauss(0.0, 0.005)
            turns.append({"timestamp": start + seconds, "seconds": seconds,
                          "trajectory_id": f"t{(moment * 4 + k * 7) % 97}", "bucket": "short" if k < 2 else "long"})
            fitted.append(0.1)
    run = SimpleNamespace(turns=turns, steps=[])
    shared = sim_probes.shared_deviation(run, fitted)
    assert shared["other_trajectories_within_20ms"] > 0.8 and abs(shared["consecutive_turns_of_one"]) < 0.2
    assert shared["other_bucket_within_20ms"] > 0.8  # (the slow moments here are the whole machine's)
    assert abs(shared["other_trajectories_100_to_200ms_apart"]) < 0.2  # each moment its own
    assert shared["share_overlapping_training"] is None  # no training step: nothing to correlate


def test_answer_waves_tells_routes_answered_together_from_a_stream():
    """Turns whose routes come back in groups (one scheduler write answering several) show as answered
    together far more often than arrivals at the same rate spread as a Poisson stream; evenly spread
    answers do not. The route wait's share of the gaps and its median come from route_seconds."""
    from types import SimpleNamespace

    def turn(start: float, route: float = 0.0) -> dict:
        return {"timestamp": start + 0.05, "seconds": 0.05, "route_seconds": route, "gap_seconds": 0.02}
    waves = [turn(i * 0.04 + 0.00005 * k, 0.015) for i in range(100) for k in range(8)]  # 8 answers at once
    spread = [turn(i * 0.005) for i in range(800)]  # the same rate, one answer every 5 ms
    together = sim_probes.answer_waves(SimpleNamespace(turns=waves))
    alone = sim_probes.answer_waves(SimpleNamespace(turns=spread))
    assert together["answers_together"] == 1.0 and alone["answers_together"] == 0.0
    assert together["if_poisson"] == pytest.approx(alone["if_poisson"], rel=0.02) and 0.1 < alone["if_poisson"] < 0.3
    assert together["route_share_of_gap"] == pytest.approx(0.75) and together["route_p50_s"] == 0.015
    assert "route_share_of_gap" not in alone  # runs recorded before route_seconds


def test_busy_periods_merge_overlapping_requests_and_count_the_idle_gaps():
    """A worker's busy stretches: requests that overlap or touch are one stretch, clipped to the span;
    the summary is stretches per training step and their median in ms."""
    held = [(0.0, 0.05), (0.02, 0.08), (0.08, 0.1), (0.2, 0.25), (0.9, 1.2)]
    assert sim_probes.busy_periods(held, 0.0, 1.0) == pytest.approx([0.1, 0.05, 0.1])  # the last clipped at 1.0
    assert sim_probes.busy_periods([], 0.0, 1.0) == [] and sim_probes.busy_periods([(2.0, 3.0)], 0.0, 1.0) == []
    assert sim_probes.period_summary([0.1, 0.05, 0.1], 2) == [1.5, 100.0]
