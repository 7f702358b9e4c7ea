"""Training cost model: step time and per-GPU memory of one (TP, PP, DP, micro-batch) layout.

Owns the Megatron-style estimate the planner's search ranks training layouts by. It knows nothing
of rollout, traces or search. Pure: bytes and seconds from the specs, no clock, no network.

    step = compute / (1 - bubble) + tp_comm + pp_comm + (1 - overlap) * dp_comm
    compute = 6 * active_params * tokens / (gpus * peak * mfu)   (+ 2 * ... for log-prob recompute)
    bubble  = (pp - 1) / (m + pp - 1) of a 1F1B schedule with m micro-batches per replica
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from libra.configbase import Section
from libra.services.planner.cost_rollout import Infeasible, OverMemory
from libra.services.planner.hardware import GIB, GpuSpec, ModelSpec


class TrainEfficiency(Section):
    """Calibrated efficiencies and memory assumptions of the training backend."""

    mfu: float = Field(0.4, gt=0, le=1, description="fraction of BF16 peak the GEMMs reach")
    comm: float = Field(0.7, gt=0, le=1, description="fraction of link bandwidth collectives reach")
    dp_overlap: float = Field(0.5, ge=0, le=1, description="share of DP gradient traffic hidden by compute")
    logprob_recompute: bool = Field(True, description="one extra forward pass for the old log-probs")
    step_overhead_s: float = Field(0.0, ge=0, le=3600, description="seconds of every step outside the optimizer "
                                   "step (the batch's assembly, the behaviour log-prob check, acks, checkpoints, "
                                   "records); 0: none; the online calibration measures it")
    activation_bytes_per_token_layer: float = Field(
        34.0, gt=0, le=1000, description="activation bytes per token per layer, in units of hidden_size "
                                         "(34: selective recompute, bf16)")
    memory_fraction: float = Field(0.92, gt=0, le=1, description="share of GPU memory training may use")


@dataclass(frozen=True)
class Layout:
    """A training layout: model-parallel degrees, replicas and sequences per micro-batch."""

    tp: int
    pp: int
    dp: int
    micro_batch: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class TrainEstimate:
    seconds: float
    compute_s: float
    bubble: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    memory_gib: float
    micro_batches: int


def memory_bytes(model: ModelSpec, layout: Layout, seq_len: int, eff: TrainEfficiency) -> float:
    """Peak bytes on the busiest GPU: bf16 weights, fp32 grads, fp32 master + Adam states sharded
    over DP (distributed optimizer), 1F1B in-flight activations, and fp32 logits of one micro-batch."""
    shard = model.total_params / (layout.tp * layout.pp)
    weights = shard * model.bytes_per_param
    grads = shard * 4.0
    optimizer = shard * 12.0 / layout.dp
    tokens = layout.micro_batch * seq_len
    in_flight = layout.pp  # the first stage holds pp micro-batches of its layers under 1F1B
    per_layer = eff.activation_bytes_per_token_layer * model.hidden_size * tokens / layout.tp
    activations = per_layer * (model.layers / layout.pp) * in_flight
    logits = tokens * model.vocab_size / layout.tp * 4.0
    return weights + grads + optimizer + activations + logits


def _ring(payload: float, n: int, bandwidth: float) -> float:
    """Ring all-reduce time of `payload` bytes over n ranks."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * payload / bandwidth


