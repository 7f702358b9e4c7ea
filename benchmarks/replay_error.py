"""Diagnostic: how far the replanner's window replay is from a plan's own whole run, per plan.

The replanner judges a move by replaying the last steps of the trace under each candidate plan
(`sim/rank.SimRanker`: `--warmup` steps that only fill the pipeline, then 9 measured). Here each
candidate of the GRP evaluation (benchmarks/grp_eval.py's hindsight shortlist, plus the search's
distinct splits on the batches of the `--at` steps) is also simulated over the whole trace, and
the replay's seconds per step after step s is printed beside the whole run's over the same 8
steps (s - 8 .. s): the ratio is the replay's error for that plan, at the efficiencies the
simulator runs at (no calibration to undo). A ratio that differs from plan to plan is what no
single calibration can correct (services/planner/audit.py measures it after each move instead).

    .venv/bin/python benchmarks/replay_error.py [--gpus 512] [--at 43] [--warmups 4 16 30]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import types

from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import TrainEfficiency
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig, search
from libra.services.planner.sim import run as sim_run
from libra.services.planner.sim.cluster import SimConfig
from libra.services.planner.sim.rank import SimRanker

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from grp_eval import SEARCH, hindsight_candidates  # noqa: E402  (the evaluation's own candidates)

MEASURED = ReplanSettings().sim_window_steps  # the replay's measured steps, as the replanner's default
SPAN = MEASURED - 1  # the intervals between them, the steps compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--drift", type=float, default=2.0)
    parser.add_argument("--at", type=int, nargs="+", default=[43], help="steps after which to replay")
    parser.add_argument("--warmups", type=int, nargs="+", default=[4, 16, 30], help="replay warm-up steps")
    args = parser.parse_args()
    started = time.process_time()
    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    trace = sim_run.build_trace("synthetic", args.steps, args.gpus * 4, 8, 0, args.drift, 1024)
    config = SearchConfig(total_gpus=args.gpus, group_size=8, **SEARCH)
    candidates = hindsight_candidates(model, gpu, args.gpus, trace, [])
    replanner_search = config.model_copy(update={"distinct_splits": True, "fleets_per_split": 2, "top_k": 4})
    for step in args.at:
        for c in search(model, gpu, trace.pairs(step), replanner_search).alternatives:
            if all((c.layout, c.rollout) != (d.layout, d.rollout) for d in candidates):
                candidates.append(c)
    whole = []
    for candidate in candidates:
        try:
            whole.append((candidate, sim_run.run_plan(model, gpu, trace, candidate, config)))
        except Exception as error:  # noqa: BLE001 - a plan that cannot run the whole trace is left out
            print(f"  cannot run the whole trace: {candidate.describe()}: {error}")
    print(f"{args.gpus} GPUs, drift {args.drift}: {len(whole)} plans, each over the whole trace "
          f"({time.process_time() - started:.0f} CPU-s)", flush=True)
    sim, rollout, train = SimConfig(core_replicas=1), RolloutEfficiency(), TrainEfficiency()
    for step in args.at:
        print(f"\nafter step {step}: replayed / whole run, seconds per step over steps {step - SPAN}..{step}")
        print(f"  {'plan':>4} {'whole':>8} " + " ".join(f"{'warm ' + str(w):>15}" for w in args.warmups))
        for index, (candidate, result) in enumerate(whole):
            truth = (result.steps[step].time_s - result.steps[step - SPAN].time_s) / SPAN
            cells = []
            for warm in args.warmups:
                ranker = SimRanker(model, gpu, config, sim, MEASURED, warm)
                observed = [types.SimpleNamespace(trajectories=trace.steps[k], lengths=trace.pairs(k))
                            for k in range(step - MEASURED + 1 - warm, step + 1)]
                replayed = ranker.play(ranker.window(observed), candidate, rollout, train).per_step_s
                cells.append(f"{replayed:7.1f} ({replayed / truth:.3f})")
            row = " ".join(f"{c:>15}" for c in cells)
            print(f"  #{index:<3} {truth:8.1f} {row}  {candidate.describe()[:90]}", flush=True)
    print(f"\n({time.process_time() - started:.0f} CPU-s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
