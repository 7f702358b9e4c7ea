"""Benchmark: the headline, simulated (issue 16 item 3): Libra against the designs users run instead.

The four designs are the run configs under configs/headline/, each simulated exactly as
`libra sim --config FILE [--set KEY=VALUE ...] --trace r2e ...` simulates it
(services/planner/sim/design.py); every row prints that command.

    (a) a-sync-colocated   synchronous colocated (verl's default trainer)
    (b) b-async-even       asynchronous, static even split, load balance, staleness bound (AReaL)
    (c) c-libra-static     the planner's split and buckets, C-MLFQ
    (d) d-libra-full       online replanning, elastic hybrid pool, C-MLFQ

Qwen3-14B on A800 nodes (configs/models/qwen3-14b.yaml, configs/hardware/a800-80g.yaml), an
R2E-Gym-like trace (libra/traces/r2e.py: up to 30k new tokens and 12 turns, lengths drifting by
1 + drift over the run), 8 trajectories per GPU per step (GPUs prompts x GRPO groups of 8).

    sweep     the best settings of (a) and (b) at every scale: each TP degree (tp_choices) is
              simulated and the fastest is the row (what a careful user would do); (c) and (d)
              take the planner's choices as they come
    table     (a)-(d): trajectories/s, output tokens/s, mean step time (first and last 10 steps),
              busy GPU fraction per pool, staleness shares; (d) over (a) and over (b)
    ablation  (d) with one mechanism off at a time (at --ablation-gpus): C-MLFQ -> load balance,
              heterogeneous buckets -> one TP degree ((b)'s best), replanning off (planner.mode
              static), elastic pool off (elastic.core_replicas 65536: no replica is ever a hybrid)
    plot      trajectories/s over steps per design at the first GPU count
              (benchmarks/results/headline_<gpus>.png); every number in
              benchmarks/results/headline_sim.json

Runs are independent and deterministic; `--jobs` runs them in parallel processes. Every finished
run is appended to OUT with the suffix .rows.jsonl at once, and a run whose command is there
already is not run again (delete that file to start afresh). With --checkpoint-dir DIR each run
also saves its whole state in DIR (every --checkpoint-every-s, 300 s; services/planner/sim/checkpoint.py), so a run
stopped part way (an hour at 4,096 GPUs) goes on from there when the command is run again. SIGTERM
or Ctrl-C, to this process alone or to all of them, stops every run in progress at its step's end,
saved, and starts no other (exit 75), with --jobs 1 or more.

    .venv/bin/python benchmarks/headline_sim.py [--gpus 48 512 4096] [--steps 100] [--seed 0]
        [--drift 1.0] [--ablation-gpus 48] [--online-gpus 48 512 4096] [--jobs 1] [--only a b c d]
        [--ablation-rows scheduler buckets replanning elastic] [--replay-workers N] [--checkpoint-dir DIR]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import pathlib
import resource
import signal
import sys
import time

from libra.config import load_run_config
from libra.services.planner.sim import design as sim_design
from libra.services.planner.sim.checkpoint import Checkpoint, Stopped

ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = {key: f"configs/headline/{name}.yaml" for key, name in
           (("a", "a-sync-colocated"), ("b", "b-async-even"), ("c", "c-libra-static"), ("d", "d-libra-full"))}
TITLES = {"a": "(a) sync colocated (verl)", "b": "(b) async even split + LB (AReaL)",
          "c": "(c) Libra static", "d": "(d) Libra full"}
SWEEP = {"a": ([1, 2, 4, 8], [1], [2], [4], [8]), "b": ([1], [2], [4], [8])}
TRACES: dict = {}  # (gpus, steps, seed, drift) -> Trace, built before the workers fork
REPLAY_WORKERS = [1]  # planner.replan.sim_workers of every run (--replay-workers; the results do not depend on it)
CHECKPOINTS: list[pathlib.Path | None] = [None]  # --checkpoint-dir: each run saves itself there as it goes
CHECKPOINT_EVERY_S = [300.0]  # --checkpoint-every-s
ABLATION_ROWS = ("scheduler", "buckets", "replanning", "elastic")  # --ablation-rows: the mechanism each turns off
STOP: list = [None]  # with --jobs > 1: a multiprocessing Event set when the benchmark is asked to stop


def overrides_for(key: str, gpus: int, extra: dict | None = None) -> dict:
    """The --set overrides that put design `key` at `gpus` GPUs (the even split of (b) scaled)."""
    found = {"planner.cluster.gpus": gpus}
    if key == "b":
        found.update({"planner.cluster.min_train_gpus": gpus // 2, "planner.cluster.min_rollout_gpus": gpus // 2})
    return {**found, **(extra or {})}


def command(key: str, sets: dict, args: argparse.Namespace, gpus: int) -> str:
    shown = " ".join(f"--set {k}={v if isinstance(v, str) else json.dumps(v).replace(' ', '')}"
                     for k, v in sets.items())
    return (f".venv/bin/libra sim --config {CONFIGS[key]} {shown} --trace r2e --steps {args.steps} "
            f"--prompts {gpus} --seed {args.seed} --drift {args.drift}")


def run_one(job: tuple) -> dict:
    """One simulated run (in a worker process): the row's numbers, or why it could not run."""
    label, key, gpus, sets, cmd, trace_key, role = job
    if _stopping():  # (--jobs > 1: a queued run after the benchmark was asked to stop)
        raise Stopped(f"{label}: not started (the benchmark was asked to stop); run the command again to go on")
    config = load_run_config(ROOT / CONFIGS[key], {**sets, "planner.replan.sim_workers": REPLAY_WORKERS[0]}, env={})
    design = sim_design.design_of(config)
    checkpoint = None
    if CHECKPOINTS[0] is not None:  # a row stopped part way goes on from its checkpoint (named by its command)
        checkpoint = Checkpoint(_checkpoint_of(cmd), key=cmd, every_s=CHECKPOINT_EVERY_S[0])
    try:
        with checkpoint.stop_on_signals() if checkpoint is not None else contextlib.nullcontext():
            if checkpoint is not None and _stopping():
                checkpoint.stop = True  # (asked to stop while this run was being set up: save at step 1)
            played = sim_design.simulate_design(design, TRACES[trace_key], trace_key[1], checkpoint=checkpoint)
    except Stopped:  # SIGTERM/SIGINT: saved; the benchmark stops (run it again to go on)
        raise
    except Exception as error:  # noqa: BLE001 - a setting the design cannot run is a row that says why
        if checkpoint is not None and checkpoint.stop:  # failed while stopping (a signal to the whole group):
            raise Stopped(f"{label}: stopped ({str(error)[:200]}); its last checkpoint is kept: run the command "
                          f"again to go on") from error  # no row, which would keep it from running again
        return {"label": label, "key": key, "role": role, "gpus": gpus, "sets": sets, "command": cmd,
                "error": str(error)[:400]}
    result, usage = played.result, played.usage
    steps = result.steps
    return {"label": label, "key": key, "role": role, "gpus": gpus, "sets": sets, "command": cmd,
            "trajectories_per_s": result.trajectories_per_s, "tokens_per_s": result.tokens_per_s,
            "makespan_s": result.makespan_s, "step_s": result.makespan_s / len(steps),
            "step_first10_s": _mean(s.interval_s for s in steps[:10]),
            "step_last10_s": _mean(s.interval_s for s in steps[-10:]),
            "busy": usage.fractions(), "staleness": usage.staleness_shares(),
            "first_plan": result.first_plan, "last_plan": result.last_plan,
            "plan_changes": [{"step": c.step, "transition_s": c.transition_s, "after": c.after,
                              "reason": c.reason} for c in result.plan_changes], "rejected": usage.rejected,
            "hybrid_moves": played.hybrid_moves, "notes": len(result.notes), "pooled": result.pooled,
            "copies": result.copies,
            "routes": result.routes, "cpu_s": result.cpu_s,  # (every part of a resumed run, its workers' included)
            "wall_s": result.wall_s, "replay_workers": REPLAY_WORKERS[0],
            "steps": [{"step": s.step, "time_s": s.time_s, "interval_s": s.interval_s, "rollout_s": s.rollout_s,
                       "train_s": s.train_s, "sequences": s.sequences} for s in steps]}


