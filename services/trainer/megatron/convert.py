"""Hugging Face ↔ Megatron-Core for Llama-architecture decoders (Llama, Qwen2, Qwen3) and their
mixture-of-experts kin (Qwen3-MoE, Qwen2-MoE).

Owns: mapping an HF model config to a Megatron `TransformerConfig` (refusing what Megatron's
local GPT layers cannot express, naming the HF field), and moving weights both ways for one
tensor-parallel rank. Must not know: training, optimizers, files other than what it is handed.

Runs in: every trainer rank process and a hybrid replica's process (building the model, loading
its HF weights, publishing them from global rank 0).

Layouts (H hidden, d head dim, nq query heads, ng key/value groups, I intermediate, tp TP size):

    HF q_proj [nq·d, H], k_proj/v_proj [ng·d, H]   ─▶  linear_qkv [(nq+2ng)·d / tp, H], grouped:
        for each KV group g: the nq/ng query heads of g, then k_g, then v_g   (biases alike: Qwen2)
        a TP rank holds ng/tp consecutive groups
    HF gate_proj, up_proj [I, H]                   ─▶  linear_fc1 [2·I / tp, H] = [gate shard; up shard]
    HF o_proj [H, nq·d], down_proj [H, I]          ─▶  linear_proj / linear_fc2, split along columns
    HF embed_tokens / lm_head [V, H]               ─▶  word_embeddings / output_layer, split along rows
    HF q_norm / k_norm [d] (Qwen3)                 ─▶  q_layernorm / k_layernorm (replicated)
    norms                                          ─▶  input_layernorm, pre_mlp_layernorm, final_layernorm

A mixture-of-experts layer's router, experts and shared expert map as `megatron.convert_moe` says.

Tied embeddings (`tie_word_embeddings`) map to `share_embeddings_and_output_weights`: there is no
`output_layer.weight` then, and no `lm_head.weight` is written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libra.services.trainer.megatron import convert_moe

if TYPE_CHECKING:
    from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class Shape:
    """The dimensions that the weight mapping needs, read once from the HF config."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    intermediate: int
    vocab: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    experts: int = 0  # routed experts per layer (0: a dense model)
    topk: int = 0  # experts each token is routed to
    expert_intermediate: int = 0  # the width of one expert's MLP
    shared_intermediate: int = 0  # the width of the gated shared expert (Qwen2-MoE; 0: none)
    normalise_topk: bool = False  # top-k probabilities renormalised to sum to 1
    aux_loss_coef: float = 0.0  # config.json router_aux_loss_coef

    @property
    def moe(self) -> bool:
        return self.experts > 0


