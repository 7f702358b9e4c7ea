"""The headline designs (configs/headline/) and what the simulator needs to play them: every config
validates and differs from the others only in its design; the colocated mode never overlaps rollout
and training and waits for the longest trajectory; the elastic pool moves replicas without
stopping the trainer; `libra sim --config` runs each; the R2E-Gym-like trace keeps its caps."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from libra.config import load_run_config
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim import control, design as sim_design
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.colocated import Colocated
from libra.services.planner.sim.control import PlanChange
from libra.traces import r2e
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADLINE = {key: ROOT / "configs" / "headline" / f"{name}.yaml" for key, name in
            (("a", "a-sync-colocated"), ("b", "b-async-even"), ("c", "c-libra-static"), ("d", "d-libra-full"))}
MODEL, GPU = model_named("qwen2.5-3b"), gpu_named("h200-141g")


def small_trace(steps: int = 3, prompts: int = 4) -> Trace:
    return r2e.r2e_like(steps, prompts, 8, seed=1, drift=0.5)


def colocated_run(trace: Trace, gpus: int = 16) -> Simulator:
    config = SearchConfig(total_gpus=gpus, group_size=8)
    simulator = Simulator(MODEL, GPU, trace, Colocated(MODEL, GPU, config), config,
                          SimConfig(staleness=0, colocated=True, policy="load_balance"))
    simulator.run()
    return simulator


# -- the configs --------------------------------------------------------------------------------
def test_the_four_configs_differ_only_in_their_design():
    configs = {key: load_run_config(path, env={}) for key, path in HEADLINE.items()}
    design = {"run_id", "run_dir", "planner", "scheduler", "elastic"}
    trees = {}
    for key, config in configs.items():
        tree = config.model_dump(mode="json")
        for name in design:
            tree.pop(name)
        tree["trainer"].pop("max_staleness")
        trees[key] = tree
    assert trees["a"] == trees["b"] == trees["c"] == trees["d"]  # model, workload, batch, lr, sampling, engines
    assert [configs[k].trainer.max_staleness for k in "abcd"] == [0, 1, 1, 1]  # (a) is synchronous by design
    clusters = {(c.planner.cluster.hardware, c.planner.cluster.model, c.planner.cluster.gpus) for c in configs.values()}
    assert clusters == {("a800-80g", "qwen3-14b", 48)}
    assert len({c.scheduler.per_worker_cap_tokens for c in configs.values()}) == 1


def test_each_config_is_the_design_it_names():
    a, b, c, d = (sim_design.design_of(load_run_config(HEADLINE[k], env={})) for k in "abcd")
    assert (a.planner, a.sim.colocated, a.sim.staleness, a.sim.policy) == ("colocated", True, 0, "load_balance")
    assert (b.planner, b.sim.staleness, b.sim.policy, len(b.search.tp_choices)) == ("static", 1, "load_balance", 1)
    assert b.search.min_train_gpus == b.search.min_rollout_gpus == b.search.total_gpus // 2  # the even split
    assert (c.planner, c.sim.policy, c.sim.core_replicas, c.search.tp_choices) == ("static", "cmlfq", 0, (1, 2, 4, 8))
    assert (d.planner, d.sim.policy, d.sim.staleness) == ("online", "cmlfq", 1) and d.sim.core_replicas >= 1
    assert len({x.search.group_size for x in (a, b, c, d)}) == 1


@pytest.mark.parametrize("key", "abcd")
def test_libra_sim_runs_each_config(key, tmp_path):
    sets = ["planner.cluster.gpus=16"] + (["planner.cluster.min_train_gpus=8", "planner.cluster.min_rollout_gpus=8"]
                                          if key == "b" else [])
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "libra.cli", "sim", "--config", str(HEADLINE[key]),
                           *[arg for s in sets for arg in ("--set", s)], "--trace", "r2e", "--steps", "2",
                           "--prompts", "4", "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "trajectories/s" in done.stdout and "busy GPU fraction per pool" in done.stdout
    assert "throughput ceiling of these batches" in done.stdout
    if key in "cd":  # the first plan chosen by replays: each reported as it ends, before the first step
        lines = done.stdout.splitlines()
        first = lines.index(next(line for line in lines if line.startswith("first plan: train ")))
        assert any(line.startswith("  replay 1/") for line in lines[:first])
        assert first < lines.index(next(line for line in lines if line.startswith("  step    0")))
    written = json.loads(out.read_text())
    assert written["run"] == f"headline-{key}"
    assert 0 < written["trajectories_per_s"] <= written["ceiling_trajectories_per_s"] or written["rejected"]


def test_libra_sim_prints_and_writes_the_replanners_decisions(tmp_path):
    """`--decisions` prints every decision Libra full's replanner recorded, a line each (moved or kept,
    why); the JSON holds them with or without it, and the moves among them are the plan changes."""
    sets = ["planner.cluster.gpus=16", "planner.replan.warmup_steps=1", "planner.replan.cooldown_s=0",
            "planner.replan.recheck_s=0", "planner.replan.interval_s=1", "planner.replan.sim_window_steps=3",
            "planner.replan.sim_warmup_steps=0"]
    out = tmp_path / "sim.json"
    argv = [sys.executable, "-m", "libra.cli", "sim", "--config", str(HEADLINE["d"]),
            *[arg for s in sets for arg in ("--set", s)], "--trace", "r2e", "--steps", "6", "--prompts", "4",
            "--json", str(out)]
    quiet = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    loud = subprocess.run([*argv, "--decisions"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    decisions = json.loads(out.read_text())["decisions"]
    applied = [d for d in decisions if d["applied"]]
    assert decisions and all(d["reason"] for d in decisions)
    assert f"replanning decisions: {len(decisions)} recorded, {len(applied)} applied (--decisions" in quiet.stdout
    assert "  after step" not in quiet.stdout.split("replanning decisions:")[1].split("routes")[0]
    lines = [line for line in loud.stdout.splitlines()
             if line.startswith("  after step") and (": keep: " in line or ": MOVE: " in line)]
    assert len(lines) == len(decisions)
    assert [line.split(": ", 2)[2] for line in lines] == [d["reason"] for d in decisions]
    assert len(applied) == len(json.loads(out.read_text())["plan_changes"])
    # as they happen, the decisions that replayed (the others decide in no time): a line each
    evaluated = [d for d in decisions if "simulated on the last" in d["reason"]]
    live = [line for line in quiet.stdout.splitlines() if line.startswith("  decision after step ")]
    assert evaluated and len(live) == len(evaluated), quiet.stdout
    assert [int(line.split()[3].rstrip(":")) for line in live] == [d["step"] for d in evaluated]
    assert all(" replays, " in line and "CPU-s" in line for line in live)


def test_libra_sim_refuses_flags_the_config_sets():
    done = subprocess.run([sys.executable, "-m", "libra.cli", "sim", "--config", str(HEADLINE["c"]), "--policy",
                           "load_balance"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--policy with --config" in done.stderr and "--set" in done.stderr


def test_a_synchronous_job_cannot_replan():
    config = load_run_config(HEADLINE["a"], {"planner.mode": "online"}, env={})
    with pytest.raises(Exception, match="set planner.mode: static"):
        sim_design.design_of(config)


# -- the colocated mode -------------------------------------------------------------------------
def test_colocated_mode_never_overlaps_rollout_and_training():
    trace = small_trace(steps=4)
    simulator = colocated_run(trace)
    records = simulator.records
    assert [r.step for r in records] == [0, 1, 2, 3]
    plan = simulator.candidate
    assert plan.layout.gpus == plan.rollout_gpus == 16 and len(plan.rollout) == 1  # every GPU on both sides
    for step, record in enumerate(records):
        train_start = record.time_s - record.train_s
        groups = simulator.feeder.groups  # in order: group s is batch s
        assert train_start >= groups.finished_s[step] - 1e-9  # training after the batch's last trajectory
        if step + 1 < len(records):
            assert groups.released_s[step + 1] >= record.time_s - 1e-9  # the next batch after training
    assert set(simulator.usage.staleness) == {0}  # every token sampled by the version that trains on it
    assert set(simulator.usage.fractions()) == {"colocated"}
    with pytest.raises(ValueError, match="staleness 0"):
        SimConfig(staleness=1, colocated=True)


def test_a_longer_tail_makes_the_colocated_step_wait_for_its_longest_trajectory():
    def batch(longest: int) -> Trace:  # 32 one-turn trajectories of 1,000 tokens, one of `longest`
        return Trace((tuple(TrajectorySpec(f"t{i}", f"p{i // 8}", 0, 500, (TurnSpec(longest if i == 5 else 1_000),))
                            for i in range(32)),), f"tail {longest}")

    short, long = colocated_run(batch(1_000)), colocated_run(batch(30_000))
    tp = long.candidate.rollout[0][0]
    per_token = MODEL.weight_bytes / tp / (GPU.hbm_gbps * 1e9)  # one sequence alone still reads the weights
    assert long.records[0].rollout_s >= 30_000 * per_token > 3 * short.records[0].rollout_s
    assert long.feeder.groups.finished_s[0] == long.records[0].time_s - long.records[0].train_s  # trained right after
    assert long.records[0].time_s - short.records[0].time_s >= 0.9 * 29_000 * per_token


def test_colocated_weights_are_reloaded_in_place_faster_than_over_the_network():
    trace = small_trace(steps=2)
    simulator = colocated_run(trace)
    reload = simulator.trainer.reload_seconds(simulator.candidate.rollout[0][0], 0.0)
    network = MODEL.weight_bytes / simulator.candidate.rollout[0][0] / (GPU.internode_gbps * 1e9)
    assert 0 < reload < network


# -- the elastic hybrid pool --------------------------------------------------------------------
SMALL = SearchConfig(total_gpus=32, group_size=8, tp_choices=(2,), whole_nodes="off")
NARROW = Candidate(Layout(2, 1, 4, 1), ((2, 12),), 0.0, 0.0)  # 8 GPUs train, 24 roll out
WIDE = Candidate(Layout(2, 1, 8, 1), ((2, 8),), 0.0, 0.0)  # four more replicas, borrowed from rollout


def dp_move_run(core: int, transition_s: float) -> tuple[Simulator, list[float]]:
    trace = small_trace(steps=6, prompts=8)
    controller = control.Scripted(NARROW, {0: PlanChange(WIDE, transition_s, "test: four more replicas")})
    simulator = Simulator(MODEL, GPU, trace, controller, SMALL, SimConfig(core_replicas=core))
    result = simulator.run()
    return simulator, [r.time_s - r.train_s for r in result.steps]


def test_a_dp_move_through_the_elastic_pool_does_not_stop_the_trainer():
    elastic, starts = dp_move_run(core=1, transition_s=150.0)
    ready = elastic.changes[0].ready_s
    assert elastic.trainer.joins == 1 and elastic.trainer.layout == WIDE.layout
    assert starts[1] < ready < starts[-1]  # the core stepped on while the hybrids got ready, then they joined
    trainer, notes = elastic.trainer, []
    for record, start in zip(elastic.records, starts):
        layout = WIDE.layout if start >= ready else NARROW.layout
        seq_len = max(1, round(elastic.trace.mean_tokens(record.step)))
        assert record.train_s == trainer.step_seconds(layout, seq_len, SMALL.train, notes, record.step)


def test_without_the_elastic_pool_a_dp_move_stops_the_trainer():
    plain, starts = dp_move_run(core=0, transition_s=150.0)
    ready = plain.changes[0].ready_s
    assert plain.trainer.joins == 0 and starts[1] >= ready - 1e-6  # resharded: it waited for the move
    elastic, _ = dp_move_run(core=1, transition_s=150.0)
    assert elastic.records[-1].time_s < plain.records[-1].time_s


# -- the trace ------------------------------------------------------------------------------------
def test_the_r2e_trace_keeps_its_caps_and_drifts():
    trace = r2e.r2e_like(20, 8, 8, seed=3, drift=1.0)
    specs = [s for step in trace.steps for s in step]
    assert max(s.output_tokens for s in specs) <= r2e.MAX_NEW_TOKENS
    assert max(len(s.turns) for s in specs) <= r2e.MAX_TURNS
    assert max(s.total_tokens for s in specs) <= r2e.MAX_CONTEXT
    assert any(s.output_tokens == r2e.MAX_NEW_TOKENS for s in specs)  # a pile-up at the budget late in the run
    mean = [sum(s.output_tokens for s in step) / len(step) for step in trace.steps]
    assert sum(mean[-5:]) > 1.5 * sum(mean[:5])
    assert r2e.r2e_like(3, 2, 4, seed=3) == r2e.r2e_like(3, 2, 4, seed=3) != r2e.r2e_like(3, 2, 4, seed=4)
    tools = {t.tool for s in specs for t in s.turns[:-1]}
    assert tools == {"search", "view_file", "edit", "run_tests"}


def test_the_r2e_trace_refuses_bad_sizes():
    from libra.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="copies"):
        r2e.r2e_like(2, 3, 4, copies=5)
    with pytest.raises(InvalidArgument, match="drift"):
        r2e.r2e_like(2, 3, 4, drift=11)


# -- the trainer's batch rule ---------------------------------------------------------------------
def batching_run(batching: str, trace: Trace, steps: int = 0) -> Simulator:
    config = SearchConfig(total_gpus=16, group_size=8)
    simulator = Simulator(MODEL, GPU, trace, control.static(MODEL, GPU, config), config,
                          SimConfig(batching=batching, steps=steps))
    simulator.run()
    return simulator


def test_first_complete_trains_whole_fresh_groups_each_once():
    trace = r2e.r2e_like(8, 4, 8, seed=2, drift=1.0)
    simulator = batching_run("first_complete", trace, steps=6)
    feeder = simulator.feeder
    assert len(simulator.records) == len(feeder.taken) == 6
    trained = [group for step in feeder.taken for group in step]
    assert len(trained) == len(set(trained))  # no group twice
    assert not set(trained) & set(feeder.rejected_groups)  # a rejected group is never trained
    for groups in feeder.taken:
        assert sum(feeder.groups.size[g] for g in groups) == trace.batch  # whole groups fill the batch
        assert all(len({s.prompt_id for s in feeder.groups.members[g]}) == 1 for g in groups)
    usage = simulator.usage
    assert sum(usage.staleness.values()) == 6 * trace.batch and max(usage.staleness) <= 1
    assert usage.rejected == sum(feeder.groups.size[g] for g in feeder.rejected_groups)


def test_first_complete_does_not_wait_for_the_longest_trajectory_of_a_batch():
    base = r2e.r2e_like(4, 4, 8, seed=2, drift=0.0)
    steps = list(base.steps)
    first = list(steps[0])
    first[0] = TrajectorySpec(first[0].trajectory_id, first[0].prompt_id, 0, 1_000, (TurnSpec(60_000),))
    trace = Trace((tuple(first),) + tuple(steps[1:]), "one very long trajectory in batch 0")
    in_order, first_complete = batching_run("in_order", trace), batching_run("first_complete", trace, steps=3)
    long_done = in_order.feeder.groups.finished_s[0]
    assert in_order.records[0].time_s > long_done  # in order: step 0 waited for it
    assert first_complete.records[0].time_s < long_done  # the trainer's rule: step 0 trained without it
    long_group = first_complete.feeder.groups.of[first[0].trajectory_id]
    assert long_group not in [g for step in first_complete.feeder.taken[:1] for g in step]
