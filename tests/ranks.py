"""Spawn a test's ranks (torch.multiprocessing, spawn start) and let each clean rank leave at once.

A rank whose work and gloo teardown are done can still abort in the interpreter's finalization
("terminate called without an active exception", SIGABRT, while gloo's threads wind down): CI saw
it in three different two-rank tests. A rank that returns leaves with os._exit(0) instead; one that
raises still reaches torch's spawn wrapper, which records the error and fails the test. Since
os._exit runs no exit handlers, the rank first stops the processes it started through
multiprocessing itself (Megatron's asynchronous checkpoint writer starts a Manager, whose server
process would otherwise outlive the test).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


def _run_then_leave(rank: int, fn: Callable[..., None], *args: Any) -> None:
    import multiprocessing

    fn(rank, *args)
    for child in multiprocessing.active_children():  # what an exit handler would have stopped
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run fn(rank, *args) in nprocs spawned processes and wait for all; raise if any failed."""
    import torch.multiprocessing as mp

    mp.start_processes(_run_then_leave, args=(fn, *args), nprocs=nprocs, join=True, start_method="spawn")
