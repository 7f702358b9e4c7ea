"""Makespan of the routing policies on the rollout simulator, against a true lower bound.

Every policy (C-MLFQ; the baselines load balance, length-aware and LA-MLFQ; and the clairvoyant
heuristic, which routes by each trajectory's true remaining output) plays the same windows on the
same layouts: the planner's simulator with its simple instance model (`services/planner/sim/`:
`rollout.Window`, `simple.SimpleModel`). Each makespan is divided by the lower bound of that window
on that layout (`sim/bound.py`: no policy, clairvoyant or not, can finish sooner) and compared
with load balance's.

How far the bound is from what routing can reach, the row `partition`: knowing every trajectory's
true total output in advance, the longest ones go to the longest bucket, the next to the next, and
so on, each kept there (least loaded in its bucket, affinity): the best such split of a grid of
bucket shares (`PARTITION_SHARES`; `Partition`). It is not a bound (a policy that moves
trajectories can beat it) but a clairvoyant reference no causal policy is expected to reach.

How far what the tool outcomes say can take routing, the row `outcome partition`: every
trajectory in one bucket for its whole life, chosen before its first turn from its *first* tool
outcome (the signature C-MLFQ's tree first learns from, known in advance): the bucket covering the
mean total output of the window's trajectories with the same first outcome (`outcome_levels`).
On the signal trace that is each trajectory's class (long / medium / short) from the start,
everything the outcomes carry there; what it leaves to the bound is what no router that knows
only the class can win back.

Traces (a window of `--trajectories` trajectories, all released at once):

    signal            synthetic: the first tool outcome predicts the continuation
    no signal         the same lengths, every tool outcome drawn at random
    equal depth       no signal again, every trajectory re-cut to 3 tool calls (the number of
                      calls no longer says how long a trajectory runs)
    quickstart        drawn from the trace a real `libra up` of configs/quickstart.yaml recorded
    code agent        drawn from the trace a real `libra up` of configs/code_agent.yaml recorded

Synthetic traces run on buckets short <= 2,000, medium <= 8,000, long <= 32,000 tokens; recorded
ones on their run's own buckets, each turn booking that run's max_new_tokens (what the per-worker
cap counts). Each policy object first plays a warm-up window (other trajectories, same prompt
pool), then the measured one, learning throughout. Per seed the windows differ; rows are means
over seeds.

    .venv/bin/python benchmarks/scheduler_eval.py [--trajectories 400] [--seeds 3] [--cap 1000000]
        [--traces signal,quickstart] [--json out.json]
        [--recorded NAME=PATH@short:10,long:512@48 ...]   (replaces the shipped recordings)

Goals (issue 15): C-MLFQ's makespan within 3% of the best baseline's (load balance, length-aware,
LA-MLFQ) on every trace and layout; on the signal trace within 1.15x of the bound.
"""

from __future__ import annotations

import argparse
import bisect
import json
import pathlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from libra.errors import InvalidArgument
from libra.routing.baselines import LAMLFQ, BucketPolicy, Clairvoyant, LengthAware, LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Policy
from libra.routing.signatures import SizeThresholds, signature
from libra.services.planner.sim.bound import lower_bound
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.rollout import Window
from libra.traces import files, synthetic
from libra.traces.spec import TrajectorySpec

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SYNTHETIC_BUCKETS = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
SYNTHETIC_LAYOUTS = {
    "TP1x4+TP2x2+TP4x1": [Group("short", 1, 4), Group("medium", 2, 2), Group("long", 4, 1)],
    "TP1x8+TP2x2+TP4x2": [Group("short", 1, 8), Group("medium", 2, 2), Group("long", 4, 2)],
}
TWO_BUCKET_SHAPES = {"TP1x4+TP2x2": ((1, 4), (2, 2)), "TP1x8+TP4x2": ((1, 8), (4, 2))}
RECORDED = {  # name -> (file, that run's buckets, its rollout.max_new_tokens: what each Route books)
    "quickstart": (RESULTS / "quickstart-trace.jsonl", [("short", 10), ("long", 512)], 48),
    "code agent": (RESULTS / "code-agent-trace.jsonl", [("short", 64), ("long", 1024)], 128),
}
SYNTHETIC_TURN_BUDGET = 4096  # max_new_tokens a synthetic turn books (the simulator's default)
BASELINES = ("load_balance", "length_aware", "la_mlfq")
POLICY_NAMES = ("cmlfq", *BASELINES, "clairvoyant")
ROWS = (*POLICY_NAMES, "outcome partition", "partition")
# shares of the window for the longest buckets, longest first (the shortest bucket takes the rest)
PARTITION_SHARES = {
    2: [(share,) for share in (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)],
    3: [(long, medium) for long in (0.01, 0.02, 0.03, 0.04, 0.05, 0.0625, 0.075, 0.1, 0.125, 0.15)
        for medium in (0.0125, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)],
}
CAP = 1_000_000  # outstanding tokens per worker before spilling (the service default)
Draw = Callable[[int, int, str], list[TrajectorySpec]]  # (n, seed, id prefix) -> trajectories


