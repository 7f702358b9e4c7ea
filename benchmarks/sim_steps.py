"""Watch one headline design in the cluster simulator step by step: each step's record as it ends
(with the wall seconds so far), and, for an online design, each decision of the replanner and each
plan change as they are made; stops after `--last` steps. For long runs (the online design at
thousands of GPUs) where `libra sim` prints every tenth step only at the end of a decision.

    .venv/bin/python benchmarks/sim_steps.py --config configs/headline/d-libra-full.yaml --gpus 4096 \\
        --last 21 --replay-workers 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from libra.config import load_run_config  # noqa: E402
from libra.services.planner.sim import design as sim_design  # noqa: E402
from libra.services.planner.sim.cluster import Simulator  # noqa: E402


class Stop(Exception):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/headline/d-libra-full.yaml")
    parser.add_argument("--gpus", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100, help="the run's length (it shapes the trace)")
    parser.add_argument("--last", type=int, default=20, help="stop after this step")
    parser.add_argument("--replay-workers", type=int, default=1, help="planner.replan.sim_workers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = load_run_config(args.config, {"planner.cluster.gpus": args.gpus,
                                           "planner.replan.sim_workers": args.replay_workers}, env={})
    design = sim_design.design_of(config)
    trace = sim_design.design_trace("r2e", args.steps, args.gpus, design.search.group_size, args.seed, 1.0)
    controller = sim_design.controller_of(design)
    started = time.perf_counter()
    seen = [0]

    def report(r) -> None:
        if r.step == 0:
            print(f"{design.name} at {args.gpus} GPUs, first plan: {getattr(controller, 'reason', '')}", flush=True)
        print(f"step {r.step} at {time.perf_counter() - started:.1f}s wall: t={r.time_s:.0f} interval "
              f"{r.interval_s:.0f} rollout {r.rollout_s:.0f} train {r.train_s:.0f} trainer waited "
              f"{getattr(r, 'wait_s', 0.0):.0f}", flush=True)
        if r.step >= args.last:
            raise Stop

    decided = getattr(controller, "after_step")

    def after_step(record):
        change = decided(record)
        for step, applied, reason in getattr(controller, "decisions", [])[seen[0]:]:
            print(f"  decision after step {step}: {'APPLIED' if applied else 'kept'}: {reason}", flush=True)
        seen[0] = len(getattr(controller, "decisions", []))
        if change is not None:
            print(f"  change after step {record.step} (transition {change.transition_s:.0f}s): "
                  f"{change.candidate.describe()}", flush=True)
        return change

    controller.after_step = after_step
    simulator = Simulator(design.model, design.gpu, trace, controller, design.search,
                          design.sim.model_copy(update={"steps": args.steps}))
    try:
        simulator.run(report)
    except Stop:
        pass
    for note in simulator.notes[:10]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
