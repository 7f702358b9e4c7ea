"""The Megatron backend's model run stage by stage through Megatron-Core's pipeline schedule.

Owns: the micro-batches handed to `get_forward_backward_func()` (each its own width and size),
the GRPO loss on the last stage, what the last stage broadcasts to the others (metric sums,
log-probs), the gradients that model parallelism leaves partial (tied embedding copies, q/k
norms), a stage's HF weights in (only the tensors it needs) and out (gathered on global rank 0),
and the parameter count of the whole model.
Must not know: optimizers, the elastic gradient hook, Redis, how batches are assembled.

Runs in: every trainer rank process (collective over its model-parallel group) and a hybrid
replica's process (one stage, TP = PP = 1: nothing sent or broadcast).

    stage 0: embedding, layers [0, L/P) ─▶ … ─▶ stage P−1: layers, final norm, LM head ─▶ CE ─▶ loss
             ◀──── activation gradients (1F1B: warm-up forwards, then one forward, one backward)
    metric sums and log-probs: computed on the last stage, broadcast over the pipeline group

Every rank of a model-parallel group (TP × PP) is handed the same sequences and packs them
itself: the first stage needs the token ids, the last the labels and loss inputs, every stage the
width (RoPE) and, with the local spec, the causal mask. Activations travel with their shape
(`variable_seq_lengths`), so micro-batches need not share a width or a size. With PP = 1 the same
code runs Megatron's no-pipelining schedule: one stage, nothing sent, nothing broadcast.

Packed micro-batches (`trainer.micro_batch_tokens`): one row of every sequence back to back, fed
in Megatron's THD form — `PackedSeqParams(qkv_format="thd", cu_seqlens)`, with which Megatron
applies RoPE per sequence (positions restarting) and hands the SDPA spec's core attention
[tokens, heads, dim] (megatron/specs.py keeps attention inside each sequence). The loss sees the
same target grid as a padded micro-batch (backend.pack), so its arithmetic does not change.

Tied embeddings with PP > 1: the first stage holds the embedding, the last a copy as its LM head
(Megatron marks it `shared`). Both are loaded from HF `embed_tokens`; `finish_model_parallel_grads`
adds their gradients over Megatron's embedding group before the update, so both take the same
step and stay equal; only the first stage's is written back, and the copy is counted once.
"""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libra.services.trainer.megatron import runtime as rt
from libra.services.trainer.backend import PackedBatch, TrainBatch, micro_batch_cost, pack

if TYPE_CHECKING:
    import torch

    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.megatron.convert import Shape


@dataclass(frozen=True)
class Micro:
    """One micro-batch as every stage feeds it to the model (tensors on the device)."""

    packed: PackedBatch  # on the CPU: the loss inputs, moved to the device on the last stage
    indices: tuple[int, ...]  # its sequences' positions in the step's batch
    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor  # the next token at each position (the last column is ignored)
    mask: torch.Tensor | None  # the causal mask for the local spec (True = hidden); SDPA masks itself
    packed_seq_params: Any = None  # Megatron's PackedSeqParams (THD) of a concatenated micro-batch


def micro_batches(batch: TrainBatch, config: TrainerConfig, device: Any, causal_mask: bool) -> list[Micro]:
    """The step's micro-batches (`TrainBatch.plan`): right-padded rows, or with
    `config.micro_batch_tokens` one concatenated row each (THD)."""
    import torch

    concatenate = bool(config.micro_batch_tokens)
    out = []
    for indices in batch.plan(config.micro_batch_size, config.micro_batch_tokens,
                              micro_batch_cost(device, config.micro_batch_cost_tokens)):
        packed = pack([batch.sequences[i] for i in indices], concatenate=concatenate)
        input_ids = packed.input_ids.to(device)
        rows, width = input_ids.shape
        labels = torch.zeros_like(input_ids)
        labels[:, :-1] = input_ids[:, 1:]
        if concatenate:
            out.append(Micro(packed, tuple(indices), input_ids, packed.position_ids.to(device), labels, None,
                             thd_params(packed, device)))
            continue
        positions = torch.arange(width, device=device).unsqueeze(0).expand(rows, width)
        mask = torch.ones((width, width), dtype=torch.bool, device=device).triu(1)[None, None] if causal_mask else None
        out.append(Micro(packed, tuple(indices), input_ids, positions, labels, mask))
    return out