@dataclass(frozen=True)
class Case:
    """One trace on one layout with its buckets."""

    trace: str
    layout_name: str
    layout: list[Group]
    buckets: list[tuple[str, int]]
    draw: Draw
    turn_budget_tokens: int = SYNTHETIC_TURN_BUDGET


@dataclass
class Run:
    """One policy on one seed of a case."""

    trace: str
    layout: str
    policy: str
    seed: int
    makespan_s: float
    bound_s: float
    binding: str
    moves: int
    reasons: dict[str, int]


def cases(recorded: dict[str, tuple[pathlib.Path, list[tuple[str, int]], int]]) -> list[Case]:
    synthetic_draws: dict[str, Draw] = {
        "signal": lambda n, seed, prefix: synthetic.signal(n, seed, prefix=prefix),
        "no signal": lambda n, seed, prefix: synthetic.no_signal(n, seed, prefix=prefix),
        "equal depth": lambda n, seed, prefix: synthetic.equal_depth(n, seed, prefix=prefix),
    }
    out = [Case(trace, name, layout, SYNTHETIC_BUCKETS, draw)
           for trace, draw in synthetic_draws.items() for name, layout in SYNTHETIC_LAYOUTS.items()]
    for trace, (path, buckets, turn_budget) in recorded.items():
        specs = files.read(path)
        draw = lambda n, seed, prefix, specs=specs: files.sample(specs, n, seed, prefix)
        for name, shapes in TWO_BUCKET_SHAPES.items():
            if len(buckets) != len(shapes):
                raise InvalidArgument(f"recorded trace {trace!r}: the layouts have {len(shapes)} buckets, "
                                      f"got {len(buckets)} ({buckets})")
            layout = [Group(bucket, tp, count) for (bucket, _), (tp, count) in zip(buckets, shapes)]
            out.append(Case(trace, name, layout, buckets, draw, turn_budget))
    return out


def build(name: str, window: Callable[[], Window], cap: int, buckets) -> Policy:
    if name == "cmlfq":
        return CMLFQ(cap, buckets=buckets)
    if name == "load_balance":
        return LoadBalance(cap)
    if name == "length_aware":
        return LengthAware(cap, buckets=buckets)
    if name == "la_mlfq":
        return LAMLFQ(cap, buckets=buckets)
    return Clairvoyant(cap, buckets=buckets, remaining_of=lambda tid: window().remaining_of(tid))


class Partition(BucketPolicy):
    """Each trajectory in the bucket level given for it in advance, for its whole life (evaluation only)."""

    name = "partition"

    def __init__(self, per_worker_cap_tokens: int, buckets: list[tuple[str, int]], level_of: dict[str, int]):
        super().__init__(per_worker_cap_tokens, True, buckets)
        self.level_of_trajectory = level_of

    def target_level(self, turn, placement) -> tuple[int, str]:
        return self.level_of_trajectory[turn.trajectory_id], "partition"


def outcome_levels(specs: Sequence[TrajectorySpec], buckets: list[tuple[str, int]]) -> dict[str, int]:
    """Per trajectory, the bucket level covering the mean total output of the trajectories in
    `specs` whose first tool outcome has the same signature as its own (none: no tool call)."""
    thresholds, limits = SizeThresholds(), sorted(limit for _, limit in buckets)
    first = {}
    for spec in specs:
        turn = spec.turns[0]
        first[spec.trajectory_id] = (signature(turn.tool, turn.status, turn.payload_tokens, thresholds)
                                     if len(spec.turns) > 1 else "none")
    totals: dict[str, list[int]] = {}
    for spec in specs:
        totals.setdefault(first[spec.trajectory_id], []).append(spec.output_tokens)
    level = {sig: min(bisect.bisect_left(limits, sum(v) / len(v)), len(limits) - 1) for sig, v in totals.items()}
    return {tid: level[sig] for tid, sig in first.items()}


