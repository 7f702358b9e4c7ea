"""Rollout cost model: how long a TP-sharded inference instance takes to serve a trace.

Owns the per-TP instance model (weights, KV cache and capacity, prefill and decode times) and the
trace assignment that turns a multiset of instances into a makespan. Units are explicit: bytes and
seconds, and "per GPU" means one GPU of a TP group. Pure: no clock, no network, no randomness.

KV sharding across TP (vLLM's rule): with tp <= kv_heads each GPU holds kv_heads/tp heads; with
tp > kv_heads each KV head is replicated tp/kv_heads times, so every GPU holds exactly one head.
Hence doubling TP at most halves the KV bytes per token per GPU, and beyond kv_heads it stops
helping. (The instance's token capacity can still more than double, because the weights per GPU
shrink too and free memory for the cache.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from pydantic import Field, field_validator

from libra.configbase import Section
from libra.errors import InvalidArgument
from libra.services.planner import gaps
from libra.services.planner.hardware import GpuSpec, ModelSpec


class Infeasible(InvalidArgument):
    """A candidate cannot run at all (out of memory, a request that fits nowhere, bad sharding)."""


class OverMemory(Infeasible):
    """A side's layout needs more GiB per GPU than the GPU allows: the binding resource, in numbers."""

    def __init__(self, side: str, layout: str, needed_gib: float, available_gib: float, detail: str):
        self.side, self.layout = side, layout
        self.needed_gib, self.available_gib = needed_gib, available_gib
        super().__init__(f"{side} {layout} needs {needed_gib:.1f} GiB per GPU; {detail}")


class RolloutEfficiency(Section):
    """Calibrated fractions of the datasheet peaks that inference reaches."""

    prefill_mfu: float = Field(0.5, gt=0, le=1, description="fraction of BF16 peak during prefill")
    decode_bw: float = Field(0.7, gt=0, le=1, description="fraction of HBM bandwidth during decode")
    comm: float = Field(0.7, gt=0, le=1, description="fraction of link bandwidth all-reduce reaches")
    allreduce_latency_s: float = Field(10e-6, ge=0, le=1e-2, description="fixed cost of one all-reduce")
    memory_fraction: float = Field(0.9, gt=0, le=1, description="share of GPU memory the engine may use")
    reserve_gib: float = Field(2.0, ge=0, le=64, description="per-GPU activations and workspace, GiB")
    max_seqs: int = Field(256, ge=1, le=65536, description="most sequences one instance decodes at once")
    step_overhead_s: float = Field(0.0, ge=0, le=10, description="fixed seconds of every decode step beyond the "
                                   "roofline (scheduling, launches, sampling set-up, the prefill passes interleaved "
                                   "with the steps); 0: the roofline alone; the online calibration measures it")
    step_per_seq_s: float = Field(0.0, ge=0, le=1, description="seconds per running sequence of a decode step "
                                  "beyond the roofline (per-row sampling, bookkeeping); the calibration measures it")
    request_s: float = Field(0.0, ge=0, le=60, description="seconds a turn spends outside the engine (the "
                             "gateway, its routing call, HTTP); the online calibration measures it")
    turn_gap_s: float = Field(0.0, ge=0, le=600, description="seconds of a trajectory before each of its turns "
                              "outside tool calls (the gateway's routing call, reports and records), their mean; "
                              "the online calibration measures it")
    first_gap_quantiles: tuple[float, ...] = Field((), description="a trajectory's seconds before its first turn "
                                                   "at the probabilities of gaps.GAP_PROBS, which the simulator "
                                                   "draws from (empty: turn_gap_s); the calibration measures them")
    turn_gap_quantiles: tuple[float, ...] = Field((), description="the same before each later turn (empty with "
                                                  "first_gap_quantiles or not at all)")
    request_quantiles: tuple[float, ...] = Field((), description="a turn's time outside the engine over its mean "
                                                 "(request_s) at the probabilities of gaps.GAP_PROBS: the simulator "
                                                 "charges each turn request_s times a draw (empty: request_s); "
                                                 "the calibration measures them")
    moment_s: float = Field(0.0, ge=0, le=60, description="seconds within which replies on one engine (and "
                            "trajectory releases) are one moment, whose draws of the quantiles above are "
                            "correlated as below (gaps.Moments; 0: every turn its own draws); the calibration "
                            "sets it")
    first_gap_correlation: float = Field(0.0, ge=0, le=1, description="correlation of the first gaps of "
                                         "trajectories released in one moment (0: independent); the calibration "
                                         "measures it")
    gap_correlation: float = Field(0.0, ge=0, le=1, description="the same for the gaps before later turns "
                                   "whose previous turns came back from one engine in one moment")
    reply_correlation: float = Field(0.0, ge=0, le=1, description="the same for the draws of request_quantiles "
                                     "of replies that came back from one engine in one moment")

    @field_validator("first_gap_quantiles", "turn_gap_quantiles", "request_quantiles")
    @classmethod
    def _gap_quantiles(cls, value: tuple[float, ...], info) -> tuple[float, ...]:
        return gaps.check_quantiles(value, info.field_name)


