"""Building one rank's Megatron-Core model and optimizer from a Hugging Face config.

Owns: the GPTModel of this rank's pipeline stage (layer spec, fusions, device and dtype; a MoE
model's experts and routers, `megatron.moe`; LoRA adapters, `megatron.lora`), Megatron DDP and the
optimizer around it (Megatron's on GPUs, torch AdamW on CPU; only trainable parameters), and
loading a Megatron state dict into a model. Must not know: the GRPO step, batches, checkpoints' layout, Redis.
Used by `megatron.backend` (load), `megatron.checkpoint` and the elastic snapshots (load_state).

Runs in: every trainer rank process and a hybrid replica's process (through `MegatronBackend.load`);
`load_state` also where an elastic snapshot is loaded into a hybrid (`elastic.backends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.megatron.convert import Shape


def build_model(hf_config: Any, shape: Shape, config: TrainerConfig, layer_spec_name: str, bf16: bool,
                cuda: bool, seed: int = 0) -> Any:
    """This rank's stage: the embedding on the first, its share of the layers, the final norm and
    LM head on the last (with PP = 1, all of it); with `config.lora`, adapters on the targeted
    linears and every other parameter frozen. Random weights: the caller loads the HF ones."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from libra.services.trainer.megatron import convert as convert
    from libra.services.trainer.megatron.specs import layer_spec

    settings = config.backend
    if shape.moe:
        from libra.services.trainer.megatron import moe

        moe.patch_missing_fused_kernels()
    tconfig = convert.transformer_config(
        hf_config, tp=settings.tensor_parallel, pp=settings.pipeline_parallel, bf16=bf16,
        ep=settings.expert_parallel, aux_loss_coef=settings.router_aux_loss_coef,
        use_cpu_initialization=not cuda, calculate_per_token_loss=True,
        **fusions(settings.fused_kernels and cuda))
    # Activations cross stages with their shape: micro-batches differ in width and size. (Set after
    # construction: TransformerConfig refuses it for MoE's allgather dispatcher, which is its
    # default even for a dense model like this one.)
    tconfig.variable_seq_lengths = settings.pipeline_parallel > 1
    # perform_initialization stays on although the HF weights replace the random ones: it is also
    # what marks each parameter tensor-parallel or replicated, which grad-norm clipping relies on.
    model = GPTModel(
        config=tconfig, transformer_layer_spec=layer_spec(layer_spec_name, shape.qk_norm, config.packed_attention,
                                                          num_experts=shape.experts or None),
        vocab_size=shape.vocab, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tied,
        position_embedding_type="rope", rotary_base=convert.rope_theta(hf_config),
    )
    model.eval()  # no dropout: the policy ratio compares two passes of one function
    if shape.moe:
        moe.prepare(model)  # routers in training mode: what adds their load-balancing loss
    if config.lora is not None:
        from libra.services.trainer.megatron import lora

        layer_offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
        experts_offset = ps.get_expert_model_parallel_rank() * (shape.experts // settings.expert_parallel)
        lora.inject(model, config.lora, seed, layer_offset, experts_offset)
    if cuda:
        # As Megatron's own get_model does: the linears are built on the GPU, but the torch norms
        # (no Apex/TE) on the default device; only the distributed optimizer's parameter buffer
        # would move them, so without it they stayed on the host.
        model.cuda(torch.cuda.current_device())
    if bf16:
        # Megatron builds its linears in params_dtype but the torch norms (no Apex/TE here) in
        # fp32. Everything in bf16, as Megatron's Float16Module does: a bf16 norm runs torch's
        # fused RMSNorm kernel, and the distributed optimizer maps masters to parameters only
        # when a group is not a mix of fp32 and bf16 parameters.
        model.bfloat16()
    return model


def build_optimizer(model: Any, config: TrainerConfig, bf16: bool, cuda: bool) -> tuple[Any, Any]:
    """(Megatron DDP wrapper or None, optimizer): on CUDA Megatron DDP + Megatron's (distributed)
    optimizer; on CPU no DDP and torch AdamW over the fp32 parameters."""
    import torch

    if not cuda:
        params = [p for p in model.parameters() if p.requires_grad]
        return None, torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    sharded = config.backend.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=sharded)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=config.lr, weight_decay=config.weight_decay, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, clip_grad=config.max_grad_norm,
        use_distributed_optimizer=sharded)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # Without Transformer Engine or Apex, Megatron falls back to torch AdamW in its multi-tensor
    # (foreach) form; its fused CUDA kernel does the same update in one pass over the fp32
    # masters. Set before the first step, which creates the state on the device it needs.
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for group in inner.optimizer.param_groups:
            if "fused" in group:
                group["foreach"], group["fused"] = False, True
    return ddp, optimizer


def load_state(model: Any, state: dict[str, Any], trainable_only: bool = False) -> None:
    """Load a Megatron state dict (its `_extra_state` entries may be absent; LoRA adapters too, or
    with `trainable_only` every frozen parameter); any other mismatch raises."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad} if trainable_only else set()
    missing = [k for k in missing if not k.endswith("_extra_state") and k not in frozen
               and k.rsplit(".", 1)[-1] not in ("lora_a", "lora_b")]
    if missing or unexpected:
        raise ValueError(f"Megatron state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def fusions(on: bool) -> dict[str, Any]:
    """Megatron's fused SwiGLU (torch.compile) and native fused vocab-parallel cross entropy.

    GPU only: on CPU torch.compile would need a C++ toolchain and buys nothing for tiny models.
    """
    return {"bias_activation_fusion": on, "cross_entropy_loss_fusion": on, "cross_entropy_fusion_impl": "native"}
