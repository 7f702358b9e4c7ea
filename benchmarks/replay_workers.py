"""How long one replanner decision takes with its replays in worker processes
(`planner.replan.sim_workers`), against one after the other in the planner's process.

The decision timed is the one every simulated-ranking run starts with (`rank.first_plan`, also
`libra plan --simulate`): the closed-form search prunes, and each plan of its shortlist, the best
plan's engine exchanges and its neighbours at other training sizes is replayed over the first
batch repeated (a replay's window, ~13 steps). The online replanner's decisions are the same
replays of its recent window (two rounds in parallel: the plan in force beside the candidates,
then the moves of the fastest two). Each worker count runs the same decision; the script checks
that every one ranks the plans exactly as the serial run does and prints, side by side, wall
seconds, CPU seconds (this process, and the workers' replays; their start-up, ~1 CPU-s each, not
counted) and the speed-up against serial.

    .venv/bin/python benchmarks/replay_workers.py --gpus 4096 --workers 1 4 8 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from libra.config import load_run_config  # noqa: E402
from libra.services.planner.sim import design as sim_design  # noqa: E402
from libra.services.planner.sim.rank import first_plan  # noqa: E402

CONFIG = "configs/headline/c-libra-static.yaml"


def decide(design, batch, workers: int) -> tuple[float, float, tuple]:
    settings = design.replan.model_copy(update={"sim_workers": workers})
    replay = design.sim.model_copy(update={"batching": "in_order", "steps": 0})
    cpu, wall = time.process_time(), time.perf_counter()
    chosen = first_plan(design.model, design.gpu, design.search, replay, batch, settings)
    wall = time.perf_counter() - wall
    cpu_s = time.process_time() - cpu + chosen.worker_cpu_s  # the workers' start-up not counted
    return wall, cpu_s, tuple((c.describe(), round(s, 6)) for c, s in chosen.ranked)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--gpus", type=int, default=4096)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.workers[0] != 1:
        parser.error("--workers must start with 1: the serial decision every other is compared with")
    design = sim_design.design_of(load_run_config(args.config, {"planner.cluster.gpus": args.gpus}, env={}))
    steps = 100  # the headline's trace (benchmarks/headline_sim.py): its step-0 batch is what is ranked
    trace = sim_design.design_trace("r2e", steps, args.gpus, design.search.group_size, args.seed, 1.0)
    batch = trace.steps[0]
    print(f"{args.config} at {args.gpus} GPUs: the first plan's decision over step 0's {trace.batch:,} trajectories "
          f"(cores available: {len(os.sched_getaffinity(0))})", flush=True)
    rows, serial = [], None
    for workers in args.workers:
        wall, cpu_s, ranked = decide(design, batch, workers)
        serial = serial or (wall, ranked)
        same = ranked == serial[1]
        rows.append((workers, wall, cpu_s, serial[0] / wall, same, len(ranked)))
        print(f"  workers {workers:3d}: {wall:7.1f} s wall  {cpu_s:7.1f} CPU-s  {serial[0] / wall:5.2f}x serial  "
              f"ranking {'the same' if same else 'DIFFERENT'} ({len(ranked)} plans replayed)", flush=True)
    if not all(row[4] for row in rows):
        print("a worker count ranked the plans differently from the serial run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
