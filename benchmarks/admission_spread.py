"""How a kept run's batches started: per batch, the spread of the moments its trajectories were taken
by the gateway's runners, the batch's rollout span, and which of its groups finished last.

Reads runs kept by benchmarks/headline_cpu.py --keep-runs (or benchmarks/headline_ab.sh): each run's
exported history (every turn's record: its seconds, its gap since the trajectory was taken or since
its previous turn) and trace (each trajectory's policy version and end). A trajectory was taken at
its first turn's end − seconds − gap.

    .venv/bin/python benchmarks/admission_spread.py RUN_DIR [RUN_DIR ...]

Prints per run, over its batches after the first: the mean spread of the takings, the mean span from
the first taking to the last end, how often the group admitted last was the last to finish, and the turns' mean batch, median latency and median gap between turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in open(run / "history.jsonl")]
    turns = [r for r in rows if r["kind"] == "turn"]
    trace = {t["trajectory_id"]: t for t in map(json.loads, open(run / "run" / "trace.jsonl"))}
    taken = {r["trajectory_id"]: r["timestamp"] - r["seconds"] - r["gap_seconds"]
             for r in turns if r["turn_number"] == 1}
    batches: dict[int, list] = defaultdict(list)
    for tid, at in taken.items():
        if tid in trace:
            batches[trace[tid]["version"]].append((at, trace[tid]["finished_at"], int(tid.split("-")[0][1:])))
    spreads, spans, last = [], [], 0
    for version in sorted(batches)[1:]:
        batch = batches[version]
        first = min(at for at, _, _ in batch)
        spreads.append(max(at for at, _, _ in batch) - first)
        spans.append(max(end for _, end, _ in batch) - first)
        groups = sorted({g for _, _, g in batch})
        last += groups.index(max(batch, key=lambda row: row[1])[2]) == len(groups) - 1
    later = [r["gap_seconds"] for r in turns if r["turn_number"] > 1]
    return {"run": str(run), "batches": len(spreads), "admission_spread_s": round(statistics.fmean(spreads), 3),
            "rollout_span_s": round(statistics.fmean(spans), 3),
            "last_group_finished_last": f"{last} of {len(spreads)}",
            "turn_batch_mean": round(statistics.fmean(r["batch"] for r in turns), 1),
            "turn_p50_s": round(statistics.median(r["seconds"] for r in turns), 4),
            "later_gap_p50_s": round(statistics.median(later), 4) if later else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="kept run directories (with history.jsonl and run/)")
    for run in parser.parse_args().runs:
        print(json.dumps(summary(run)))


if __name__ == "__main__":
    main()