def run_all(jobs: list[tuple], processes: int, rows_file: pathlib.Path) -> list[dict]:
    """Every job's row; rows already in `rows_file` (the same command) are not run again, and every
    new row is appended to it as soon as it is done (a long run that is stopped loses nothing).

    In parallel (`processes` > 1), SIGTERM or SIGINT to this process (a `timeout`, a batch system
    or Ctrl-C) is passed on to the workers: each run in progress saves at its step's end and stops,
    no queued run starts, the rows already done are kept, and then `Stopped` is raised here, as in
    one process. Without --checkpoint-dir a run has nothing to save: the workers are killed and the
    process exits at once (128 + the signal's number)."""
    done = {}
    if rows_file.exists():
        for line in rows_file.read_text().splitlines():
            row = json.loads(line)
            done[row["command"]] = row
    todo = [job for job in jobs if job[4] not in done]
    rows = [_progress(done[job[4]], rows_file=None) for job in jobs if job[4] in done]
    if processes <= 1:
        return rows + [_progress(run_one(job), rows_file) for job in todo]
    context = multiprocessing.get_context("fork")
    STOP[0] = context.Event()  # inherited by the workers (forked after this)

    def stop(signum, _frame) -> None:
        if CHECKPOINTS[0] is None:  # nothing a run could save: stop now (the workers are killed below)
            raise SystemExit(128 + signum)
        STOP[0].set()
        for child in multiprocessing.active_children():  # the pool's workers (their replays' are theirs)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)

    stopped: list[Stopped] = []
    finished = False
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    pool = context.Pool(processes, initializer=_worker_start)
    try:
        results = pool.imap_unordered(run_one, todo)
        while True:
            try:
                rows.append(_progress(next(results), rows_file))
            except StopIteration:
                break
            except Stopped as error:  # a run saved and stopped: wait for the others to do the same
                print(f"  stopped: {error}", flush=True)
                stopped.append(error)
        pool.close()  # the workers leave once the queue is empty (they ignore SIGTERM: no terminate())
        pool.join()
        finished = True
    finally:
        if not finished:  # interrupted without checkpoints, or failed: the workers go now
            for child in multiprocessing.active_children():
                child.kill()
            pool.terminate()
            pool.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        STOP[0] = None
    if len(stopped) == 1:
        raise stopped[0]
    if stopped:
        raise Stopped(f"{len(stopped)} runs stopped, each as said above; run the same command again to go on")
    return rows


