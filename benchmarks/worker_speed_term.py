"""A model term tried on the simulator against real runs and not kept: each engine's speed varying
over time (issue 16 item 2, "where it misses, find the term the model lacks").

    .venv/bin/python benchmarks/worker_speed_term.py --keep-runs DIR [--period 0.1] [--weighting turn|time|matched]

DIR is what `headline_cpu.py --keep-runs DIR` left (as for benchmarks/sim_vs_real.py, whose
calibration and replay this script runs, with `--calibration mean`: every sample of the run alike).

What it measures first, per run, from the run alone (no simulation): each measured turn's seconds
over what the calibrated turn model predicts for it at its own measured batch (sim_probes.fitted_turns),
that ratio's p10 / p50 / p90 in the thirds of the turns by predicted size (is the deviation a
multiple of the turn, or a constant added to it?), and the correlation of its logarithm between
turns of one worker by how far apart their midpoints are (how long a slow moment of a worker lasts).

What it then tries: the simulated engines run at a speed that changes every `--period` seconds,
per engine, its slowdown drawn (deterministically, from the engine's name and the period's index)
from that ratio's distribution, in place of the simulator's per-turn draw of the time outside the
engine (request_s times a factor; the term replaced). Three ways to turn the per-turn distribution
into a per-period one: `turn` takes it as it is; `time` weights each ratio by itself (a slow period
lasts longer per turn it serves, so it holds fewer turns than its share of time); `matched`
starts from `turn` and rescales the quantiles three times so that the replay's own per-turn ratio
(its latency over the turn model at its simulated batch) matches the run's. It prints a JSON line
per run (the probes above, the ratio's quantiles measured and replayed, the mean batch a turn ran
in, replayed and measured, and both sides of every figure) and the sim_vs_real table. The engines' clock is patched here, in this script's process
only (services/planner/sim/engines.py is not changed): the term is not part of the simulator.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sim_probes  # noqa: E402
import sim_vs_real  # noqa: E402
from libra.services.planner import cost_rollout, gaps  # noqa: E402
from libra.services.planner.calibration import Calibration  # noqa: E402
from libra.services.planner.cost_train import Layout  # noqa: E402
from libra.services.planner.sim import engines  # noqa: E402

SEPARATIONS = ((0.0, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.8), (0.8, 1.6))


class Speeds:
    """Per engine and period, the factor its steps take longer by (a draw from `quantiles`)."""

    def __init__(self, period: float):
        self.period, self.quantiles = period, (1.0,) * len(gaps.GAP_PROBS)  # (quantiles at GAP_PROBS)

    def index(self, t: float) -> int:
        k = int(t // self.period)
        return k + 1 if (k + 1) * self.period <= t else k  # (t on a boundary, rounded down by the float)

    def factor(self, wid: str, k: int) -> float:
        return gaps.draw(self.quantiles, f"{wid}/{k}/speed")


def patch(speeds: Speeds) -> None:
    """CostModelInstance's clock at the varying speed: between events, time runs through each period
    at 1 / factor (the engine's closed form per period); a completion is found period by period."""

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt <= 0:
            return
        t, self.last = self.last, now
        if self.stall > 0:
            used = min(self.stall, dt)
            self.stall -= used
            dt -= used
            self.busy_s += used
            t += used
        seqs = self.seqs
        if seqs and dt > 0:
            self.busy_s += dt
            while t < now:
                k = speeds.index(t)
                end = min(now, (k + 1) * speeds.period)
                n = _steps(self, (end - t) / speeds.factor(self.wid, k), self.context)
                self.progress += n
                self.context += seqs * n
                t = end

    def next_completion(self) -> float | None:
        if not self.heap:
            return None
        left, t, context = max(0.0, self.heap[0][0] - self.progress), self.last + self.stall, self.context
        while True:
            k = speeds.index(t)
            end, factor = (k + 1) * speeds.period, speeds.factor(self.wid, k)
            need = factor * (left * (self.fixed + self.kv_s * context) + self.kv_s * self.seqs * left * left / 2)
            if left <= 0 or t + need <= end:
                return t + need
            n = _steps(self, (end - t) / factor, context)
            left, context, t = left - n, context + self.seqs * n, end

    engines.CostModelInstance.advance = advance
    engines.CostModelInstance.next_completion = next_completion
    plain = Calibration.rollout_efficiency
    Calibration.rollout_efficiency = lambda self: plain(self).model_copy(update={"request_quantiles": ()})


def _steps(instance, seconds: float, context: float) -> float:
    """Decode steps in `seconds` from `context` (engines.py's closed form, solved for n)."""
    q, b = instance.kv_s * instance.seqs / 2, instance.fixed + instance.kv_s * context
    return 2 * seconds / (b + math.sqrt(b * b + 4 * q * seconds))


class Recorder:
    """The replay's per-turn ratio: latency over the turn model at the turn's simulated batch."""

    def __init__(self):
        self.engine, self.ratios, self.tokens = None, [], {}
        enqueue, complete = sim_probes.Timed.enqueue, sim_probes.Timed.complete
        recorder = self

        def timed_enqueue(timed, unit) -> None:
            recorder.tokens[id(unit)] = (unit.context, unit.turn_left)
            enqueue(timed, unit)

        def timed_complete(timed):
            latencies, batches = len(timed._latencies), len(timed._batches)
            unit = complete(timed)
            tokens = recorder.tokens.pop(id(unit), None)
            if tokens and len(timed._latencies) > latencies and len(timed._batches) > batches:
                fitted = sim_probes.turn_seconds(recorder.engine, *tokens, timed._batches[-1])
                if fitted > 0:
                    recorder.ratios.append(timed._latencies[-1] / fitted)
            return unit
        sim_probes.Timed.enqueue, sim_probes.Timed.complete = timed_enqueue, timed_complete


def ratio_probes(run, ratios: list[float], fitted: list[float]) -> dict:
    """The ratio by thirds of predicted size, and its log's correlation between one worker's turns."""
    order = sorted(range(len(fitted)), key=fitted.__getitem__)
    thirds = [order[i * len(order) // 3:(i + 1) * len(order) // 3] for i in range(3)]
    by_size = [{"predicted_s": round(statistics.median(fitted[i] for i in third), 3),
                "ratio_p10_p50_p90": [round(gaps.quantiles([ratios[i] for i in third], (q,))[0], 2)
                                      for q in (0.1, 0.5, 0.9)]} for third in thirds]
    per_worker: dict[str, list[tuple[float, float]]] = {}
    for turn, ratio in zip(run.turns, ratios):
        if turn.get("worker_id") and ratio > 0:
            per_worker.setdefault(turn["worker_id"], []).append((turn["timestamp"] - turn["seconds"] / 2,
                                                                 math.log(ratio)))
    correlation = {}
    for low, high in SEPARATIONS:
        xs, ys = [], []
        for points in per_worker.values():
            points.sort()
            times = [t for t, _ in points]
            for i, (t, value) in enumerate(points):
                first, last = bisect.bisect_left(times, t + low, i + 1), bisect.bisect_left(times, t + high)
                for j in range(first, last, max(1, (last - first) // 5)):
                    xs.append(value)
                    ys.append(points[j][1])
        correlation[f"{low:g}-{high:g}s"] = round(statistics.correlation(xs, ys), 2) if len(xs) > 10 else None
    return {"ratio_by_predicted_size": by_size, "log_ratio_correlation_same_worker": correlation}


def time_weighted(ratios: list[float]) -> tuple[float, ...]:
    ordered = sorted(ratios)
    total, running, cdf = sum(ordered), 0.0, []
    for ratio in ordered:
        running += ratio
        cdf.append(running / total)
    return tuple(ordered[min(len(ordered) - 1, bisect.bisect_left(cdf, p))] for p in gaps.GAP_PROBS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-runs", required=True)
    parser.add_argument("--period", type=float, default=0.1, help="seconds an engine keeps one speed")
    parser.add_argument("--weighting", choices=("turn", "time", "matched"), default="turn")
    args = parser.parse_args(argv)
    keep = pathlib.Path(args.keep_runs)
    entries = [e for e in json.loads((keep / "runs.json").read_text())["runs"] if e.get("dir") and e["returncode"] == 0]
    speeds, recorder = Speeds(args.period), Recorder()
    patch(speeds)
    by_design: dict[str, list] = {}
    for entry in entries:
        run = sim_vs_real.load(keep, entry)
        model = sim_vs_real.tiny_model(run.config)
        cal = sim_vs_real.calibrate(run, model, Layout(1, 1, 1, run.config.trainer.micro_batch_size), "mean")
        fitted = sim_probes.fitted_turns(run, cal, model)
        ratios = [t["seconds"] / f if f > 0 else 0.0 for t, f in zip(run.turns, fitted)]
        positive = [r for r in ratios if r > 0]
        measured_q = gaps.quantiles(positive)
        quantiles = list(time_weighted(positive) if args.weighting == "time" else measured_q)
        recorder.engine = cost_rollout.instance(model, sim_probes.CPU_CORE, 1, cal.rollout_efficiency())
        for _ in range(4 if args.weighting == "matched" else 1):
            speeds.quantiles, recorder.ratios = tuple(sorted(quantiles)), []
            predicted, notes = sim_vs_real.replay(run, how="mean")
            replayed_q = gaps.quantiles(recorder.ratios)
            quantiles = [q * m / r if r > 0 else q for q, m, r in zip(quantiles, measured_q, replayed_q)]
        real = sim_vs_real.measured(run)
        by_design.setdefault(f"({run.design}) {sim_vs_real.DESIGNS[run.design][0]}", []).append((predicted, real))
        print(json.dumps({"run": run.name, **ratio_probes(run, ratios, fitted),
                          "ratio_p10_p50_p90": {"measured": [round(measured_q[i], 2) for i in (1, 5, 9)],
                                                "replayed": [round(replayed_q[i], 2) for i in (1, 5, 9)]},
                          "turn_batch_mean": notes["turn_batch_mean"],  # [replayed, measured]
                          **{f: [round(predicted[f], 3), round(real[f], 3)] for f in sim_vs_real.FIGURES}}),
              flush=True)
    rows = {design: {f: (statistics.median(p[f] for p, _ in runs), statistics.median(m[f] for _, m in runs))
                     for f in sim_vs_real.FIGURES} for design, runs in by_design.items()}
    print(sim_vs_real.table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
