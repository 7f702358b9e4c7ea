"""Benchmark: the Global Resource Planner against fixed layouts on the cluster simulator.

Same drifting long-tailed agentic trace (lengths grow by 1 + drift over the run), same GPU count,
Qwen2.5-7B on H200 nodes, asynchronous GRPO with staleness 1:

    (a) static   the search's best plan for step 0's batch, kept; C-MLFQ routing
    (b) tp2      a homogeneous TP-2 layout (both sides), load-balance routing   <- the baseline
    (c) online   GRP: start like (a), the Replanner re-plans after every step when the predicted
                 gain minus the transition cost pays; C-MLFQ routing
    (a') static with load-balance routing: separates the planner's share from the router's

Prints trajectories/s and output tokens/s with ratios against (b), writes
benchmarks/results/grp_eval.json and a throughput-over-steps plot per GPU count
(benchmarks/results/grp_<gpus>.png), then times one 4,096-GPU x 100-step simulation.

    .venv/bin/python benchmarks/grp_eval.py [--gpus 48 512] [--steps 100] [--seed 0] [--drift 2.0]
                                            [--prompts-per-gpu 4] [--timing-gpus 4096] [--skip-timing]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.sim import run as sim_run
from libra.services.planner.sim.cluster import SimConfig

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
RUNS = [("(a) static + cmlfq", "static", "cmlfq"), ("(b) tp2 + load_balance", "tp2", "load_balance"),
        ("(c) online GRP + cmlfq", "online", "cmlfq"), ("(a') static + load_balance", "static", "load_balance")]
BASELINE = "(b) tp2 + load_balance"
TIMING_TARGET_S = 60.0
# every planner searches the same way; beyond 64 TP multisets the search uses its two-degree grid,
# which keeps the online planner's per-step search at a fraction of a second
SEARCH = {"exact_multiset_limit": 64}


def evaluate(gpus: int, steps: int, seed: int, drift: float, max_units: int, prompts_per_gpu: int) -> dict:
    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    trace = sim_run.build_trace("synthetic", steps, gpus * prompts_per_gpu, 8, seed, drift, max_units)
    print(f"\n{gpus} GPUs: {model.name} on {gpu.name}, {steps} steps x {trace.batch} trajectories "
          f"(1 trace entry = {trace.steps[0][0].copies}), mean tokens {trace.mean_tokens(0):,.0f} at step 0 -> "
          f"{trace.mean_tokens(steps - 1):,.0f} at step {steps - 1}")
    results = {}
    for label, planner, policy in RUNS:
        results[label] = sim_run.simulate(model, gpu, gpus, trace, planner, policy, SimConfig(),
                                          search_options=SEARCH)
        r = results[label]
        print(f"  {label:28s} {r.trajectories_per_s:8.3f} traj/s {r.tokens_per_s:12,.0f} tok/s  "
              f"{len(r.plan_changes)} plan changes  (sim wall {r.wall_s:.1f}s)")
    base = results[BASELINE]
    print(f"\n  {'run':28s} {'traj/s':>9s} {'tok/s':>12s} {'vs (b)':>7s} {'changes':>7s} "
          f"{'step s first10':>14s} {'last10':>7s}  plan at start -> end")
    rows = []
    for label, r in results.items():
        ratio = r.trajectories_per_s / base.trajectories_per_s
        first = sum(s.interval_s for s in r.steps[:10]) / len(r.steps[:10])
        last = sum(s.interval_s for s in r.steps[-10:]) / len(r.steps[-10:])
        print(f"  {label:28s} {r.trajectories_per_s:9.3f} {r.tokens_per_s:12,.0f} {ratio:6.2f}x "
              f"{len(r.plan_changes):7d} {first:14.1f} {last:7.1f}  {r.first_plan}")
        if r.last_plan != r.first_plan:
            print(f"  {'':28s} {'':>9s} {'':>12s} {'':>7s} {'':>7s} {'':>14s} {'':>7s}  -> {r.last_plan}")
        rows.append(sim_run.to_json(r, {"label": label, "gpus": gpus, "vs_b": ratio}))
    for change in results["(c) online GRP + cmlfq"].plan_changes:
        print(f"  (c) change after step {change.step}: transition {change.transition_s:.0f}s; {change.reason}")
    RESULTS.mkdir(exist_ok=True)
    sim_run.plot(results, RESULTS / f"grp_{gpus}.png",
                 f"{model.name}, {gpus} x {gpu.name}, drifting agentic trace (drift {drift})")
    return {"gpus": gpus, "trace": trace.source, "batch": trace.batch, "runs": rows}


def timing(gpus: int, steps: int, seed: int, drift: float, max_units: int) -> dict:
    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    started = time.perf_counter()
    trace = sim_run.build_trace("synthetic", steps, gpus, 8, seed, drift, max_units)
    built = time.perf_counter() - started
    result = sim_run.simulate(model, gpu, gpus, trace, "static", "cmlfq", SimConfig(max_workers=128),
                              search_options=SEARCH)
    total = time.perf_counter() - started
    print(f"\ntiming: {gpus} GPUs x {steps} steps, batch {trace.batch} ({trace.steps[0][0].copies} per trace entry), "
          f"engines per simulated worker <= {result.pooled}, {result.routes:,} routes")
    print(f"  trace {built:.1f}s + simulation {result.wall_s:.1f}s wall ({result.cpu_s:.1f}s CPU) = {total:.1f}s; "
          f"target <= {TIMING_TARGET_S:.0f}s: {'met' if total <= TIMING_TARGET_S else 'NOT met'} "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"  {result.trajectories_per_s:.1f} trajectories/s simulated; plan {result.first_plan}")
    return {"gpus": gpus, "steps": steps, "trace_s": built, "sim_wall_s": result.wall_s, "sim_cpu_s": result.cpu_s,
            "total_s": total, "routes": result.routes, "pooled": result.pooled, "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[48, 512])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift", type=float, default=2.0)
    parser.add_argument("--prompts-per-gpu", type=int, default=4, help="GRPO groups of 8 per GPU per step")
    parser.add_argument("--max-units", type=int, default=1024)
    parser.add_argument("--timing-gpus", type=int, default=4096)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    report = {"command": "benchmarks/grp_eval.py", "args": vars(args),
              "evaluations": [evaluate(g, args.steps, args.seed, args.drift, args.max_units,
                                                      args.prompts_per_gpu) for g in args.gpus]}
    if not args.skip_timing:
        report["timing"] = timing(args.timing_gpus, 100, args.seed, args.drift, args.max_units)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grp_eval.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {RESULTS / 'grp_eval.json'}")


if __name__ == "__main__":
    main()
