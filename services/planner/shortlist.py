"""What the replanner simulates at a decision: the search's best distinct splits, and the plans one
engine exchange away from the plan in force.

The closed-form search ranks one synchronous step; the asynchronous pipeline can rank plans
differently, most of all the rollout fleet's TP mix at a given split (two batches share the
engines, and the router sends the long tail to the wide engines). So next to the search's best
splits (one or two fleets each) the shortlist holds the plan in force's neighbours: the same
training layout, some GPUs of the engines of one TP degree given to engines of another: the
`near` best small exchanges by the closed form, and every whole exchange (all of one degree's
engines turned into another's), which the closed form does not filter, since it is the ranking
that misjudges the TP mix: without them the replanner walks to a far fleet an eighth at a time,
one confirmed move after another. A run's first plan (sim/rank.first_plan) also replays
`split_neighbours`: the search's best at other training data-parallel degrees. Pure: candidates
and their closed-form times, no simulation here.
"""

from __future__ import annotations

import math
from typing import Sequence

from libra.services.planner import cost_rollout, cost_train, placement
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.rejections import Rejections
from libra.services.planner.layout_rules import layout_filter
from libra.services.planner.search import Candidate, Multiset, SearchConfig, SearchResult, rollout_instances
from libra.services.planner.transition import same_plan


def shortlist(result: SearchResult, model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]],
              config: SearchConfig, current: Candidate, splits: int, near: int, whole: bool = True,
              around: bool = False) -> list[Candidate]:
    """The search's `splits` best candidates other than `current`, then `near` of its neighbours,
    (with `whole`) its whole exchanges and (with `around`) `current` at the nearest other training
    data-parallel degrees (`around_ratios`)."""
    out = [c for c in result.alternatives if not same_plan(c, current)][:splits]
    more = neighbours(model, gpu, trace, config, current, near, whole)
    if around:
        whole_nodes = result.placement.startswith("whole nodes on")
        more += split_neighbours(model, gpu, trace, config, current, whole_nodes, around_ratios(current.layout.dp))
    for candidate in more:
        if not same_plan(candidate, current) and not any(same_plan(candidate, c) for c in out):
            out.append(candidate)
    return out


def around_ratios(dp: int) -> tuple[float, ...]:
    """The training data-parallel degrees a replanner tries around a plan of `dp` replicas, as ratios
    to it: one replica fewer and one more, half and twice (`split_neighbours` takes the valid degree
    nearest each). The closed-form search ranks one synchronous step and knows every length in
    advance, so its best splits can all lean the same way where the asynchronous pipeline, replayed,
    wants another (docs/benchmarks.md, the headline at 48 GPUs)."""
    return tuple(r for r in ((dp - 1) / dp, (dp + 1) / dp, 0.5, 2.0) if r > 0)


