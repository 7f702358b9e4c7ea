"""This process's place in torch.distributed's default world, for any backend: whether one is
joined, this process's rank in it (0 alone) and a barrier (nothing to wait for alone).

Owns: these three questions only. Must not know: backends, model-parallel groups (Megatron's are
megatron/runtime.py's), how the world was joined.
"""

from __future__ import annotations


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    import torch.distributed as dist

    if distributed():
        dist.barrier()
