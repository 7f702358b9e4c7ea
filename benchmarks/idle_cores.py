"""Where the quickstart leaves a core idle: every thread of the `libra up` tree sampled every 20 ms.

Each thread's time on a CPU comes from /proc/PID/task/TID/schedstat (nanoseconds; the CPU counters
in /proc/PID/stat tick every 10 ms, too coarse for 20 ms windows). Per window, the cores each part
of the tree used (the trainer, the engine workers, the gateway, the scheduler, `libra up`, the rest); over the
RL phase (the first step's start to the last step's end, from the run record): how many cores the
windows used, which parts used them in the windows below `--low` cores, and the cores by position
within a training step (one step's end to the next in ten slices: is the idle time at the steps'
boundaries, where the trainer publishes and the engines load, or spread?), and the start-up's CPU. `--plot` draws a few
seconds of the timeline, stacked by part, the steps' ends marked.

    .venv/bin/python benchmarks/idle_cores.py --steps 30 --plot benchmarks/results/idle_cores.png  # ~40 s, idle machine
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from process_tree import _tree, component  # noqa: E402
from quickstart_race import command, start, step_rows, warm_cache  # noqa: E402

PARTS = ("trainer", "engine workers", "rollout", "scheduler", "libra up")  # the rest: planner, elastic, redis


def part_of(name: str) -> str:
    return name if name in PARTS else "rest"


class ThreadSampler(threading.Thread):
    """Every `interval_s`: each process of the tree's summed thread CPU nanoseconds."""

    def __init__(self, root: int, interval_s: float):
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.stopping = threading.Event()
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.names: dict[int, str] = {}
        self.sampler_ns = 0  # this thread's own CPU (what sampling costs)

    def run(self) -> None:
        pids: list[int] = []
        refreshed = 0.0
        tasks: dict[int, list[str]] = {}
        while not self.stopping.is_set():
            now = time.time()
            began = time.thread_time_ns()
            if now - refreshed > 0.5:  # processes and threads come and go: look again twice a second
                pids = _tree(self.root)
                tasks = {}
                for pid in pids:
                    try:
                        tasks[pid] = [f"/proc/{pid}/task/{tid}/schedstat" for tid in os.listdir(f"/proc/{pid}/task")]
                    except OSError:
                        continue
                    if pid not in self.names:
                        self.names[pid] = component(pid)
                refreshed = now
            sample = {}
            for pid, paths in tasks.items():
                total = 0
                for path in paths:
                    try:
                        with open(path) as handle:
                            total += int(handle.read().split()[0])
                    except (OSError, ValueError, IndexError):
                        continue  # a thread that ended: its time is gone from the sum (a small undercount)
                sample[pid] = total
            self.samples.append((now, sample))
            self.sampler_ns += time.thread_time_ns() - began
            self.stopping.wait(self.interval_s)


def windows(sampler: ThreadSampler) -> list[tuple[float, float, dict[str, float]]]:
    """(start, end, cores per part) for each pair of consecutive samples."""
    out = []
    for (t0, a), (t1, b) in zip(sampler.samples, sampler.samples[1:]):
        if t1 <= t0:
            continue
        cores: dict[str, float] = {}
        for pid, ns in b.items():
            delta = ns - a.get(pid, 0)  # a process first seen here: all it used so far lands in this window
            if delta > 0:
                part = part_of(sampler.names.get(pid, "?"))
                cores[part] = cores.get(part, 0.0) + delta / 1e9 / (t1 - t0)
        out.append((t0, t1, cores))
    return out


def summarize(rows: list[tuple[float, float, dict[str, float]]], steps: list[dict], low: float) -> dict:
    start, end = steps[0]["started"], steps[-1]["t"]
    rl = [(t0, t1, c) for t0, t1, c in rows if t0 >= start and t1 <= end]
    total = [sum(c.values()) for _, _, c in rl]
    parts = PARTS + ("rest",)
    mean = {p: statistics.fmean(c.get(p, 0.0) for _, _, c in rl) for p in parts}
    lows = [c for (_, _, c), s in zip(rl, total) if s < low]
    low_mean = {p: statistics.fmean(c.get(p, 0.0) for c in lows) if lows else 0.0 for p in parts}
    bins = [0.0, 0.5, 1.0, 1.5, 1.8, 99.0]
    histogram = {f"{a:.1f}-{b:.1f}" if b < 99 else f">={a:.1f}": sum(1 for s in total if a <= s < b) / len(total)
                 for a, b in zip(bins, bins[1:])}
    ends = [row["t"] for row in steps]
    by_slice = [[] for _ in range(10)]
    for (t0, t1, c), s in zip(rl, total):
        middle = (t0 + t1) / 2
        index = bisect.bisect_left(ends, middle)
        if index == 0 or index >= len(ends):
            continue
        begin, finish = ends[index - 1], ends[index]
        by_slice[min(9, int(10 * (middle - begin) / (finish - begin)))].append(s)
    return {"rl_seconds": end - start, "windows": len(rl), "mean_cores": {k: round(v, 3) for k, v in mean.items()},
            "mean_total": round(statistics.fmean(total), 3),
            "cores_histogram": {k: round(v, 3) for k, v in histogram.items()},
            f"below_{low}_share": round(len(lows) / len(rl), 3),
            f"below_{low}_mean_cores": {k: round(v, 3) for k, v in low_mean.items()},
            "by_step_slice": [round(statistics.fmean(s), 3) if s else None for s in by_slice],
            "step_seconds_median": round(statistics.median(b - a for a, b in zip(ends, ends[1:])), 3),
            "start_up": start_up(rows, start)}