def thd_params(packed: PackedBatch, device: Any) -> Any:
    """Megatron's description of a concatenated row: where each sequence starts, the longest one."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(packed.cu_seqlens, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=packed.max_seqlen,
                           max_seqlen_kv=packed.max_seqlen)


def run(model: Any, micros: list[Micro], loss_of: Callable[[Micro, Any], Any], forward_only: bool) -> None:
    """One pass of Megatron's schedule over `micros`. On the last stage, `loss_of(micro, logprobs)`
    receives each micro-batch's (B, T−1) float32 next-token log-probs and returns the scalar that is
    backpropagated (with calculate_per_token_loss the schedule leaves its scale to us)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micros:  # e.g. a core rank whose whole slice went to hybrid replicas; every stage agrees
        return

    def forward_step(data_iterator: Iterator[Micro], module: Any) -> tuple[Any, Callable]:
        micro = next(data_iterator)
        # With labels, the last stage returns the per-token cross entropy −log p(label), vocab-parallel
        # in fp32; the other stages return their hidden states, which the schedule sends on.
        extra = {} if micro.packed_seq_params is None else {"packed_seq_params": micro.packed_seq_params}
        output = module(input_ids=micro.input_ids, position_ids=micro.positions, attention_mask=micro.mask,
                        labels=micro.labels, **extra)

        def loss_func(per_token: Any) -> tuple[Any, Any, dict]:
            loss = loss_of(micro, -per_token[:, :-1].float())
            tokens = torch.tensor(int(micro.packed.loss_mask.sum()), dtype=torch.int, device=loss.device)
            return loss, tokens, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micros), model=model, num_microbatches=len(micros),
        seq_length=max(m.input_ids.shape[1] for m in micros),
        micro_batch_size=max(m.input_ids.shape[0] for m in micros), forward_only=forward_only)


def logprobs(model: Any, micros: list[Micro]) -> list[torch.Tensor] | None:
    """Per sequence of the step's batch (in its order), the log-probs of its response tokens on the
    last stage (None elsewhere); no grad."""
    import torch

    from libra.services.trainer.backend import unpack

    out: list[Any] = [None] * sum(len(m.indices) for m in micros)

    def keep(micro: Micro, logprobs: Any) -> Any:
        for index, values in zip(micro.indices, unpack(logprobs, micro.packed)):
            out[index] = values
        return logprobs.new_zeros(())

    with torch.no_grad():
        run(model, micros, keep, forward_only=True)
    return out if rt.last_stage() else None


def share_logprobs(local: list[torch.Tensor] | None, batch: TrainBatch, device: Any) -> list[torch.Tensor]:
    """The last stage's log-probs on every stage of the pipeline (one broadcast)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if rt.pp_size() == 1:
        assert local is not None
        return local
    lengths = [s.response_length for s in batch.sequences]
    flat = torch.cat(local) if local else torch.empty(sum(lengths), dtype=torch.float32, device=device)
    dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return list(flat.split(lengths))


def accumulate(model: Any, micros: list[Micro], config: TrainerConfig, old: list | None,
               token_count: float) -> dict[str, float]:
    """Forward and backward of every micro-batch, the GRPO loss on the last stage; the metric sums
    (loss included) on every stage. `old`: recomputed log-probs per sequence (last stage), or None."""
    import torch

    from libra.services.trainer.grpo import policy_loss

    sums: dict[str, float] = defaultdict(float)

    def loss_of(micro: Micro, new: Any) -> Any:
        packed, device = micro.packed, new.device
        behaviour = packed.behaviour_logprobs.to(device)
        old_grid = behaviour
        if old is not None:
            old_grid = torch.zeros_like(new)
            old_grid[packed.response_mask.to(device)] = torch.cat([old[i] for i in micro.indices]).to(device)
        loss, metrics = policy_loss(
            new, old_grid, behaviour, packed.advantages.to(device), packed.loss_mask.to(device),
            config.clip_low, config.clip_high, config.tis_cap, config.kl_coef, token_count=token_count)
        sums["loss"] += float(loss.detach())
        for name, value in metrics.items():
            sums[name] += float(value)
        return loss

    run(model, micros, loss_of, forward_only=False)
    return share_sums(dict(sums))


def share_sums(sums: dict[str, float]) -> dict[str, float]:
    """The last stage's metric sums on every stage of the pipeline."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if rt.pp_size() == 1:
        return sums
    box = [sums if rt.last_stage() else None]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return dict(box[0])


def finish_model_parallel_grads(model: Any, main_grad: bool) -> None:
    """Complete the gradients that model parallelism leaves partial, as Megatron's
    finalize_model_grads does besides the DP reduce (which the backend does itself). Linear, so it
    may run before or after that reduce. `main_grad`: Megatron DDP's fp32 buffers, else `.grad`.

    Qwen3's q/k norms are replicated over TP but each rank applies them to its own heads only, so
    each holds part of their gradient: summed over TP (the layer norms see the full hidden state
    and already agree). A tied embedding's two copies (first and last stage): summed over the
    embedding group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1 and model.config.qk_layernorm:
        for name, p in model.named_parameters():
            if ("q_layernorm" in name or "k_layernorm" in name) and p.requires_grad:  # frozen under LoRA
                grad = p.main_grad if main_grad else p.grad
                if grad is not None:
                    dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
    if rt.pp_size() == 1 or not model.share_embeddings_and_output_weights or not ps.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    if not weight.requires_grad:  # frozen under LoRA
        return
    if main_grad:
        grad = weight.main_grad
    else:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad
    dist.all_reduce(grad, group=ps.get_embedding_group())


# ---- weights ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """What of the whole model this rank's GPTModel holds."""

    first: bool  # the embedding
    last: bool  # the final norm and the LM head
    layer_offset: int
    layers: int


