"""Megatron-Core's process groups, the few collectives the trainer adds, and its CPU adaptations.

Owns: joining torch.distributed and building Megatron's TP × PP × DP groups (once per process),
sums over the data-parallel group, model-parallel-aware gradient clipping for the CPU path, and the
patches that let Megatron-Core run where torch has no CUDA. Must not know: models, batches, the
GRPO loss.

Runs in: every trainer rank process (joins the launcher's world) and a hybrid replica's process
(finds the one-process world `elastic.backends` made for it, never the core's); the CPU patches in
whichever of them runs without CUDA.

Rank layout (Megatron's default order tp-cp-ep-dp-pp): global rank = tp + TP·(dp + DP·pp), so
global rank 0 is TP rank 0 of DP replica 0 on the first pipeline stage.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from libra.errors import FailedPrecondition


def init_parallel(tp: int, cuda: bool, pp: int = 1, ep: int = 1) -> None:
    """Join (or create, for one process) torch.distributed, then Megatron's model-parallel groups
    (and expert-parallel ones: `ep` ranks of the data-parallel dimension share a layer's experts)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo")
        else:  # a single process (tests, one-GPU runs): a private file store, no ports
            store = os.path.join(tempfile.mkdtemp(prefix="libra-megatron-"), "store")
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"trainer.backend.tensor_parallel={tp} × pipeline_parallel={pp} = {tp * pp} does not "
                         f"divide the world size {world}; launch a multiple of {tp * pp} ranks")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"trainer.backend.expert_parallel={ep} does not divide the data-parallel size "
                         f"{world // (tp * pp)}; launch a multiple of {tp * pp * ep} ranks")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise FailedPrecondition(
                f"Megatron model parallelism is already initialised with TP={have[0]}, PP={have[1]}, EP={have[2]}, "
                f"not trainer.backend.tensor_parallel={tp}, pipeline_parallel={pp}, expert_parallel={ep}; one "
                "process holds one layout")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


def tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def ep_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank()


def pp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage()


def dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def dp_sum_tensor(tensor: Any) -> Any:
    """All-reduce SUM over the data-parallel group, in place (a no-op with one replica)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dp_size() > 1:
        dist.all_reduce(tensor, group=ps.get_data_parallel_group())
    return tensor


def clip_model_parallel(params: list[Any], max_norm: float) -> float:
    """Clip by the norm of the whole model, every rank of a model-parallel (TP × PP) group alike.

    TP-sharded gradients are summed over TP and PP; replicated ones (norms) are counted once per
    stage (TP rank 0's); the last stage's copy of a tied embedding (`shared`, kept equal to the
    first stage's) is not counted, as in Megatron's own clipping; expert-parallel ones (each EP rank
    its own experts) are summed over EP and PP (`moe.expert_square_norm`).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from libra.services.trainer.megatron import moe

    grads = [p for p in params if p.grad is not None]
    experts = moe.expert_square_norm(grads) if ps.get_expert_model_parallel_world_size() > 1 else 0.0
    counted = [p for p in grads if not getattr(p, "shared", False) and not moe.is_expert(p)]
    sharded = sum(float(p.grad.double().pow(2).sum()) for p in counted if getattr(p, "tensor_model_parallel", False))
    replicated = sum(float(p.grad.double().pow(2).sum()) for p in counted
                     if not getattr(p, "tensor_model_parallel", False))
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        tensor = torch.tensor([sharded, replicated if ps.get_tensor_model_parallel_rank() == 0 else 0.0],
                              dtype=torch.float64)
        dist.all_reduce(tensor, group=group)
        sharded, replicated = float(tensor[0]), float(tensor[1])
    norm = (sharded + replicated + experts) ** 0.5
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p in grads:
            p.grad.mul_(scale)
    return norm


PATCHED_ = False


def patch_megatron_for_cpu() -> None:
    """Make Megatron-Core's CUDA assumptions hold on a CPU-only torch; called only without CUDA.

    Megatron allocates scratch tensors on `torch.cuda.current_device()` (GlobalMemoryBuffer, the
    RoPE frequencies, the checkpoint writer's status flags, the pipeline's received activations),
    waits on `torch.cuda.synchronize()` before copying checkpoint tensors out and after pipeline
    sends, swaps CUDA RNG states in `CudaRNGStatesTracker.fork`, moves the last stage's copy of a
    tied embedding with `Tensor.cuda()` before syncing it, and its pipeline schedules count tokens
    in `torch.zeros(..., device="cuda")`. With no CUDA each of these raises. Here the current
    device is the CPU, there is no stream to wait for, the fork is a no-op (the model runs without
    dropout, so no random stream is drawn inside it), `.cuda()` leaves a tensor where it is, and
    the schedules' "cuda" zeros are CPU zeros. MoE's all-to-all token dispatcher copies its split
    sizes to the host on a side stream (`torch.cuda.Stream`, `torch.cuda.stream`, an event it
    waits on): without CUDA there is one stream, the host's, so each of these is a no-op; and the
    split sizes it hands to all-to-all become numpy arrays only when they come from a GPU, so on the
    host they are made numpy arrays too (torch's all_to_all_single takes no tensor there). A CUDA
    build of torch is never patched.
    """
    global PATCHED_
    import contextlib

    import torch

    if PATCHED_ or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    host_stream = _HostStream()
    torch.cuda.Stream = lambda *args, **kwargs: host_stream
    torch.cuda.current_stream = lambda device=None: host_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):  # noqa: ANN001 - Megatron's signature
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    to_host = moe_utils.maybe_move_tensor_to_cpu

    def to_host_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host_numpy
    PATCHED_ = True


class _HostStream:
    """The one stream of a CPU process: waiting on it or on its events returns at once."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return self

    def synchronize(self) -> None:
        return None


class _TorchOnCpu:
    """`torch` as Megatron's pipeline schedules see it without CUDA: `zeros(device="cuda")` is on the CPU."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> Any:
        import torch

        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)
