"""Distributed checkpoints of the Megatron-Core backend: model and optimizer state in model space.

Owns: the checkpoint layout (a Megatron `dist_checkpointing` directory `<path>.dcp/` plus a small
marker file `path`), and reading/writing the optimizer's state per model parameter for every
optimizer the backend builds (`optimizer_state`, also what the elastic snapshots read and
restore). Must not know: the GRPO step, batches, Redis.

Runs in: every trainer rank process (`save` and `load` are collective over all of them). The
optimizer adapters also run on the core rank that takes an elastic snapshot and in the hybrid
replica's process that loads it (`elastic.backends`). Takes the model and optimizer it reads or
writes as arguments, never the backend object: `megatron.backend` imports this module, not the
other way round.

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

from libra.services.trainer.backend import atomic_torch_save
from libra.services.trainer.megatron import runtime as rt
from libra.services.trainer.megatron.build import load_state

CHECKPOINT_FORMAT = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


def save(model: Any, optimizer: Any, path: str, extra: dict[str, Any]) -> None:
    """Write `model` (this rank's GPTModel stage) and `optimizer` as checkpoint `path`; collective."""
    import torch
    from megatron.core import dist_checkpointing

    directory = f"{path}.dcp"
    staging = f"{directory}.partial"
    if rt.rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    rt.barrier()
    state = sharded_state(model, optimizer, loading=False)
    dist_checkpointing.save(state, staging)
    rt.barrier()
    if rt.rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.rename(staging, directory)
        marker = {"format": CHECKPOINT_FORMAT, "backend": "megatron", "directory": os.path.basename(directory),
                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "extra": dict(extra)}
        atomic_torch_save(marker, path)
        _prune_orphans(os.path.dirname(os.path.abspath(path)))
    rt.barrier()


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
               trainable_only=_has_frozen(model))
    step = float(loaded["optim.step"].reshape(-1)[0])
    states = {}
    for name, _ in trainable_parameters(model):
        states[name] = {what: loaded[f"optim.{name}.{what}"] for what in _kinds(model)}
    optimizer_state(model, optimizer).set_states(states, step)
    torch.set_rng_state(marker["rng"]["torch"])
    version, internal, gauss = marker["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    return marker["extra"]


def sharded_state(model: Any, optimizer: Any, loading: bool) -> dict[str, Any]:
    """The flat sharded state dict: `model.*` from Megatron, `optim.*` shaped like each parameter."""
    import torch

    model_sd = _flatten(model.sharded_state_dict())
    if _has_frozen(model):  # LoRA: the adapters only; the base weights come from the model directory
        trainable = {name for name, _ in trainable_parameters(model)}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    state: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    adapter = optimizer_state(model, optimizer)
    kinds = _kinds(model)
    saved = None if loading else adapter.get_states()
    for name, param in trainable_parameters(model):
        template = model_sd.get(name)
        for what in kinds:
            data = torch.zeros(param.shape, dtype=torch.float32) if loading else saved[name][what]
            state[f"optim.{name}.{what}"] = _like(template, data, name, what)
    step = torch.zeros(1) if loading else torch.tensor([adapter.step()], dtype=torch.float32)
    state["optim.step"] = _like(None, step, "optim", "step")
    return state


# ---- optimizer state in model space ---------------------------------------------------------

def trainable_parameters(model: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of every trainable parameter, in the model's order (every rank agrees)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _has_frozen(model: Any) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _kinds(model: Any) -> tuple[str, ...]:
    """Stored tensors per parameter: the moments, plus fp32 masters when the parameters are not fp32."""
    import torch

    low_precision = any(p.dtype != torch.float32 for _, p in trainable_parameters(model))
    return MOMENTS + (("main",) if low_precision else ())


def optimizer_state(model: Any, optimizer: Any) -> _Adapter:
    """The adapter that reads and writes `optimizer`'s state per parameter of `model` (model space)."""
    inner = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if not hasattr(inner[0], "get_loss_scale"):  # a plain torch optimizer (the CPU path)
        return _TorchAdamW(model, optimizer)
    return _MegatronOptimizers(model, inner)


class _Adapter:
    def get_states(self) -> dict[str, dict[str, Any]]:
        """name → {exp_avg, exp_avg_sq[, main]}: full (TP-local) CPU fp32 tensors of the parameter's shape."""
        raise NotImplementedError

    def set_states(self, states: dict[str, dict[str, Any]], step: float) -> None:
        raise NotImplementedError

    def step(self) -> float:
        """Adam's step count (collective over all ranks for Megatron's optimizers)."""
        raise NotImplementedError

    def local_step(self) -> float:
        """Adam's step count as this rank holds it (no collective)."""
        raise NotImplementedError

    def whole(self, name: str, p: Any) -> dict[str, Any]:
        """{main, exp_avg, exp_avg_sq} of parameter `p` as live tensors, when this rank holds all of its
        state (moments absent before the first step); a DP-sharded optimizer raises."""
        raise NotImplementedError


class _TorchAdamW(_Adapter):
    """The CPU path: torch AdamW over the fp32 model parameters themselves."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def get_states(self) -> dict[str, dict[str, Any]]:
        import torch

        out = {}
        for name, p in trainable_parameters(self.model):
            state = self.optimizer.state.get(p) or {}
            out[name] = {k: (state[k] if k in state else torch.zeros_like(p)).detach().float().cpu().clone()
                         for k in MOMENTS}
        return out

    def step(self) -> float:
        steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return steps[0] if steps else 0.0

    def local_step(self) -> float:
        return self.step()

    def whole(self, name: str, p: Any) -> dict[str, Any]:
        state = self.optimizer.state.get(p) or {}
        return {"main": p, **{k: state[k] for k in MOMENTS if k in state}}

    def set_states(self, states: dict[str, dict[str, Any]], step: float) -> None:
        import torch

        for name, p in trainable_parameters(self.model):
            # AdamW bumps `step` in place: each parameter gets its own tensor.
            self.optimizer.state[p] = {"step": torch.tensor(step), **{k: states[name][k].to(p.device, p.dtype).clone()
                                                                       for k in MOMENTS}}


class _MegatronOptimizers(_Adapter):
    """Megatron's mixed-precision optimizers (one or several, chained), sharded over DP or not.

    With the distributed optimizer a parameter may have no range on this DP rank (another rank
    owns all of it): it has no owner here, contributes zeros to the sum, and takes nothing back.
    Every rank walks the parameters in the same order, so the per-parameter all-reduces match.
    """

    def __init__(self, model: Any, inner: list[Any]) -> None:
        self.model, self.inner = model, inner
        sharded = [o for o in inner if _distributed(o)]
        self.dp_group = sharded[0].data_parallel_group if sharded else None
        self.owner: dict[int, Any] = {}
        # Model parameter -> its fp32 master shard, paired as Megatron's own main-to-model copy pairs them.
        self.shard: dict[int, Any] = {}
        for opt in sharded:
            for models, shards in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                   (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for model_group, shard_group in zip(models, shards):
                    self.shard.update((id(m), s) for m, s in zip(model_group, shard_group))
        for name, p in trainable_parameters(model):
            found = [o for o in inner if _owns(o, p)]
            if len(found) > 1 or (not found and not sharded):
                raise RuntimeError(f"megatron checkpoint: parameter {name} belongs to {len(found)} optimizers, not 1")
            if found:
                self.owner[id(p)] = found[0]

    def _local(self, p: Any) -> tuple[dict[str, Any], int, int]:
        """This rank's flat slices {param (fp32 master), exp_avg, exp_avg_sq} of p and their range."""
        opt = self.owner.get(id(p))
        if opt is None:
            return {}, 0, 0
        if _distributed(opt):
            main = self.shard[id(p)]
            piece = opt._get_model_param_range_map(p)["param"]
            if piece.end - piece.start != main.numel():
                raise RuntimeError(f"megatron checkpoint: the master shard of a {tuple(p.shape)} parameter has "
                                   f"{main.numel()} elements, its range {piece.start}:{piece.end}")
            tensors = {"param": main}
            tensors.update((k, v) for k, v in opt.optimizer.state.get(main, {}).items() if k in MOMENTS)
            return tensors, piece.start, piece.end
        main = getattr(p, "main_param", p)
        tensors = {"param": main.view(-1)}
        for k, v in opt.optimizer.state.get(main, {}).items():
            if hasattr(v, "view") and v.numel() == p.numel():
                tensors[k] = v.view(-1)
        return tensors, 0, p.numel()

    def get_states(self) -> dict[str, dict[str, Any]]:
        import torch
        import torch.distributed as dist

        reduce = self.dp_group is not None and dist.get_world_size(self.dp_group) > 1
        out = {}
        for name, p in trainable_parameters(self.model):
            tensors, start, end = self._local(p)
            full = {}
            for kind, source in _KINDS_TO_LOCAL:
                flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                if source in tensors and end > start:
                    flat[start:end] = tensors[source].reshape(-1)[: end - start].float()
                if reduce:
                    dist.all_reduce(flat, group=self.dp_group)  # disjoint ranges: the sum assembles
                full[kind] = flat.view(p.shape).cpu()
            out[name] = full
        return out

    def local_step(self) -> float:
        for opt in self.inner:
            for state in opt.optimizer.state.values():
                if "step" in state:
                    return float(state["step"])
        return 0.0

    def whole(self, name: str, p: Any) -> dict[str, Any]:
        tensors, start, end = self._local(p)
        if end - start != p.numel():
            raise RuntimeError(f"parameter {name} has {end - start} of {p.numel()} optimizer values on this rank "
                               "(a sharded optimizer); hybrids need trainer.backend.distributed_optimizer=false")
        return {"main": tensors["param"], **{k: tensors[k] for k in MOMENTS if k in tensors}}

    def step(self) -> float:
        import torch
        import torch.distributed as dist

        found = [0.0]
        for opt in self.inner:
            for state in opt.optimizer.state.values():
                if "step" in state:
                    found.append(float(state["step"]))
                    break
        value = torch.tensor([max(found)], dtype=torch.float64,
                             device="cuda" if torch.cuda.is_available() else "cpu")
        if rt.distributed():  # a DP rank that owns no range of any parameter has no state yet
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    def set_states(self, states: dict[str, dict[str, Any]], step: float) -> None:
        import torch

        with torch.no_grad():  # masters are leaves that require grad
            self._set_states(states, step)

    def _set_states(self, states: dict[str, dict[str, Any]], step: float) -> None:
        import torch

        for opt in self.inner:
            if _distributed(opt):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()  # allocate Adam state (then overwritten)
            else:
                _init_torch_state(opt.optimizer)
        for name, p in trainable_parameters(self.model):
            tensors, start, end = self._local(p)
            for kind, target in _KINDS_TO_LOCAL:
                if target in tensors and end > start:
                    source = states[name][kind].reshape(-1)[start:end].to(tensors[target].device)
                    tensors[target].reshape(-1)[: end - start].copy_(source)
        for opt in self.inner:
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.full_like(state["step"], step) if torch.is_tensor(state["step"]) else step
            # The model's bf16 weights were loaded from the checkpoint already; copying the fp32
            # masters over them keeps the two exactly consistent, as after an optimizer step.
            opt._copy_main_params_to_model_params()


_KINDS_TO_LOCAL = (("main", "param"),) + tuple((m, m) for m in MOMENTS)  # stored kind -> local tensor name


def _distributed(opt: Any) -> bool:
    return hasattr(opt, "model_param_gbuf_map")


def _owns(opt: Any, p: Any) -> bool:
    if _distributed(opt):
        return p in opt.model_param_gbuf_map
    groups = getattr(opt, "float16_groups", []) + getattr(opt, "fp32_from_fp32_groups", [])
    return any(p is q for group in groups for q in group)


def _init_torch_state(optimizer: Any) -> None:
    """Allocate zero Adam state for parameters that never stepped, so loading has targets."""
    import torch

    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # these keep `step` beside the parameter
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                for k in MOMENTS:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


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
