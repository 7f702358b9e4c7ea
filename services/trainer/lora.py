"""LoRA on the plain-PyTorch backend, through Hugging Face peft.

Owns: wrapping the HF model in peft's LoRA (adapters on the `trainer.lora.target_modules` linears,
every other weight frozen), switching the adapters' dropout, and the model's weights with the
adapters merged (W + (alpha/r)·B·A) under the HF model's own names — what the trainer publishes,
so every engine and every transport (disk, weights group, CUDA IPC) loads plain HF weights.
Must not know: optimizers, the GRPO loss, files (the backend writes them).

Runs in: the torch trainer process (and a torch hybrid replica's) whose config has `trainer.lora`.

The merged weights are computed beside the model, never by merging in place: merging and
unmerging would move the frozen weights by float rounding every version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.services.trainer.config import LoraConfig

ADAPTER = "default"  # peft's adapter name


def wrap(model: Any, config: LoraConfig) -> Any:
    """`model` with LoRA adapters (B = 0: it computes what it did) and its other weights frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [name for name in config.target_modules if name in present]
    if not targets:
        raise ValueError(f"trainer.lora.target_modules={list(config.target_modules)}: this model has none of them "
                         "as a linear layer")
    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                 target_modules=targets, bias="none")
    return get_peft_model(model, peft_config)


def set_dropout(model: Any, active: bool) -> None:
    """The adapters' dropout on (the gradient pass) or off; the rest of the model stays in eval."""
    for name, module in model.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER}"):
            module.train(active)


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def merged_named_tensors(model: Any) -> list[tuple[str, Any]]:
    """(HF name, tensor) of every parameter of the underlying HF model, in its order, with each
    adapted weight merged; tensors on the model's device, detached (merged ones fresh)."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, Any] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight
                merged[f"{name}.weight"] = weight + module.get_delta_weight(ADAPTER).to(weight.dtype)
    out = []
    for name, param in base.named_parameters():
        if is_adapter(name):
            continue
        hf_name = name.replace(".base_layer.", ".")
        out.append((hf_name, merged.get(hf_name, param.detach())))
    return out
