"""Preflight: trace validation, candidates turned into plans, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from libra.errors import ConfigError, InvalidArgument
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.preflight import check_trace, load_trace, preflight

TRACE = [(512, 200), (800, 4000), (300, 900), (1000, 12000)] * 16


def test_preflight_returns_the_best_plan_first_with_buckets_by_tp():
    decision = preflight(model_named("qwen2.5-7b"), gpu_named("h100-80g"), TRACE, gpus=16, top_k=3)
    chosen = decision.chosen
    assert chosen.source == "search" and not decision.applied
    assert chosen.training.gpus + sum(b.tp * b.replicas for b in chosen.buckets) <= 16
    assert [b.tp for b in chosen.buckets] == sorted(b.tp for b in chosen.buckets)
    assert chosen.buckets[-1].max_tokens == max(o for _, o in TRACE)
    steps = [max(c.predicted_train_seconds, c.predicted_rollout_seconds) for c in decision.candidates]
    assert steps == sorted(steps) and len(decision.candidates) <= 3
    assert decision.candidates[0].plan == chosen


def test_bad_traces_and_budgets_are_named():
    with pytest.raises(InvalidArgument, match="entry 1"):
        check_trace([(10, 10), (10, -1)])
    with pytest.raises(InvalidArgument, match="empty"):
        check_trace([])
    with pytest.raises(InvalidArgument, match="gpus must be >= 2"):
        preflight(model_named("qwen2.5-3b"), gpu_named("a100-80g"), TRACE, gpus=1)


def test_trace_files(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("prompt_tokens,output_tokens\n10,20\n{\"prompt_tokens\": 5, \"output_tokens\": 7}\n")
    assert load_trace(good) == [(10, 20), (5, 7)]
    bad = tmp_path / "bad.csv"
    bad.write_text("10,x\n")
    with pytest.raises(ConfigError, match="bad.csv:1"):
        load_trace(bad)


def test_libra_plan_prints_the_choice_and_exits_2_on_bad_input(tmp_path):
    base = [sys.executable, "-m", "libra.cli", "plan", "--cluster", "configs/hardware/h200-141g.yaml",
            "--model", "configs/models/qwen3-4b.yaml", "--gpus", "16"]
    ok = subprocess.run(base + ["--trace", "configs/traces/agentic-longtail.csv"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("chosen: train"), ok.stdout + ok.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("5,0\n")
    failed = subprocess.run(base + ["--trace", str(bad)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "output_tokens=0" in failed.stderr


def test_a_recorded_run_trace_is_a_preflight_trace(tmp_path):
    import json

    from libra.services.planner.preflight import load_trace

    lines = [{"trajectory_id": "a", "prompt_id": "1", "prompt_tokens": 40, "outputs": [10, 20],
              "tools": [{"name": "calc", "status": "success", "payload_tokens": 5}], "status": "completed"},
             {"trajectory_id": "b", "prompt_id": "1", "prompt_tokens": 40, "outputs": [7], "tools": [],
              "status": "failed"}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_trace(path) == [(45, 30)]  # failed trajectories are left out


def _plan(*args: str, cluster: str = "h200-141g") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra.cli", "plan", "--cluster", f"configs/hardware/{cluster}.yaml",
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("gpus", ["8", "12"])
def test_libra_plan_plans_one_node_and_partial_nodes(gpus):
    """One 8-GPU node, and 12 GPUs (a node and a half): a plan, with why whole nodes are off."""
    ok = _plan("--model", "configs/models/qwen3-4b.yaml", "--trace", "configs/traces/agentic-drift-sample.jsonl",
               "--gpus", gpus, "--group-size", "4")
    assert ok.returncode == 0 and ok.stdout.startswith("chosen: train"), ok.stdout + ok.stderr
    assert "step 3's batch (the last of 4 steps in the file)" in ok.stdout  # the project's trajectory JSONL
    assert "whole nodes off (auto:" in ok.stdout


def test_libra_plan_flags_and_refusals_name_their_cause():
    base = ("--model", "configs/models/qwen3-4b.yaml", "--trace", "configs/traces/agentic-longtail.csv")
    ok = _plan(*base, "--gpus", "16", "--tp", "1,2", "--min-rollout-gpus", "12", "--group-size", "16")
    assert ok.returncode == 0, ok.stderr
    chosen = ok.stdout.splitlines()[0]
    assert "TP4" not in chosen and "TP8" not in chosen and chosen.startswith(("chosen: train tp1", "chosen: train tp2"))
    rollout_gpus = int(chosen.split(" = ")[1].split(" GPUs")[0])
    assert rollout_gpus >= 12, chosen
    whole = _plan(*base, "--gpus", "8", "--whole-nodes", "on")
    assert whole.returncode == 2 and "less than two nodes" in whole.stderr and "whole_nodes off" in whole.stderr
    groups = _plan(*base, "--gpus", "8", "--group-size", "7")
    assert groups.returncode == 2 and "not a whole number of GRPO groups of 7" in groups.stderr
    big = _plan("--model", "configs/models/qwen3-14b.yaml", "--trace", "configs/traces/agentic-longtail.csv",
                "--gpus", "2", cluster="a100-80g")
    assert big.returncode == 2 and "GiB per GPU (tp1 pp1 dp1 mb1) and a100-80g allows 73.6 GiB" in big.stderr
