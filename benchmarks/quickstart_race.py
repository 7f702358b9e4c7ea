"""Time to first learning: the quickstart against two synchronous baselines, side by side.

    .venv/bin/python benchmarks/quickstart_race.py [--runs 3] [--quick] [--only NAME ...] [--set KEY=VALUE]
                                                   [--variant NAME KEY=VALUE ...] [--cores N]
                                                   [--loop-threads T] [--json FILE]

Contenders, each run `--runs` times, one after the other (never two at once):

  quickstart       libra up --config configs/quickstart.yaml (asynchronous GRPO, five services)
  sync-colocated   libra up --config configs/sync-colocated.yaml (Libra, synchronous: roll out a
                   whole batch, train, publish, reload in place; nothing overlaps)
  sync-loop        benchmarks/sync_grpo_loop.py: one process, transformers `generate` + the same
                   loss, no services
  quickstart/NAME  with --variant NAME KEY=VALUE ...: the quickstart with those overrides, one more
                   contender run beside the others (a setting measured against the shipped one)

Run i of every contender uses seed i - 1 (the config's `seed:`, which also shapes the warm start),
so the contenders meet on the same seeds and the runs of one contender are different samples. Runs
of one seed start from the same warm-started weights: the model cache's entry for the quickstart's
recipe with that seed, built before the first run and not timed (`libra up` then copies it into the
run directory; the plain loop copies it too). Each `libra up` gets free ports and a fresh run directory.

Per run: the step at which the 10-step mean reward first reaches --target (0.65), and when (seconds
from the process start, and from the start of the first RL step), wall time to the end, peak memory
of the whole process tree (the sum of PSS over every process of the tree, sampled every 0.2 s; the
sum of RSS beside it over-counts shared pages), mean busy cores (CPU seconds of the tree / wall
seconds, over the whole run and over its RL phase: the first step's start to the last step's end, not
the shutdown after it) and, for Libra, trajectories thrown away as stale.
An idle machine is assumed: the figures mean nothing on a machine shared with other work.

`--cores N` runs every contender's whole process tree on N CPUs only (the first N this process may
use; the race's own sampling stays unpinned): the same race as on a machine of N cores, on a
larger idle one. `--loop-threads T` gives the plain loop T torch threads (its default 1 is the
fastest on 2 cores; with cores to spare a careful user might try more).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from process_tree import TreeMonitor  # noqa: E402

CONTENDERS = ("quickstart", "sync-colocated", "sync-loop")
CONFIGS = {"quickstart": "configs/quickstart.yaml", "sync-colocated": "configs/sync-colocated.yaml",
           "sync-loop": "configs/quickstart.yaml"}
WINDOW = 10


# ---- one run ----------------------------------------------------------------------------------
@dataclass
class Result:
    contender: str
    run: int
    seed: int  # the run's seed (`seed:` of the config): the same for every contender's run of that index
    returncode: int
    wall_s: float
    rl_start_s: float | None  # seconds from the start to the start of the first RL step
    reached_step: int | None  # the step whose 10-step mean first reached the target
    reached_s: float | None  # seconds from the start
    reached_rl_s: float | None  # seconds from the start of the first RL step
    peak_pss_gb: float
    peak_rss_gb: float
    busy_cores: float
    busy_cores_rl: float | None
    steps: int
    final_mean: float | None  # the 10-step mean at the last step
    rejected: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by part of the tree
    rewards: list[float] = field(default_factory=list)


def reached(rewards: list[float], target: float) -> int | None:
    """The first step (1-based) whose trailing WINDOW-step mean reward is >= target."""
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW:end]) >= target:
            return end
    return None


def _free_port() -> int:
    from libra.redis_server import free_port

    return free_port()


def _slug(contender: str) -> str:
    """The contender's name where a path or run id needs it (a variant's `quickstart/NAME` has a slash)."""
    return contender.replace("/", "-")


def command(contender: str, work: pathlib.Path, steps: int, seed: int,
            overrides: tuple[str, ...] = (), variants: dict[str, list[str]] | None = None,
            loop_threads: int = 1) -> list[str]:
    """The contender's command line; `overrides` (KEY=VALUE) go to the quickstart's `libra up` only,
    and a variant's own (`quickstart/NAME`, from `variants`) after them."""
    variant = (variants or {}).get(contender)
    config = str(ROOT / CONFIGS["quickstart" if variant is not None else contender])
    if contender == "sync-loop":
        extra = ["--steps", str(steps)] if steps else []
        return [sys.executable, str(ROOT / "benchmarks" / "sync_grpo_loop.py"), "--config", config,
                "--out", str(work / "steps.jsonl"), "--set", f"seed={seed}", "--threads", str(loop_threads), *extra]
    sets = [f"addresses.{s}=127.0.0.1:{_free_port()}" for s in ("planner", "elastic", "scheduler", "rollout",
                                                                 "trainer")]
    sets += ["metrics.base_port=0", "rollout.worker.base_port=0", f"seed={seed}"]
    if contender == "quickstart" or variant is not None:
        sets += list(overrides) + list(variant or ())
    if steps:
        sets.append(f"trainer.steps={steps}")
    return [sys.executable, "-m", "libra.cli", "up", "--config", config, "--run-dir", str(work / "run"),
            "--run-id", f"race-{_slug(contender)}-{os.getpid()}", "--fresh",
            *[arg for item in sets for arg in ("--set", item)]]


