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
    return Loaded(entry["dir"], entry["design"], load_run_config(str(run_dir / "config.yaml")),
                  run_record.load(run_dir), [h for h in history if h["kind"] == "turn"],
                  [h for h in history if h["kind"] == "step"], run_dir / "trace.jsonl")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measured(run: Loaded) -> dict[str, float]:
    steps = run.record.steps
    ends = [s["t"] for s in steps]
    start = ends[0] - steps[0]["scalars"]["time/step_s"]
    span = ends[-1] - start
    lat = [t["seconds"] for t in run.turns]
    busy = {}  # worker -> [samples with a request in flight, samples]
    for sample in run.record.rollout:
        if start <= sample["t"] <= ends[-1]:
            for worker in sample.get("workers", []):
                if worker.get("state") in ("serving", "draining"):
                    seen = busy.setdefault(worker["id"], [0, 0])
                    seen[0] += worker.get("inflight", 0) > 0
                    seen[1] += 1
    return {"step_s": statistics.fmean(b - a for a, b in zip(ends, ends[1:])),
            "turn_p50_s": percentile(lat, 50), "turn_p90_s": percentile(lat, 90),
            "busy_train": sum(s["scalars"]["time/train_s"] for s in steps) / span,
            "busy_rollout": statistics.fmean(a / n for a, n in busy.values() if n) if busy else float("nan")}


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