@dataclass(frozen=True)
class Instance:
    """One rollout instance of TP degree `tp`, in per-GPU and per-instance units."""

    tp: int
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_capacity_tokens: int  # tokens of KV the whole instance holds at once
    model: ModelSpec
    gpu: GpuSpec
    eff: RolloutEfficiency

    def prefill_seconds(self, tokens: int) -> float:
        """Compute-bound: 2 * active_params * tokens over the group's effective FLOP/s."""
        flops = 2.0 * self.model.active_params * tokens
        return flops / (self.tp * self.gpu.bf16_tflops * 1e12 * self.eff.prefill_mfu)

    def decode_step_seconds(self, batch: float, context_tokens: float) -> float:
        """Bandwidth-bound: weights read + KV read per GPU over HBM, plus 2 all-reduces per layer, plus
        the step's fixed and per-sequence overheads."""
        weights = self.weight_bytes_per_gpu * _expert_read_fraction(self.model, batch)
        kv = context_tokens * self.kv_bytes_per_token_per_gpu
        memory = (weights + kv) / (self.gpu.hbm_gbps * 1e9 * self.eff.decode_bw)
        return memory + 2 * self.model.layers * self.allreduce_seconds(batch) + self.overhead_seconds(batch)

    def overhead_seconds(self, batch: float) -> float:
        """A decode step's cost beyond the roofline: fixed, plus per sequence (both 0 unless calibrated)."""
        return self.eff.step_overhead_s + self.eff.step_per_seq_s * batch if batch else 0.0

    def allreduce_seconds(self, batch: int) -> float:
        """Ring all-reduce of one hidden-state activation (batch x hidden, bf16) across the group."""
        if self.tp == 1:
            return 0.0
        payload = batch * self.model.hidden_size * 2.0
        wire = 2.0 * (self.tp - 1) / self.tp * payload
        return self.eff.allreduce_latency_s + wire / (self.gpu.link_bytes_per_s(self.tp) * self.eff.comm)