def neighbours(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], config: SearchConfig,
               plan: Candidate, keep: int = 2, whole: bool = True) -> list[Candidate]:
    """Plans one exchange away from `plan`: its training layout, and its rollout fleet with some GPUs
    of the engines of one TP degree given to engines of another: the fewest that trade evenly (the
    lcm of the two degrees), and about an eighth of the fleet (in lcm units). The `keep` best by
    the closed-form rollout time on `trace`: the replanner simulates them next to the search's
    shortlist, which holds one or two fleets per split. With `whole`, then every whole exchange
    (all of one degree's engines, in lcm units, to another degree) not already in, unranked."""
    if not trace or not plan.rollout:
        return []
    rejected = Rejections()
    try:
        instances = rollout_instances(model, gpu, config, rejected)
        batch = len(trace)
        seq_len = max(1, round(sum(p + o for p, o in trace) / batch))
        train_s = cost_train.step_time(model, gpu, plan.layout, batch, seq_len, config.train, config.group_size).seconds
    except Infeasible:
        return []
    packing = placement.Packing(config.total_gpus, gpu.gpus_per_node, config.tp_choices)
    counts = dict(plan.rollout)
    found: dict[Multiset, Candidate | None] = {}
    far: dict[Multiset, Candidate | None] = {}
    for source, have in counts.items():
        for target in instances:
            if target == source or source not in instances:
                continue
            unit = math.lcm(source, target)
            small = sorted({unit, max(unit, plan.rollout_gpus // 8 // unit * unit)})
            for gpus in small + ([have * source // unit * unit] if whole else []):
                if have * source < gpus or not gpus:
                    continue
                mix = dict(counts)
                mix[source] -= gpus // source
                mix[target] = mix.get(target, 0) + gpus // target
                fleet_mix = tuple(sorted((tp, n) for tp, n in mix.items() if n))
                into = found if gpus in small else far
                if fleet_mix not in found and fleet_mix not in far:
                    into[fleet_mix] = _costed(plan.layout, train_s, fleet_mix, instances, trace, packing)
    ranked = sorted((c for c in found.values() if c is not None), key=lambda c: (c.step_s, c.rollout_s))
    return ranked[:keep] + [c for c in far.values() if c is not None]


def split_neighbours(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], config: SearchConfig,
                     plan: Candidate, whole: bool,
                     ratios: Sequence[float] = (0.25, 0.5, 2 / 3, 1.5, 2.0, 4.0)) -> list[Candidate]:
    """`plan` with other training data-parallel degrees (its TP and PP kept, the fastest
    micro-batch): for each of `ratios`, the valid degree nearest to the plan's times it (a DP
    replica holds whole GRPO groups, the split leaves rollout GPUs); the rollout fleet scaled to the
    GPUs left in its TP proportions. The closed form balances one synchronous step, where the
    asynchronous pipeline overlaps a batch's long tail with the next step and so wants another
    split: these let a replay rank the splits around the search's choice (the search's own
    shortlist often holds one split with several layouts)."""
    if not trace or not plan.rollout:
        return []
    rejected = Rejections()
    try:
        instances = rollout_instances(model, gpu, config, rejected)
    except Infeasible:
        return []
    batch = len(trace)
    seq_len = max(1, round(sum(p + o for p, o in trace) / batch))
    packing = placement.Packing(config.total_gpus, gpu.gpus_per_node, config.tp_choices)
    width = plan.layout.tp * plan.layout.pp
    timed: dict[int, tuple[float, Layout]] = {}
    for dp in range(1, (config.total_gpus - 1) // width + 1):
        if dp == plan.layout.dp or layout_filter(dp * width, dp, batch, gpu.gpus_per_node, whole, config):
            continue
        for mb in config.micro_batches:
            layout = Layout(plan.layout.tp, plan.layout.pp, dp, mb)
            try:
                seconds = cost_train.step_time(model, gpu, layout, batch, seq_len, config.train,
                                               config.group_size).seconds
            except Infeasible:
                continue
            if dp not in timed or seconds < timed[dp][0]:
                timed[dp] = (seconds, layout)
    chosen = {min(timed, key=lambda dp: abs(math.log(dp / (plan.layout.dp * ratio)))) for ratio in ratios} \
        if timed else set()
    out = []
    for dp in sorted(chosen):
        train_s, layout = timed[dp]
        mix = _scaled(plan.rollout, config.total_gpus - layout.gpus, instances)
        candidate = _costed(layout, train_s, mix, instances, trace, packing) if mix else None
        if candidate is not None:
            out.append(candidate)
    return out


def _scaled(mix: Multiset, gpus: int, instances: dict) -> Multiset:
    """The fleet `mix` grown or shrunk to `gpus` GPUs, each TP degree keeping its share of engines
    (rounded down; the GPUs left go to the widest degree that fits them, then narrower ones)."""
    total = sum(tp * n for tp, n in mix)
    counts = {tp: n * gpus // total for tp, n in mix}
    left = gpus - sum(tp * n for tp, n in counts.items())
    for tp in sorted(set(counts) | set(instances), reverse=True):
        if tp in instances and left >= tp:
            counts[tp] = counts.get(tp, 0) + left // tp
            left %= tp
    return tuple(sorted((tp, n) for tp, n in counts.items() if n))


def _costed(layout: Layout, train_s: float, fleet_mix: Multiset, instances: dict, trace,
            packing: placement.Packing) -> Candidate | None:
    if not packing.fits(layout.tp, layout.pp * layout.dp, fleet_mix):
        return None
    try:
        rollout_s = cost_rollout.rollout_time(trace, [instances[tp] for tp, n in fleet_mix for _ in range(n)])
    except Infeasible:
        return None
    return Candidate(layout, fleet_mix, train_s, rollout_s)
