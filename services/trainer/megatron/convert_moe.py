"""Hugging Face ↔ Megatron-Core for the mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE): the MoE
half of `megatron.convert`.

Owns: the MoE fields of the model's `Shape` read from the HF config (refusing layer patterns
Megatron's uniform blocks cannot hold), Megatron's MoE settings for them, and one MoE layer's
weights both ways. Must not know: training, process groups (the caller says which expert-parallel
rank it converts for), files.

Runs in: every trainer rank process whose model is a mixture of experts (through `convert`).

Mixture of experts (E experts, each of width I_e; `ep` expert-parallel ranks, rank k holding experts
k·E/ep … (k+1)·E/ep − 1 as its local experts 0 … E/ep − 1):

    HF mlp.gate [E, H] (router)                    ─▶  mlp.router.weight (every rank)
    HF mlp.experts.{e}.gate_proj, up_proj [I_e, H] ─▶  mlp.experts.local_experts.{e − k·E/ep}.linear_fc1 [2·I_e, H]
    HF mlp.experts.{e}.down_proj [H, I_e]          ─▶  mlp.experts.local_experts.{…}.linear_fc2
    HF mlp.shared_expert.* (Qwen2-MoE)             ─▶  mlp.shared_experts.linear_fc1 / linear_fc2
    HF mlp.shared_expert_gate [1, H] (Qwen2-MoE)   ─▶  mlp.shared_experts.gate_weight

The HF names are those of the checkpoint on disk (one tensor per expert: what `save_pretrained`
writes and vLLM loads), not transformers 5's fused in-memory `experts.gate_up_proj`. Routing:
softmax over all experts then top-k (`norm_topk_prob: false`) is Megatron's pre-softmax router;
top-k then renormalised (`true`) is its default (softmax over the top-k logits), the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from libra.services.trainer.megatron.convert import Shape


def moe_shape(hf_config: Any) -> dict[str, Any]:
    """The MoE fields of `Shape`, refusing the layer patterns Megatron's uniform blocks cannot hold."""
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"config.json decoder_sparse_step={hf_config.decoder_sparse_step}: the Megatron backend maps "
                         "models whose every layer is a mixture of experts (decoder_sparse_step=1)")
    if getattr(hf_config, "mlp_only_layers", None):
        raise ValueError(f"config.json mlp_only_layers={hf_config.mlp_only_layers}: the Megatron backend maps models "
                         "whose every layer is a mixture of experts (mlp_only_layers=[])")
    experts, topk = hf_config.num_experts, hf_config.num_experts_per_tok
    if not 1 <= topk <= experts:
        raise ValueError(f"config.json num_experts_per_tok={topk} must be in 1..num_experts={experts}")
    return dict(experts=experts, topk=topk, expert_intermediate=hf_config.moe_intermediate_size,
                shared_intermediate=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
                normalise_topk=bool(getattr(hf_config, "norm_topk_prob", False)),
                aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0))


def moe_settings(shape: Shape, ep: int, aux_loss_coef: float) -> dict[str, Any]:
    """Megatron's MoE fields for `shape`: dropless top-k routing in fp32 as HF routes, the
    load-balancing loss, and the all-to-all dispatcher (the one that takes expert parallelism and
    micro-batches of varying width through a pipeline)."""
    return dict(
        num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.expert_intermediate,
        moe_router_pre_softmax=not shape.normalise_topk, moe_router_score_function="softmax",
        moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux_loss_coef,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep, moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=shape.shared_intermediate or None,
        moe_shared_expert_gate=bool(shape.shared_intermediate),
    )


def experts_to_megatron(hf: Any, src: str, dst: str, shape: Shape, ep: int, ep_rank: int) -> dict[str, Tensor]:
    """One MoE layer's router, this expert-parallel rank's experts and the shared expert (TP = 1)."""
    import torch

    out = {dst + "router.weight": hf[src + "gate.weight"]}
    local = shape.experts // ep
    for index in range(local):
        expert, target = f"{src}experts.{ep_rank * local + index}.", f"{dst}experts.local_experts.{index}."
        out[target + "linear_fc1.weight"] = torch.cat([hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"]])
        out[target + "linear_fc2.weight"] = hf[expert + "down_proj.weight"]
    if shape.shared_intermediate:
        shared = src + "shared_expert."
        out[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]])
        out[dst + "shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        out[dst + "shared_experts.gate_weight"] = hf[src + "shared_expert_gate.weight"]
    return out


def experts_to_hf(megatron: dict[str, Tensor], src: str, dst: str, shape: Shape) -> dict[str, Tensor]:
    """Inverse of `experts_to_megatron` over every expert (numbered globally in `megatron`)."""
    hf = {dst + "gate.weight": megatron[src + "router.weight"]}
    for index in range(shape.experts):
        expert, target = f"{src}experts.local_experts.{index}.", f"{dst}experts.{index}."
        gate, up = megatron[expert + "linear_fc1.weight"].chunk(2)
        hf[target + "gate_proj.weight"], hf[target + "up_proj.weight"] = gate, up
        hf[target + "down_proj.weight"] = megatron[expert + "linear_fc2.weight"]
    if shape.shared_intermediate:
        gate, up = megatron[src + "shared_experts.linear_fc1.weight"].chunk(2)
        hf[dst + "shared_expert.gate_proj.weight"], hf[dst + "shared_expert.up_proj.weight"] = gate, up
        hf[dst + "shared_expert.down_proj.weight"] = megatron[src + "shared_experts.linear_fc2.weight"]
        hf[dst + "shared_expert_gate.weight"] = megatron[src + "shared_experts.gate_weight"]
    return hf
