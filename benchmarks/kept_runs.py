"""What a run kept by `benchmarks/headline_cpu.py --keep-runs DIR` measured, read back: its resolved
config, run record and exported history (Redis streams history:turn and history:step), and the
figures the simulator is compared on (`sim_vs_real.py`). Owns the kept-run format's reading; knows
nothing of the simulator.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from dataclasses import dataclass

from libra.config import load_run_config
from libra.telemetry import record as run_record


@dataclass
class Loaded:
    name: str
    design: str
    config: object
    record: run_record.RunRecord
    turns: list[dict]
    steps: list[dict]  # history step records
    trace: pathlib.Path


def load(keep: pathlib.Path, entry: dict) -> Loaded:
    base = keep / entry["dir"]
    run_dir = base / "run"
    history = [json.loads(line) for line in (base / "history.jsonl").read_text().splitlines() if line.strip()]
    turns = number_turns([h for h in history if h["kind"] == "turn"])
    return Loaded(entry["dir"], entry["design"], load_run_config(str(run_dir / "config.yaml")),
                  run_record.load(run_dir), turns, [h for h in history if h["kind"] == "step"],
                  run_dir / "trace.jsonl")


def number_turns(turns: list[dict]) -> list[dict]:
    """Turn records as the gateway writes them since HistoryRecord field 21: each with its place in
    its trajectory (`turn_number`, 1 for the first). Runs recorded before it (field 20 named the
    trajectory) get it from the order of their turns' starts; records naming no trajectory, 0."""
    if all(t.get("turn_number") for t in turns):
        return turns
    order: dict[str, list[dict]] = {}
    for t in turns:
        t["turn_number"] = 0
        if t.get("trajectory_id"):
            order.setdefault(t["trajectory_id"], []).append(t)
    for own in order.values():
        for number, t in enumerate(sorted(own, key=lambda t: t["timestamp"] - t["seconds"]), 1):
            t["turn_number"] = number
    return turns


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def rl_phase(run: Loaded) -> tuple[float, float]:
    """The run's RL phase: the first step's start to the last step's end (record clock)."""
    steps = run.record.steps
    return steps[0]["t"] - steps[0]["scalars"]["time/step_s"], steps[-1]["t"]


def measured(run: Loaded, steady: bool = True) -> dict[str, float]:
    """The run's figures: the mean step from the end of step 0 (step 0 holds the start-up: the
    engines' first passes, the first routes), the turns' p50 and p90, and the busy fractions over
    the same steady state, from the end of step 0 to the end of the last (`steady=False`: over the
    whole RL phase, step 0 included, as before)."""
    steps = run.record.steps
    ends = [s["t"] for s in steps]
    start = ends[0] if steady and len(ends) > 1 else rl_phase(run)[0]
    trained = steps[1:] if steady and len(ends) > 1 else steps
    span = ends[-1] - start
    lat = [t["seconds"] for t in run.turns]
    return {"step_s": statistics.fmean(b - a for a, b in zip(ends, ends[1:])),
            "turn_p50_s": percentile(lat, 50), "turn_p90_s": percentile(lat, 90),
            "busy_train": sum(s["scalars"]["time/train_s"] for s in trained) / span,
            "busy_rollout": busy_rollout(run.record.rollout, start, ends[-1])}


def busy_rollout(samples: list[dict], start: float, end: float) -> float:
    """The rollout workers' mean share of [start, end] with a request in flight: from each worker's
    busy seconds in the rollout service's samples (`busy_s`, exact: the gateway integrates it)
    between its first and last sample in the span, over their seconds; runs recorded before
    `busy_s` from the share of samples that saw a request in flight (1-second samples of a ~1-second
    step alias: uncertain by ~0.1)."""
    exact, seen = {}, {}  # worker -> [(t, busy_s) first, last]; worker -> [samples in flight, samples]
    for sample in samples:
        if start <= sample["t"] <= end:
            for worker in sample.get("workers", []):
                if worker.get("state") not in ("serving", "draining"):
                    continue
                if "busy_s" in worker:
                    row = exact.setdefault(worker["id"], [(sample["t"], worker["busy_s"])] * 2)
                    row[1] = (sample["t"], worker["busy_s"])
                counts = seen.setdefault(worker["id"], [0, 0])
                counts[0] += worker.get("inflight", 0) > 0
                counts[1] += 1
    shares = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in exact.values() if b[0] > a[0]]
    if shares:
        return statistics.fmean(min(1.0, share) for share in shares)
    return statistics.fmean(a / n for a, n in seen.values() if n) if seen else float("nan")


def trainer_overheads(run: Loaded) -> dict[int, float]:
    """Per step, the trainer's seconds since the previous step outside its wait, training and publish,
    from its run record: what a step's history record carries as `overhead_seconds` since the trainer
    reports it (runs recorded before that have it only in their run record)."""
    steps = run.record.steps
    out = {}
    for before, step in zip(steps, steps[1:]):
        timers = sum(step["scalars"].get(f"time/{k}_s", 0.0) for k in ("wait", "train", "publish"))
        out[int(step["step"])] = max(0.0, step["t"] - before["t"] - timers)
    return out
