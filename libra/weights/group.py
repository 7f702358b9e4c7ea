"""The weights group: trainer → rollout workers weight broadcast over NCCL (GPU) or gloo (CPU).

A group has a *generation*: one fixed set of ranks, reused for every policy version until that set
changes (workers added, drained, failed) or a version fails on it; then the trainer forms the next
generation and every rank of the old one closes it (libra/weights/roster.py says who decides what). The
trainer is rank 0 and each worker engine process (each TP rank of a vLLM worker) is one rank ≥ 1.
All generations meet in one TCPStore hosted by the trainer for the life of its process, each under
its own key prefix (`libra-weights/g{G}/`), and each is a standalone
`ProcessGroupNCCL`/`ProcessGroupGloo` (libra/process_group.py), never `init_process_group`, so it
cannot collide with the trainer's own training group.

Forming generation G: every rank sets `joined/{rank}` and waits for all the others (the trainer
gives up at once when its caller says the workers will not come, and then writes `abort`, which
stops the ranks that did come); only then is the process group built, so a rendezvous that cannot
complete never leaves a rank stuck inside the backend.

One version, as the two sides see it (the store carries the handshake, the group the bytes):

    sender (rank 0)                                   receiver (rank r)
    ───────────────                                   ─────────────────
    set v{N}/meta = version, bucket size, layout id   set v{N}/ready/{r}
      (a new layout id: its names, shapes, dtypes     get v{N}/meta (and the layout, once per id);
       and offsets under layouts/{id}, once)          plan where every byte lands
    wait all v{N}/ready/* (timeout) ─ missing? ─▶     get v{N}/go ─▶ not empty: aborted, why → WeightSyncError
    set v{N}/go = "" (or why it aborted)
    bucket 0: pack ─▶ broadcast ┐                     recv bucket 0 ┐
    bucket 1: pack (overlaps) ─▶│ broadcast           recv bucket 1 │ unpack 0 (overlaps)
      …  (two buffers, reused once their broadcast is done)            …
    all-gather of every rank's timings ◀──────────▶  (the acknowledgement: done when all bytes are in)

All tensors form one virtual byte stream (each tensor 16-byte aligned) cut into fixed-size
buckets (libra/weights/layout.py), so a tensor larger than a bucket spans several and the buffers never
grow. Optionally, tensors of at least `direct_bytes` are broadcast one by one straight from the
trainer's parameter into the worker's, with no copy on either side (they go first, then the
buckets); it is off by default: on two H200s it was slower than packing (1B-sized set: 61.9% of a
plain broadcast with 8 MiB direct tensors, 68.5% all in 256 MiB buckets; docs/benchmarks.md) —
one NCCL call per tensor costs more than the device copies it saves. Receivers copy each chunk straight into a target tensor (the engine's own parameter)
when one is given, else into a fresh tensor, and yield every tensor once it is complete.

No copy at all where a side's tensors already sit at the stream's offsets in one buffer
(`libra.weights.flat.FlatWeights`, which the hf engine adopts for its parameters after its first version):
then a bucket is a slice of that buffer, broadcast from it or received into it as it is. Each side
decides alone (both cut the same buckets, every bucket exactly its bytes long), so a flat sender
works with packing receivers and the other way round.

Failure rules: a receiver that does not join a version within the timeout, or before the
sender's `cancel` event is set, makes the sender abort that version *before* any collective
starts (the group stays usable; the caller retries the version over the disk path). A failure
inside a collective (a receiver that dies mid-broadcast) breaks the group: every later call raises
until the next generation replaces it. On NCCL a dead peer is only noticed at the group's timeout.
This module holds the group (rendezvous, generations, the helpers both sides use); the sender's
half is libra/weights/send.py, the receivers' libra/weights/receive.py. They know torch.distributed only: not
HTTP, Redis or engines.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from libra import process_group
from libra.errors import FailedPrecondition
from libra.weights.flat import FlatWeights
from libra.weights.layout import DEFAULT_DIRECT_BYTES, Layout, TensorSlot, plan_layout
from libra.weights.receive import WeightsReceiver
from libra.weights.send import SyncReport, WeightSyncError, WeightsSender

__all__ = ["DEFAULT_BUCKET_BYTES", "FlatWeights", "Layout", "SyncReport", "WeightSyncError", "WeightsGroup",
           "join_generation", "open_store", "plan_layout"]

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 256 * 2**20
BACKENDS = process_group.BACKENDS
POLL_S = 0.2  # a wait for other ranks looks at `cancel` and `abort` this often


def open_store(host: str, port: int | str, is_master: bool, timeout_s: float) -> Any:
    """The TCPStore every generation meets in: hosted by the trainer (`is_master`), a client elsewhere
    (libra/process_group.py: the trainer does not block until workers exist)."""
    return process_group.open_store(host, port, is_master, timeout_s)


class WeightsGroup(WeightsSender, WeightsReceiver):
    """This process's rank in one generation of the weights group (rank 0: trainer, ≥ 1: workers).

    Building it is the rendezvous: it returns once every rank of `generation` has joined, raises
    WeightSyncError when they do not within `timeout_s` (or, on rank 0, once `cancel` is set).
    `store`: the trainer's long-lived TCPStore (`open_store`); None connects a client of its own.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 60.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int | None = DEFAULT_DIRECT_BYTES, generation: int = 0, store: Any = None,
                 cancel: threading.Event | None = None):
        import torch
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"weights group backend must be one of {BACKENDS}, got {backend!r}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"weights group needs world_size >= 2 and 0 <= rank < world_size, "
                             f"got rank={rank}, world_size={world_size}")
        if backend == "nccl" and not str(device).startswith("cuda"):
            raise ValueError(f"the nccl backend needs a cuda device, got {device!r}; use gloo on CPU")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.generation = int(generation)
        self.device = torch.device(device)
        self.timeout_s, self.bucket_bytes = float(timeout_s), int(bucket_bytes)
        self.direct_bytes = direct_bytes
        self.broken: str | None = None
        self.last_layout: Layout | None = None  # of the last version this rank received
        self.trace: list[tuple[int, str, float]] | None = None  # a list: (version, phase, perf_counter) marks
        self._plan_key: tuple = ()  # sender: the tensor set last planned, and its plan (slots, JSON, id)
        self._plan: tuple = ()
        self._published: set[str] = set()  # sender: layout ids written to this generation's store
        self._layouts: dict[str, tuple[TensorSlot, ...]] = {}  # receiver: layouts by id
        self.group: Any = None
        self._buffers: list[Any] = []
        self.store = store if store is not None else open_store(host, port, rank == 0, timeout_s)
        root = f"libra-weights/g{self.generation}"
        self.keys = dist.PrefixStore(root, self.store)
        try:
            self.keys.set(f"joined/{rank}", "1")  # wait for every rank before the backend connects
            self._await("joined/{}", range(world_size), self.timeout_s, cancel, f"generation {self.generation}")
            if backend == "nccl":
                torch.cuda.set_device(self.device)
            self.group = process_group.build_group(self.store, f"{root}/pg", rank, world_size, backend,
                                                   self.device, timeout_s)
        except Exception as error:
            if rank == 0:  # the ranks that did come stop waiting at once
                try:
                    self.keys.set("abort", f"{type(error).__name__}: {error}")
                except Exception:  # noqa: BLE001 - the store itself failed; they time out instead
                    pass
            raise

    def close(self) -> None:
        """Leave this generation: shut the process group down, free the buffers. Idempotent."""
        group, self.group = self.group, None
        self._buffers.clear()
        self.broken = self.broken or f"generation {self.generation} was closed"
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort: a peer may be gone already
                pass

    def _await(self, key: str, ranks: Iterable[int], timeout_s: float, cancel: threading.Event | None,
               what: str) -> None:
        """Wait until `key.format(r)` is set for every rank r; WeightSyncError naming the missing
        ranks when `timeout_s` passes, `cancel` is set, or (on a worker) the trainer aborted."""
        ranks = list(ranks)
        keys = [key.format(r) for r in ranks]
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:  # returns as soon as every key is there: one round trip when they already are
                self.keys.wait(keys, datetime.timedelta(seconds=max(0.001, min(POLL_S, remaining))))
                return
            except Exception:  # noqa: BLE001 - a short wait timed out (or the store failed: _has says)
                if self._has(keys, what):
                    return
            if self.rank != 0 and self._has(["abort"], what):
                raise WeightSyncError(f"the trainer gave up on {what}: {self.keys.get('abort').decode()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (cancel is not None and cancel.is_set()):
                missing = [r for r, k in zip(ranks, keys) if not self._has([k], what)]
                why = f"within {timeout_s:.0f}s" if remaining <= 0 else "before the receivers were done (cancelled)"
                raise WeightSyncError(f"ranks {missing} did not join {what} {why}")

    def _has(self, keys: list[str], what: str) -> bool:
        try:
            return self.keys.check(keys)
        except Exception as error:  # noqa: BLE001 - the trainer's store is gone (it stopped or restarted)
            raise WeightSyncError(f"the weights group's store failed while waiting for {what}: {error}") from error

    # ---- shared --------------------------------------------------------------------------
    def _mark(self, version: int, phase: str) -> None:
        """Note when `phase` of `version` was reached, if tracing (benchmarks/gpu_weight_sync.py --trace)."""
        if self.trace is not None:
            self.trace.append((version, phase, time.perf_counter()))

    def _buffer(self, index: int) -> "torch.Tensor":
        import torch

        while len(self._buffers) <= index:  # allocated once, reused for every version
            self._buffers.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
        return self._buffers[index]

    def _broadcast(self, tensor: "torch.Tensor") -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.group.broadcast([tensor], options)

    def _check(self) -> None:
        if self.broken:
            raise FailedPrecondition(f"the weights group is broken ({self.broken}); the next generation "
                                     f"replaces it, until then versions go over the disk path")

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - any collective failure breaks the group
            self.broken = f"{what}: {type(error).__name__}: {error}"
            raise WeightSyncError(f"weights group failed during {what}: {error}") from error

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _exchange_timings(self, version: int, mine: list[float]) -> dict[int, dict[str, float]]:
        """Every rank's [seconds, handshake_seconds, bytes] of `version`, by one all-gather over the
        group itself: the receivers' acknowledgement. (A round trip through the TCPStore cost
        ~1.2 ms on two H200s, an eighth of a 3 GB transfer; a collective of 24 bytes costs far less,
        and it completes only once every receiver has all the bytes.)"""
        import torch

        device = self.device if self.backend == "nccl" else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        self._wait(self.group.allgather([gathered], [local]), f"version {version} acknowledgements")
        rows = torch.stack(gathered).cpu().tolist()
        return {r: {"seconds": rows[r][0], "handshake_seconds": rows[r][1], "bytes": int(rows[r][2])}
                for r in range(1, self.world_size)}

def join_generation(previous: WeightsGroup | None, host: str, port: int | str, rank: int | str,
                    world_size: int | str, backend: str, device: str, timeout_s: float | str,
                    bucket_mb: int | str, generation: int | str) -> WeightsGroup:
    """A worker rank's move to `generation`: close the generation it was in, then join the new one
    (blocks until every rank is there). Arguments may arrive as strings (over /collective_rpc)."""
    if previous is not None:
        previous.close()
    return WeightsGroup(host, int(port), int(rank), int(world_size), backend, device=device,
                        timeout_s=float(timeout_s), bucket_bytes=int(bucket_mb) * 2**20, generation=int(generation))
