"""The cluster simulator against real runs: replay benchmarks/headline_cpu.py's runs and compare.

    .venv/bin/python benchmarks/sim_vs_real.py --keep-runs DIR [--plot benchmarks/results/sim_vs_real.png]
        [--json FILE]

DIR is what `headline_cpu.py --keep-runs DIR` left: runs.json and, per run, its record (telemetry,
trace.jsonl, the resolved config.yaml) and history.jsonl, the Redis streams history:turn and
history:step the online planner reads. No run is started here.

Per run, with nothing taken from the run but what the planner could know:

1. Calibrate: every turn record of the history goes to the planner's own `Calibration.observe_turn`
   (the turn fit: prefill and decode efficiency, the per-pass and per-row overheads, the time
   outside the engine, at the engine's own batch where the record has it, `engine_batch`; the
   draws' correlations within a moment: moments.MomentWindows), every step record to `observe_train`
   (training MFU), as the online
   planner feeds them (services/planner/core.py), with the run's calibration settings (the fit
   remembers the last `turn_window` turns, the training MFU is an EWMA; `--calibration mean`:
   every turn and step of the run alike instead). The cost model needs a model and a
   device: the run's tiny model (model.* of its config, fp32) and one CPU core as a nominal
   "device" (CPU_CORE below); the calibration corrects the nominal speeds, so their values only
   set where it starts. A weight sync costs the run's median publish time (time/publish_s).
2. Replay: the run's own trajectories (RUN_DIR/trace.jsonl, regrouped by GRPO group in release
   order) through `cluster.Simulator` with the run's plan (the trainer and the rollout workers it
   had; for an online run, each plan the planner applied, from the step it was applied), staleness,
   routing policy, per-worker cap and turn budget; the synchronous design (max_staleness 0) is
   played as the simulator plays it (colocated: rollout, then training, then the reload). With
   `--draw-seeds N` each run is replayed N times with other draws (SimConfig.draw_seed) and each
   figure is their mean.
3. Compare, predicted (simulated) against measured: mean step time (steps 2..N: the first
   includes the workers' start), turn latency p50 / p90 (measured: the rollout gateway's turn
   seconds, route to reply; simulated: a turn's arrival at its engine to its last token, plus the
   calibrated time outside the engine), busy fraction per pool over the same steady state as the
   step time, from the end of step 0 to the end of the last step (`--whole-rl-phase`: from the
   first step's start, the start-up in step 0 included, which the simulator does not play and the
   calibration leaves out) (training: training seconds / span, the trainer's overhead outside its
   timers not counted on either side; rollout: per worker, the fraction of the span it had a
   request in flight, as the gateway counts one (sent to reply received; measured from the
   rollout service's samples of its in-flight requests; simulated: each turn's arrival at its
   engine to its reply's return, the calibrated time outside the engine included), averaged over
   the workers; the simulated engines' own busy time is in the JSON lines, `sim_engine_busy`).

Prints one JSON line per run (both sides of every figure, the turn fit's terms and the EWMAs,
turns per bucket measured and simulated, training seconds measured and simulated, and turn
seconds per generated token by the worker's batch beside the calibrated cost model's decode step,
the mean batch a turn ran in, simulated (the sequences decoding) and measured (the requests in flight
on its worker; the engine's own), the median turn as the calibrated turn
model predicts each measured turn at its measured batch: the model without the simulator's dynamics,
whether the turns reached their engines in waves, `answer_waves`, and how often each worker went
idle, `busy_periods`),
a table per design (median over its runs: predicted, measured, their ratio, within 10% or not),
and a plot of predicted / measured per figure and design against the 10% band. What the misses point to is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
from collections import Counter
from typing import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))

from headline_cpu import DESIGNS  # noqa: E402
from kept_runs import Loaded, load, measured, percentile, rl_phase, trainer_overheads  # noqa: E402
from sim_probes import (CPU_CORE, TimedEngines, answer_waves, busy_periods, fitted_turns,  # noqa: E402
                        in_flight_share, per_token, period_summary, shared_deviation, trajectory_time)
from libra.routing.registry import make_policy  # noqa: E402
from libra.services.planner import cost_rollout  # noqa: E402
from libra.services.planner.calibration import Calibration  # noqa: E402
from libra.services.planner.cost_rollout import RolloutEfficiency  # noqa: E402
from libra.services.planner.cost_train import Layout, TrainEfficiency  # noqa: E402
from libra.services.planner.gaps import GapSampler  # noqa: E402
from libra.services.planner.hardware import ModelSpec  # noqa: E402
from libra.services.planner.search import Candidate, SearchConfig  # noqa: E402
from libra.services.planner.sim import control  # noqa: E402
from libra.services.planner.sim.cluster import SimConfig, Simulator  # noqa: E402
from libra.services.planner.sim.engines import CostModelEngines  # noqa: E402
from libra.traces import files  # noqa: E402

FIGURES = ("step_s", "turn_p50_s", "turn_p90_s", "busy_train", "busy_rollout")
LABELS = {"step_s": "step time (s)", "turn_p50_s": "turn latency p50 (s)", "turn_p90_s": "turn latency p90 (s)",
          "busy_train": "busy fraction, training", "busy_rollout": "busy fraction, rollout workers"}
PLAN = re.compile(r"train (\d+) GPU tp(\d+) pp(\d+) dp(\d+) \| (.*)$")
BUCKET = re.compile(r"tp(\d+)x(\d+)")


def tiny_model(config) -> ModelSpec:
    m = config.model
    return ModelSpec(name="tiny", source="the run's model.* section (fp32)", hidden_size=m.hidden_size,
                     layers=m.layers, heads=m.heads, kv_heads=m.kv_heads, head_dim=m.hidden_size // m.heads,
                     intermediate_size=m.intermediate_size, vocab_size=m.vocab_size, bytes_per_param=4.0,
                     kv_bytes_per_value=4.0)


# ---- calibrate and replay -----------------------------------------------------------------------
def calibrate(run: Loaded, model: ModelSpec, layout: Layout, how: str = "ewma",
              moment_s: float | None = None, engine_batch: bool = True) -> Calibration:
    """The planner's calibration fed the run's history, record by record, as core.py feeds it.
    how: "ewma": the run config's settings (the online planner's: an EWMA that follows the last few
    samples); "mean": each estimator a plain mean of every sample of the run (alpha 1/n, with
    min_samples above any run's count). The turns recorded before the first training step are left
    out: they run once a run, while the engines and the gateway start (their first turns waited
    0.4-0.5 s to be routed on the GPU machine's CPUs, and the engines' first passes are slow), and the
    step time compared leaves the first step out too (`replay`); in a whole-run mean they would be
    charged to every step (a synchronous step waits for its slowest trajectory). So is the first
    step's training: the trainer's first pass (1.4-1.5 s on the GPU machine's 16 cores against
    0.08 s for the next ones; on 2 cores like the others)."""
    settings = run.config.planner.replan.calibration
    if how == "mean":
        settings = settings.model_copy(update={"alpha": 1e-9, "min_samples": 10_000, "turn_window": 1e9})
    if moment_s is not None:
        settings = settings.model_copy(update={"moment_window_s": moment_s})
    cal = Calibration(model, CPU_CORE, RolloutEfficiency(), TrainEfficiency(), settings)
    first_step = min((s["timestamp"] for s in run.steps), default=float("inf"))
    for turn in run.turns:
        if turn["timestamp"] < first_step:
            continue  # the start-up's (below)
        cal.observe_turn(max(1, turn["tp"]), turn["prompt_tokens"], turn["output_tokens"], turn["seconds"],
                         (turn.get("engine_batch", 0.0) if engine_batch else 0.0) or turn["batch"],
                         turn.get("gap_seconds", 0.0), turn["turn_number"],
                         worker=turn.get("worker_id", ""), end_s=turn["timestamp"],
                         trajectory=turn.get("trajectory_id", ""))
    overheads = trainer_overheads(run)
    for step in sorted(run.steps, key=lambda s: s["timestamp"])[1:]:  # the first is the start-up's (below)
        lengths = list(zip(step["prompt_lengths"], step["output_lengths"]))
        if lengths and step["train_seconds"] > 0:
            overhead = step.get("overhead_seconds") or overheads.get(int(step["step"]), 0.0)
            cal.observe_train(layout, lengths, step["train_seconds"], overhead)
    return cal


def plans(run: Loaded, first: Candidate) -> dict[int, control.PlanChange]:
    """The plans an online run's planner applied after its first, by the step they came in at."""
    changes = {}
    for decision in run.record.decisions:
        match = PLAN.search(decision.get("plan", "")) if decision.get("applied") else None
        if not match or decision.get("trigger") == "config":
            continue
        gpus, tp, pp, dp, fleet = match.groups()
        rollout = tuple(sorted((int(a), int(b)) for a, b in BUCKET.findall(fleet)))
        layout = Layout(int(tp), int(pp), int(dp), first.layout.micro_batch)
        version = run.record.trainer_version_at(decision["t"]) or 1  # policy version v: steps 0..v-2 done
        step = max(0, version - 2)
        changes[step] = control.PlanChange(Candidate(layout, rollout, 0.0, 0.0), 0.0, decision.get("reason", ""))
    return changes


class RunBuckets(Simulator):
    """The simulator routing onto the run's own buckets (planner.buckets: names, limits, replicas),
    where it would derive one bucket per TP degree from the plan (preflight.to_plan); used while
    the run's plan stays the config's."""

    run_buckets: list[tuple[str, int]] = []

    def _new_policy(self, candidate, lengths) -> None:
        self.rollout.policy = make_policy(self.routing, self.run_buckets)


def replay(run: Loaded, how: str = "ewma", turn_gap: bool = True, moments: bool = True,
           seeds: Sequence[int] = (0,), moment_s: float | None = None,
           engine_batch: bool = True, steady: bool = True) -> tuple[dict[str, float], dict]:
    """The run replayed in the calibrated simulator: predicted figures and how it was calibrated
    (`turn_gap=False`: the gap between turns left out, to show what that term changes;
    `moments=False`: every turn's draws its own, the calibrated correlations left out). With several
    draw `seeds` each figure is the mean of the replays, and the notes give its least and greatest
    (`seed_range`); the other notes are the first seed's. `moment_s`: the calibration's
    moment_window_s instead of the run config's. `engine_batch=False`: the turn fit takes each
    turn's requests in flight on its worker as its batch, as before the engine reported its own.
    `steady=False`: the busy fractions over the whole replay, step 0 included (`measured`'s the same)."""
    config, trainer = run.config, run.config.trainer
    model = tiny_model(config)
    steps = len(run.record.steps)
    batch = trainer.groups_per_step * trainer.group_size
    workers = sum(b.replicas for b in config.planner.buckets)
    layout = Layout(1, 1, 1, trainer.micro_batch_size)
    cal = calibrate(run, model, layout, how, moment_s, engine_batch)
    rollout = cal.rollout_efficiency()
    if not turn_gap:
        rollout = rollout.model_copy(update={"turn_gap_s": 0.0, "first_gap_quantiles": (), "turn_gap_quantiles": ()})
    if not moments:
        rollout = rollout.model_copy(update={"first_gap_correlation": 0.0, "gap_correlation": 0.0,
                                             "reply_correlation": 0.0})
    train_overhead = cal.train_efficiency().step_overhead_s  # in the simulated step; not in a busy fraction
    search = SearchConfig(total_gpus=1 + workers, group_size=trainer.group_size, tp_choices=(1,),
                          rollout=rollout, train=cal.train_efficiency())
    first = Candidate(layout, ((1, workers),), 0.0, 0.0)
    changes = plans(run, first) if config.planner.mode == "online" else {}
    publish = statistics.median(s["scalars"].get("time/publish_s", 0.0) for s in run.record.steps)
    specs = sorted(files.read(run.trace), key=_group_order)
    trace = files.batches(specs, steps + steps // 10 + 2, batch, str(run.trace))  # (read once: every seed plays it)
    plays = [_play(run, model, search, first, changes, publish, train_overhead, steps, trace, seed, steady)
             for seed in list(seeds) or [0]]
    predicted = {f: statistics.fmean(p[0][f] for p in plays) for f in FIGURES}
    _, simulator, result, engines = plays[0]
    records = result.steps
    span = records[-1].time_s
    snap = cal.snapshot()
    fitted = fitted_turns(run, cal, model, engine_batch)
    notes = {"slowdowns": {k: v["slowdown"] for k, v in snap["estimators"].items()},
             "turn_fit": {k: v for k, v in snap["turn_fit"].items()},
             "turn_gap_s": snap["efficiency"]["turn_gap_s"]["calibrated"],
             "quantiles": {"first_gap": [round(g, 4) for g in rollout.first_gap_quantiles],
                           "later_gap": [round(g, 4) for g in rollout.turn_gap_quantiles],
                           "request_factor": [round(f, 3) for f in rollout.request_quantiles]},
             "rejected": snap["rejected"], "plan_changes": len(result.plan_changes),
             "sim_usage": {k: round(v, 3) for k, v in simulator.usage.fractions().items()},
             "sim_engine_busy": round(statistics.fmean(min(1.0, e.busy_s / span) for e in engines.engines), 3),
             "sim_train_s": statistics.fmean(r.train_s for r in records) - train_overhead,
             "real_train_s": statistics.fmean(s["scalars"]["time/train_s"] for s in run.record.steps),
             "sync_s": publish,
             "trainer_wait_s": [round(statistics.fmean(r.wait_s for r in records[1:]), 4),
                                round(statistics.fmean(s["scalars"].get("time/wait_s", 0.0)
                                                       for s in run.record.steps[1:]), 4)],
             "turns_per_bucket": {"measured": dict(Counter(t["bucket"] for t in run.turns)),
                                  "simulated": dict(Counter(e.bucket for e in engines.engines
                                                            for _ in range(e.routed)))},
             "s_per_token_by_batch": per_token(run.turns, cost_rollout.instance(model, CPU_CORE, 1, rollout)),
             "turn_batch_mean": [round(statistics.fmean(engines.batches), 1),
                                 round(statistics.fmean(t["batch"] for t in run.turns), 1),
                                 round(statistics.fmean(t.get("engine_batch", 0.0) for t in run.turns), 1)],
             "turn_p50_fitted_s": round(percentile(fitted, 50), 4),
             "turn_deviation_correlation": shared_deviation(run, fitted),
             "answer_waves": answer_waves(run),
             "busy_periods": measured_periods(run, len(records), engines, span),
             "trajectory_time": trajectory_time(run, specs, engines.by_trajectory, GapSampler.of(rollout)),
             "moments": {"window_s": rollout.moment_s, "first_gap": rollout.first_gap_correlation,
                         "later_gap": rollout.gap_correlation, "reply": rollout.reply_correlation}}
    if len(plays) > 1:
        notes["seed_range"] = {f: [round(min(p[0][f] for p in plays), 4), round(max(p[0][f] for p in plays), 4)]
                               for f in FIGURES}
    return predicted, notes


def _play(run: Loaded, model: ModelSpec, search: SearchConfig, first: Candidate, changes: dict, publish: float,
          train_overhead: float, steps: int, trace, seed: int, steady: bool = True) -> tuple:
    """One replay of the run's `trace` with the draws of `seed`: (figures, simulator, result, engines);
    the busy fractions over the steady state, from the end of step 0, as `measured` takes them
    (`steady=False`: from the start)."""
    config, trainer = run.config, run.config.trainer
    colocated = trainer.max_staleness == 0
    sim = SimConfig(draw_seed=seed, staleness=trainer.max_staleness, policy=config.scheduler.policy.type,
                    per_worker_cap_tokens=config.scheduler.per_worker_cap_tokens,
                    turn_budget_tokens=config.rollout.max_new_tokens, sync_gbps=100_000.0, sync_latency_s=publish,
                    colocated=colocated, host_gbps=10_000.0, batching="in_order" if colocated else "first_complete",
                    core_replicas=config.elastic.core_replicas if changes else 0, steps=steps,
                    max_in_flight=config.rollout.max_concurrent_trajectories)
    own = [b for b in config.planner.buckets for _ in range(b.replicas)]
    engines = TimedEngines(CostModelEngines(model, CPU_CORE, (1,), search.rollout),
                           None if changes else [b.name for b in own])
    kind = Simulator if changes else type("Run", (RunBuckets,), {"run_buckets": [
        (b.name, b.max_tokens) for b in config.planner.buckets]})
    simulator = kind(model, CPU_CORE, trace, control.Scripted(first, changes), search, sim, engines)
    result = simulator.run()
    records = result.steps
    span = records[-1].time_s
    start = records[0].time_s if steady and len(records) > 1 else 0.0
    trained = records[1:] if steady and len(records) > 1 else records
    lat = engines.latencies
    predicted = {"step_s": statistics.fmean(r.interval_s for r in records[1:]),
                 "turn_p50_s": percentile(lat, 50), "turn_p90_s": percentile(lat, 90),
                 "busy_train": sum(r.train_s - train_overhead for r in trained) / (span - start),
                 "busy_rollout": statistics.fmean(in_flight_share(e.held, span, start) for e in engines.engines)}
    return predicted, simulator, result, engines


def measured_periods(run: Loaded, steps: int, engines: TimedEngines, span: float) -> dict[str, list[list[float]]]:
    """Per worker, [busy periods per step, their median ms]: the simulated engines' over the replay,
    the run's workers' from its turn records (route answer to reply) over its RL phase."""
    start, end = rl_phase(run)
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for t in run.turns:
        by_worker.setdefault(t.get("worker_id", ""), []).append((t["timestamp"] - t["seconds"], t["timestamp"]))
    return {"simulated": [period_summary(busy_periods(e.held, 0.0, span), steps) for e in engines.engines],
            "measured": [period_summary(busy_periods(held, start, end), len(run.record.steps))
                         for _, held in sorted(by_worker.items())]}


def _group_order(spec) -> tuple:
    """Trajectory ids are g{group}-s{sample}: the order groups were released in."""
    match = re.match(r"g(\d+)-s(\d+)", spec.trajectory_id)
    return (int(match.group(1)), int(match.group(2))) if match else (1 << 30, spec.trajectory_id)


# ---- report -------------------------------------------------------------------------------------
def table(rows: dict[str, dict[str, tuple[float, float]]]) -> str:
    lines = [f"{'design':<18} {'figure':<32} {'predicted':>10} {'measured':>10} {'pred/meas':>9}  within 10%"]
    for design, figures in rows.items():
        for figure in FIGURES:
            p, m = figures[figure]
            ratio = p / m if m else float("nan")
            lines.append(f"{design:<18} {LABELS[figure]:<32} {p:>10.3f} {m:>10.3f} {ratio:>9.2f}  "
                         f"{'yes' if abs(ratio - 1) <= 0.10 else 'NO'}")
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, tuple[float, float]]], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8.5, 4.2))
    width = 0.8 / max(1, len(rows))
    for index, (design, figures) in enumerate(rows.items()):
        ratios = [figures[f][0] / figures[f][1] if figures[f][1] else float("nan") for f in FIGURES]
        xs = [i + (index - (len(rows) - 1) / 2) * width for i in range(len(FIGURES))]
        bars = axis.bar(xs, ratios, width, label=design)
        for x, r in zip(xs, ratios):
            axis.text(x, r, f"{r:.2f}", ha="center", va="bottom", fontsize=7, color=bars[0].get_facecolor())
    axis.axhspan(0.9, 1.1, color="tab:green", alpha=0.15, label="within 10%")
    axis.axhline(1.0, color="0.3", lw=1)
    axis.set_xticks(range(len(FIGURES)), [LABELS[f] for f in FIGURES], fontsize=8, rotation=12)
    axis.set_ylabel("simulated / measured")
    axis.set_title("Calibrated simulator replaying real `libra up` runs (median over runs; 1.0 = exact)", fontsize=10)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Replay headline_cpu.py's runs in the calibrated simulator.")
    parser.add_argument("--keep-runs", required=True, help="the directory headline_cpu.py --keep-runs wrote")
    parser.add_argument("--plot", default=str(ROOT / "benchmarks/results/sim_vs_real.png"))
    parser.add_argument("--json", default="", help="every run's figures, predicted and measured")
    parser.add_argument("--calibration", choices=("ewma", "mean"), default="ewma",
                        help="ewma: the online planner's settings (default); mean: each estimator over the whole run")
    parser.add_argument("--no-turn-gap", action="store_true",
                        help="replay without the calibrated gap between turns (what that term changes)")
    parser.add_argument("--independent-draws", action="store_true",
                        help="replay with every turn's draws its own (the calibrated correlations of a moment "
                             "left out: what that term changes)")
    parser.add_argument("--draw-seeds", type=int, default=1,
                        help="replay each run with this many seeds of the draws; each figure their mean")
    parser.add_argument("--in-flight-batch", action="store_true",
                        help="fit the turns at the requests in flight on their worker, not the engine's own batch "
                             "(HistoryRecord.engine_batch; runs recorded before it have only the former)")
    parser.add_argument("--whole-rl-phase", action="store_true",
                        help="busy fractions over the whole RL phase, step 0 (the start-up) included, as before; "
                             "default: from the end of step 0, the window of the step time")
    parser.add_argument("--moment-window-s", type=float, default=None,
                        help="the calibration's moment window (default: the run config's "
                             "planner.replan.calibration.moment_window_s)")
    args = parser.parse_args(argv)
    if args.draw_seeds < 1:
        parser.error(f"--draw-seeds must be >= 1, got {args.draw_seeds}")
    keep = pathlib.Path(args.keep_runs)
    index = keep / "runs.json"
    if not index.exists():
        parser.error(f"--keep-runs: no {index}; run benchmarks/headline_cpu.py --keep-runs {keep} first")
    entries = [e for e in json.loads(index.read_text())["runs"] if e.get("dir") and e["returncode"] == 0]
    per_run, by_design = [], {}
    for entry in entries:
        run = load(keep, entry)
        predicted, notes = replay(run, how=args.calibration, turn_gap=not args.no_turn_gap,
                                  moments=not args.independent_draws, seeds=range(args.draw_seeds),
                                  moment_s=args.moment_window_s, engine_batch=not args.in_flight_batch,
                                  steady=not args.whole_rl_phase)
        real = measured(run, steady=not args.whole_rl_phase)
        per_run.append({"run": run.name, "predicted": predicted, "measured": real, **notes})
        print(json.dumps({"run": run.name, **{f: [round(predicted[f], 3), round(real[f], 3)] for f in FIGURES},
                          **notes}), flush=True)
        by_design.setdefault(f"({run.design}) {DESIGNS[run.design][0]}", []).append((predicted, real))
    rows = {design: {f: (statistics.median(p[f] for p, _ in runs), statistics.median(m[f] for _, m in runs))
                     for f in FIGURES} for design, runs in by_design.items()}
    print(table(rows))
    plot(rows, pathlib.Path(args.plot))
    print(f"plot: {args.plot}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(per_run, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
