"""Benchmark: the Global Resource Planner's online replanning against the best static split.

Same trace and GPU count for every row: Qwen2.5-7B on H200 nodes, asynchronous GRPO (staleness
1), C-MLFQ routing unless said, a synthetic long-tailed agentic trace whose lengths grow by
1 + drift over the run (`--drift 0`: a stationary trace, the no-thrashing check).

    (h) best static   the best fixed plan chosen with hindsight: the search's shortlist (distinct
                      splits) on the batches of five points of the run (first, quartiles, last),
                      plus the plans (a) and (c) used, each simulated over the WHOLE trace; the
                      fastest is (h). Every ratio is against (h).
    (a) static        the search's best plan for step 0's batch, kept
    (c) online        the Replanner: starts like (a), then ranks the search's shortlist by replaying
                      the recent steps through the simulator and moves when the simulated gain
                      beats the simulated move (with the elastic pool: a core of one trainer
                      replica, hybrids join and leave for a change of dp alone; only moves see it)
    (o) oracle bound  free, instant moves between the (h) candidates every `--segment` steps, each
                      segment timed inside that candidate's whole run: what any replanner choosing
                      among those plans could at most gain (transitions cost nothing here)
    (b) tp2 + LB      a homogeneous TP-2 layout with load-balance routing (the older baseline)

Prints the table (every run against (h) and against (a)), every plan change (c) made with its
reason, and what its decisions were (how many replays judged a move, and why the others were not
applied); writes benchmarks/results/grp_eval.json (every step of every run, every decision of (c))
and a throughput-over-steps plot per GPU count (benchmarks/results/grp_<gpus>.png; with
--stationary also grp_<gpus>_stationary.png), then times one 4,096-GPU x 100-step static
simulation.

    .venv/bin/python benchmarks/grp_eval.py [--gpus 48 512] [--steps 100] [--seed 0] [--drift 2.0]
                                            [--prompts-per-gpu 4] [--segment 10] [--timing-gpus 4096]
                                            [--skip-timing] [--stationary]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from libra.services.planner.config import ReplanSettings
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.services.planner.sim import control, run as sim_run
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.result import SimResult

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TIMING_TARGET_S = 60.0
# every planner searches the same way; beyond 64 TP multisets the search uses its two-degree grid,
# which keeps the online planner's per-decision search at a fraction of a second
SEARCH = {"exact_multiset_limit": 64}
SHORTLIST = 5  # distinct splits per point of the run that (h) simulates over the whole trace


def hindsight_candidates(model, gpu, gpus: int, trace, extra: list[Candidate]) -> list[Candidate]:
    """The search's distinct-split shortlist at five points of the run, and the plans given."""
    config = SearchConfig(total_gpus=gpus, group_size=8, top_k=SHORTLIST, distinct_splits=True, fleets_per_split=2,
                          **SEARCH)
    last = len(trace.steps) - 1
    found: dict = {}
    for step in sorted({0, last // 4, last // 2, 3 * last // 4, last}):
        for candidate in search(model, gpu, trace.pairs(step), config).alternatives:
            found.setdefault((candidate.layout, candidate.rollout), candidate)
    for candidate in extra:
        found.setdefault((candidate.layout, candidate.rollout), candidate)
    return list(found.values())


def segment_oracle(runs: list[SimResult], segment: int) -> tuple[float, list[int]]:
    """Seconds of the run with the fastest plan per segment (timed inside each plan's whole run)."""
    steps = len(runs[0].steps)
    total, choice = 0.0, []
    for start in range(0, steps, segment):
        end = min(steps, start + segment) - 1

        def span(result: SimResult) -> float:
            return result.steps[end].time_s - (result.steps[start - 1].time_s if start else 0.0)
        best = min(range(len(runs)), key=lambda i: span(runs[i]))
        total += span(runs[best])
        choice.append(best)
    return total, choice


def evaluate(gpus: int, steps: int, seed: int, drift: float, max_units: int, prompts_per_gpu: int,
             segment: int) -> dict:
    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    trace = sim_run.build_trace("synthetic", steps, gpus * prompts_per_gpu, 8, seed, drift, max_units)
    print(f"\n{gpus} GPUs: {model.name} on {gpu.name}, {steps} steps x {trace.batch} trajectories "
          f"(1 trace entry = {trace.steps[0][0].copies}), drift {drift}: mean tokens {trace.mean_tokens(0):,.0f} "
          f"at step 0 -> {trace.mean_tokens(steps - 1):,.0f} at step {steps - 1}", flush=True)
    started = time.process_time()
    config = SearchConfig(total_gpus=gpus, group_size=8, **SEARCH)
    # what `libra sim --config` runs for an online run config: the elastic pool's core of one replica
    # (elastic.core_replicas' default), so that a change of the training dp alone joins or releases
    # hybrids while the core steps on, in the run and in the replanner's replays of moves
    elastic = SimConfig(core_replicas=1)
    static = control.static(model, gpu, config, ReplanSettings(), elastic)  # the planner's first plan, kept
    runs = {"(a) static, step-0 plan": Simulator(model, gpu, trace, static, config).run()}
    replanner = control.Online(model, gpu, config, ReplanSettings(), elastic)
    online_started = time.process_time()
    online = Simulator(model, gpu, trace, replanner, config, elastic).run()
    online_cpu = time.process_time() - online_started
    print(f"  (c) online: {online.trajectories_per_s:.3f} traj/s, {len(online.plan_changes)} plan changes, "
          f"{replanner.replanner.ranker.plays} window replays in {online_cpu:.0f}s CPU", flush=True)
    used = [static.first.chosen] + [change.candidate for change in replanner.changes]
    candidates = hindsight_candidates(model, gpu, gpus, trace, used)
    fixed = []
    for candidate in candidates:
        try:
            fixed.append(sim_run.run_plan(model, gpu, trace, candidate, config))
        except Exception as error:  # noqa: BLE001 - a candidate that cannot run the late steps is not a static option
            print(f"  (h) candidate cannot run the whole trace: {candidate.describe()}: {error}")
    best = max(fixed, key=lambda r: r.trajectories_per_s)
    print(f"  (h) {len(fixed)} static candidates simulated over the whole trace; best {best.trajectories_per_s:.3f} "
          f"traj/s (CPU {time.process_time() - started:.0f}s so far)", flush=True)
    oracle_s, choice = segment_oracle(fixed, segment)
    runs = {f"(h) best static of {len(fixed)}": best, **runs, "(c) online GRP": online,
            "(b) tp2 + load_balance": sim_run.simulate(model, gpu, gpus, trace, "tp2", "load_balance", SimConfig(),
                                                       search_options=SEARCH)}
    base, step0 = best.trajectories_per_s, runs["(a) static, step-0 plan"].trajectories_per_s
    oracle_rate = best.trajectories / oracle_s
    print(f"\n  {'run':28s} {'traj/s':>9s} {'vs (h)':>7s} {'vs (a)':>7s} {'changes':>7s} {'step s first10':>14s} "
          f"{'last10':>7s}")
    rows = []
    for label, r in runs.items():
        first = sum(s.interval_s for s in r.steps[:10]) / len(r.steps[:10])
        last = sum(s.interval_s for s in r.steps[-10:]) / len(r.steps[-10:])
        print(f"  {label:28s} {r.trajectories_per_s:9.3f} {r.trajectories_per_s / base:6.3f}x "
              f"{r.trajectories_per_s / step0:6.3f}x {len(r.plan_changes):7d} {first:14.1f} {last:7.1f}")
        rows.append(sim_run.to_json(r, {"label": label, "gpus": gpus, "vs_h": r.trajectories_per_s / base,
                                        "vs_a": r.trajectories_per_s / step0}))
    print(f"  {'(o) oracle bound':28s} {oracle_rate:9.3f} {oracle_rate / base:6.3f}x {oracle_rate / step0:6.3f}x   "
          f"(moves free every {segment} steps; plans by segment: {' '.join(str(i) for i in choice)})")
    print("\n  plans:")
    for index, r in enumerate(fixed):
        mark = "(h)" if r is best else "   "
        print(f"   {mark} #{index}: {r.trajectories_per_s:7.3f} traj/s  {r.first_plan}")
    print(f"  (c) starts: {online.first_plan}")
    for change in online.plan_changes:
        print(f"  (c) after step {change.step}, transition {change.transition_s:.0f}s -> {change.after}\n"
              f"        why: {change.reason}")
    outcomes = decision_outcomes(replanner.decisions)
    print(f"  (c) decisions: {', '.join(f'{n} {what}' for what, n in outcomes.items())}")
    RESULTS.mkdir(exist_ok=True)
    name = f"grp_{gpus}{'_stationary' if drift == 0 else ''}.png"
    sim_run.plot({k: v for k, v in runs.items() if not k.startswith("(b)")}, RESULTS / name,
                 f"{model.name}, {gpus} x {gpu.name}, agentic trace (drift {drift})")
    return {"gpus": gpus, "drift": drift, "trace": trace.source, "batch": trace.batch, "runs": rows,
            "static_candidates": [{"plan": r.first_plan, "trajectories_per_s": r.trajectories_per_s} for r in fixed],
            "oracle": {"segment": segment, "trajectories_per_s": oracle_rate, "vs_h": oracle_rate / base,
                       "vs_a": oracle_rate / step0, "choice": choice},
            "online": {"decisions": [{"step": st, "applied": applied, "reason": reason}
                                     for st, applied, reason in replanner.decisions],
                       "outcomes": outcomes, "replays": replanner.replanner.ranker.plays, "cpu_s": online_cpu},
            "cpu_s": time.process_time() - started}


def decision_outcomes(decisions: list[tuple[int, bool, str]]) -> dict[str, int]:
    """The online controller's recorded decisions by outcome (the first words of the reason)."""
    kinds = (("applied", "applied"), ("waiting for a second call", "not applied yet"),
             ("gain below min_gain_ratio", "not applied: net gain below"),
             ("gain does not pay for the move", "not applied: gain does not pay"),
             ("no other plan to simulate", "not applied: the search found no other plan"),
             ("not evaluated (gates, too few steps)", "not evaluated"))
    out = {what: 0 for what, _ in kinds}
    out["other"] = 0
    for _, applied, reason in decisions:
        what = next((w for w, prefix in kinds if reason.startswith(prefix)), "other")
        out["applied" if applied else what] += 1
    return {what: n for what, n in out.items() if n}


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
    parser.add_argument("--stationary", action="store_true", help="also run every GPU count with drift 0")
    parser.add_argument("--prompts-per-gpu", type=int, default=4, help="GRPO groups of 8 per GPU per step")
    parser.add_argument("--segment", type=int, default=10, help="steps between the oracle's free moves")
    parser.add_argument("--max-units", type=int, default=1024)
    parser.add_argument("--timing-gpus", type=int, default=4096)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "grp_eval.json"))
    args = parser.parse_args()
    drifts = [args.drift] + ([0.0] if args.stationary else [])
    report = {"command": "benchmarks/grp_eval.py", "args": vars(args), "evaluations": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for drift in drifts:
        for gpus in args.gpus:  # written after each, so a long run stopped midway keeps what it measured
            report["evaluations"].append(evaluate(gpus, args.steps, args.seed, drift, args.max_units,
                                                  args.prompts_per_gpu, args.segment))
            out.write_text(json.dumps(report, indent=1))
    if not args.skip_timing:
        report["timing"] = timing(args.timing_gpus, 100, args.seed, args.drift, args.max_units)
        out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