def step_rows(contender: str, work: pathlib.Path) -> list[dict]:
    """Per step: reward, wall clock at its end, its start, trajectories rejected before it."""
    if contender == "sync-loop":
        path = work / "steps.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [{"reward": row["reward"], "t": row["t"], "started": row["started"], "rejected": 0}
                for row in map(json.loads, lines)]
    from libra.telemetry import record

    try:
        steps = record.load(work / "run").steps
    except Exception:  # noqa: BLE001 - a run that died before its first step has no record
        return []
    return [{"reward": s["scalars"]["reward/mean"], "t": s["t"], "started": s["t"] - s["scalars"]["time/step_s"],
             "rejected": int(s["scalars"].get("staleness/rejected_trajectories", 0))} for s in steps]


def start(argv: list[str], env: dict[str, str], log, cpus: set[int] | None) -> subprocess.Popen:
    """A contender's process, in its own session, on `cpus` only when given: the affinity is set in
    the child before it runs anything, so every process it starts inherits it."""
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def run_once(contender: str, index: int, args: argparse.Namespace, env: dict[str, str]) -> Result:
    with tempfile.TemporaryDirectory(prefix=f"race-{_slug(contender)}-") as scratch:
        work = pathlib.Path(scratch)
        log = open(work / "output.log", "w")
        started = time.time()
        argv = command(contender, work, args.steps, seed_of(index), tuple(args.set), args.variants,
                       args.loop_threads)
        process = start(argv, env, log, args.cpus)
        monitor = TreeMonitor(process.pid)
        monitor.start()
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 15)
            returncode = process.wait()
        ended = time.time()
        monitor.stopping.set()
        monitor.join()
        log.close()
        rows = step_rows(contender, work)
        if args.keep:  # logs and run records, not the weights
            shutil.copytree(work, pathlib.Path(args.keep) / f"{_slug(contender)}-{index}", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("weights", "checkpoints", "model", "redis", "snapshots"))
        if returncode != 0:
            print(f"  {contender} run {index} exited {returncode}; last lines:\n"
                  + "\n".join((work / "output.log").read_text(errors="replace").splitlines()[-15:]), flush=True)
    rewards = [row["reward"] for row in rows]
    step = reached(rewards, args.target)
    rl_start, rl_end = (rows[0]["started"], rows[-1]["t"]) if rows else (None, None)
    cpu_total = sum(monitor.cpu_by_pid.values())
    busy_rl = None
    if rl_start is not None and rl_end > rl_start:  # the steps only: a run's shutdown (its last checkpoint,
        busy_rl = (monitor.cpu_at(rl_end) - monitor.cpu_at(rl_start)) / (rl_end - rl_start)  # report) is not RL
    return Result(
        contender, index, seed_of(index), returncode, ended - started, rl_start - started if rl_start else None, step,
        rows[step - 1]["t"] - started if step else None, rows[step - 1]["t"] - rl_start if step else None,
        monitor.peak_pss_kib / 2**20, monitor.peak_rss_kib / 2**20, cpu_total / (ended - started), busy_rl,
        len(rows), statistics.fmean(rewards[-WINDOW:]) if rewards else None,
        sum(row["rejected"] for row in rows), monitor.cpu_by_component(), [round(r, 4) for r in rewards])


# ---- the table --------------------------------------------------------------------------------
def _median(values: list) -> str:
    """The median, a run that never got there (None) counted as slower than every run that did."""
    present = [v for v in values if v is not None]
    if not present:
        return "not reached" if values else "-"
    middle = statistics.median(sorted(present) + [math.inf] * (len(values) - len(present)))
    if middle == math.inf:
        return f"not reached ({len(values) - len(present)} of {len(values)} not)"
    text = (f"{middle:.2f}" if middle < 10 else f"{middle:.1f}") if isinstance(present[0], float) else f"{middle:g}"
    return text + (f" ({len(values) - len(present)} not)" if len(present) < len(values) else "")