def _worker_start() -> None:
    """A pool worker between runs ignores SIGTERM and SIGINT (the main process passes them on; a run
    in progress catches them itself, `Checkpoint.stop_on_signals`, and restores this after)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stopping() -> bool:
    """Whether the main process of a --jobs > 1 run was asked to stop (never, in one process: there the
    signal reaches the run itself)."""
    return STOP[0] is not None and STOP[0].is_set()


def _checkpoint_of(cmd: str) -> pathlib.Path | None:
    if CHECKPOINTS[0] is None:
        return None
    return CHECKPOINTS[0] / f"{hashlib.sha256(cmd.encode()).hexdigest()[:16]}.pkl"


def _progress(row: dict, rows_file: pathlib.Path | None) -> dict:
    if rows_file is not None:
        with rows_file.open("a") as out:
            out.write(json.dumps(row, default=str) + "\n")
        done = _checkpoint_of(row["command"])
        if done is not None and "error" not in row:  # the row is kept: nothing left to go on from
            done.unlink(missing_ok=True)
    if "error" in row:
        print(f"  {row['label']:44s} cannot run: {row['error'][:160]}", flush=True)
    else:
        print(f"  {row['label']:44s} {row['trajectories_per_s']:8.3f} traj/s  (CPU {row['cpu_s']:.0f}s)", flush=True)
    return row


def scale(gpus: int, args: argparse.Namespace) -> dict:
    trace_key = (gpus, args.steps, args.seed, args.drift)
    keys = [k for k in "abcd" if k in args.only and (k != "d" or gpus in args.online_gpus)]

    def job(label: str, key: str, extra: dict | None = None, role: str = "design") -> tuple:
        sets = overrides_for(key, gpus, extra)
        return label, key, gpus, sets, command(key, sets, args, gpus), trace_key, role

    jobs = [job(TITLES[key], key) for key in keys if key not in SWEEP]
    if gpus in args.ablation_gpus and "d" in keys:
        homogeneous = load_run_config(ROOT / CONFIGS["b"], env={}).planner.cluster.tp_choices  # (b)'s, the best swept
        jobs += [job(f"(d) minus {what}", "d", sets, "ablation") for name, what, sets in (
            ("scheduler", "C-MLFQ -> load balance", {"scheduler.policy": "load_balance"}),
            ("buckets", f"heterogeneous -> homogeneous tp_choices {list(homogeneous)}",
             {"planner.cluster.tp_choices": list(homogeneous)}),
            ("replanning", "replanning off (planner.mode static)", {"planner.mode": "static"}))
            if name in args.ablation_rows]
    jobs.sort(key=lambda j: j[1] != "d" or "planner.mode" in j[3])  # the online runs (the long ones) first
    jobs += [job(f"{TITLES[key][:3]} tp_choices {choice}", key, {"planner.cluster.tp_choices": choice})
             for key in keys for choice in SWEEP.get(key, ())]
    print(f"\n{gpus} GPUs: {', '.join(keys)}, sweeps of (a) and (b)"
          f"{', ablation of (d)' if gpus in args.ablation_gpus else ''}", flush=True)
    rows_file = pathlib.Path(args.out).with_suffix(".rows.jsonl")
    rows = run_all(jobs, args.jobs, rows_file)
    if gpus in args.ablation_gpus and "d" in keys and "elastic" in args.ablation_rows:
        rows.append(elastic_off(job("(d) minus elastic pool off (core_replicas 65536)", "d",
                                    {"elastic.core_replicas": 65536}, "ablation"), rows, rows_file))
    design_rows = {key: [r for r in rows if r["key"] == key and r.get("role") != "ablation" and "error" not in r]
                   for key in keys}
    best = {key: max(found, key=lambda r: r["trajectories_per_s"]) for key, found in design_rows.items() if found}
    report = {"gpus": gpus, "batch": gpus * 8, "best": best,
              "sweep": [r for r in rows if r["key"] in SWEEP],
              "ablation": [r for r in rows if r.get("role") == "ablation"]}
    print_scale(report)
    return report


def elastic_off(job: tuple, rows: list[dict], rows_file: pathlib.Path) -> dict:
    """(d) without the elastic pool. When (d) made no move the pool could make (no hybrid move),
    the run is (d)'s to the last event: the pool only changes how a move of training replicas
    alone is made, and the replanner, which also replays such moves with the pool, chose none of
    them; a move's replayed cost without the pool can only be higher, so no decision changes.
    Then (d)'s row stands for it (said in its label) instead of another hour of replays."""
    full = next((r for r in rows if r["key"] == "d" and r["role"] == "design" and "error" not in r), None)
    if full is None or full["hybrid_moves"]:
        return run_all([job], 1, rows_file)[0]
    return {**full, "label": job[0] + ": = (d), which made no hybrid move", "role": "ablation", "sets": job[3],
            "command": job[4], "cpu_s": 0.0}