def start_up(rows: list[tuple[float, float, dict[str, float]]], rl_start: float) -> dict:
    """The start (the first sample) to the first step's start: CPU seconds per part, and per 0.5 s
    the cores in use (is the start-up short of CPU, or a chain that leaves cores idle?). Processes
    are looked for twice a second, so what a new one used before it was first seen lands in the
    window it was seen in: up to half a second late."""
    begin = rows[0][0]
    seconds: dict[str, float] = {}
    halves: list[float] = [0.0] * (int((rl_start - begin) / 0.5) + 1)
    for t0, t1, cores in rows:
        if t1 > rl_start:
            break
        for part, used in cores.items():
            seconds[part] = seconds.get(part, 0.0) + used * (t1 - t0)
        halves[int((t0 - begin) / 0.5)] += sum(cores.values()) * (t1 - t0) / 0.5
    return {"seconds": round(rl_start - begin, 2), "cpu_s": {k: round(v, 2) for k, v in seconds.items()},
            "cores_per_half_second": [round(h, 2) for h in halves]}


def plot(rows, steps, path: str, seconds: float = 4.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    middle = (steps[0]["started"] + steps[-1]["t"]) / 2
    shown = [(t0, t1, c) for t0, t1, c in rows if middle <= t0 and t1 <= middle + seconds]
    xs = [(t0 + t1) / 2 - middle for t0, t1, _ in shown]
    parts = PARTS + ("rest",)
    fig, axis = plt.subplots(figsize=(9, 3.6))
    axis.stackplot(xs, *[[c.get(p, 0.0) for _, _, c in shown] for p in parts], labels=parts, step="mid")
    for row in steps:
        if middle <= row["t"] <= middle + seconds:
            axis.axvline(row["t"] - middle, color="black", lw=0.8, ls=":")
    axis.axhline(2.0, color="grey", lw=0.8)
    axis.set_xlabel("seconds (a stretch of the RL phase; dotted: a training step ends)")
    axis.set_ylabel("cores in use (20 ms windows)")
    axis.legend(loc="upper left", fontsize=8, ncol=5)
    axis.set_ylim(0, 2.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    parser.add_argument("--low", type=float, default=1.5, help="a window below this many cores counts as low")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to libra up")
    parser.add_argument("--plot", help="a PNG of a few seconds of the timeline")
    parser.add_argument("--json", help="the summary as JSON here")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    warm_cache(env, (args.seed,))
    with tempfile.TemporaryDirectory(prefix="idle-cores-") as scratch:
        work = pathlib.Path(scratch)
        with open(work / "output.log", "w") as log:
            process = start(command("quickstart", work, args.steps, args.seed, tuple(args.set)), env, log, None)
            sampler = ThreadSampler(process.pid, args.interval)
            sampler.start()
            code = process.wait(timeout=900)
            sampler.stopping.set()
            sampler.join()
        if code != 0:
            print((work / "output.log").read_text()[-3000:])
            return code
        steps = step_rows("quickstart", work)
        from libra.telemetry import record

        timers = {}
        for name in ("step_s", "train_s", "wait_s", "publish_s", "publish_rpc_s"):
            values = [row["scalars"].get(f"time/{name}") for row in record.load(work / "run").steps]
            values = [v for v in values if v is not None]
            if values:
                timers[name] = round(statistics.median(values), 4)
    rows = windows(sampler)
    result = summarize(rows, steps, args.low)
    elapsed = sampler.samples[-1][0] - sampler.samples[0][0]
    result["sampler_cores"] = round(sampler.sampler_ns / 1e9 / elapsed, 3)
    result["trainer_timers_median_s"] = timers  # the run record's time/* of each step
    result["command"] = " ".join(["benchmarks/idle_cores.py", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(result, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, steps, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