def table(results: list[Result], target: float) -> str:
    rows = [("", *dict.fromkeys(r.contender for r in results))]  # in the order they ran
    names = rows[0][1:]
    measures = [(f"step reaching {target} (10-step mean)", "reached_step"),
                (f"s to {target} from start", "reached_s"), (f"s to {target} from first RL step", "reached_rl_s"),
                ("s from start to first RL step", "rl_start_s"), ("wall s (all steps)", "wall_s"),
                ("peak tree memory GB (PSS)", "peak_pss_gb"), ("peak tree memory GB (RSS sum)", "peak_rss_gb"),
                ("busy cores, whole run", "busy_cores"), ("busy cores, RL phase", "busy_cores_rl"),
                ("final 10-step mean reward", "final_mean"), ("trajectories rejected as stale", "rejected")]
    for label, key in measures:
        rows.append((label, *[_median([getattr(r, key) for r in results if r.contender == c]) for c in names]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + ("\n(medians over the runs; 'not': runs whose 10-step mean never got there, "
                               "counted as the slowest)")


def seed_of(index: int) -> int:
    """Run `index` (1-based) of every contender runs with seed index - 1: the contenders meet on the
    same seeds, and the runs of one contender differ (a deterministic loop would repeat one sample)."""
    return index - 1


def warm_cache(env: dict[str, str], seeds: tuple[int, ...] = (0,)) -> None:
    """Build the quickstart's warm-started model of each of `seeds` into the cache (not timed), so
    every contender starts from the same cached weights; says how long a first run's warm start
    takes. One process for all seeds: the imports are paid once."""
    code = ("import sys, tempfile, time, pathlib; sys.path.insert(0, '.');"
            "from libra.config import load_run_config; from libra.services.trainer.model_state import base_model\n"
            f"for seed in {list(seeds)!r}:\n"
            "    t = time.time(); d = pathlib.Path(tempfile.mkdtemp()) / 'base'\n"
            "    hit = base_model(load_run_config('configs/quickstart.yaml', overrides={'seed': seed}), d)\n"
            "    print(f'model cache, seed {seed}:', 'hit' if hit else "
            "f'built in {time.time() - t:.0f} s (a first run pays this once)', flush=True)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)


def pinned_cpus(cores: int, parser: argparse.ArgumentParser) -> set[int] | None:
    """The first `cores` CPUs this process may run on (None: no pinning); an error names the limit."""
    allowed = sorted(os.sched_getaffinity(0))
    if cores < 0 or cores > len(allowed):
        parser.error(f"--cores must be between 1 and the {len(allowed)} CPUs this process may use "
                     f"(0: no pinning), got {cores}")
    return set(allowed[:cores]) if cores else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The quickstart against two synchronous baselines.")
    parser.add_argument("--runs", type=int, default=3, help="runs of each contender")
    parser.add_argument("--quick", action="store_true", help="a smoke: one run each, 20 steps")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--steps", type=int, default=0, help="steps of every contender (0: each config's)")
    parser.add_argument("--target", type=float, default=0.65, help="10-step mean reward to reach")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--json", default="", help="write every run's figures here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the quickstart's libra up only (a setting against the baselines)")
    parser.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME_THEN_KEY=VALUE",
                        help="one more contender, quickstart/NAME: the quickstart with these overrides "
                             "(--variant one-worker 'planner.buckets=[...]'); repeatable")
    parser.add_argument("--keep", default="", help="keep each run's logs and run record under this directory")
    parser.add_argument("--cores", type=int, default=0,
                        help="run every contender on this many CPUs only (0: all this process may use)")
    parser.add_argument("--loop-threads", type=int, default=1, help="torch threads of the plain loop")
    args = parser.parse_args(argv)
    args.cpus = pinned_cpus(args.cores, parser)
    if args.loop_threads < 1:
        parser.error(f"--loop-threads must be >= 1, got {args.loop_threads}")
    args.variants = {}
    for name, *sets in args.variant:
        if not sets or "=" in name or "/" in name or any("=" not in item for item in sets):
            parser.error(f"--variant takes a NAME (no '=' or '/') and one or more KEY=VALUE: got {[name, *sets]}")
        args.variants[f"quickstart/{name}"] = sets
    if args.quick:
        args.runs, args.steps = 1, args.steps or 20
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    pinned = f", contenders pinned to CPUs {sorted(args.cpus)}" if args.cpus else ""
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores{pinned}", flush=True)
    warm_cache(env, tuple(seed_of(index) for index in range(1, args.runs + 1)))
    results = []
    for index in range(1, args.runs + 1):
        for contender in [*args.only, *args.variants]:  # interleaved: a drift in the machine touches all alike
            result = run_once(contender, index, args, env)
            results.append(result)
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(result).items() if k != "rewards"}
            print(json.dumps(shown), flush=True)
    print(table(results, args.target))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
