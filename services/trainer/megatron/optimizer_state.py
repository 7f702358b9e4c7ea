"""The Megatron-Core backend's optimizer state in model space: each trainable parameter's Adam
moments (and fp32 master weights when the parameters are bf16/fp16) read and written by parameter
name, whatever optimizer the backend built (a plain torch AdamW on CPU; Megatron's chained, possibly
distributed, optimizers on GPUs).

Used by the distributed checkpoints (`megatron.checkpoint`) and the elastic snapshots
(`elastic.backends`: the core rank that takes one, the hybrid replica that loads it). Changes with
the optimizers Megatron builds; knows nothing of the checkpoint layout.
"""

from __future__ import annotations

from typing import Any

from libra.services.trainer import world

MOMENTS = ("exp_avg", "exp_avg_sq")


def trainable_parameters(model: Any) -> list[tuple[str, Any]]:
    """(name, parameter) of every trainable parameter, in the model's order (every rank agrees)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def has_frozen(model: Any) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def stored_kinds(model: Any) -> tuple[str, ...]:
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
        if world.distributed():  # a DP rank that owns no range of any parameter has no state yet
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
