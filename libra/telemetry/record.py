"""Reading a run's record back: RUN_DIR/telemetry/<service>.jsonl into one `RunRecord` (pure: files in,
data out; no Redis, no services).

The run record is what a run leaves whatever happened to it: written line by line as the run goes
(a killed service loses at most its last, partial line, which is skipped), kept in the run
directory with the logs and checkpoints, and independent of Redis (gone with `libra up`'s private
server, shared or flushed elsewhere) and of TensorBoard (off, or not installed).
"""

from __future__ import annotations

import bisect
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from libra.errors import ConfigError

SERVICES = ("trainer", "rollout", "scheduler", "planner")


@dataclass
class RunRecord:
    run_dir: pathlib.Path
    started_at: float
    steps: list[dict[str, Any]] = field(default_factory=list)  # trainer "step", one per step (the last written)
    rollout: list[dict[str, Any]] = field(default_factory=list)  # rollout "sample"
    scheduler: list[dict[str, Any]] = field(default_factory=list)  # scheduler "sample"
    moves: list[dict[str, Any]] = field(default_factory=list)  # scheduler "move"
    ticks: list[dict[str, Any]] = field(default_factory=list)  # planner "tick"
    decisions: list[dict[str, Any]] = field(default_factory=list)  # planner "decision"
    skipped: int = 0  # lines that were not whole JSON objects (a service killed mid-write)

    @property
    def ended_at(self) -> float:
        times = [row["t"] for rows in (self.steps, self.rollout, self.scheduler, self.moves, self.ticks,
                                       self.decisions) for row in rows[-1:]]
        return max(times, default=self.started_at)

    def elapsed(self, row: dict[str, Any]) -> float:
        """Seconds since the run started."""
        return row["t"] - self.started_at

    def scalar(self, rows: list[dict[str, Any]], tag: str) -> tuple[list[float], list[float]]:
        """(elapsed seconds, value) of `tag` over `rows`, where present."""
        found = [(self.elapsed(r), r["scalars"][tag]) for r in rows
                 if r.get("scalars", {}).get(tag) is not None]
        return [t for t, _ in found], [v for _, v in found]

    def trainer_version_at(self, t: float) -> int | None:
        """The policy version the trainer had published at time `t` (None: before its first step)."""
        times = [row["t"] for row in self.steps]
        index = bisect.bisect_right(times, t)
        if index == 0:
            return self.steps[0]["policy_version"] - 1 if self.steps else None
        return self.steps[index - 1]["policy_version"]

    def worker_lags(self) -> dict[str, tuple[list[float], list[int]]]:
        """Per worker: (elapsed seconds, versions behind the trainer) at each rollout sample."""
        lags: dict[str, tuple[list[float], list[int]]] = {}
        for sample in self.rollout:
            trainer = self.trainer_version_at(sample["t"])
            if trainer is None:
                continue
            for worker in sample.get("workers", []):
                times, values = lags.setdefault(worker["id"], ([], []))
                times.append(self.elapsed(sample))
                values.append(max(0, trainer - worker["version"]))
        return lags

    def staleness_counts(self) -> dict[int, int]:
        """Trained trajectories by staleness (policy versions), over the whole run."""
        total: dict[int, int] = {}
        for step in self.steps:
            for lag, count in step.get("staleness_counts", {}).items():
                total[int(lag)] = total.get(int(lag), 0) + count
        return dict(sorted(total.items()))


def _rows(path: pathlib.Path) -> tuple[list[dict[str, Any]], int]:
    rows, skipped = [], 0
    if not path.exists():
        return rows, skipped
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(row, dict) and "kind" in row and "t" in row:
                rows.append(row)
            else:
                skipped += 1
    return rows, skipped


def load(run_dir: str | pathlib.Path) -> RunRecord:
    """The run record of `run_dir`; ConfigError naming the fix when it has none."""
    run_dir = pathlib.Path(run_dir)
    directory = run_dir / "telemetry"
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {run_dir} is not a directory; pass a run directory (the config's run_dir)")
    if not any((directory / f"{service}.jsonl").exists() for service in SERVICES):
        raise ConfigError(f"{run_dir} has no run record ({directory}/<service>.jsonl): pass the run_dir of a run "
                          "made by `libra up` or `libra serve` (the services write it as they run)")
    rows: dict[str, list[dict[str, Any]]] = {}
    skipped = 0
    for service in SERVICES:
        rows[service], bad = _rows(directory / f"{service}.jsonl")
        skipped += bad
    every = [row for service_rows in rows.values() for row in service_rows]
    try:
        started_at = float(json.loads((directory / "clock.json").read_text())["started_at"])
    except (OSError, ValueError, KeyError):
        started_at = min(row["t"] for row in every) if every else 0.0
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows["trainer"]:
        if row["kind"] == "step":
            by_step[row["step"]] = row  # a step written again after a restart: the later one stands
    kinds = lambda service, kind: [r for r in rows[service] if r["kind"] == kind]  # noqa: E731
    return RunRecord(run_dir, started_at, [by_step[s] for s in sorted(by_step)], kinds("rollout", "sample"),
                     kinds("scheduler", "sample"), kinds("scheduler", "move"), kinds("planner", "tick"),
                     kinds("planner", "decision"), skipped)