def best_partition(case: Case, specs: Sequence[TrajectorySpec], cap: int) -> tuple[float, tuple[float, ...]]:
    """The shortest makespan of the clairvoyant partitions (module docstring), and its shares."""
    levels = len(case.buckets)
    if levels == 1:
        grid: list[tuple[float, ...]] = [()]
    elif levels in PARTITION_SHARES:
        grid = PARTITION_SHARES[levels]
    else:
        raise InvalidArgument(f"the partition reference knows 1 to 3 buckets, got {len(case.buckets)}")
    longest_first = sorted(specs, key=lambda spec: (-spec.output_tokens, spec.trajectory_id))
    best = (float("inf"), ())
    for shares in grid:
        level_of, start = {}, 0
        for depth, share in enumerate(shares):  # the longest bucket first
            count = max(1, round(share * len(specs)))
            for spec in longest_first[start:start + count]:
                level_of[spec.trajectory_id] = levels - 1 - depth
            start += count
        for spec in longest_first[start:]:
            level_of[spec.trajectory_id] = 0
        window = Window(case.layout, specs, turn_budget_tokens=case.turn_budget_tokens)
        makespan = window.run(Partition(cap, case.buckets, level_of)).makespan_s
        best = min(best, (makespan, shares))
    return best


def evaluate(case: Case, seed: int, n: int, cap: int = CAP) -> list[Run]:
    """Every policy on one seed: warm up on one window, measure on the next (same prompt pool)."""
    warm = case.draw(n, seed * 1000 + 1, f"s{seed}w-")
    measured = case.draw(n, seed * 1000 + 2, f"s{seed}m-")
    bound = lower_bound(case.layout, measured)
    runs = []
    for name in POLICY_NAMES:
        current: list[Window] = []
        policy = build(name, lambda: current[-1], cap, case.buckets)
        for specs in (warm, measured):
            current.append(Window(case.layout, specs, turn_budget_tokens=case.turn_budget_tokens))
            result = current[-1].run(policy)
        if result.makespan_s < bound.makespan_s * (1 - 1e-9):
            raise AssertionError(f"{name} on {case.trace} / {case.layout_name} seed {seed} finished in "
                                 f"{result.makespan_s:.3f} s, under the lower bound {bound.makespan_s:.3f} s")
        runs.append(Run(case.trace, case.layout_name, name, seed, result.makespan_s, bound.makespan_s,
                        bound.binding, result.moves, dict(result.reasons)))
    outcome = Window(case.layout, measured, turn_budget_tokens=case.turn_budget_tokens).run(
        Partition(cap, case.buckets, outcome_levels(measured, case.buckets))).makespan_s
    if outcome < bound.makespan_s * (1 - 1e-9):
        raise AssertionError(f"the outcome partition on {case.trace} / {case.layout_name} seed {seed} finished in "
                             f"{outcome:.3f} s, under the lower bound {bound.makespan_s:.3f} s")
    runs.append(Run(case.trace, case.layout_name, "outcome partition", seed, outcome, bound.makespan_s,
                    bound.binding, 0, {}))
    makespan, shares = best_partition(case, measured, cap)
    if makespan < bound.makespan_s * (1 - 1e-9):
        raise AssertionError(f"the partition {shares} on {case.trace} / {case.layout_name} seed {seed} finished in "
                             f"{makespan:.3f} s, under the lower bound {bound.makespan_s:.3f} s")
    runs.append(Run(case.trace, case.layout_name, "partition", seed, makespan, bound.makespan_s, bound.binding, 0,
                    {"shares " + "/".join(f"{share:g}" for share in shares): 1}))
    return runs


def table(runs: Sequence[Run]) -> list[str]:
    """Per case and policy: mean makespan, mean makespan / bound, load balance's / the policy's."""
    lines = [f"{'trace':<22} {'layout':<18} {'policy':<17} {'makespan s':>10} {'/ bound':>7} {'vs LB':>6} "
             f"{'worst seed / best baseline':>26}"]
    keys = list(dict.fromkeys((r.trace, r.layout) for r in runs))
    for trace, layout in keys:
        here = [r for r in runs if (r.trace, r.layout) == (trace, layout)]
        seeds = sorted({r.seed for r in here})
        by = {(r.policy, r.seed): r for r in here}
        best = {seed: min(by[p, seed].makespan_s for p in BASELINES) for seed in seeds}
        for name in ROWS:
            mine = [by[name, seed] for seed in seeds]
            makespan = sum(r.makespan_s for r in mine) / len(mine)
            over_bound = sum(r.makespan_s / r.bound_s for r in mine) / len(mine)
            vs_lb = sum(by["load_balance", s].makespan_s for s in seeds) / len(seeds) / makespan
            worst = max(by[name, s].makespan_s / best[s] for s in seeds)
            lines.append(f"{trace:<22} {layout:<18} {name:<17} {makespan:>10.2f} {over_bound:>7.2f} {vs_lb:>6.2f} "
                         f"{worst:>26.3f}")
        lines.append("")
    return lines


