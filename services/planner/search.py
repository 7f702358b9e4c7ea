"""Allocation search of the Global Resource Planner: split a fixed GPU budget between training and
rollout so that the step time max(T_train, T_rollout) is smallest.

Owns candidate enumeration, the filters (memory; the cost-free layout rules, `layout_rules.py`:
min GPUs per side, whole nodes, whole GRPO groups per DP replica) and pruning. Costs come from
`cost_train` and `cost_rollout`; this module must not know about Redis, RPCs or the clock. When
nothing passes, the error names every reason with its count, and the binding resource in numbers
(the least GiB per GPU any layout of a side needed against what the GPU allows).

    training layouts, sorted by T_train ──▶ stop once T_train >= k-th best objective (bound)
        └─ rollout GPUs R = total - train ──▶ best TP multiset for R (cached per R)
               └─ each multiset: rollout_time(trace, cutoff=bound) aborts early past the bound
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Sequence

from pydantic import Field, field_validator, model_validator

from libra.configbase import Section
from libra.services.planner import cost_rollout, cost_train, placement
from libra.services.planner.cost_rollout import Infeasible, OverMemory, RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.layout_rules import layout_filter
from libra.services.planner.rejections import Rejections

Multiset = tuple[tuple[int, int], ...]  # ((tp, instances), ...) sorted by tp


class SearchConfig(Section):
    """What the search may choose and what it must respect."""

    total_gpus: int = Field(..., ge=2, le=1_000_000, description="GPUs shared by training and rollout")
    group_size: int = Field(8, ge=1, le=4096, description="GRPO samples per prompt (whole groups per DP replica)")
    min_train_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs for training")
    min_rollout_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs for rollout, used by its engines")
    tp_choices: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="TP degrees to try (both sides)")
    pp_choices: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="training PP degrees to try")
    micro_batches: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="sequences per micro-batch")
    whole_nodes: Literal["auto", "on", "off"] = Field(
        "auto", description="on: each side gets whole nodes; off: TP groups packed into nodes, sides may share "
                            "one; auto: on for clusters of >= 2 whole nodes while it costs <= whole_node_slack")
    whole_node_slack: float = Field(0.05, ge=0, le=10, description="auto: whole nodes are kept while their best "
                                                                   "plan is at most this share slower than the "
                                                                   "best packed plan")
    top_k: int = Field(5, ge=1, le=100, description="alternatives reported next to the best plan")
    distinct_splits: bool = Field(False, description="the top_k hold one layout per (training GPUs, rollout "
                                                     "fleet): the replanner's shortlist to simulate")
    fleets_per_split: int = Field(1, ge=1, le=8, description="with distinct_splits: rollout fleets (TP mixes) "
                                                             "considered per split, best first")
    exact_multiset_limit: int = Field(512, ge=1, le=1_000_000,
                                      description="enumerate every TP multiset when there are at most this many")
    mix_steps: int = Field(8, ge=1, le=64, description="grid steps for two-degree mixes beyond that limit")
    uneven_splits_up_to: int = Field(0, ge=0, le=1_000_000,
                                     description="on clusters of at most this many GPUs a training data-parallel "
                                                 "degree need not divide the batch's GRPO groups (the busiest "
                                                 "replica charged); 0: only degrees that divide them")
    rollout: RolloutEfficiency = Field(default_factory=RolloutEfficiency, description="rollout efficiencies")
    train: TrainEfficiency = Field(default_factory=TrainEfficiency, description="training efficiencies")

    @field_validator("whole_nodes", mode="before")
    @classmethod
    def _whole_nodes_bool(cls, value):
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("tp_choices", "pp_choices", "micro_batches")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 1 <= v <= 4096 for v in value):
            raise ValueError(f"every degree must be in 1..4096, got {list(value)}")
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _sides_fit(self) -> "SearchConfig":
        if self.min_train_gpus + self.min_rollout_gpus > self.total_gpus:
            raise ValueError(f"min_train_gpus ({self.min_train_gpus}) + min_rollout_gpus ({self.min_rollout_gpus}) "
                             f"exceed total_gpus ({self.total_gpus})")
        return self


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    rollout: Multiset
    train_s: float
    rollout_s: float

    @property
    def rollout_gpus(self) -> int:
        return sum(tp * n for tp, n in self.rollout)

    @property
    def step_s(self) -> float:
        return max(self.train_s, self.rollout_s)

    def describe(self) -> str:
        mix = " + ".join(f"TP{tp}x{n}" for tp, n in self.rollout)
        mix += f" = {self.rollout_gpus} GPUs"
        side = "training-bound" if self.train_s >= self.rollout_s else "rollout-bound"
        l = self.layout
        gpus = f"{l.gpus} GPU{'s' if l.gpus != 1 else ''}"
        return (f"train tp{l.tp} pp{l.pp} dp{l.dp} mb{l.micro_batch} ({gpus}, {self.train_s:.1f}s) | "
                f"rollout {mix} ({self.rollout_s:.1f}s) | step {self.step_s:.1f}s, {side}")


@dataclass
class SearchResult:
    best: Candidate
    alternatives: list[Candidate]  # top-k by step time, best first (includes best)
    rejected: Counter = field(default_factory=Counter)  # reason -> how many layouts it removed
    evaluated: int = 0  # training layouts whose rollout side was costed
    pruned: int = 0  # training layouts skipped because T_train alone exceeded the bound
    batch_sequences: int = 0
    placement: str = ""  # whole-node placement used, and why (auto's choice)

    @property
    def sequences_per_s(self) -> float:
        """The throughput the best plan implies: one batch per predicted step."""
        return self.batch_sequences / self.best.step_s


def multisets(gpus: int, tps: Sequence[int], config: SearchConfig) -> list[Multiset]:
    """TP multisets for `gpus` rollout GPUs.

    When there are at most `exact_multiset_limit`, every multiset using at most `gpus` GPUs (idle
    GPUs allowed, so the best rollout time never grows with more GPUs). Otherwise a grid that uses
    all of them: each pure degree, and two-degree mixes with the larger degree on step/mix_steps.
    """
    tps = sorted(tps, reverse=True)
    exact: list[Multiset] = []

    def walk(i: int, left: int, acc: tuple) -> bool:
        if len(exact) > config.exact_multiset_limit:
            return False
        if left == 0 or i == len(tps):
            if acc:  # GPUs left over stay idle: allowed, so more GPUs never hurt (see rollout_time)
                exact.append(tuple(sorted(acc)))
            return True
        for n in range(left // tps[i], -1, -1):
            if not walk(i + 1, left - n * tps[i], acc + (((tps[i], n),) if n else ())):
                return False
        return True

    if walk(0, gpus, ()):
        return exact
    grid = {((t, gpus // t),) for t in tps if gpus % t == 0}
    for big in tps:
        for small in tps:
            if small >= big or big % small:
                continue
            for step in range(1, config.mix_steps):
                share = gpus * step // config.mix_steps // big * big
                if 0 < share < gpus and (gpus - share) % small == 0:
                    grid.add(((small, (gpus - share) // small), (big, share // big)))
    return sorted(grid)


def _train_layouts(model: ModelSpec, gpu: GpuSpec, batch: int, seq_len: int, config: SearchConfig,
                   whole: bool, rejected: Rejections) -> list[tuple[float, Layout]]:
    """Every training layout that passes the filters, with its step time."""
    out = []
    for tp in config.tp_choices:
        for pp in config.pp_choices:
            for dp in range(1, config.total_gpus // (tp * pp) + 1):
                gpus = tp * pp * dp
                reason = layout_filter(gpus, dp, batch, gpu.gpus_per_node, whole, config)
                for mb in config.micro_batches:
                    if reason:
                        rejected.add(reason)
                        continue
                    try:
                        est = cost_train.step_time(model, gpu, Layout(tp, pp, dp, mb), batch, seq_len, config.train,
                                                   config.group_size)
                    except OverMemory as error:
                        rejected.over_memory(error)
                        continue
                    except Infeasible as error:
                        rejected.add("training: " + str(error))
                        continue
                    out.append((est.seconds, Layout(tp, pp, dp, mb)))
    out.sort(key=lambda item: item[0])
    return out


class _FleetCosts:
    """`rollout_time` of each fleet on one trace, remembered across the searches of one `search` call
    (the packed and the whole-node search, and tables keyed by the training TP degree, cost the same
    fleets on the same trace and instances).

    The greedy returns `inf` exactly when its makespan reaches the cutoff (the makespan only grows),
    so a remembered finite makespan answers every cutoff, and a remembered `inf` answers every cutoff
    at or below the one it was costed under; anything else is costed again. A fleet found infeasible
    stays so under any cutoff: longest first, a request that fits no instance comes before every one
    that fits, so the greedy fails on it before a cutoff can stop it. Rejections are still counted by
    each search that meets the fleet.
    """

    def __init__(self, trace: Sequence[tuple[int, int]]):
        self.trace = cost_rollout.longest_first(trace)
        self.known: dict[Multiset, tuple[float, float] | Infeasible] = {}

    def seconds(self, mix: Multiset, cutoff: float, instances: dict[int, cost_rollout.Instance]) -> float:
        """The fleet's makespan, or `inf` at or past `cutoff`; raises `Infeasible` as the greedy does.
        `instances` (per TP degree) must be the same at every call: they follow from the search's config."""
        known = self.known.get(mix)
        if isinstance(known, Infeasible):  # whatever the cutoff (above)
            raise known
        if known is not None:
            value, costed_under = known
            if value < math.inf:
                return value if value < cutoff else math.inf
            if cutoff <= costed_under:
                return math.inf
        try:
            value = self.afresh(mix, cutoff, instances)
        except Infeasible as error:
            self.known[mix] = error
            raise
        self.known[mix] = (value, cutoff)
        return value

    def afresh(self, mix: Multiset, cutoff: float, instances: dict[int, cost_rollout.Instance]) -> float:
        """The greedy on the fleet, nothing remembered (`seconds` without the memo)."""
        fleet = [instances[tp] for tp, n in mix for _ in range(n)]
        return cost_rollout.rollout_time(self.trace, fleet, cutoff=cutoff, ordered=True)