def print_scale(report: dict) -> None:
    best = report["best"]
    print(f"\n{report['gpus']} GPUs, batch {report['batch']} trajectories per step")
    print(f"  {'design':50s} {'traj/s':>8s} {'tok/s':>9s} {'step s':>7s} {'first10':>8s} {'last10':>7s}  "
          "busy / staleness")
    rows = [(TITLES[k], r) for k, r in best.items()] + [(r["label"], r) for r in report.get("ablation", [])]
    for title, r in rows:
        if "error" in r:
            print(f"  {title[:50]:50s} cannot run: {r['error'][:120]}")
            continue
        busy = " ".join(f"{pool} {share:.0%}" for pool, share in r["busy"].items())
        stale = " ".join(f"{lag}:{share:.0%}" for lag, share in r["staleness"].items())
        stale += f" rejected {r['rejected']:,}" if r["rejected"] else ""
        print(f"  {title[:50]:50s} {r['trajectories_per_s']:8.3f} {r['tokens_per_s']:9,.0f} {r['step_s']:7.1f} "
              f"{r['step_first10_s']:8.1f} {r['step_last10_s']:7.1f}  {busy} / {stale}")
    if "d" in best:
        for other in ("a", "b", "c"):
            if other in best:
                ratio = best["d"]["trajectories_per_s"] / best[other]["trajectories_per_s"]
                print(f"  (d) / {TITLES[other][:3]}: {ratio:.2f}x")
    for title, r in rows:
        if "error" not in r:
            print(f"  {title}: {r['first_plan']}" + (f"\n      -> {r['last_plan']} ({len(r['plan_changes'])} "
                                                          f"changes)" if r["plan_changes"] else ""))
            print(f"      {r['command']}")


