"""Headline on real processes (CPU): designs (a), (b) and (d) of issue 16 with `libra up` on this machine.

    .venv/bin/python benchmarks/headline_cpu.py [--runs 3] [--steps 30] [--target 0.65]
        [--only a b d] [--keep-runs DIR] [--plot benchmarks/results/headline_cpu.png] [--json FILE]
    .venv/bin/python benchmarks/headline_cpu.py --report FILE     # table and plot of a runs.json, no runs

Designs (configs/headline/, the same model, workload, batch and learning rate):

  a  sync-colocated   every worker rolls out the batch, then the trainer trains, then the weights
                      are reloaded in place; nothing overlaps (trainer.max_staleness 0)
  b  async-even       asynchronous, a fixed even split, load-balanced routing, staleness 1
  d  libra-full       asynchronous, C-MLFQ, the online planner and the elastic hybrid pool

Every run is a real `libra up` (five services, Redis, gRPC, two transformers-engine workers, the
torch trainer), capped at --steps training steps, with free ports and a fresh run directory; runs
are interleaved a, b, d, a, b, d, ... so a drift in the machine's load touches every design alike.
What must differ on this machine is set here with `--set` (OVERRIDES), never in the YAML:
d-libra-full.yaml's planner.cluster is the 48-GPU testbed `libra sim` plays; the online planner
plans for it and the elastic coordinator then starts one CPU worker per planned engine (a smoke
run's plan had twelve), so here it plans for a cluster of this machine's shape: 3 units (the trainer
and two rollout workers), TP 1 only, the smallest model spec (qwen2.5-3b: one that trains on one
unit), and the trainer counted as one unit (planner.training.gpus 1; with 0, CPU training, the
planner cannot describe the config's plan, takes it for "no plan in force" and replaces it with
its own at once, restarting both workers in one TP-1 bucket: in a smoke run the trajectories in
flight failed and the trainer crashed at its checkpoint; docs/benchmarks.md). Every design
also samples its telemetry every second instead of five (MEASURE: sim_vs_real.py's busy fractions).

Per run: the step at which the 10-step mean reward first reaches --target, and when (seconds from
the start of `libra up`, and from the start of the first RL step), trajectories trained per second
over the RL phase, busy cores of the process tree, and the reward curve; then medians per design, a
plot of reward (10-step mean) against wall-clock seconds, and with --keep-runs each run's record
(telemetry, trace.jsonl, logs, config) plus the runtime history the planner's calibration reads
(Redis streams history:turn and history:step, exported to history.jsonl after the run, from the
run's own persistent Redis files): benchmarks/sim_vs_real.py replays those runs in the simulator.
The timing and reward helpers are benchmarks/quickstart_race.py's. A shared machine moves the
figures: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
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
from quickstart_race import WINDOW, _free_port, reached, step_rows, warm_cache  # noqa: E402

DESIGNS = {"a": ("sync-colocated", "configs/headline/a-sync-colocated.yaml"),
           "b": ("async-even", "configs/headline/b-async-even.yaml"),
           "d": ("libra-full", "configs/headline/d-libra-full.yaml")}
OVERRIDES = {"a": [], "b": [],
             "d": ["planner.cluster.gpus=3", "planner.cluster.model=qwen2.5-3b", "planner.cluster.tp_choices=[1]",
                   "planner.training.gpus=1"]}
MEASURE = ["telemetry.sample_s=1"]  # every design: the workers' in-flight requests sampled each second (busy fraction)
SERVICES = ("planner", "elastic", "scheduler", "rollout", "trainer")
KEEP_IGNORE = shutil.ignore_patterns("weights", "checkpoints", "model", "redis", "snapshots", "tensorboard", "token")
COLORS = {"a": "tab:red", "b": "tab:blue", "d": "tab:green"}


@dataclass
class Run:
    design: str
    run: int
    returncode: int
    wall_s: float  # libra up, start to exit
    rl_start_s: float | None  # from the start to the start of the first RL step
    rl_s: float | None  # first RL step started -> last step finished
    steps: int
    trajectories: int
    trajectories_per_s: float | None  # trained, over the RL phase
    reached_step: int | None
    reached_s: float | None  # from the start of libra up
    reached_rl_s: float | None  # from the start of the first RL step
    final_mean: float | None
    busy_cores: float
    rejected: int
    dir: str = ""  # the kept run directory (--keep-runs), relative to it
    rewards: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)  # each step's end, seconds from the start


def command(design: str, run_dir: pathlib.Path, run_id: str, steps: int) -> list[str]:
    sets = [f"addresses.{s}=127.0.0.1:{_free_port()}" for s in SERVICES]
    sets += ["metrics.base_port=0", "rollout.worker.base_port=0", f"trainer.steps={steps}", *MEASURE,
             *OVERRIDES[design]]
    return [sys.executable, "-m", "libra.cli", "up", "--config", str(ROOT / DESIGNS[design][1]), "--run-dir",
            str(run_dir), "--run-id", run_id, "--fresh", *[arg for item in sets for arg in ("--set", item)]]


def export_history(run_dir: pathlib.Path, run_id: str, out: pathlib.Path) -> int:
    """The run's history:turn and history:step streams, read from its persistent Redis files (a
    redis-server started on them for the read), one JSON object per record; how many."""
    import redis
    from google.protobuf.json_format import MessageToDict

    from libra.redis_server import PrivateRedis
    from libra.state.keys import Keys
    from libra.v1 import common_pb2

    server = PrivateRedis(run_dir / "redis", log_path=out.parent / "redis-export.log", persistent=True).start()
    try:
        client, keys, count = redis.Redis.from_url(server.url), Keys(run_id), 0
        with open(out, "w") as sink:
            for kind in ("turn", "step"):
                for entry, fields in client.xrange(keys.history(kind)):
                    record = common_pb2.HistoryRecord.FromString(fields[b"data"])
                    row = MessageToDict(record, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
                    sink.write(json.dumps({"id": entry.decode(), **row}) + "\n")
                    count += 1
        client.close()
        return count
    finally:
        server.stop()


def run_once(design: str, index: int, args: argparse.Namespace, env: dict[str, str]) -> Run:
    run_id = f"hl-{design}-{index}-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix=f"headline-{design}-") as scratch:
        work = pathlib.Path(scratch)
        with open(work / "output.log", "w") as log:
            started = time.time()
            process = subprocess.Popen(command(design, work / "run", run_id, args.steps), cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        rows = step_rows(design, work)
        (work / "run.json").write_text(json.dumps({"design": design, "run": index, "run_id": run_id,
                                                   "started": started, "ended": ended}))
        kept = ""
        if args.keep_runs:
            try:
                print(f"  history records exported: {export_history(work / 'run', run_id, work / 'history.jsonl')}",
                      flush=True)
            except Exception as error:  # noqa: BLE001 - the run's figures stand without it; say why
                print(f"  history of {run_id} not exported: {error}", flush=True)
            kept = f"{design}-{index}"
            shutil.copytree(work, pathlib.Path(args.keep_runs) / kept, dirs_exist_ok=True, ignore=KEEP_IGNORE)
        if returncode != 0:
            print(f"  {design} run {index} exited {returncode}; last lines:\n"
                  + "\n".join((work / "output.log").read_text(errors="replace").splitlines()[-15:]), flush=True)
    rewards = [row["reward"] for row in rows]
    step = reached(rewards, args.target)
    rl_start = rows[0]["started"] if rows else None
    rl_s = rows[-1]["t"] - rl_start if rows else None
    trajectories = len(rows) * args.batch
    return Run(design, index, returncode, ended - started, rl_start - started if rl_start else None, rl_s,
               len(rows), trajectories, trajectories / rl_s if rl_s else None, step,
               rows[step - 1]["t"] - started if step else None, rows[step - 1]["t"] - rl_start if step else None,
               statistics.fmean(rewards[-WINDOW:]) if rewards else None,
               sum(monitor.cpu_by_pid.values()) / (ended - started), sum(row["rejected"] for row in rows), kept,
               [round(r, 4) for r in rewards], [round(row["t"] - started, 2) for row in rows])


# ---- the table and the plot -------------------------------------------------------------------
def _median(values: list) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "not reached" if values else "-"
    middle = statistics.median(present)
    text = f"{middle:.2f}" if isinstance(middle, float) and middle < 10 else f"{middle:.1f}" \
        if isinstance(middle, float) else f"{middle:g}"
    return text + (f" ({len(values) - len(present)} not)" if len(present) < len(values) else "")


def table(runs: list[Run], target: float) -> str:
    designs = [d for d in DESIGNS if any(r.design == d for r in runs)]
    rows = [("", *[f"({d}) {DESIGNS[d][0]}" for d in designs])]
    measures = [(f"s to {target} (10-step mean) from start", "reached_s"),
                (f"s to {target} from first RL step", "reached_rl_s"), (f"step reaching {target}", "reached_step"),
                ("trajectories/s (RL phase)", "trajectories_per_s"), ("s from start to first RL step", "rl_start_s"),
                ("wall s (libra up, all steps)", "wall_s"), ("final 10-step mean reward", "final_mean"),
                ("busy cores, whole run", "busy_cores"), ("trajectories rejected as stale", "rejected")]
    for label, key in measures:
        rows.append((label, *[_median([getattr(r, key) for r in runs if r.design == d]) for d in designs]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    count = {d: sum(r.design == d for r in runs) for d in designs}
    return "\n".join(lines) + (f"\n(medians over {', '.join(f'{n} ({d})' for d, n in count.items())} runs; "
                               "'not reached': runs whose 10-step mean never got there within the step cap)")


def smoothed(rewards: list[float]) -> list[float]:
    """Trailing mean over up to WINDOW steps (fewer at the start)."""
    return [statistics.fmean(rewards[max(0, i + 1 - WINDOW):i + 1]) for i in range(len(rewards))]


def plot(runs: list[Run], target: float, out: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.5))
    for design in DESIGNS:
        mine = [r for r in runs if r.design == design and r.rewards]
        if not mine:
            continue
        times = [r.reached_s for r in mine if r.reached_s is not None]
        label = (f"({design}) {DESIGNS[design][0]}: {target} reached in "
                 + (f"{statistics.median(times):.0f} s (median of {len(times)}/{len(mine)})" if times else
                    f"none of {len(mine)} runs"))
        for index, r in enumerate(mine):
            axis.plot(r.step_end_s, smoothed(r.rewards), color=COLORS[design], lw=1.6, alpha=0.85,
                      label=label if index == 0 else None)
            if r.reached_s is not None:
                axis.plot([r.reached_s], [smoothed(r.rewards)[r.reached_step - 1]], "o", color=COLORS[design], ms=5)
    axis.axhline(target, color="0.4", ls="--", lw=1)
    axis.text(axis.get_xlim()[0], target, f" threshold {target}", va="bottom", fontsize=8, color="0.3")
    axis.set_xlabel("wall-clock seconds since `libra up` started (model start-up included)")
    axis.set_ylabel(f"reward, trailing {WINDOW}-step mean")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def title(steps: int, runs: int) -> str:
    return (f"Designs on real processes, this {os.cpu_count()}-core CPU machine: tiny model, {steps} steps, "
            f"{runs} run(s) each")


def save(runs: list[Run], args: argparse.Namespace) -> None:
    payload = json.dumps({"target": args.target, "steps": args.steps, "batch": args.batch, "measure": MEASURE,
                          "overrides": OVERRIDES, "runs": [asdict(r) for r in runs]}, indent=1)
    for out in [args.json] + ([str(pathlib.Path(args.keep_runs) / "runs.json")] if args.keep_runs else []):
        if out:
            pathlib.Path(out).write_text(payload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Designs (a), (b), (d) with libra up on this machine.")
    parser.add_argument("--runs", type=int, default=3, help="runs of each design (interleaved)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (the cap)")
    parser.add_argument("--target", type=float, default=0.65, help="10-step mean reward to reach")
    parser.add_argument("--only", nargs="+", choices=list(DESIGNS), default=list(DESIGNS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--keep-runs", default="", help="keep each run's record and history here "
                                                        "(benchmarks/sim_vs_real.py reads it)")
    parser.add_argument("--plot", default=str(ROOT / "benchmarks/results/headline_cpu.png"))
    parser.add_argument("--json", default="", help="every run's figures here too (--keep-runs: DIR/runs.json)")
    parser.add_argument("--report", default="", help="no runs: the table and plot of a runs.json written before")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(pathlib.Path(args.report).read_text())
        runs = [Run(**row) for row in saved["runs"]]
        print(table(runs, saved["target"]))
        plot(runs, saved["target"], pathlib.Path(args.plot), title(saved["steps"], max(r.run for r in runs)))
        print(f"plot: {args.plot}")
        return 0
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be >= 1")
    from libra.config import load_run_config

    batches = {load_run_config(str(ROOT / DESIGNS[d][1])).trainer for d in args.only}
    sizes = {t.groups_per_step * t.group_size for t in batches}
    if len(sizes) != 1:
        parser.error(f"the designs train different batches ({sorted(sizes)}): they must be the same")
    args.batch = sizes.pop()
    if args.keep_runs:
        pathlib.Path(args.keep_runs).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    warm_cache(env)  # the headline configs share the quickstart's model recipe: one cache entry
    runs: list[Run] = []
    for index in range(1, args.runs + 1):
        for design in args.only:
            run = run_once(design, index, args, env)
            runs.append(run)
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(run).items()
                     if k not in ("rewards", "step_end_s")}
            print(json.dumps(shown), flush=True)
            save(runs, args)  # after every run: an interrupted measurement keeps what it ran
    print(table(runs, args.target))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    plot(runs, args.target, pathlib.Path(args.plot), title(args.steps, args.runs))
    print(f"plot: {args.plot}")
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
