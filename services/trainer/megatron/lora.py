"""Low-rank adapters (LoRA) on the Megatron backend's linear layers: our own, Megatron-Core has none.

Owns: putting adapters on the tensor-parallel linears that `trainer.lora.target_modules` names
(and freezing everything else), their forward under tensor parallelism, their checkpoint sharding,
switching their dropout, and the merged weights (W + (alpha/r)·B·A) that publication converts to
HF. Must not know: HF names beyond the target list, optimizers, the GRPO loss.

Runs in: every trainer rank process whose config has `trainer.lora`.

Megatron-Core 0.16/0.19 ship no adapter layer (NeMo keeps its own), so each targeted
`ColumnParallelLinear` / `RowParallelLinear` instance becomes an instance of a subclass that adds
`lora_a` [r, in] and `lora_b` [out, r] beside the frozen `weight`; names, state dict keys and the
HF conversion of the base weights do not change. Megatron fuses projections, so one adapter covers
each fused one (HF names → Megatron):

    q_proj, k_proj, v_proj → linear_qkv     o_proj → linear_proj
    gate_proj, up_proj     → linear_fc1     down_proj → linear_fc2   (dense MLP, experts, shared expert)

Under tensor parallelism (y = W·x + s·B·(A·x), s = alpha / r):

    column-parallel (W split by rows)  A whole on every rank, B split like W's rows:
                                       h = A·x is the same everywhere; its gradient is summed over TP
                                       (copy_to_tensor_model_parallel_region) so A's is whole
    row-parallel (W split by columns)  A split like W's columns, B whole:
                                       h = Σ_tp A_k·x_k (reduce_from_tensor_model_parallel_region)

A starts Kaiming-uniform from a generator seeded by the module's global name (the same on every
rank and for every layout), B at zero: the adapted model starts equal to the base one.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.services.trainer.config import LoraConfig

MODULES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
           "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
ADAPTER_KEYS = ("lora_a", "lora_b")


def targets(config: LoraConfig) -> set[str]:
    """The Megatron linear names (last path component) that `config.target_modules` adapts."""
    return {MODULES[name] for name in config.target_modules}


def inject(model: Any, config: LoraConfig, seed: int, layer_offset: int, experts_offset: int) -> int:
    """Adapters on every targeted linear of `model` (this rank's stage), everything else frozen;
    returns how many linears got one. `layer_offset`/`experts_offset`: this stage's first layer and
    this EP rank's first expert, for the global names that seed A."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for p in model.parameters():
        p.requires_grad_(False)
    wanted, count = targets(config), 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in wanted or leaf == "linear_proj" and ".self_attention." not in f".{name}":
            continue
        if isinstance(module, ColumnParallelLinear):
            parallel = "column"
        elif isinstance(module, RowParallelLinear):
            parallel = "row"
        else:
            continue
        module.__class__ = _adapted_class(type(module), parallel)
        module.add_adapter(config, _seed(seed, _global_name(name, layer_offset, experts_offset)))
        count += 1
    if not count:
        raise ValueError(f"trainer.lora.target_modules={list(config.target_modules)} matched no linear layer of "
                         "this model")
    return count


def set_dropout(model: Any, active: bool) -> None:
    """Adapter dropout on (the gradient pass) or off (every other pass)."""
    for module in model.modules():
        if hasattr(module, "lora_dropout_active"):
            module.lora_dropout_active = active


def adapter_parameters(model: Any) -> int:
    """Parameters of the adapters on this rank."""
    return sum(p.numel() for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] in ADAPTER_KEYS)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_KEYS


def merged_state(model: Any) -> dict[str, Any]:
    """This rank's Megatron state dict (no `_extra_state`) with every adapter merged into its
    weight and the adapters themselves left out: what HF conversion expects."""
    import torch

    state = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name, module in model.named_modules():
        if getattr(module, "lora_rank", None):
            with torch.no_grad():
                delta = (module.lora_b.float() @ module.lora_a.float()) * module.lora_scale
                state[f"{name}.weight"] = (module.weight.float() + delta).to(module.weight.dtype)
    return {k: v for k, v in state.items() if not is_adapter(k)}


_CLASSES: dict[tuple[type, str], type] = {}


def _adapted_class(base: type, parallel: str) -> type:
    """`base` (a Megatron tensor-parallel linear class) with an adapter; one subclass per base."""
    key = (base, parallel)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Lora{base.__name__}", (_LoraMixin, base), {"lora_parallel": parallel})
    return _CLASSES[key]


class _LoraMixin:
    """The adapter part of an adapted linear (mixed in before the Megatron class)."""

    lora_parallel = "column"
    lora_rank = 0

    def add_adapter(self, config: LoraConfig, seed: int) -> None:
        import torch

        weight = self.weight  # [out_local, in_local]
        out_local, in_local = weight.shape
        tp = self.tp_group.size() if getattr(self, "tp_group", None) is not None else 1
        tp_rank = self.tp_group.rank() if tp > 1 else 0
        column = self.lora_parallel == "column"
        in_full = in_local if column else in_local * tp
        generator = torch.Generator().manual_seed(seed)
        a = torch.empty(config.rank, in_full)
        bound = 1.0 / math.sqrt(in_full)  # torch.nn.Linear's (Kaiming uniform, a = sqrt(5)) bound
        a.uniform_(-bound, bound, generator=generator)
        if not column:
            a = a.chunk(tp, dim=1)[tp_rank]
        self.lora_a = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, config.rank, device=weight.device, dtype=weight.dtype))
        self.lora_rank, self.lora_scale, self.lora_dropout = config.rank, config.alpha / config.rank, config.dropout
        self.lora_dropout_active = False
        sharded = self.lora_b if column else self.lora_a
        for param in (self.lora_a, self.lora_b):
            param.tensor_model_parallel = tp > 1 and param is sharded
            param.partition_dim = 0 if column else 1
            param.partition_stride = 1
            param.allreduce = getattr(weight, "allreduce", True)  # an expert's adapter is an expert parameter

    def forward(self, input_: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.nn.functional as F
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        output, bias = super().forward(input_, *args, **kwargs)
        x = input_
        if self.lora_dropout and self.lora_dropout_active:
            x = F.dropout(x, p=self.lora_dropout, training=True)
        h = F.linear(x, self.lora_a)
        if self.lora_parallel == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return output + F.linear(h, self.lora_b) * self.lora_scale, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """The base linear's, with the adapter sharded as it is held (B by rows or A by columns)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {"lora_b": 0} if self.lora_parallel == "column" else {"lora_a": 1}
        out.update(make_sharded_tensors_for_checkpoint(
            {"lora_a": self.lora_a, "lora_b": self.lora_b}, prefix, axis, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out


def _global_name(name: str, layer_offset: int, experts_offset: int) -> str:
    """`name` with this stage's layer index and this EP rank's expert index made global."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            parts[i + 1] = str(int(parts[i + 1]) + layer_offset)
        if part == "local_experts" and parts[i + 1].isdigit():
            parts[i + 1] = str(int(parts[i + 1]) + experts_offset)
    return ".".join(parts)


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
