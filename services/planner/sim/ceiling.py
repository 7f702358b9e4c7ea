"""The throughput ceiling: the most trajectories per second any design could train a trace at, under
the cost model the simulator runs on (`benchmarks/throughput_ceiling.py`, docs/benchmarks.md).

Every GPU-second of a run is rollout or training. Whatever the design (colocated or disaggregated,
any split, any TP degrees, any routing, any staleness), training the trace's batches costs at least

    decode    each generated token reads its sequence's KV cache once and a share of the weights,
              (weights read per step / max_seqs + kv bytes per token x the tokens before it) / (HBM
              bandwidth x decode_bw) GPU-seconds (a mixture of experts' step reads the experts its
              tokens hit, at max_seqs tokens): the cost model's decode step per sequence
              (`cost_rollout.Instance.decode_step_seconds`) at the largest batch an engine runs,
              without all-reduces or calibrated overheads. Its GPU-seconds are the same at every TP
              degree (a TP-t engine reads 1/t of the weights and KV on each of its t GPUs; above the
              model's KV heads, heads are replicated and it reads more)
    prefill   each token that enters a context without being generated (the prompt, every tool
              payload) is prefilled once: 2 x active params at prefill_mfu of the peak
    training  the compute term of `cost_train.step_time`: (6, or 8 with the log-prob recompute) x
              active params per token of the batch at mfu of the peak, with no pipeline bubble,
              communication or per-step overhead (the batch's tokens less half a token per
              sequence: a step is costed at the batch's mean length, rounded)

so training them takes at least (their sum) / GPUs seconds. The simulator charges every one of
these and more (the weights read per step at the batch it runs, all-reduces, re-prefills after a
move, bubbles, communication, GPUs waiting), so no simulated run of the same batches beats it
(tests/unit/test_ceiling.py plays several designs against it). A design that rejects stale groups
trains groups of later batches in their place and also generated the ones it threw away: the
ceiling of the batches it did not train bounds it only as far as those are no cheaper than the
ones they replace (on a trace whose lengths grow, later batches cost more on average).

    ceiling(model, gpu, search, batches) ─▶ Ceiling(GPU-seconds of each part, the makespan floor,
                                                    trajectories/s at most)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from libra.errors import InvalidArgument
from libra.services.planner import cost_rollout
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.search import SearchConfig
from libra.traces.spec import TrajectorySpec


@dataclass(frozen=True)
class Ceiling:
    gpus: int
    trajectories: int
    decode_gpu_s: float
    prefill_gpu_s: float
    train_gpu_s: float

    @property
    def gpu_s(self) -> float:
        return self.decode_gpu_s + self.prefill_gpu_s + self.train_gpu_s

    @property
    def makespan_floor_s(self) -> float:
        """No design trains the batches in less time on `gpus` GPUs."""
        return self.gpu_s / self.gpus

    @property
    def trajectories_per_s(self) -> float:
        """No design trains them faster."""
        return self.trajectories / self.makespan_floor_s


def ceiling(model: ModelSpec, gpu: GpuSpec, search: SearchConfig,
            batches: Sequence[Sequence[TrajectorySpec]]) -> Ceiling:
    """The ceiling of training `batches` (one per step) on `search.total_gpus` GPUs of `gpu`, at the
    efficiencies of `search` (module docstring)."""
    if not batches or not all(batches):
        raise InvalidArgument("the throughput ceiling needs at least one batch, and no empty one")
    roll, train = search.rollout, search.train
    bandwidth = gpu.hbm_gbps * 1e9 * roll.decode_bw
    # a step reads the dense weights and the experts any of its tokens hit: per token the least at the
    # largest batch (the share read, 1 - (1 - active/experts)^batch, grows slower than the batch)
    weights_per_token = (model.weight_bytes * cost_rollout._expert_read_fraction(model, roll.max_seqs)
                         / roll.max_seqs / bandwidth)
    # the whole KV cache of a token (what a TP-1 engine holds; TP-t engines split it, or replicate heads)
    per_context_token = 2.0 * model.layers * model.kv_heads * model.head_dim * model.kv_bytes_per_value / bandwidth
    prefill_per_token = 2.0 * model.active_params / (gpu.bf16_tflops * 1e12 * roll.prefill_mfu)
    passes = 6.0 + (2.0 if train.logprob_recompute else 0.0)
    train_per_token = passes * model.active_params / (gpu.bf16_tflops * 1e12 * train.mfu)
    decode_s = prefill_s = train_s = 0.0
    trajectories = 0
    for batch in batches:
        sequences = 0
        for spec in batch:
            copies, context = spec.copies, spec.prompt_tokens
            fed = spec.prompt_tokens
            for index, turn in enumerate(spec.turns):
                n = turn.output_tokens  # its i-th token reads the context and the i turn tokens before it
                decode_s += copies * (n * weights_per_token + per_context_token * (n * context + n * (n - 1) / 2))
                context += n
                if index + 1 < len(spec.turns):
                    fed += turn.payload_tokens
                    context += turn.payload_tokens
            prefill_s += copies * fed * prefill_per_token
            train_s += copies * spec.total_tokens * train_per_token
            sequences += copies
        train_s -= 0.5 * sequences * train_per_token  # (a step costs its batch at the rounded mean length)
        trajectories += sequences
    return Ceiling(search.total_gpus, trajectories, decode_s, prefill_s, train_s)
