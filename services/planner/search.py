"""Allocation search of the Global Resource Planner: split a fixed GPU budget between training and
rollout so that the step time max(T_train, T_rollout) is smallest.

Owns candidate enumeration, the filters (memory, batch divisibility, whole GRPO groups per DP
replica, min GPUs per side, node boundaries) and pruning. Costs come from `cost_train` and
`cost_rollout`; this module must not know about Redis, RPCs or the clock.

    training layouts, sorted by T_train ──▶ stop once T_train >= k-th best objective (bound)
        └─ rollout GPUs R = total - train ──▶ best TP multiset for R (cached per R)
               └─ each multiset: rollout_time(trace, cutoff=bound) aborts early past the bound
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from pydantic import Field

from libra.configbase import Section
from libra.services.planner import cost_rollout, cost_train
from libra.services.planner.cost_rollout import Infeasible, RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.hardware import GpuSpec, ModelSpec

Multiset = tuple[tuple[int, int], ...]  # ((tp, instances), ...) sorted by tp


class SearchConfig(Section):
    """What the search may choose and what it must respect."""

    total_gpus: int = Field(..., ge=2, le=1_000_000, description="GPUs shared by training and rollout")
    group_size: int = Field(8, ge=1, le=4096, description="GRPO samples per prompt (whole groups per DP replica)")
    min_train_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs for training")
    min_rollout_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs for rollout")
    tp_choices: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="TP degrees to try (both sides)")
    pp_choices: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="training PP degrees to try")
    micro_batches: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="sequences per micro-batch")
    whole_nodes: bool = Field(True, description="when total >= one node, each side gets whole nodes")
    top_k: int = Field(5, ge=1, le=100, description="alternatives reported next to the best plan")
    exact_multiset_limit: int = Field(512, ge=1, le=1_000_000,
                                      description="enumerate every TP multiset when there are at most this many")
    mix_steps: int = Field(8, ge=1, le=64, description="grid steps for two-degree mixes beyond that limit")
    rollout: RolloutEfficiency = Field(default_factory=RolloutEfficiency, description="rollout efficiencies")
    train: TrainEfficiency = Field(default_factory=TrainEfficiency, description="training efficiencies")


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
        return (f"train tp{l.tp} pp{l.pp} dp{l.dp} mb{l.micro_batch} ({l.gpus} GPUs, {self.train_s:.1f}s) | "
                f"rollout {mix} ({self.rollout_s:.1f}s) | step {self.step_s:.1f}s, {side}")


@dataclass
class SearchResult:
    best: Candidate
    alternatives: list[Candidate]  # top-k by step time, best first (includes best)
    rejected: Counter = field(default_factory=Counter)  # reason -> how many layouts it removed
    evaluated: int = 0  # training layouts whose rollout side was costed
    pruned: int = 0  # training layouts skipped because T_train alone exceeded the bound
    batch_sequences: int = 0

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
                   rejected: Counter) -> list[tuple[float, Layout]]:
    """Every training layout that passes the filters, with its step time."""
    node = gpu.gpus_per_node if config.whole_nodes and config.total_gpus >= gpu.gpus_per_node else 1
    out = []
    for tp in config.tp_choices:
        for pp in config.pp_choices:
            for dp in range(1, config.total_gpus // (tp * pp) + 1):
                gpus = tp * pp * dp
                reason = _layout_filter(gpus, dp, batch, node, config)
                for mb in config.micro_batches:
                    if reason or batch % (dp * mb):
                        rejected[reason or "batch not divisible by dp x micro_batch"] += 1
                        continue
                    try:
                        est = cost_train.step_time(model, gpu, Layout(tp, pp, dp, mb), batch, seq_len, config.train)
                    except Infeasible as error:
                        rejected["training " + _reason_of(error)] += 1
                        continue
                    out.append((est.seconds, Layout(tp, pp, dp, mb)))
    out.sort(key=lambda item: item[0])
    return out


def _reason_of(error: Exception) -> str:
    text = str(error)
    if "GiB per GPU" in text:
        return "over memory"
    if "node" in text:
        return "tp crosses a node"
    return text.split(" (")[0][:60]


def _layout_filter(gpus: int, dp: int, batch: int, node: int, config: SearchConfig) -> str:
    if gpus < config.min_train_gpus:
        return "fewer than min_train_gpus"
    if config.total_gpus - gpus < config.min_rollout_gpus:
        return "fewer than min_rollout_gpus left for rollout"
    if gpus % node or (config.total_gpus - gpus) % node:
        return "not whole nodes"
    if batch % dp or (batch // dp) % config.group_size:
        return "DP replica would split a GRPO group"
    return ""


class _RolloutTable:
    """Best rollout multiset per rollout GPU count, computed lazily under a shrinking cutoff.

    A cached `inf` means "no multiset beats the cutoff in force then"; cutoffs only shrink, so it
    stays valid. A cached finite value is exact: aborted multisets were at or past a larger cutoff.

    Fewer GPUs never beat more (idle GPUs are allowed in exact mode; approximately so on the grid),
    so once R GPUs cannot beat a cutoff, no count <= R is costed again: `failed_up_to` remembers R.
    """

    def __init__(self, trace, instances: dict[int, cost_rollout.Instance], config: SearchConfig):
        self.trace, self.instances, self.config = trace, instances, config
        self.cache: dict[int, tuple[float, Multiset]] = {}
        self.failed_up_to = 0

    def best(self, gpus: int, cutoff: float) -> tuple[float, Multiset]:
        if gpus <= self.failed_up_to:
            return math.inf, ()
        if gpus not in self.cache:
            self.cache[gpus] = self._search(gpus, cutoff)
            if self.cache[gpus][0] == math.inf:
                self.failed_up_to = max(self.failed_up_to, gpus)
        return self.cache[gpus]

    def _search(self, gpus: int, cutoff: float) -> tuple[float, Multiset]:
        best: tuple[float, Multiset] = (math.inf, ())
        for mix in multisets(gpus, list(self.instances), self.config):
            fleet = [self.instances[tp] for tp, n in mix for _ in range(n)]
            try:
                seconds = cost_rollout.rollout_time(self.trace, fleet, cutoff=min(cutoff, best[0]))
            except Infeasible:
                continue
            if seconds < best[0]:
                best = (seconds, mix)
        return best


def search(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], config: SearchConfig) -> SearchResult:
    """Best allocation of `config.total_gpus` for one GRPO step whose rollouts are `trace`.

    The batch is the trace (one sequence per request); the training sequence length is the mean
    prompt + output. Raises `Infeasible` when no candidate passes every filter.
    """
    if not trace:
        raise Infeasible("an empty trace gives nothing to plan for")
    batch = len(trace)
    seq_len = max(1, round(sum(p + o for p, o in trace) / batch))
    result_rejected: Counter = Counter()
    layouts = _train_layouts(model, gpu, batch, seq_len, config, result_rejected)
    table = _RolloutTable(trace, _rollout_instances(model, gpu, config, result_rejected), config)
    top: list[Candidate] = []
    evaluated = 0
    for index, (train_s, layout) in enumerate(layouts):
        bound = top[-1].step_s if len(top) >= config.top_k else math.inf
        if train_s >= bound:
            return _result(top, result_rejected, evaluated, len(layouts) - index, batch)
        evaluated += 1
        rollout_s, mix = table.best(config.total_gpus - layout.gpus, bound)
        if max(train_s, rollout_s) < bound:
            top.append(Candidate(layout, mix, train_s, rollout_s))
            top.sort(key=lambda c: (c.step_s, c.layout.gpus))
            del top[config.top_k:]
    return _result(top, result_rejected, evaluated, 0, batch)


def _rollout_instances(model: ModelSpec, gpu: GpuSpec, config: SearchConfig,
                       rejected: Counter) -> dict[int, cost_rollout.Instance]:
    out = {}
    for tp in config.tp_choices:
        if gpu.gpus_per_node % tp:
            rejected[f"rollout tp{tp} would straddle nodes"] += 1
            continue
        try:
            out[tp] = cost_rollout.instance(model, gpu, tp, config.rollout)
        except Infeasible as error:
            rejected[f"rollout tp{tp}: {_reason_of(error)}"] += 1
    if not out:
        raise Infeasible(f"no rollout TP degree in {config.tp_choices} can hold {model.name} on {gpu.name}")
    return out


def _result(top: list[Candidate], rejected: Counter, evaluated: int, pruned: int, batch: int) -> SearchResult:
    if not top:
        reasons = ", ".join(f"{r} ({n})" for r, n in rejected.most_common(4)) or "no layouts"
        raise Infeasible(f"no feasible allocation; rejected: {reasons}")
    return SearchResult(top[0], list(top), rejected, evaluated, pruned, batch)
