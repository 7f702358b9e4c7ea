"""Diagnostic: a design's run with its first plan replaced by the plan the replay ranked K-th.

A run's first plan is the fastest of its candidates replayed on step 0's batch
(`services/planner/sim/rank.first_plan`). Where the top candidates replay within a percent or two
of each other, the choice between them is a near tie the replay cannot settle, and the lengths'
growth over the run (which step 0's batch does not show) may favour another. This runs `libra
sim` with the arguments given, exactly as the CLI would, except that the ranking's K-th plan is
held instead of the first; it prints the CPU time of that choice and the top of the ranking first.
With --rank 1 it is the plain run.

    .venv/bin/python benchmarks/first_plan_rank.py --rank 2 -- --config configs/headline/c-libra-static.yaml \\
        --set planner.cluster.gpus=4096 --trace r2e --steps 100 --prompts 4096 --seed 0 --drift 1.0
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from libra.services.planner.sim import rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=2, help="which of the replay's ranking to hold (1: the first)")
    parser.add_argument("--show", type=int, default=5, help="ranked plans to print")
    parser.add_argument("sim_args", nargs=argparse.REMAINDER, help="-- then `libra sim`'s arguments")
    args = parser.parse_args()
    sim_args = args.sim_args[1:] if args.sim_args[:1] == ["--"] else args.sim_args
    if args.rank < 1:
        parser.error(f"--rank must be >= 1, got {args.rank}")
    ranked_first = rank.first_plan

    def kth(*positional, **keywords):
        started = time.process_time()
        first = ranked_first(*positional, **keywords)
        print(f"the first plan's choice: {time.process_time() - started:.1f} CPU-s (the search and "
              f"{len(first.ranked)} replays, in this process)", flush=True)
        if args.rank > len(first.ranked):
            raise SystemExit(f"the replay ranked {len(first.ranked)} plans; --rank {args.rank} is not among them")
        for place, (candidate, per_step) in enumerate(first.ranked[:max(args.show, args.rank)], start=1):
            mark = "  <- held" if place == args.rank else ""
            print(f"replay #{place}: {per_step:9.1f}s per step  {candidate.describe()}{mark}", flush=True)
        chosen, per_step = first.ranked[args.rank - 1]
        return dataclasses.replace(first, chosen=chosen, reason=f"the replay's #{args.rank} ({per_step:.1f}s per step), "
                                                                f"held by benchmarks/first_plan_rank.py")

    rank.first_plan = kth  # control.SearchOnce imports it when the run starts
    from libra.cli import main as cli_main
    cli_main(["sim", *sim_args])


if __name__ == "__main__":
    main()
