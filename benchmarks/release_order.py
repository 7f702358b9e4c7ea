"""Where a synchronous step's time goes, measured and replayed (docs/benchmarks.md, "Simulator against
reality", the release term): per kept run of synchronous colocated, (1) from its records, how long
after a step's record a runner took the next batch's first trajectory and sent its first turn;
(2) the calibrated simulator's replay (seed 0, whole-run calibration) beside the run: the trainer's
wait for a batch and the batch's own span, its first trajectory's start to its last finish, both
means over steps 1..N.

    .venv/bin/python benchmarks/release_order.py --keep-runs /work/hl/v14 [--design a]

Run it on another tree's code with benchmarks/sim_speed.py's driver to see an older simulator.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sim_vs_real  # noqa: E402
from kept_runs import load  # noqa: E402
from libra.services.planner.sim import cluster  # noqa: E402
from libra.traces import files  # noqa: E402


def batch_of(trajectory_id: str, groups_per_step: int) -> int:
    return int(re.match(r"g(\d+)", trajectory_id).group(1)) // groups_per_step


def measured_lags(run, groups_per_step: int) -> tuple[float, float, float]:
    """Mean seconds from a step's record to a runner taking the next batch's first trajectory, the
    least of them, and the mean to that batch's first turn sent (steps 2..N)."""
    ends = [s["t"] for s in run.record.steps]
    taken: dict[int, float] = {}
    sent: dict[int, float] = {}
    for turn in run.turns:
        if turn.get("turn_number") == 1 and turn.get("trajectory_id"):
            k = batch_of(turn["trajectory_id"], groups_per_step)
            start = turn["timestamp"] - turn["seconds"]
            taken[k] = min(taken.get(k, float("inf")), start - turn.get("gap_seconds", 0.0))
            sent[k] = min(sent.get(k, float("inf")), start)
    lags = [taken[k] - ends[k - 1] for k in range(2, len(ends)) if k in taken]
    return statistics.fmean(lags), min(lags), statistics.fmean(sent[k] - ends[k - 1] for k in range(2, len(ends)) if k in sent)


def spans(run, groups_per_step: int) -> tuple[float, float, float, float]:
    """(measured wait, simulated wait, measured batch span, simulated batch span), means over steps 1..N."""
    finished: dict[str, tuple[float, float]] = {}
    original = cluster.Simulator._finished

    def record(self, unit):
        finished[unit.spec.trajectory_id] = (unit.released_s, self.events.now)
        return original(self, unit)

    cluster.Simulator._finished = record
    try:
        _, notes = sim_vs_real.replay(run, how="mean", seeds=[0])
    finally:
        cluster.Simulator._finished = original
    real: dict[int, list[tuple[float, float]]] = {}
    firsts: dict[str, float] = {}
    for turn in run.turns:
        if turn.get("turn_number") == 1 and turn.get("trajectory_id"):
            firsts[turn["trajectory_id"]] = turn["timestamp"] - turn["seconds"] - turn.get("gap_seconds", 0.0)
    for line in run.trace.read_text().splitlines():
        row = json.loads(line)
        if row["trajectory_id"] in firsts:
            real.setdefault(batch_of(row["trajectory_id"], groups_per_step), []).append(
                (firsts[row["trajectory_id"]], row["finished_at"]))
    sim: dict[int, list[tuple[float, float]]] = {}
    for sim_id, pair in finished.items():
        copy = files.copy_of(sim_id)
        if copy:
            sim.setdefault(batch_of(copy[1], groups_per_step), []).append(pair)
    steps = [k for k in range(1, len(run.record.steps)) if k in real and k in sim]
    span = lambda rows: max(end for _, end in rows) - min(start for start, _ in rows)  # noqa: E731
    return (notes["trainer_wait_s"][1], notes["trainer_wait_s"][0], statistics.fmean(span(real[k]) for k in steps),
            statistics.fmean(span(sim[k]) for k in steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-runs", required=True)
    parser.add_argument("--design", default="a")
    args = parser.parse_args(argv)
    keep = pathlib.Path(args.keep_runs)
    for entry in json.loads((keep / "runs.json").read_text())["runs"]:
        if entry["design"] != args.design or entry.get("returncode") != 0:
            continue
        run = load(keep, entry)
        per_step = run.config.trainer.groups_per_step
        lag, least, first_turn = measured_lags(run, per_step)
        wait_real, wait_sim, span_real, span_sim = spans(run, per_step)
        print(f"{run.name}: a runner took the next batch {lag * 1e3:.1f} ms after a step's record (least "
              f"{least * 1e3:.1f} ms), its first turn {first_turn * 1e3:.1f} ms after; trainer's wait "
              f"{wait_real:.3f} s measured, {wait_sim:.3f} s simulated; batch span {span_real:.3f} s measured, "
              f"{span_sim:.3f} s simulated", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
