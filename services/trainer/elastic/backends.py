"""The training backend a hybrid replica builds, and the state of a backend that a snapshot holds.

Owns: naming the core's backend kind (torch | megatron), building the same kind in a hybrid
process (Megatron: TP = PP = 1 in a private one-process world), the flat-gradient layout both
sides compare at the join, and reading / writing a backend's model and optimizer state as plain
tensors for `snapshot`. Must not know: sockets, membership, files, Redis.

    core:   prepare_meta(backend) = {backend, model_dir, config, layout} ─▶ prepare / snapshot.json
    hybrid: build(meta) ─▶ same kind, same config ─▶ layout_mismatch(ours, the core's)? ─▶ join fails

Flat gradients must mean the same on both sides: the hybrid's gradient is added element-wise to
the core rank's and the reduced one is written back into the hybrid's. Torch backend and Megatron
on CPU: every trainable parameter's gradient in `named_parameters` order. Megatron on GPUs: Megatron
DDP's contiguous grad buffer; with `use_distributed_optimizer=False` (required with a hook) both
megatron-core 0.16 and 0.19 lay it out without padding, parameters in reverse order, independent of
the data-parallel size — the join still compares (name, start, end) of every parameter, so a layout
that ever differs fails the join with its reason instead of training on misaligned gradients.

State in a snapshot, per kind:
  torch     model.state_dict() and torch AdamW's state_dict (state by parameter index, groups).
  megatron  the GPTModel's tensors (its `_extra_state` entries hold no tensors and are skipped) and,
            per trainable parameter index, {exp_avg, exp_avg_sq, main}: Adam's moments and the fp32
            master (GPU mixed precision; on CPU the parameter itself), whole on every core rank
            since the distributed optimizer is refused with a hook; Adam's step count in `extra`.
            Loading goes through `megatron.optimizer_state`'s adapters, the same code that
            restores checkpoints, so torch AdamW (CPU) and Megatron's optimizers (GPU) both work.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

KINDS = ("torch", "megatron")


def kind_of(backend: Any) -> str:
    """"megatron" for a MegatronBackend (checked without importing Megatron), else "torch"."""
    import sys

    module = sys.modules.get("libra.services.trainer.megatron.backend")
    return "megatron" if module is not None and isinstance(backend, module.MegatronBackend) else "torch"


def prepare_meta(backend: Any) -> dict[str, Any]:
    """What a hybrid needs to build a replica of `backend`: sent in `prepare`, kept in snapshot.json."""
    return {"backend": kind_of(backend), "model_dir": getattr(backend, "model_dir", None) or "",
            "config": backend.config.model_dump(mode="json"), "layout": gradient_layout(backend)}


def build(meta: dict[str, Any], threads: int, device: str) -> Any:
    """A backend of the core's kind, loaded from its model directory, on `device` (a hybrid's)."""
    from libra.services.trainer.config import TrainerConfig

    kind = meta.get("backend", "torch")
    config = TrainerConfig(**{**meta["config"], "torch_threads": threads})
    if kind == "torch":
        from libra.services.trainer.torch_backend import TorchBackend

        backend = TorchBackend(config)
        backend.load(meta["model_dir"])
        backend.to(device)
        return backend
    if kind == "megatron":
        return _build_megatron(config, meta["model_dir"], device)
    raise ValueError(f"the core runs backend {kind!r}; a hybrid builds one of {KINDS}")


def _build_megatron(config: Any, model_dir: str, device: str) -> Any:
    import torch

    from libra.services.trainer.megatron.backend import MegatronBackend

    settings = config.backend
    if settings.tensor_parallel != 1 or settings.pipeline_parallel != 1:
        raise ValueError(f"a hybrid replica is one whole model: the core's trainer.backend.tensor_parallel="
                         f"{settings.tensor_parallel}, pipeline_parallel={settings.pipeline_parallel} must be 1")
    cuda = torch.cuda.is_available()
    if device.startswith("cuda") != cuda:
        raise ValueError(f"the Megatron backend runs on {'CUDA' if cuda else 'the CPU'} in this process, "
                         f"but the hybrid was started with --device {device}")
    if cuda:  # init_parallel selects LOCAL_RANK's GPU; this process has one, the one it was given
        os.environ["LOCAL_RANK"] = str(torch.device(device).index or 0)
    _own_world(cuda)
    # The whole reduced gradient and whole optimizer state live here: never sharded over DP.
    config = config.model_copy(update={"backend": settings.model_copy(update={"distributed_optimizer": False})})
    backend = MegatronBackend(config)
    backend.load(model_dir)
    return backend


def _own_world(cuda: bool) -> None:
    """A one-process torch.distributed world of its own (never the core's, whatever the environment
    says: a hybrid started from a trainer's launcher inherits RANK / MASTER_ADDR)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return  # tests run hybrids as threads of a one-rank core process: that world is one process too
    store = os.path.join(tempfile.mkdtemp(prefix="libra-hybrid-"), "store")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)