class _RolloutTable:
    """Best rollout multiset per rollout GPU count, computed lazily under a shrinking cutoff.

    A cached `inf` means "no multiset beats the cutoff in force then"; cutoffs only shrink, so it
    stays valid. A cached finite value is exact: aborted multisets were at or past a larger cutoff.

    Fewer GPUs never beat more (idle GPUs are allowed in exact mode; approximately so on the grid),
    so once R GPUs cannot beat a cutoff, no count <= R is costed again: `failed_up_to` remembers R.
    A fleet whose engines use fewer than `min_rollout_gpus` is not costed (the GPUs it leaves idle
    are not rollout's): still monotone, since a larger count keeps every fleet a smaller one had.
    Where TP groups may straddle a node (`placement.Packing.needed`), the fleet must also pack next
    to the training groups: the table is then keyed by the training TP degree too, without the
    `failed_up_to` shortcut.
    """

    def __init__(self, fleets: _FleetCosts, instances: dict[int, cost_rollout.Instance], config: SearchConfig,
                 packing: placement.Packing, rejected: Rejections):
        self.fleets, self.instances, self.config = fleets, instances, config
        self.packing, self.rejected = packing, rejected
        self.cache: dict[tuple[int, int], tuple[float, Multiset]] = {}
        self.failed_up_to = 0

    def best(self, gpus: int, cutoff: float, layout: Layout) -> list[tuple[float, Multiset]]:
        """The `fleets` fastest multisets (fastest first; [(inf, ())] when none beats the cutoff)."""
        key = (gpus, layout.tp if self.packing.needed else 0)
        if not self.packing.needed and gpus <= self.failed_up_to:
            return [(math.inf, ())]
        if key not in self.cache:
            self.cache[key] = self._search(gpus, cutoff, layout)
            if self.cache[key][0][0] == math.inf and not self.packing.needed:
                self.failed_up_to = max(self.failed_up_to, gpus)
        return self.cache[key]

    def _search(self, gpus: int, cutoff: float, layout: Layout) -> list[tuple[float, Multiset]]:
        keep = self.config.fleets_per_split if self.config.distinct_splits else 1
        floor = self.config.min_rollout_gpus
        best: list[tuple[float, Multiset]] = []
        for mix in multisets(gpus, list(self.instances), self.config):
            if sum(tp * n for tp, n in mix) < floor:  # GPUs left idle do not count as given to rollout
                self.rejected.add(f"a rollout fleet of fewer than min_rollout_gpus={floor} GPUs (the rest idle)")
                continue
            if not self.packing.fits(layout.tp, layout.pp * layout.dp, mix):
                self.rejected.add(f"TP groups would straddle a node of {self.packing.nodes[0]} GPUs")
                continue
            bar = best[-1][0] if len(best) >= keep else math.inf
            try:
                seconds = self.fleets.seconds(mix, min(cutoff, bar), self.instances)
            except Infeasible as error:
                self.rejected.add(f"rollout: {error}")
                continue
            if seconds < bar:
                best = sorted(best + [(seconds, mix)])[:keep]
        return best or [(math.inf, ())]


