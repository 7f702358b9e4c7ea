"""What a mixture-of-experts model adds to the Megatron backend: expert parameters and their
groups, the routers' load-balancing loss, and the experts' weights gathered for publication.

Owns: telling expert parameters from dense ones (and summing or norming each over its own group on
the CPU path), switching the routers' load-balancing loss on and weighting it per step, reading
what the routers recorded (the step metric `router_aux_loss`), and renumbering expert-parallel
ranks' local experts into one HF-ordered set on the rank that publishes. Must not know: the GRPO
loss, optimizers, batches, HF names (`megatron.convert` has them).

Runs in: every trainer rank process whose model is a mixture of experts.

Expert parallelism (EP ranks, taken from the data-parallel ranks as Megatron lays them out): each
rank of an EP group holds E/EP experts, tokens travel to their experts and back (all-to-all);
every other parameter is replicated over data parallelism as in a dense model.

    dense parameter   gradient summed over the data-parallel group, counted once in the norm
    expert parameter  gradient summed over the expert-data-parallel group (the ranks holding the
                      same experts), its square summed over the EP group in the norm

The load-balancing loss (Megatron's `aux_loss`, Switch-style) reaches the gradient through
Megatron's router: per micro-batch, coefficient × loss × the micro-batch's tokens. The trainer's own
loss is Σ token loss / (N/W) (`gradient_hook`), so the coefficient is divided by N/W each step —
Megatron's own weighting under per-token loss, where everything is divided by the step's loss
tokens. Megatron only adds it while the router is in training mode with gradients on: the routers
are put in training mode (they have no dropout; the rest of the model stays in eval), so log-prob
passes (no gradients) never compute it.
"""

from __future__ import annotations

from typing import Any

ROUTER_AUX_LOSS = "router_aux_loss"  # the step metric: the mean load-balancing loss over MoE layers and micro-batches


def patch_missing_fused_kernels() -> None:
    """megatron-core 0.16 names Transformer Engine's fused MoE kernels only when TE imports, then
    tests them for None: without TE the router's gating linear raises NameError. Define them as None
    (0.19 does this itself)."""
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def routers(model: Any) -> list[Any]:
    from megatron.core.transformer.moe.router import Router

    return [m for m in model.modules() if isinstance(m, Router)]


def prepare(model: Any) -> None:
    """Routers in training mode (only what switches the load-balancing loss on; no dropout there)."""
    for router in routers(model):
        router.train()


def weigh_aux_loss(model: Any, coefficient: float, token_count: float) -> None:
    """Set this step's weight of the load-balancing loss: `coefficient` / (N/W) (see the module doc)."""
    for router in routers(model):
        router.config.moe_aux_loss_coeff = coefficient / token_count if coefficient > 0 else 0.0


def clear_aux_loss() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def read_aux_loss(model: Any, micro_batches: int) -> dict[str, float]:
    """{router_aux_loss: the mean over the model's MoE layers and this rank's micro-batches} of what
    the routers recorded in the last gradient pass (then cleared). Collective over the pipeline
    group (each stage recorded its own layers). Call only when the loss is on (coefficient > 0)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    total = torch.zeros(1, dtype=torch.float64)
    if entry is not None:
        total += float(entry["values"].detach().double().sum())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        on = total.to(_device())
        dist.all_reduce(on, group=ps.get_pipeline_model_parallel_group())
        total = on.cpu()
    clear_aux_loss()
    return {ROUTER_AUX_LOSS: float(total) / (model.config.num_layers * max(micro_batches, 1))}


def _device() -> Any:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


# ---- expert parameters on the CPU path ---------------------------------------------------------

def is_expert(param: Any) -> bool:
    """An expert-parallel parameter (Megatron marks them allreduce=False when EP > 1)."""
    return not getattr(param, "allreduce", True)


def sum_gradients(params: list[Any], flat: Any) -> Any:
    """`flat` (every trainable parameter's gradient, in `params` order) summed over the data-parallel
    group for dense parameters and over the expert-data-parallel group for expert ones; in place."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    expert_slices, offset = [], 0
    dense_mask = torch.ones(flat.numel(), dtype=torch.bool)
    for p in params:
        if is_expert(p):
            expert_slices.append((offset, offset + p.numel()))
            dense_mask[offset: offset + p.numel()] = False
        offset += p.numel()
    dense = flat[dense_mask.to(flat.device)]
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(dense, group=ps.get_data_parallel_group())
    flat[dense_mask.to(flat.device)] = dense
    if expert_slices:
        experts = torch.cat([flat[a:b] for a, b in expert_slices])
        if ps.get_expert_data_parallel_world_size() > 1:
            dist.all_reduce(experts, group=ps.get_expert_data_parallel_group())
        offset = 0
        for a, b in expert_slices:
            flat[a:b] = experts[offset: offset + b - a]
            offset += b - a
    return flat


def expert_square_norm(params: list[Any]) -> float:
    """Σ grad² of the expert parameters over every rank holding a different share of the experts (EP × PP)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None and is_expert(p))
    group = ps.get_expert_tensor_model_pipeline_parallel_group()
    total = torch.tensor([local], dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total)


# ---- publication ------------------------------------------------------------------------------

def gather_experts(local: dict[str, Any], experts_per_rank: int) -> dict[str, Any] | None:
    """This stage's Megatron state with every expert, numbered globally, on EP rank 0 (None on the
    others); collective over the expert-parallel group. With EP = 1 `local` itself."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return local
    group = ps.get_expert_model_parallel_group()
    marker = ".experts.local_experts."
    mine = {k: v.detach().cpu() for k, v in local.items() if marker in k}
    first = ps.get_expert_model_parallel_rank() == 0
    gathered: list[Any] | None = [None] * ep if first else None
    dist.gather_object(mine, gathered, dst=dist.get_process_group_ranks(group)[0], group=group)
    if not first:
        return None
    assert gathered is not None
    out = {k: v for k, v in local.items() if marker not in k}
    device = next(iter(local.values())).device if local else "cpu"
    for rank, shard in enumerate(gathered):
        for name, tensor in shard.items():
            head, tail = name.split(marker)
            index, rest = tail.split(".", 1)
            out[f"{head}{marker}{rank * experts_per_rank + int(index)}.{rest}"] = tensor.to(device)
    return out