def _expert_read_fraction(model: ModelSpec, batch: int) -> float:
    """Share of the weights a decode step reads: every dense weight, and the experts some token hit."""
    if not model.experts:
        return 1.0
    touched = 1.0 - (1.0 - model.active_experts / model.experts) ** batch
    expert = model.layers * (model.mlp_params - model.hidden_size * model.experts)
    dense = model.total_params - expert
    return (dense + expert * touched) / model.total_params


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads one GPU stores; raises `Infeasible` for a TP degree the heads cannot be split over."""
    if model.heads % tp:
        raise Infeasible(f"tp {tp} does not divide {model.name}'s {model.heads} attention heads")
    if tp <= model.kv_heads:
        if model.kv_heads % tp:
            raise Infeasible(f"tp {tp} does not divide {model.name}'s {model.kv_heads} kv heads")
        return model.kv_heads // tp
    if tp % model.kv_heads:
        raise Infeasible(f"tp {tp} is not a multiple of {model.name}'s {model.kv_heads} kv heads")
    return 1  # replicated: one head per GPU


def instance(model: ModelSpec, gpu: GpuSpec, tp: int, eff: RolloutEfficiency) -> Instance:
    """The instance model for one TP degree; `Infeasible` if the weights leave no room for KV."""
    if tp > gpu.gpus_per_node:
        raise Infeasible(f"tp {tp} exceeds the {gpu.gpus_per_node} GPUs of one node")
    weights = model.weight_bytes / tp
    kv_per_token = 2.0 * model.layers * kv_heads_per_gpu(model, tp) * model.head_dim * model.kv_bytes_per_value
    usable = gpu.memory_bytes * eff.memory_fraction - eff.reserve_gib * 1024 ** 3
    free = usable - weights
    if free <= 0:
        raise OverMemory("rollout", f"tp{tp}", weights / 2**30, usable / 2**30,
                         f"{gpu.name} allows {usable / 2**30:.1f} GiB per GPU for weights and KV cache "
                         f"({gpu.memory_gib:g} GiB x memory_fraction {eff.memory_fraction:g} - reserve "
                         f"{eff.reserve_gib:g} GiB), which leaves no room for a KV cache after "
                         f"{model.name}'s weights")
    return Instance(tp, weights, kv_per_token, int(free // kv_per_token), model, gpu, eff)


class _Costs:
    """One TP degree's finish-time constants, folded once per fleet (the greedy's hot loop reads them).

    The estimate (`_greedy` computes it): continuous batching; prefills are serialised (sum of their
    times). Decode runs at a steady batch b = the number of requests, capped by `max_seqs` and by
    how many mean-size contexts fit in the KV cache; it needs max(longest output, total output / b)
    steps, each costing `Instance.decode_step_seconds(b, b * mean context)`.
    """

    def __init__(self, inst: Instance):
        model, bandwidth = inst.model, inst.gpu.hbm_gbps * 1e9 * inst.eff.decode_bw
        self.capacity, self.max_seqs = inst.kv_capacity_tokens, inst.eff.max_seqs
        self.prefill_per_token = inst.prefill_seconds(1)
        self.weight_s = inst.weight_bytes_per_gpu / bandwidth
        self.kv_s = inst.kv_bytes_per_token_per_gpu / bandwidth
        # a step's cost beyond its reads: the all-reduces and the pass overheads, fixed and per sequence
        comm_fixed = 2 * model.layers * inst.allreduce_seconds(0) if inst.tp > 1 else 0.0
        self.step_fixed = comm_fixed + inst.eff.step_overhead_s
        per_seq_comm = 2 * model.layers * (inst.allreduce_seconds(1) - inst.allreduce_seconds(0))
        self.step_per_seq = per_seq_comm + inst.eff.step_per_seq_s
        self.moe = model if model.experts else None  # MoE: a step reads the experts its batch hit


def longest_first(trace: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The trace in the order the greedy assigns it (longest prompt + output first), for callers that
    cost many fleets on one trace (`rollout_time(..., ordered=True)` then skips the sort)."""
    return sorted(trace, key=lambda r: r[0] + r[1], reverse=True)


def rollout_time(trace: Sequence[tuple[int, int]], instances: Sequence[Instance],
                 cutoff: float = math.inf, allow_idle: bool = False, ordered: bool = False) -> float:
    """Makespan of serving `trace` [(prompt tokens, output tokens)] on `instances`.

    `allow_idle=False` is the plain greedy below. Like every list-scheduling rule it has Graham's
    anomalies: one more instance can, rarely, lengthen the greedy makespan a little. `allow_idle=True`
    returns the best greedy over every sub-fleet (idle instances allowed), which is monotone by
    construction: more instances never increase it. It costs one greedy per sub-fleet count vector,
    so it is for small fleets (at most `IDLE_LATTICE_LIMIT` count vectors).

    Requests go longest-first (prompt + output) to the instance whose estimated finish after taking
    the request is earliest, among instances whose KV cache can hold the whole request. Instances of
    one TP degree are identical, so only the least-loaded of each degree is a candidate (one heap per
    degree). Returns `math.inf` as soon as any finish reaches `cutoff` (used for pruning). `ordered`:
    the trace is already longest-first (`longest_first`), as the search passes it for every fleet.
    """
    ordered_trace = trace if ordered else longest_first(trace)
    if allow_idle:
        return _best_sub_fleet(ordered_trace, instances, cutoff)
    return _greedy(ordered_trace, instances, cutoff)