def stage_of(model: Any) -> Stage:
    layers = len(model.decoder.layers)
    offset = model.decoder.layers[0].layer_number - 1 if layers else 0  # layer_number is global, from 1
    return Stage(bool(model.pre_process), bool(model.post_process), offset, layers)


def stage_state(model: Any, model_dir: str, shape: Shape, tp: int, tp_rank: int, ep: int = 1,
                ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The Megatron state dict of this stage, TP rank and EP rank, reading only the HF tensors it needs."""
    from libra.services.trainer.megatron import convert as convert

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"MegatronBackend.load: no *.safetensors weights in {model_dir!r}")
    stage = stage_of(model)
    return convert.hf_to_megatron(_SafetensorsFiles(files), shape, tp=tp, rank=tp_rank, layer_offset=stage.layer_offset,
                                  layers=stage.layers, first=stage.first, last=stage.last, ep=ep, ep_rank=ep_rank)


class _SafetensorsFiles(Mapping):
    """HF tensor name → tensor over a model's safetensors files, each read when first asked for."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._where: dict[str, str] = {}
        for name in files:
            with safe_open(name, "pt") as handle:
                self._where.update(dict.fromkeys(handle.keys(), name))

    def __getitem__(self, name: str) -> Any:
        from safetensors import safe_open

        with safe_open(self._where[name], "pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def hf_state_dict(model: Any, shape: Shape, to_cpu: bool, device: Any) -> dict[str, torch.Tensor] | None:
    """The whole model in HF names on global rank 0 (DP 0, TP 0, first stage), None elsewhere.

    Collective over the ranks of DP replica 0 (and, with expert parallelism, the ranks holding the
    other experts: `moe.gather_experts`): TP shards are all-gathered within each stage and converted
    there; the stages' HF tensors are then sent to the first stage one by one. LoRA adapters are
    merged into their weights first (`lora.merged_state`). With
    `to_cpu`, host copies (each received tensor moves to the host as it arrives, so rank 0's device
    never holds the whole model); without, tensors on the device that may alias the parameters.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from libra.services.trainer.megatron import convert as convert
    from libra.services.trainer.megatron import lora, moe

    local = lora.merged_state(model)
    if shape.moe:  # EP ranks are DP ranks: the experts of DP replica 0's group come to it first
        local = moe.gather_experts(local, shape.experts // ps.get_expert_model_parallel_world_size())
    if ps.get_data_parallel_rank() != 0:  # the TP and PP groups of a rank lie within its DP replica
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    shards = [local]
    if tp > 1:
        gathered = {}
        for name in sorted(local):
            gathered[name] = [torch.empty_like(local[name]) for _ in range(tp)]
            dist.all_gather(gathered[name], local[name].contiguous(), group=ps.get_tensor_model_parallel_group())
        shards = [{name: g[r] for name, g in gathered.items()} for r in range(tp)]
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    stage = stage_of(model)
    if stage.first and to_cpu:  # copies even on a CPU: a snapshot that later steps leave alone
        shards = [{k: v.to("cpu", copy=True) for k, v in s.items()} for s in shards]
    hf = convert.megatron_to_hf(shards, shape, stage.layer_offset, stage.layers, stage.first, stage.last)
    return hf if rt.pp_size() == 1 else _gather_stages(hf, stage.first, to_cpu, device)


def _gather_stages(hf: dict[str, torch.Tensor], first: bool, to_cpu: bool, device: Any) -> dict | None:
    """Every stage's HF tensors on the first stage (names, shapes and dtypes first, then each tensor)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    names = sorted(hf)
    entries = [(name, tuple(hf[name].shape), hf[name].dtype) for name in names]
    listing: list | None = [None] * len(ranks) if first else None
    dist.gather_object(entries, listing, dst=ranks[0], group=group)
    if not first:
        for name in names:
            dist.send(hf[name].contiguous(), dst=ranks[0], group=group)
        return None
    assert listing is not None
    for source, stage_entries in zip(ranks[1:], listing[1:]):
        for name, size, dtype in stage_entries:
            received = torch.empty(size, dtype=dtype, device=device)
            dist.recv(received, src=source, group=group)
            hf[name] = received.cpu() if to_cpu else received
    return hf


def count_parameters(model: Any, tp: int, device: Any) -> int:
    """Parameters of the whole model: TP shards summed, replicated norms once, stages added, the
    last stage's copy of a tied embedding not counted, expert-parallel shares multiplied by EP,
    LoRA adapters not counted. Collective over the pipeline group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from libra.services.trainer.megatron import lora, moe

    ep = ps.get_expert_model_parallel_world_size()
    local = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) * (ep if moe.is_expert(p) else 1)
                for name, p in model.named_parameters() if not getattr(p, "shared", False) and not lora.is_adapter(name))
    if rt.pp_size() == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return int(total)
