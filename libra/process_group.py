"""Standalone torch.distributed process groups: a TCPStore and a `ProcessGroupNCCL` or
`ProcessGroupGloo` built on it directly.

Never `init_process_group`: a group built here cannot collide with (or be torn down with) the
process's own default group, so a trainer rank can be in its training group, in the weights group
(libra/weights/group.py) and in one pair group per elastic hybrid
(services/trainer/elastic/device_channel.py) at once, each with its own ranks and lifetime.

Owns the store setup and the one timeout workaround both users need; must not know what travels
over the group. torch is imported inside the functions (the control plane never loads it).
"""

from __future__ import annotations

import datetime
from typing import Any

BACKENDS = ("nccl", "gloo")


def open_store(host: str, port: int | str, is_master: bool, timeout_s: float, world_size: int | None = None) -> Any:
    """A TCPStore: hosted here (`is_master`; port 0 picks a free one, `.port` says which) or a client.

    `wait_for_workers=False`: the host must not block until its clients exist (they come later,
    or never, and the caller's own rendezvous says so). `world_size` None: not known in advance."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=float(timeout_s)), wait_for_workers=False)


def build_group(store: Any, prefix: str, rank: int, world_size: int, backend: str, device: Any,
                timeout_s: float) -> Any:
    """Rank `rank` of a `world_size`-rank group over `store` (keys under `prefix`): NCCL on `device`
    (a CUDA device), or gloo. Blocks until the backend has connected every rank (NCCL: lazily, at
    the first collective). `timeout_s` bounds each collective where the backend honours it."""
    import torch
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"process group backend must be one of {BACKENDS}, got {backend!r}")
    keys = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if backend == "gloo":
        return dist.ProcessGroupGloo(keys, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    try:
        options._timeout = timeout
    except AttributeError:  # older torch: the options carry no timeout; NCCL's default applies
        pass
    with torch.cuda.device(torch.device(device)):
        return dist.ProcessGroupNCCL(keys, rank, world_size, options)