# ---- the flat gradient's layout -----------------------------------------------------------------

def gradient_layout(backend: Any) -> list[list[Any]]:
    """[name, start, end] of every trainable parameter in the flat gradient, in offset order."""
    ddp = getattr(backend, "_ddp", None)
    if ddp is not None:  # Megatron DDP on GPUs: the grad buffers, concatenated as flat_gradients() does
        names = {id(p): n for n, p in backend.model.named_parameters()}
        out, offset = [], 0
        for buffer in ddp.buffers:
            spans = sorted((start, end, names[id(p)]) for p, (start, end, _) in buffer.param_index_map.items())
            out += [[name, offset + start, offset + end] for start, end, name in spans]
            offset += buffer.grad_data.numel()
        return out
    out, offset = [], 0
    for name, p in backend.model.named_parameters():
        if p.requires_grad:
            out.append([name, offset, offset + p.numel()])
            offset += p.numel()
    return out


def layout_mismatch(ours: list[list[Any]], core: list[list[Any]] | None) -> str:
    """Why the two flat gradients do not line up ("" when they do, or when the core sent none)."""
    if core is None:
        return ""
    if len(ours) != len(core):
        return f"the core's flat gradient has {len(core)} parameters, this replica's {len(ours)}"
    for mine, theirs in zip(ours, core):
        if list(mine) != list(theirs):
            return f"flat gradient layouts differ: the core has {theirs}, this replica {mine}"
    return ""


# ---- model + optimizer state ------------------------------------------------------------------

def capture_state(backend: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[dict], dict[str, Any]]:
    """(model tensors, optimizer state by parameter index, param groups, extra): private copies on
    the tensors' device (device-to-device on a GPU; the snapshot writer moves them to the host)."""
    if kind_of(backend) == "megatron":
        return _megatron_state(backend)
    model = {name: t.detach().clone() for name, t in backend.model.state_dict().items()}
    state = backend.optimizer.state_dict()
    optimizer = {int(index): {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in values.items()}
                 for index, values in state["state"].items()}
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return model, optimizer, groups, {}


def load_state(backend: Any, model: dict[str, Any], optimizer: dict[int, Any], groups: list[dict],
               extra: dict[str, Any]) -> None:
    """Put a captured state into `backend` (built with the same architecture and kind)."""
    if kind_of(backend) == "megatron":
        _load_megatron_state(backend, model, optimizer, extra)
        return
    backend.model.load_state_dict(model)
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    backend.optimizer.load_state_dict({"state": optimizer, "param_groups": groups})  # casts to the params' device


def _megatron_state(backend: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[dict], dict[str, Any]]:
    import torch

    from libra.services.trainer.megatron import optimizer_state as opt_state

    model = {k: t.detach().clone() for k, t in backend.model.state_dict().items() if torch.is_tensor(t)}
    adapter = opt_state.optimizer_state(backend.model, backend.optimizer)
    params = opt_state.trainable_parameters(backend.model)
    optimizer = {}
    for index, (name, p) in enumerate(params):
        tensors = adapter.whole(name, p)
        optimizer[index] = {k: (tensors[k] if k in tensors else torch.zeros(p.numel(), device=p.device))
                            .detach().float().reshape(p.shape).clone() for k in ("main", *opt_state.MOMENTS)}
    # Adam's step read locally: the adapter's `step()` is a collective over all ranks, and only the
    # hybrid's core rank takes its snapshot.
    extra = {"names": [name for name, _ in params], "adam_step": adapter.local_step()}
    return model, optimizer, [], extra


def _load_megatron_state(backend: Any, model: dict[str, Any], optimizer: dict[int, Any],
                         extra: dict[str, Any]) -> None:
    from libra.services.trainer.megatron import optimizer_state as opt_state
    from libra.services.trainer.megatron.build import load_state

    names = [name for name, _ in opt_state.trainable_parameters(backend.model)]
    if names != extra["names"]:
        raise ValueError(f"the snapshot's parameters {extra['names'][:3]}… are not this model's {names[:3]}…")
    load_state(backend.model, model)
    states = {name: optimizer[index] for index, name in enumerate(names)}
    opt_state.optimizer_state(backend.model, backend.optimizer).set_states(states, float(extra["adam_step"]))
