"""Routing variants tried against issue 15's signal-trace goal (within 1.15x of the bound), on the
measured windows of benchmarks/scheduler_eval.py, none of them kept.

On top of the outcome partition (every trajectory's class known before its first turn,
`scheduler_eval.outcome_levels`), two ways to keep the longest of the long trajectories apart:
- `cap K`: at most K trajectories in the long bucket at once, first come; the others of the long
  class wait in the medium bucket, each trying again at its next turn;
- `demote θ`: a long-class trajectory whose work done is below θ tokens at its third turn or later
  goes to the medium bucket for good, if a medium worker has fewer than 30 requests.
C-MLFQ changed in one place each:
- `mean only`: a tree node moves a trajectory by its mean alone (no agreement with its p90);
- `start spill`: a new trajectory starts on the least loaded worker of any bucket when its
  history's bucket holds more than 4x its requests (+1).
Every row is makespan / bound (mean of the seeds); the C-MLFQ rows also makespan / the best
baseline, from the evaluation's own runs of the baselines (its --json), every trace.

    .venv/bin/python benchmarks/scheduler_variants.py [--eval benchmarks/results/scheduler_eval.json] [--seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import scheduler_eval as E  # noqa: E402
from libra.routing.baselines import BucketPolicy  # noqa: E402
from libra.routing.cmlfq import CMLFQ  # noqa: E402
from libra.services.planner.sim.rollout import Window  # noqa: E402


class Capped(BucketPolicy):
    """The outcome partition with at most `limit` trajectories in the long bucket at once."""

    def __init__(self, cap: int, buckets, level_of: dict[str, int], limit: int):
        super().__init__(cap, True, buckets)
        self.level_of_trajectory, self.limit, self.on_long = level_of, limit, set()

    def target_level(self, turn, placement):
        level, tid = self.level_of_trajectory[turn.trajectory_id], turn.trajectory_id
        if level < 2 or tid in self.on_long:
            return level, "class"
        if len(self.on_long) < self.limit:
            self.on_long.add(tid)
            return 2, "admitted"
        return 1, "waiting"

    def finish(self, trajectory_id, prompt_id, output_tokens):
        super().finish(trajectory_id, prompt_id, output_tokens)
        self.on_long.discard(trajectory_id)


class Demoted(BucketPolicy):
    """The outcome partition; a long-class trajectory with little work done by its third turn goes down."""

    def __init__(self, cap: int, buckets, level_of: dict[str, int], below: int):
        super().__init__(cap, True, buckets)
        self.level_of_trajectory, self.below, self.done, self.demoted = level_of, below, {}, set()

    def target_level(self, turn, placement):
        tid = turn.trajectory_id
        level = self.level_of_trajectory[tid]
        if level < 2:
            return level, "class"
        if tid not in self.demoted and turn.turn >= 2 and self.done.get(tid, 0) < self.below:
            medium = [w for w in self.state.workers.values() if self.level_of.get(w.bucket) == 1]
            if min(w.outstanding_requests for w in medium) < 30:
                self.demoted.add(tid)
        return (1, "demoted") if tid in self.demoted else (2, "class")

    def turn_done(self, trajectory_id, worker_id, output_tokens=0):
        super().turn_done(trajectory_id, worker_id, output_tokens)
        self.done[trajectory_id] = self.done.get(trajectory_id, 0) + output_tokens


class MeanOnly(CMLFQ):
    """C-MLFQ whose tree lookups report each node's mean as its p90: mean and p90 always agree,
    so a node moves a trajectory by its mean alone (`_tree_level` unchanged; starts read the
    prompt tree's root directly, not through the lookup)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        lookup = self.forest.lookup

        def mean_as_p90(*call):
            stats, source, depth = lookup(*call)
            return (None if stats is None else dataclasses.replace(stats, p90=stats.mean)), source, depth
        self.forest.lookup = mean_as_p90


class StartSpill(CMLFQ):
    def _start(self, turn, candidates):
        worker, reason = super()._start(turn, candidates)
        idle = min((w for level in self._by_level(candidates) for w in level),
                   key=lambda w: (w.outstanding_requests, w.worker_id))
        if worker.outstanding_requests > 4 * idle.outstanding_requests + 1:
            return idle, "fallback:spill"
        return worker, reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", default=str(E.RESULTS / "scheduler_eval.json"),
                        help="scheduler_eval.py's --json (its bounds and baselines)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.process_time()
    runs = {(r["trace"], r["layout"], r["policy"], r["seed"]): r for r in json.loads(pathlib.Path(args.eval).read_text())}
    seeds = range(1, args.seeds + 1)
    for case in E.cases(E.RECORDED):
        key = (case.trace, case.layout_name)
        bound = {s: runs[(*key, "cmlfq", s)]["bound_s"] for s in seeds}
        best = min(sum(runs[(*key, p, s)]["makespan_s"] for s in seeds) for p in E.BASELINES)
        rows: dict[str, list[float]] = {}
        for seed in seeds:
            warm = case.draw(400, seed * 1000 + 1, f"s{seed}w-")
            measured = case.draw(400, seed * 1000 + 2, f"s{seed}m-")

            def play(policy, warm_up: bool = False) -> float:
                for specs in ([warm] if warm_up else []) + [measured]:
                    result = Window(case.layout, specs, turn_budget_tokens=case.turn_budget_tokens).run(policy)
                return result.makespan_s

            variants = {"cmlfq, mean only": lambda: play(MeanOnly(E.CAP, buckets=case.buckets), True),
                        "cmlfq, start spill": lambda: play(StartSpill(E.CAP, buckets=case.buckets), True)}
            if case.trace == "signal":
                levels = E.outcome_levels(measured, case.buckets)
                for limit in (10, 20, 30, 40):
                    variants[f"cap {limit}"] = lambda limit=limit: play(Capped(E.CAP, case.buckets, levels, limit))
                for below in (3000, 5000, 8000):
                    variants[f"demote {below}"] = lambda below=below: play(Demoted(E.CAP, case.buckets, levels, below))
            for name, run in variants.items():
                rows.setdefault(name, []).append(run())
        for name, makespans in rows.items():
            over = sum(m / bound[s] for m, s in zip(makespans, seeds)) / len(makespans)
            against = f"  / best baseline {sum(makespans) / best:.3f}" if name.startswith("cmlfq") else ""
            print(f"{case.trace:12} {case.layout_name:18} {name:20} / bound {over:.3f}{against}", flush=True)
    print(f"({time.process_time() - started:.1f} CPU s)")


if __name__ == "__main__":
    main()
