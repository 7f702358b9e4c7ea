"""Distributed checkpoints of the Megatron-Core backend: model and optimizer state in model space.

Owns: the checkpoint layout (a Megatron `dist_checkpointing` directory `<path>.dcp/` plus a small
marker file `path`). The optimizer's state per model parameter, for every optimizer the backend
builds, is read and written through `megatron.optimizer_state` (which the elastic snapshots use
too). Must not know: the GRPO step, batches, Redis.

Runs in: every trainer rank process (`save` and `load` are collective over all of them). Takes the
model and optimizer it reads or writes as arguments, never the backend object: `megatron.backend`
imports this module, not the other way round.

One format for every execution path. Each model parameter `name` is stored as Megatron's own
sharded tensor `model.<name>` (TP/PP offsets in the global shape), and its optimizer state beside
it, sharded exactly like the parameter:

    optim.<key>.exp_avg, optim.<key>.exp_avg_sq      Adam moments (fp32)
    optim.<key>.main                                 fp32 master weights (only when the model
                                                     trains bf16/fp16 parameters, i.e. on GPUs)
    optim.step                                       the Adam step count (one for all parameters)

With LoRA (frozen parameters) only the trainable ones — the adapters — are stored: the frozen
base weights are the model directory's, which `load` has already put in place.

Because every tensor has the parameter's shape, a checkpoint does not depend on how the optimizer
shards its state over data-parallel ranks: one saved at DP=2 loads at DP=1 or DP=4 (a joining
elastic replica's snapshot changes DP), and the CPU path (torch AdamW, fp32) writes the same keys.
Megatron's own optimizer formats are not used: on megatron-core 0.19.2 its default
(`fully_sharded_model_space`) refuses the flattened ranges it builds ("ShardedTensor.
flattened_range is not supported") and `fully_reshardable` failed a DP=2 round trip on H200.

Where the state lives, per optimizer (inner optimizers of a ChainedOptimizer are handled each):

    torch AdamW (CPU)                  optimizer.state[param]
    Megatron mixed precision, no DP    param.main_param and inner.optimizer.state[main_param]
      sharding (Float16Optimizer)
    DistributedOptimizer               each DP rank owns a contiguous range of the flattened
                                       parameter: ranges are written into a zero tensor and
                                       summed over the DP group (they are disjoint), and on load
                                       each rank takes its range back

The marker (format, extra, RNG, the directory's name) is written last and atomically, so a
checkpoint exists exactly when its marker does; directories whose marker was pruned are removed.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
from typing import Any

from libra.services.trainer import world
from libra.services.trainer.backend import atomic_torch_save
from libra.services.trainer.megatron.build import load_state
from libra.services.trainer.megatron.optimizer_state import has_frozen, optimizer_state, stored_kinds, \
    trainable_parameters

CHECKPOINT_FORMAT = 2


def save(model: Any, optimizer: Any, path: str, extra: dict[str, Any]) -> None:
    """Write `model` (this rank's GPTModel stage) and `optimizer` as checkpoint `path`; collective."""
    import torch
    from megatron.core import dist_checkpointing

    directory = f"{path}.dcp"
    staging = f"{directory}.partial"
    if world.rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    world.barrier()
    state = sharded_state(model, optimizer, loading=False)
    dist_checkpointing.save(state, staging)
    world.barrier()
    if world.rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.rename(staging, directory)
        marker = {"format": CHECKPOINT_FORMAT, "backend": "megatron", "directory": os.path.basename(directory),
                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "extra": dict(extra)}
        atomic_torch_save(marker, path)
        _prune_orphans(os.path.dirname(os.path.abspath(path)))
    world.barrier()


def load(model: Any, optimizer: Any, path: str) -> dict[str, Any]:
    """Restore what `save` wrote into `model` and `optimizer` (built alike); returns its `extra`."""
    import torch
    from megatron.core import dist_checkpointing

    marker = torch.load(path, map_location="cpu", weights_only=True)
    if marker.get("backend") != "megatron":
        raise ValueError(f"{path}: not a Megatron-backend checkpoint (backend {marker.get('backend')!r})")
    if marker.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: Megatron checkpoint format {marker.get('format')}, this version reads "
                         f"format {CHECKPOINT_FORMAT}; resume from a checkpoint written by this version")
    directory = os.path.join(os.path.dirname(os.path.abspath(path)), marker["directory"])
    loaded = dist_checkpointing.load(sharded_state(model, optimizer, loading=True), directory)
    load_state(model, {k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")},
               trainable_only=has_frozen(model))
    step = float(loaded["optim.step"].reshape(-1)[0])
    states = {}
    for name, _ in trainable_parameters(model):
        states[name] = {what: loaded[f"optim.{name}.{what}"] for what in stored_kinds(model)}
    optimizer_state(model, optimizer).set_states(states, step)
    torch.set_rng_state(marker["rng"]["torch"])
    version, internal, gauss = marker["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    return marker["extra"]


def sharded_state(model: Any, optimizer: Any, loading: bool) -> dict[str, Any]:
    """The flat sharded state dict: `model.*` from Megatron, `optim.*` shaped like each parameter."""
    import torch

    model_sd = _flatten(model.sharded_state_dict())
    if has_frozen(model):  # LoRA: the adapters only; the base weights come from the model directory
        trainable = {name for name, _ in trainable_parameters(model)}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    state: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    adapter = optimizer_state(model, optimizer)
    kinds = stored_kinds(model)
    saved = None if loading else adapter.get_states()
    for name, param in trainable_parameters(model):
        template = model_sd.get(name)
        for what in kinds:
            data = torch.zeros(param.shape, dtype=torch.float32) if loading else saved[name][what]
            state[f"optim.{name}.{what}"] = _like(template, data, name, what)
    step = torch.zeros(1) if loading else torch.tensor([adapter.step()], dtype=torch.float32)
    state["optim.step"] = _like(None, step, "optim", "step")
    return state


# ---- sharded tensors --------------------------------------------------------------------------

def _flatten(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _like(template: Any, data: Any, name: str, what: str) -> Any:
    """A ShardedTensor for tensor `what` of parameter `name`, sharded as the parameter.

    A plain ShardedTensor template (layers share one key, offset along the layer axis) is copied.
    Megatron describes some parameters by a factory instead (the fused gate/up fc1 under TP); their
    state is stored whole per TP rank under a key of its own, saved by DP rank 0.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    data = data.detach().clone()
    if template is None or not hasattr(template, "global_shape"):
        key = f"optim.{name}.{what}.tp{ps.get_tensor_model_parallel_rank()}.pp{ps.get_pipeline_model_parallel_rank()}"
        return ShardedTensor.from_rank_offsets(key, data, replica_id=ps.get_data_parallel_rank())
    return ShardedTensor(key=f"optim.{template.key}.{what}", data=data, dtype=data.dtype,
                         local_shape=template.local_shape, global_shape=template.global_shape,
                         global_offset=template.global_offset, axis_fragmentations=template.axis_fragmentations,
                         replica_id=template.replica_id, prepend_axis_num=template.prepend_axis_num)


def _prune_orphans(directory: str) -> None:
    for found in glob.glob(os.path.join(directory, "*.dcp")):
        if not os.path.exists(found[: -len(".dcp")]):
            shutil.rmtree(found, ignore_errors=True)
