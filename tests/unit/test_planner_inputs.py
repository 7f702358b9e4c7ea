"""Bad inputs to `libra plan` and `libra sim` get a clear error (exit 2, the cause named, no
traceback); every trace file the project ships or records is one `libra plan` reads."""

from __future__ import annotations

import glob
import math
import subprocess
import sys

import pytest

from libra.errors import ConfigError, InvalidArgument
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.preflight import load_batch, load_batch_specs
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim import run as sim_run
from libra.traces import synthetic

HW, MODEL = "configs/hardware/h200-141g.yaml", "configs/models/qwen3-4b.yaml"
SHIPPED = sorted(glob.glob("configs/traces/*.jsonl") + glob.glob("configs/traces/*.csv")
                 + glob.glob("benchmarks/results/*-trace.jsonl"))


def libra(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra.cli", *args, "--cluster", HW, "--model", MODEL],
                          capture_output=True, text=True, timeout=120)


def refused(done: subprocess.CompletedProcess, *words: str) -> bool:
    return done.returncode == 2 and "Traceback" not in done.stderr and all(w in done.stderr for w in words)


def test_an_empty_trace_and_negative_lengths_are_refused_by_plan_and_sim(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("# nothing recorded\n\n")
    negative = tmp_path / "negative.jsonl"
    negative.write_text('{"step": 0, "prompt_tokens": 10, "turns": [{"output_tokens": -3}]}\n')
    for trace, words in ((empty, ("empty.csv has no entries",)), (negative, ("negative.jsonl:1", "output_tokens=-3"))):
        plan = libra("plan", "--trace", str(trace), "--gpus", "8")
        assert refused(plan, *words), plan.stderr
        sim = libra("sim", "--trace", str(trace), "--gpus", "8", "--steps", "2")
        assert refused(sim, *words), sim.stderr


def test_a_plan_without_rollout_engines_is_refused_naming_the_fleet():
    trace = synthetic.drifting(2, 4, 4, seed=1, drift=0.0)
    config = SearchConfig(total_gpus=8, group_size=4)
    for fleet in ((), ((1, 0),)):
        plan = Candidate(Layout(1, 1, 1, 1), fleet, math.nan, math.nan)
        with pytest.raises(InvalidArgument, match=r"has no rollout engine \(rollout fleet \[.*no bucket with a replica"):
            sim_run.run_plan(model_named("qwen3-4b"), gpu_named("h200-141g"), trace, plan, config)


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_or_recorded_trace_gives_a_batch(path):
    pairs, note = load_batch(path, 0 if "-trace.jsonl" not in path else 64, 8)
    assert pairs and all(p >= 1 and o >= 1 for p, o in pairs) and note.startswith(path)


def test_a_recording_that_is_not_whole_groups_names_the_batch_flag():
    recorded = "benchmarks/results/quickstart-trace.jsonl"
    total = len(load_batch(recorded)[0])
    assert total % 8, "the recording must leave a partial group for this test"
    with pytest.raises(ConfigError, match=f"{total} sequences, not a whole number of GRPO groups of 8.*--batch N"):
        load_batch(recorded, 0, 8)
    done = libra("plan", "--trace", recorded, "--gpus", "12", "--batch", "256")
    assert done.returncode == 0 and done.stdout.startswith("chosen: train"), done.stderr
    assert "256 of its" in done.stdout and "drawn with seed 0" in done.stdout


def test_plan_simulate_ranks_the_shortlist_on_the_simulator_and_keeps_the_batchs_turns():
    """`libra plan --simulate`: the chosen plan is the fastest replayed (#1), the closed form's best
    is among those ranked, the buckets are the chosen plan's; the trajectory trace's turns reach the
    replay (load_batch_specs keeps them, a draw with --batch too)."""
    path = "configs/traces/agentic-drift-sample.jsonl"
    specs, _ = load_batch_specs(path, 0, 8)
    assert any(len(s.turns) > 1 for s in specs) and sum(s.copies for s in specs) == len(load_batch(path, 0, 8)[0])
    drawn, _ = load_batch_specs(path, 16, 8)
    assert len(drawn) == 16 and [(s.prompt_tokens + s.payload_tokens, s.output_tokens) for s in drawn] == \
        load_batch(path, 16, 8)[0]
    done = libra("plan", "--trace", path, "--gpus", "16", "--simulate")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    chosen = lines[0].removeprefix("chosen: ")
    ranked = [line for line in lines if line.startswith("  #")]
    assert ranked[0].endswith(chosen) or ranked[0].endswith(chosen + "  (the closed form's best)"), done.stdout
    assert sum("(the closed form's best)" in line for line in ranked) == 1
    seconds = [float(line.split()[1].removesuffix("s")) for line in ranked]
    assert seconds == sorted(seconds) and "cmlfq routing" in done.stdout
    assert lines[-1].startswith("rollout buckets: tp")
    alone = libra("plan", "--trace", path, "--gpus", "16", "--simulate", "--sim-workers", "1")
    assert "in 1 process;" in alone.stdout and [line for line in alone.stdout.splitlines() if line.startswith("  #")] \
        == ranked  # the default replays side by side (one process per core): the same ranking
    progress = alone.stderr.splitlines()  # the choice as it goes, apart from the answer on stdout
    assert progress[0].startswith("first plan: the closed-form search")
    assert progress[-1].startswith(f"first plan: {chosen}")
    assert sum(line.startswith("  replay ") for line in progress) == len(ranked)
    bad = libra("plan", "--trace", path, "--gpus", "16", "--simulate", "--staleness", "99")
    assert refused(bad, "--staleness must be in 0..64")
    early = libra("plan", "--trace", "/nonexistent.jsonl", "--gpus", "16", "--simulate", "--staleness", "99")
    assert refused(early, "--staleness must be in 0..64")  # checked before the trace is read or searched
    many = libra("plan", "--trace", "/nonexistent.jsonl", "--gpus", "16", "--simulate", "--sim-workers", "-1")
    assert refused(many, "--sim-workers must be in 0..256")