def search(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], config: SearchConfig) -> SearchResult:
    """Best allocation of `config.total_gpus` for one GRPO step whose rollouts are `trace`.

    The batch is the trace (one sequence per request); the training sequence length is the mean
    prompt + output. `whole_nodes` as in `placement`; the result's `placement` says which was used
    and why. Raises `Infeasible` when no candidate passes every filter.
    """
    if not trace:
        raise Infeasible("an empty trace gives nothing to plan for")
    per_node = gpu.gpus_per_node
    if config.whole_nodes != "auto":
        result = _search(model, gpu, trace, config, config.whole_nodes == "on", _FleetCosts(trace))
        result.placement = f"whole nodes {config.whole_nodes} (asked)"
        return result
    consider, why = placement.auto_whole_nodes(config.total_gpus, per_node)
    fleets = _FleetCosts(trace)  # the two searches cost many of the same fleets
    packed = _search(model, gpu, trace, config, False, fleets)
    if not consider:
        packed.placement = f"whole nodes off (auto: {why})"
        return packed
    try:
        whole = _search(model, gpu, trace, config, True, fleets)
    except Infeasible as error:
        packed.placement = f"whole nodes off (auto: no whole-node split is feasible: {error})"
        return packed
    ratio = whole.best.step_s / packed.best.step_s - 1.0
    numbers = (f"best whole-node plan {whole.best.step_s:.2f}s vs packed {packed.best.step_s:.2f}s per step, "
               f"{ratio:+.1%}; whole_node_slack {config.whole_node_slack:.0%}")
    if ratio <= config.whole_node_slack:
        whole.placement = f"whole nodes on (auto: {placement.describe_cluster(config.total_gpus, per_node)}; {numbers})"
        return whole
    packed.placement = f"whole nodes off (auto: they would cost too much: {numbers})"
    return packed