def model_shape(hf_config: Any) -> Shape:
    """Validate an HF config for Megatron's GPT model and read its dimensions."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r}: the Megatron backend supports "
                         f"{SUPPORTED_MODEL_TYPES}; use trainer.backend=torch for other architectures")
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"config.json hidden_act={activation!r}: the Megatron backend maps only silu (SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=true: Megatron's local layers cannot add biases to the MLP alone")
    if model_type == "llama" and getattr(hf_config, "attention_bias", False):
        raise ValueError("config.json attention_bias=true (Llama): Megatron would also need an o_proj-only "
                         "bias scheme it cannot express; use trainer.backend=torch")
    if model_type in ("qwen3", "qwen3_moe") and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"config.json attention_bias=true ({model_type}) is not supported by the Megatron backend")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported "
                         "by the Megatron backend")
    rope_type = _rope(hf_config)[1]
    if rope_type not in (None, "default"):
        raise ValueError(f"config.json rope_scaling type {rope_type!r}: the Megatron backend supports plain RoPE only")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % groups:
        raise ValueError(f"config.json num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and getattr(hf_config, "qkv_bias", True))
    return Shape(
        layers=hf_config.num_hidden_layers, hidden=hf_config.hidden_size, heads=heads, groups=groups,
        head_dim=head_dim, intermediate=hf_config.intermediate_size, vocab=hf_config.vocab_size,
        qkv_bias=qkv_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **(convert_moe.moe_shape(hf_config) if model_type in MOE_MODEL_TYPES else {}),
    )


def check_parallel(shape: Shape, tp: int, pp: int, ep: int = 1) -> None:
    """Clear errors for a tensor/pipeline/expert split that the model's dimensions do not allow."""
    if ep > 1 and not shape.moe:
        raise ValueError(f"trainer.backend.expert_parallel={ep} needs a mixture-of-experts model; this one is "
                         "dense (config.json has no num_experts): set expert_parallel=1")
    if shape.moe and shape.experts % ep:
        raise ValueError(f"trainer.backend.expert_parallel={ep} does not divide config.json num_experts="
                         f"{shape.experts}; choose a divisor of it")
    if shape.moe and tp > 1:
        raise ValueError(f"trainer.backend.tensor_parallel={tp} with a mixture-of-experts model: Megatron's MoE layers "
                         "need sequence parallelism under TP, which this backend does not run; use tensor_parallel=1 "
                         "and spread the experts with expert_parallel")
    if shape.heads % tp:
        raise ValueError(f"trainer.backend.tensor_parallel={tp} does not divide config.json "
                         f"num_attention_heads={shape.heads}; choose a divisor of it")
    if shape.groups % tp:
        raise ValueError(f"trainer.backend.tensor_parallel={tp} does not divide config.json "
                         f"num_key_value_heads={shape.groups}; choose a divisor of it")
    if shape.intermediate % tp:
        raise ValueError(f"trainer.backend.tensor_parallel={tp} does not divide config.json "
                         f"intermediate_size={shape.intermediate}")
    if shape.vocab % tp:
        raise ValueError(f"trainer.backend.tensor_parallel={tp} does not divide config.json "
                         f"vocab_size={shape.vocab}; pad the vocabulary to a multiple of it")
    if shape.layers % pp:
        raise ValueError(f"trainer.backend.pipeline_parallel={pp} does not divide config.json "
                         f"num_hidden_layers={shape.layers}")