def plot(report: dict, out: pathlib.Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 4.2))
    for index, (key, r) in enumerate(report["best"].items()):
        rates = [s["sequences"] / s["interval_s"] for s in r["steps"]]
        smooth = [_mean(rates[max(0, i - 9):i + 1]) for i in range(len(rates))]
        line, = axis.plot([s["step"] for s in r["steps"]], smooth, lw=1.8, ls=("-", "--", ":", "-.")[index % 4],
                          label=f"{TITLES[key]}: {r['trajectories_per_s']:.2f} traj/s overall")
        for change in r["plan_changes"]:
            axis.axvline(change["step"], color=line.get_color(), ls=":", lw=0.8)
    axis.set_xlabel("training step")
    axis.set_ylabel("trajectories / s (10-step mean)")
    axis.set_title(f"Qwen3-14B, {report['gpus']} x A800, R2E-Gym-like trace (drift {args.drift}), simulated")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[48, 512, 4096])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift", type=float, default=1.0)
    parser.add_argument("--ablation-gpus", type=int, nargs="*", default=[48])
    parser.add_argument("--online-gpus", type=int, nargs="*", default=[48, 512, 4096],
                        help="GPU counts at which (d) is simulated (its replanner replays the recent steps "
                             "after every step: the costliest run by far)")
    parser.add_argument("--only", nargs="+", default=list("abcd"), choices=list("abcd"))
    parser.add_argument("--ablation-rows", nargs="+", default=list(ABLATION_ROWS), choices=list(ABLATION_ROWS),
                        help="which of the ablation's rows to run (each is an hour or more at 4,096 GPUs: split "
                             "them over machines, each with its own --out, and merge the rows files)")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes")
    parser.add_argument("--replay-workers", type=int, default=1,
                        help="planner.replan.sim_workers of every run: the online runs' replays side by side in "
                             "this many processes (the same results, sooner; not part of a row's command)")
    parser.add_argument("--checkpoint-dir",
                        help="each run saves its whole state here as it goes and, run again, goes on from it (a "
                             "killed benchmark loses at most --checkpoint-every-s of each run; SIGTERM or Ctrl-C "
                             "saves at the step's end and exits 75; not part of a row's command)")
    parser.add_argument("--checkpoint-every-s", type=float, default=300.0,
                        help="wall seconds between a run's checkpoints, at a step's end")
    parser.add_argument("--out", default=str(RESULTS / "headline_sim.json"))
    args = parser.parse_args()
    REPLAY_WORKERS[0] = args.replay_workers
    CHECKPOINTS[0] = pathlib.Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.checkpoint_every_s < 0:
        parser.error(f"--checkpoint-every-s must be >= 0 seconds, got {args.checkpoint_every_s}")
    CHECKPOINT_EVERY_S[0] = args.checkpoint_every_s
    started = time.perf_counter()
    for gpus in args.gpus:  # built once here; the worker processes inherit them
        TRACES[(gpus, args.steps, args.seed, args.drift)] = sim_design.design_trace(  # as `libra sim --config` does
            "r2e", args.steps, gpus, 8, args.seed, args.drift)
    reports = [scale(gpus, args) for gpus in args.gpus]
    RESULTS.mkdir(exist_ok=True)
    if reports and reports[0]["best"]:
        out = pathlib.Path(args.out).parent / f"headline_{reports[0]['gpus']}.png"  # beside --out's json
        plot(reports[0], out, args)
        print(f"\nwrote {out}")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    payload = {"command": "benchmarks/headline_sim.py " + " ".join(sys.argv[1:]), "args": vars(args),
               "cpu_s": me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime,
               "wall_s": time.perf_counter() - started, "scales": reports}
    pathlib.Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except Stopped as stopped:
        print(f"headline_sim: {stopped}", file=sys.stderr)
        sys.exit(75)