def _search(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], config: SearchConfig,
            whole: bool, fleets: _FleetCosts) -> SearchResult:
    batch = len(trace)
    seq_len = max(1, round(sum(p + o for p, o in trace) / batch))
    rejected = Rejections()
    layouts = _train_layouts(model, gpu, batch, seq_len, config, whole, rejected)
    packing = placement.Packing(config.total_gpus, gpu.gpus_per_node, config.tp_choices)
    table = _RolloutTable(fleets, rollout_instances(model, gpu, config, rejected), config, packing, rejected)
    top: list[Candidate] = []
    evaluated = 0
    for index, (train_s, layout) in enumerate(layouts):
        bound = top[-1].step_s if len(top) >= config.top_k else math.inf
        if train_s >= bound:
            return _result(top, rejected, evaluated, len(layouts) - index, batch, config, gpu, whole)
        evaluated += 1
        for rollout_s, mix in table.best(config.total_gpus - layout.gpus, bound, layout):
            bound = top[-1].step_s if len(top) >= config.top_k else math.inf
            if max(train_s, rollout_s) >= bound:
                break
            if config.distinct_splits:  # layouts are costed fastest first: a split already in keeps its layout
                if any(c.layout.gpus == layout.gpus and c.rollout == mix for c in top):
                    continue
            top.append(Candidate(layout, mix, train_s, rollout_s))
            top.sort(key=lambda c: (c.step_s, c.layout.gpus))
            del top[config.top_k:]
    return _result(top, rejected, evaluated, 0, batch, config, gpu, whole)


def rollout_instances(model: ModelSpec, gpu: GpuSpec, config: SearchConfig,
                       rejected: Rejections) -> dict[int, cost_rollout.Instance]:
    out = {}
    for tp in config.tp_choices:
        if gpu.gpus_per_node % tp:
            rejected.add(f"rollout tp{tp} would straddle nodes of {gpu.gpus_per_node} GPUs")
            continue
        try:
            out[tp] = cost_rollout.instance(model, gpu, tp, config.rollout)
        except OverMemory as error:
            rejected.over_memory(error)
        except Infeasible as error:
            rejected.add(f"rollout tp{tp}: {error}")
    if not out:
        raise Infeasible(f"no rollout TP degree in {list(config.tp_choices)} can hold {model.name} on {gpu.name}. "
                         f"{rejected.explain(gpu)}")
    return out


def _result(top: list[Candidate], rejected: Rejections, evaluated: int, pruned: int, batch: int,
            config: SearchConfig, gpu: GpuSpec, whole: bool) -> SearchResult:
    if not top:
        where = placement.describe_cluster(config.total_gpus, gpu.gpus_per_node)
        raise Infeasible(f"no feasible allocation of {where} for a batch of {batch} sequences "
                         f"(whole nodes {'on' if whole else 'off'}). {rejected.explain(gpu)}")
    return SearchResult(top[0], list(top), rejected.reasons, evaluated, pruned, batch)