def verdict(runs: Sequence[Run]) -> list[str]:
    """C-MLFQ against the best baseline per case (seed means) and the signal trace against its bound."""
    lines = []
    for trace, layout in dict.fromkeys((r.trace, r.layout) for r in runs):
        here = [r for r in runs if (r.trace, r.layout) == (trace, layout)]
        mean = {p: sum(r.makespan_s for r in here if r.policy == p) / len([r for r in here if r.policy == p])
                for p in ROWS}
        best = min(BASELINES, key=mean.__getitem__)
        ratio = mean["cmlfq"] / mean[best]
        mine = [r for r in here if r.policy == "cmlfq"]
        bound = sum(r.makespan_s / r.bound_s for r in mine) / len(mine)
        over = {p: sum(r.makespan_s / r.bound_s for r in here if r.policy == p) / len([r for r in here if r.policy == p])
                for p in ("partition", "outcome partition")}
        lines.append(f"{trace:<22} {layout:<18} cmlfq / {best} = {ratio:.3f} ({'ok' if ratio <= 1.03 else 'MISS'}"
                     f" within 3%); cmlfq / bound = {bound:.2f}; outcome partition / bound = "
                     f"{over['outcome partition']:.2f}; clairvoyant partition / bound = {over['partition']:.2f}; "
                     f"cmlfq / partition = {mean['cmlfq'] / mean['partition']:.3f}")
    return lines


def parse_recorded(items: list[str]) -> dict[str, tuple[pathlib.Path, list[tuple[str, int]], int]]:
    out = {}
    for item in items:
        try:
            name, rest = item.split("=", 1)
            path, spec, budget = (rest.split("@") + [str(SYNTHETIC_TURN_BUDGET)])[:3]
            buckets = [(bucket, int(tokens)) for bucket, tokens in (b.split(":") for b in spec.split(","))]
            out[name] = (pathlib.Path(path), buckets, int(budget))
        except ValueError:
            raise InvalidArgument(f"--recorded {item!r}: expected NAME=PATH@bucket:max_tokens,...[@max_new_tokens], "
                                  f"e.g. quickstart=runs/quickstart/trace.jsonl@short:10,long:512@48") from None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per case (1..N)")
    parser.add_argument("--cap", type=int, default=CAP, help="per-worker cap on outstanding tokens")
    parser.add_argument("--traces", help="comma-separated trace names to run (default: all)")
    parser.add_argument("--recorded", action="append", default=[],
                        help="NAME=PATH@bucket:max_tokens,...[@max_new_tokens]: a run's trace.jsonl, its buckets and "
                             "its rollout.max_new_tokens (repeatable; replaces the shipped recordings)")
    parser.add_argument("--json", help="write every run (per seed) here")
    args = parser.parse_args()
    if args.trajectories < 1 or args.seeds < 1:
        parser.error("--trajectories and --seeds must be >= 1")
    started = time.process_time()
    try:  # a bad trace file or bucket list: its message, not a traceback
        chosen = cases(parse_recorded(args.recorded) if args.recorded else RECORDED)
        if args.traces:
            wanted = {name.strip() for name in args.traces.split(",")}
            unknown = wanted - {case.trace for case in chosen}
            if unknown:
                parser.error(f"--traces: unknown {sorted(unknown)}; choose from {sorted({c.trace for c in chosen})}")
            chosen = [case for case in chosen if case.trace in wanted]
        runs = [run for case in chosen for seed in range(1, args.seeds + 1)
                for run in evaluate(case, seed, args.trajectories, args.cap)]
    except InvalidArgument as error:
        parser.error(str(error))
    print(f"{args.trajectories} trajectories per window, mean of {args.seeds} seeds, per-worker cap {args.cap} tokens")
    print("\n".join(table(runs)))
    print("/ bound: makespan / lower bound (1.00 would be optimal); vs LB: load-balance makespan / policy "
          "makespan (>1 is faster); worst seed / best baseline: the policy's makespan over the best of "
          "load_balance, length_aware, la_mlfq, at its worst seed\n")
    print("\n".join(verdict(runs)))
    print(f"({time.process_time() - started:.1f} CPU s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