IDLE_LATTICE_LIMIT = 4096


def _best_sub_fleet(trace: Sequence[tuple[int, int]], instances: Sequence[Instance], cutoff: float) -> float:
    kinds = {inst.tp: inst for inst in instances}
    tps = sorted(kinds)
    counts = [sum(1 for inst in instances if inst.tp == tp) for tp in tps]
    if math.prod(c + 1 for c in counts) > IDLE_LATTICE_LIMIT:
        raise InvalidArgument(f"allow_idle over {len(instances)} instances is too large a lattice")
    best = math.inf
    for vector in itertools.product(*(range(c + 1) for c in counts)):
        fleet = [kinds[tp] for tp, n in zip(tps, vector) for _ in range(n)]
        if fleet:
            try:
                best = min(best, _greedy(trace, fleet, min(cutoff, best)))
            except Infeasible:
                continue
    if best == math.inf and cutoff == math.inf:
        _greedy(trace, instances, cutoff)  # every sub-fleet failed: raise the full fleet's reason
    return best


def _greedy(trace: Sequence[tuple[int, int]], instances: Sequence[Instance], cutoff: float) -> float:
    """The greedy of `rollout_time`. One heap per TP degree of flat tuples (finish, index, prefill_s,
    decode_tokens, context_sum, longest_output, requests): each request is offered to every degree's
    least-loaded instance and goes where it finishes first (`_Costs`' estimate, written out here:
    the hot loop of every search; tests/unit/test_planner_search.py states the rule apart)."""
    if not instances:
        raise Infeasible("no rollout instances")
    by_tp: dict[int, tuple] = {}
    for index, inst in enumerate(instances):
        kind = by_tp.get(inst.tp)
        if kind is None:
            c = _Costs(inst)
            kind = by_tp[inst.tp] = (c.capacity, c.prefill_per_token, c.max_seqs, c.weight_s, c.kv_s, c.step_fixed,
                                     c.step_per_seq, c.moe, [])
        kind[-1].append((0.0, index, 0.0, 0, 0.0, 0, 0))
    classes = list(by_tp.values())
    makespan = 0.0
    for prompt, output in trace:  # longest first (`longest_first`)
        best_heap, best_finish, best = None, math.inf, None
        for capacity, per_token, max_seqs, weight_s, kv_s, fixed, per_seq, moe, heap in classes:
            if prompt + output > capacity:
                continue
            _, index, prefill_s, decode, context, longest, requests = heap[0]  # this degree's least loaded
            prefill_s = prefill_s + per_token * prompt
            decode = decode + output
            context = context + prompt + output / 2.0
            if output > longest:  # (max() and min() written out: ~20 million calls at 4,096 GPUs)
                longest = output
            requests = requests + 1
            mean = context / requests
            batch = int(capacity // (mean if mean > 1.0 else 1.0))
            if requests < batch:
                batch = requests
            if max_seqs < batch:
                batch = max_seqs
            if batch < 1:
                batch = 1
            steps = -(-decode // batch)
            if longest > steps:
                steps = longest
            fraction = 1.0 if moe is None else _expert_read_fraction(moe, batch)
            finish = prefill_s + steps * (weight_s * fraction + kv_s * batch * mean + fixed + per_seq * batch)
            if best_heap is None or finish < best_finish:
                best_heap, best_finish = heap, finish
                best = (finish, index, prefill_s, decode, context, longest, requests)
        if best_heap is None:
            raise Infeasible(f"a request of {prompt}+{output} tokens fits the KV cache of no instance "
                             f"(largest holds {max(i.kv_capacity_tokens for i in instances)} tokens)")
        heapq.heapreplace(best_heap, best)
        if best_finish > makespan:
            makespan = best_finish
            if makespan >= cutoff:
                return math.inf
    return makespan