def transformer_config(hf_config: Any, tp: int = 1, pp: int = 1, bf16: bool = False, ep: int = 1,
                       aux_loss_coef: float | None = None, **overrides: Any) -> Any:
    """The Megatron `TransformerConfig` equal to an HF config of a supported type; `aux_loss_coef`
    (None: config.json's router_aux_loss_coef) weights a MoE model's load-balancing loss."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    shape = model_shape(hf_config)
    check_parallel(shape, tp, pp, ep)
    settings = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.intermediate,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    if shape.moe:
        settings.update(convert_moe.moe_settings(shape, ep, shape.aux_loss_coef if aux_loss_coef is None
                                                 else aux_loss_coef))
    return TransformerConfig(**{**settings, **overrides})


def rope_theta(hf_config: Any) -> float:
    return _rope(hf_config)[0]


def _rope(hf_config: Any) -> tuple[float, str | None]:
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta / rope_scaling.
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    return float(theta), rope_type


# ---- weights ---------------------------------------------------------------------------------

def hf_to_megatron(hf: dict[str, Tensor], shape: Shape, tp: int = 1, rank: int = 0,
                   layer_offset: int = 0, layers: int | None = None, first: bool = True,
                   last: bool = True, ep: int = 1, ep_rank: int = 0) -> dict[str, Tensor]:
    """The Megatron state dict of TP rank `rank` (and of a pipeline stage's layers, and of expert-
    parallel rank `ep_rank`'s experts) from HF tensors."""
    import torch

    layers = shape.layers if layers is None else layers
    out: dict[str, Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = _rows(hf["model.embed_tokens.weight"], tp, rank)
    for local in range(layers):
        src, dst = f"model.layers.{local + layer_offset}.", f"decoder.layers.{local}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape, tp, rank)
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape, tp, rank)
        if shape.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = _columns(hf[attn + "o_proj.weight"], tp, rank)
        if shape.moe:
            out.update(convert_moe.experts_to_megatron(hf, src + "mlp.", dst + "mlp.", shape, ep, ep_rank))
            continue
        mlp = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [_rows(hf[mlp + "gate_proj.weight"], tp, rank), _rows(hf[mlp + "up_proj.weight"], tp, rank)])
        out[dst + "mlp.linear_fc2.weight"] = _columns(hf[mlp + "down_proj.weight"], tp, rank)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tied:
            out["output_layer.weight"] = _rows(hf["lm_head.weight"], tp, rank)
        elif not first:  # the last stage of a pipeline keeps its own copy of the tied embedding
            out["output_layer.weight"] = _rows(hf["model.embed_tokens.weight"], tp, rank)
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[dict[str, Tensor]], shape: Shape, layer_offset: int = 0,
                   layers: int | None = None, first: bool = True, last: bool = True) -> dict[str, Tensor]:
    """HF tensors from the state dicts of all TP ranks (index = TP rank) of one pipeline stage.

    The stage holds `layers` layers from `layer_offset` on (default: the whole model), the
    embedding if `first`, the final norm and LM head if `last`; a last stage's copy of a tied
    embedding is not written (the first stage's is the HF tensor). A MoE model's experts are
    numbered globally here (`moe.gather_experts` renumbers expert-parallel ranks' local ones).
    """
    import torch

    tp = len(shards)
    layers = shape.layers if layers is None else layers
    hf: dict[str, Tensor] = {}
    if first:
        hf["model.embed_tokens.weight"] = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    for local in range(layers):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{local + layer_offset}."
        rank0 = shards[0]
        hf[dst + "input_layernorm.weight"] = rank0[src + "input_layernorm.weight"]
        hf[dst + "post_attention_layernorm.weight"] = rank0[src + "pre_mlp_layernorm.weight"]
        attn = dst + "self_attn."
        q, k, v = _split_qkv([s[src + "self_attention.linear_qkv.weight"] for s in shards], shape)
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"] = q, k, v
        if shape.qkv_bias:
            q, k, v = _split_qkv([s[src + "self_attention.linear_qkv.bias"] for s in shards], shape)
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"] = q, k, v
        if shape.qk_norm:
            hf[attn + "q_norm.weight"] = rank0[src + "self_attention.q_layernorm.weight"]
            hf[attn + "k_norm.weight"] = rank0[src + "self_attention.k_layernorm.weight"]
        hf[attn + "o_proj.weight"] = torch.cat([s[src + "self_attention.linear_proj.weight"] for s in shards], dim=1)
        if shape.moe:
            hf.update(convert_moe.experts_to_hf(rank0, src + "mlp.", dst + "mlp.", shape))
            continue
        fc1 = [s[src + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[dst + "mlp.down_proj.weight"] = torch.cat([s[src + "mlp.linear_fc2.weight"] for s in shards], dim=1)
    if last:
        hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        if not shape.tied:
            hf["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])
    assert tp >= 1
    return {k: v.contiguous() for k, v in hf.items()}


def _rows(t: Tensor, tp: int, rank: int) -> Tensor:
    return t.chunk(tp, dim=0)[rank]


def _columns(t: Tensor, tp: int, rank: int) -> Tensor:
    return t.chunk(tp, dim=1)[rank]


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: Shape, tp: int, rank: int) -> Tensor:
    """[q heads of group g; k_g; v_g] for each KV group g of this rank (weights [·, H] or biases [·])."""
    import torch

    per_group = shape.heads // shape.groups
    tail = q.shape[1:]
    qg = q.reshape(shape.groups, per_group * shape.head_dim, *tail)
    kg = k.reshape(shape.groups, shape.head_dim, *tail)
    vg = v.reshape(shape.groups, shape.head_dim, *tail)
    fused = torch.cat([qg, kg, vg], dim=1)  # [groups, (per_group + 2)·d, ...]
    mine = fused.chunk(tp, dim=0)[rank]
    return mine.reshape(-1, *tail)


def _split_qkv(shards: list[Tensor], shape: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `_fuse_qkv` over all TP ranks' fused tensors."""
    import torch

    per_group = shape.heads // shape.groups
    tail = shards[0].shape[1:]
    fused = torch.cat(shards).reshape(shape.groups, (per_group + 2) * shape.head_dim, *tail)
    q, k, v = fused.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail))
