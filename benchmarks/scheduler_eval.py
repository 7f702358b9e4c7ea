"""Makespan and throughput of the routing policies on the rollout simulator, side by side.

Every policy (C-MLFQ, load balance, length-aware, LA-MLFQ, and the oracle that knows each
trajectory's true remaining output) runs on the same layouts and the same traces, on the
planner's simulator with its simple instance model (`services/planner/sim/`: `rollout.Window`,
`simple.SimpleModel`; traces from `libra/traces/synthetic.py`): one where the first tool outcome
predicts the continuation ("signal") and one with the same lengths but random tool outcomes
("no signal"). Each policy object first plays a warm-up trace (other trajectories, same prompt
pool), then the evaluated trace; it keeps learning during both.

    .venv/bin/python benchmarks/scheduler_eval.py [--trajectories 400] [--seeds 3] [--cap 1000000]
        [--recorded RUN_DIR/trace.jsonl --recorded-buckets short:10,long:512]

`--recorded` adds a trace that a real run wrote (libra/trace_record.py): trajectories are drawn
from it by seed (warm-up and evaluation draws differ), with their real prompt ids, per-turn
lengths, tool outcomes and tool latencies, on a layout of the run's own buckets (TP1x4 for the
first, TP2x2 for the second, TP4x1 for a third) with the run's bucket thresholds.

Goals: C-MLFQ within 15% of the oracle's makespan and clearly ahead of load balance where
signals exist; not worse than load balance where outcomes carry no signal.
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass

from libra.routing.baselines import LAMLFQ, LengthAware, LoadBalance, Oracle
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Policy
from libra.routing.prefix_tree import PrefixForest
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.result import RolloutResult
from libra.services.planner.sim.rollout import Window
from libra.traces import files, synthetic

BUCKETS = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
LAYOUTS = {
    "TP1x4+TP2x2+TP4x1": [Group("short", 1, 4), Group("medium", 2, 2), Group("long", 4, 1)],
    "TP1x8+TP2x2+TP4x2": [Group("short", 1, 8), Group("medium", 2, 2), Group("long", 4, 2)],
}
TRACES = {"signal": synthetic.signal, "no signal": synthetic.no_signal}
POLICY_NAMES = ("cmlfq", "load_balance", "length_aware", "la_mlfq", "oracle")
CAP = 1_000_000  # outstanding tokens per worker before spilling (the service default)


class Holder:
    """Lets the oracle ask whichever window is running for the true remaining output."""

    sim: Window | None = None

    def remaining_of(self, trajectory_id: str) -> int:
        assert self.sim is not None
        return self.sim.remaining_of(trajectory_id)


def build(name: str, holder: Holder, cap: int = CAP, buckets=BUCKETS) -> Policy:
    if name == "cmlfq":
        return CMLFQ(cap, buckets=buckets, forest=PrefixForest(min_visits=3))
    if name == "load_balance":
        return LoadBalance(cap)
    if name == "length_aware":
        return LengthAware(cap, buckets=buckets)
    if name == "la_mlfq":
        return LAMLFQ(cap, buckets=buckets)
    return Oracle(cap, buckets=buckets, remaining_of=holder.remaining_of)


def evaluate(name: str, layout: list[Group], make_trace, n: int, seed: int, cap: int = CAP,
             buckets=BUCKETS) -> RolloutResult:
    """Warm the policy on one trace, then measure it on another (same prompt pool)."""
    holder = Holder()
    policy = build(name, holder, cap, buckets)
    for trace_seed in (seed * 1000 + 1, seed * 1000 + 2):  # warm-up, then evaluation
        holder.sim = Window(layout, make_trace(n, trace_seed, prefix=f"s{trace_seed}-"))
        result = holder.sim.run(policy)
    return result


@dataclass
class Row:
    """One table row: the seed-average of a policy's runs."""

    makespan_s: float
    trajectories_per_s: float
    tokens_per_s: float
    busy: dict[str, float]
    moves: int


def mean_result(runs: list[RolloutResult]) -> Row:
    """The seed-average of several runs (makespans are dominated by a few long trajectories: noisy)."""
    avg = lambda values: sum(values) / len(values)
    buckets = {bucket for run in runs for bucket in run.busy}
    return Row(avg([r.makespan_s for r in runs]), avg([r.trajectories_per_s for r in runs]),
               avg([r.tokens_per_s for r in runs]), {b: avg([r.busy.get(b, 0.0) for r in runs]) for b in buckets},
               round(avg([r.moves for r in runs])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3, help="seeds averaged per row (1..N)")
    parser.add_argument("--cap", type=int, default=CAP, help="per-worker cap on outstanding tokens")
    parser.add_argument("--recorded", help="a trace.jsonl a run recorded (RUN_DIR/trace.jsonl; any format "
                                           "libra.traces.files reads)")
    parser.add_argument("--recorded-buckets", default="short:10,long:512",
                        help="that run's buckets as name:max_tokens,... (the quickstart's by default)")
    parser.add_argument("--only-recorded", action="store_true", help="skip the synthetic traces")
    args = parser.parse_args()
    started = time.perf_counter()
    runs = [] if args.only_recorded else [(name, layout, trace_name, make_trace, BUCKETS)
                                          for name, layout in LAYOUTS.items() for trace_name, make_trace in TRACES.items()]
    if args.recorded:
        buckets = [(name, int(tokens)) for name, tokens in (item.split(":") for item in args.recorded_buckets.split(","))]
        shapes = [(1, 4), (2, 2), (4, 1)]
        layout = [Group(name, *shapes[i]) for i, (name, _) in enumerate(buckets[:3])]
        layout_name = "+".join(f"TP{g.tp}x{g.count}" for g in layout)
        runs.append((layout_name, layout, "recorded", functools.partial(files.sample, files.read(args.recorded)),
                     buckets))
    print(f"{args.trajectories} trajectories, mean of {args.seeds} seeds, per-worker cap {args.cap} tokens")
    print(f"{'layout':<18} {'trace':<9} {'policy':<13} {'makespan s':>10} {'traj/s':>6} {'tok/s':>6} "
          f"{'vs LB':>5} {'vs oracle':>9} {'moves':>5}  busy per bucket")
    for layout_name, layout, trace_name, make_trace, buckets in runs:
        results = {name: mean_result([evaluate(name, layout, make_trace, args.trajectories, seed, args.cap, buckets)
                                      for seed in range(1, args.seeds + 1)]) for name in POLICY_NAMES}
        lb, oracle = results["load_balance"].makespan_s, results["oracle"].makespan_s
        for name, r in results.items():
            busy = "/".join(f"{r.busy.get(b, 0):.2f}" for b, _ in buckets)
            print(f"{layout_name:<18} {trace_name:<9} {name:<13} {r.makespan_s:>10.1f} "
                  f"{r.trajectories_per_s:>6.3f} {r.tokens_per_s:>6.0f} {lb / r.makespan_s:>5.2f} "
                  f"{r.makespan_s / oracle:>9.2f} {r.moves:>5}  {busy}")
        print()
    print("vs LB: load-balance makespan / policy makespan (>1 is faster); "
          "vs oracle: policy makespan / oracle makespan (1.15 = 15% slower)")
    print(f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