def busiest_replica(batch_sequences: int, dp: int, group_size: int = 1) -> int:
    """Sequences on the busiest of `dp` data-parallel replicas: whole GRPO groups of `group_size`, as
    even as their count allows, the split the trainer makes (services/trainer/ranks.py
    data_parallel_shard: 48 groups on 5 replicas train 10, 10, 10, 9 and 9). Raises `Infeasible`
    when the batch is not whole groups or a replica would get none."""
    groups, rest = divmod(batch_sequences, group_size)
    if rest:
        raise Infeasible(f"batch {batch_sequences} is not whole GRPO groups of {group_size}")
    if groups < dp:
        raise Infeasible(f"dp {dp} exceeds the batch's {groups} GRPO groups of {group_size}: "
                         f"a replica would train nothing")
    return -(-groups // dp) * group_size


def step_time(model: ModelSpec, gpu: GpuSpec, layout: Layout, batch_sequences: int, seq_len: int,
              eff: TrainEfficiency, group_size: int = 1) -> TrainEstimate:
    """Seconds of one optimizer step over `batch_sequences` sequences of mean length `seq_len`, in
    GRPO groups of `group_size`: the busiest data-parallel replica's (`busiest_replica`; the others
    wait for it at the gradient all-reduce), in micro-batches of up to `micro_batch` sequences.

    Raises `Infeasible` when a replica would get no group, a micro-batch would be larger than a
    replica's share, or the layout does not fit in memory.
    """
    busiest = busiest_replica(batch_sequences, layout.dp, group_size)
    if layout.micro_batch > busiest:
        raise Infeasible(f"micro_batch {layout.micro_batch} exceeds a replica's {busiest} sequences "
                         f"(batch {batch_sequences} on dp {layout.dp})")
    per_replica = -(-busiest // layout.micro_batch)
    if layout.tp > gpu.gpus_per_node:
        raise Infeasible(f"training tp {layout.tp} crosses a node of {gpu.gpus_per_node} GPUs")
    if layout.pp > model.layers:
        raise Infeasible(f"pp {layout.pp} exceeds {model.layers} layers")
    memory = memory_bytes(model, layout, seq_len, eff)
    budget = gpu.memory_bytes * eff.memory_fraction
    if memory > budget:
        raise OverMemory("training", f"tp{layout.tp} pp{layout.pp} dp{layout.dp} mb{layout.micro_batch}",
                         memory / GIB, budget / GIB,
                         f"{gpu.name} allows {budget / GIB:.1f} ({gpu.memory_gib:g} GiB x memory_fraction "
                         f"{eff.memory_fraction:g}) for {model.name} with {seq_len}-token sequences")
    m = per_replica
    passes = 6.0 + (2.0 if eff.logprob_recompute else 0.0)
    compute = (passes * model.active_params * busiest * layout.dp * seq_len
               / (layout.gpus * gpu.bf16_tflops * 1e12 * eff.mfu))
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    tp_comm, pp_comm, dp_comm = _comm_seconds(model, gpu, layout, m, seq_len, eff)
    seconds = compute / (1.0 - bubble) + tp_comm + pp_comm + (1.0 - eff.dp_overlap) * dp_comm + eff.step_overhead_s
    return TrainEstimate(seconds, compute, bubble, tp_comm, pp_comm, dp_comm, memory / GIB, m)


def _comm_seconds(model: ModelSpec, gpu: GpuSpec, layout: Layout, m: int, seq_len: int,
                  eff: TrainEfficiency) -> tuple[float, float, float]:
    """TP all-reduces, PP point-to-point sends and the DP gradient collective, in seconds."""
    activation = layout.micro_batch * seq_len * model.hidden_size * 2.0  # one bf16 hidden state
    # 4 all-reduces per layer per micro-batch (2 forward, 2 backward), +2 for the recompute pass.
    tp_calls = (4 + (2 if eff.logprob_recompute else 0)) * (model.layers / layout.pp) * m
    tp_comm = tp_calls * _ring(activation, layout.tp, gpu.link_bytes_per_s(layout.tp) * eff.comm)
    pp_link = gpu.link_bytes_per_s(layout.tp * layout.pp) * eff.comm
    # Forward and backward sends on the critical path of a 1F1B schedule, tp-sharded (scatter-gather).
    pp_comm = 0.0 if layout.pp == 1 else 2.0 * (m + layout.pp - 1) * (activation / layout.tp) / pp_link
    grads = model.total_params / (layout.tp * layout.pp) * 4.0  # reduce-scatter + all-gather ~ one ring
    dp_comm = _ring(grads, layout.dp, gpu.link_bytes_per_s(layout.gpus) * eff.comm)
    return tp_comm, pp_comm, dp_comm
