"""The weights group: trainer → rollout workers weight broadcast over NCCL (GPU) or gloo (CPU).

A group has a *generation*: one fixed set of ranks, reused for every policy version until that set
changes (workers added, drained, failed) or a version fails on it; then the trainer forms the next
generation and every rank of the old one closes it (weights_roster.py says who decides what). The
trainer is rank 0 and each worker engine process (each TP rank of a vLLM worker) is one rank ≥ 1.
All generations meet in one TCPStore hosted by the trainer for the life of its process, each under
its own key prefix (`libra-weights/g{G}/`), and each is a standalone
`ProcessGroupNCCL`/`ProcessGroupGloo`, never `init_process_group`, so it cannot collide with the
trainer's own training group.

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
buckets (weight_layout.py), so a tensor larger than a bucket spans several and the buffers never
grow. Optionally, tensors of at least `direct_bytes` are broadcast one by one straight from the
trainer's parameter into the worker's, with no copy on either side (they go first, then the
buckets); it is off by default: on two H200s it was slower than packing (1B-sized set: 61.9% of a
plain broadcast with 8 MiB direct tensors, 68.5% all in 256 MiB buckets; docs/benchmarks.md) —
one NCCL call per tensor costs more than the device copies it saves. Receivers copy each chunk straight into a target tensor (the engine's own parameter)
when one is given, else into a fresh tensor, and yield every tensor once it is complete.

No copy at all where a side's tensors already sit at the stream's offsets in one buffer
(`weight_flat.FlatWeights`, which the hf engine adopts for its parameters after its first version):
then a bucket is a slice of that buffer, broadcast from it or received into it as it is. Each side
decides alone (both cut the same buckets, every bucket exactly its bytes long), so a flat sender
works with packing receivers and the other way round.

Failure rules: a receiver that does not join a version within the timeout, or before the
sender's `cancel` event is set, makes the sender abort that version *before* any collective
starts (the group stays usable; the caller retries the version over the disk path). A failure
inside a collective (a receiver that dies mid-broadcast) breaks the group: every later call raises
until the next generation replaces it. On NCCL a dead peer is only noticed at the group's timeout.
This module knows torch.distributed only: not HTTP, Redis or engines.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from libra.errors import FailedPrecondition, Unavailable
from libra.services.rollout.weight_flat import FlatWeights
from libra.services.rollout.weight_layout import (DEFAULT_DIRECT_BYTES, Layout, TensorSlot, plan_layout,
                                                  slots_digest, slots_from_json, slots_to_json)

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 256 * 2**20
BACKENDS = ("nccl", "gloo")
POLL_S = 0.2  # a wait for other ranks looks at `cancel` and `abort` this often


class WeightSyncError(Unavailable):
    """A version could not be delivered: a receiver missed it, or the group broke mid-transfer."""


def _bytes_of(tensor: "torch.Tensor") -> "torch.Tensor":
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class SyncReport:
    """What one version cost: bytes moved, wall time on the sender, each receiver's own timings."""

    version: int
    bytes: int
    buckets: int
    seconds: float  # handshake excluded: first pack to last broadcast done
    handshake_seconds: float
    receivers: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def open_store(host: str, port: int | str, is_master: bool, timeout_s: float) -> Any:
    """The TCPStore every generation meets in: hosted by the trainer (`is_master`), a client elsewhere.

    wait_for_workers=False: the trainer must not block until workers exist."""
    import torch.distributed as dist

    return dist.TCPStore(host, int(port), None, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightsGroup:
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
            pg_store = dist.PrefixStore(f"{root}/pg", self.store)
            timeout = datetime.timedelta(seconds=timeout_s)
            if backend == "nccl":
                torch.cuda.set_device(self.device)
                options = dist.ProcessGroupNCCL.Options()
                try:
                    options._timeout = timeout
                except AttributeError:  # older torch: the options carry no timeout; NCCL's default applies
                    pass
                self.group = dist.ProcessGroupNCCL(pg_store, rank, world_size, options)
            else:
                self.group = dist.ProcessGroupGloo(pg_store, rank, world_size, timeout)
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

    # ---- sender (rank 0) -----------------------------------------------------------------
    def send(self, named: Iterable[tuple[str, "torch.Tensor"]], version: int,
             join_timeout_s: float | None = None, cancel: threading.Event | None = None) -> SyncReport:
        """Broadcast `named` tensors as `version` to every receiver; return its timings.

        A FlatWeights whose buffer fits the layout is broadcast bucket by bucket from that buffer
        (no pack copy). Raises WeightSyncError naming the ranks that did not join within `join_timeout_s` or before
        `cancel` was set (the version is aborted before any byte moves; the group stays usable), or
        when a collective fails (the group is then broken). `cancel` only matters until every
        receiver has joined: a transfer under way is never cut.
        """
        if self.rank != 0:
            raise FailedPrecondition("only rank 0 (the trainer) sends weights")
        self._check()
        self._mark(version, "send")
        flat = named if isinstance(named, FlatWeights) else None
        tensors = dict(named)
        layout, digest = self._layout(tensors, version)
        if flat is not None and not flat.fits(layout):
            flat = None
        started = time.perf_counter()
        self._mark(version, "planned")
        # The layout goes out before the receivers are all there: each plans where its bytes land
        # while the others arrive, so only the one-word `go` sits between the last arrival and the bytes.
        if digest not in self._published:
            self.keys.set(f"layouts/{digest}", self._plan[1])
            self._published.add(digest)
        self.keys.set(f"{version}/meta", json.dumps({"version": version, "bucket_bytes": layout.bucket_bytes,
                                                     "layout": digest}))
        self._await_receivers(version, join_timeout_s, cancel)
        self._mark(version, "all ready")
        self.keys.set(f"{version}/go", "")
        handshake = time.perf_counter() - started
        started = time.perf_counter()
        self._mark(version, "go set")
        direct = [self._broadcast(_bytes_of(tensors[slot.name])) for slot in layout.direct_slots]
        if flat is not None:  # the tensors already sit at the stream's offsets: every bucket is a slice
            pending = [self._broadcast(flat.bucket(layout, bucket)) for bucket in range(layout.num_buckets)]
        else:
            pending = [None, None]
        for bucket in range(layout.num_buckets if flat is None else 0):
            slot = bucket % 2
            if pending[slot] is not None:  # the buffer's previous broadcast must be done first
                self._wait(pending[slot], f"version {version} bucket {bucket - 2}")
            low = bucket * layout.bucket_bytes
            buffer = self._buffer(slot)[:min(layout.bucket_bytes, layout.stream_bytes - low)]
            for tensor_slot, start, end in layout.overlapping(bucket):
                source = _bytes_of(tensors[tensor_slot.name])
                buffer[start - low:end - low].copy_(source[start - tensor_slot.offset:end - tensor_slot.offset],
                                                    non_blocking=True)
            pending[slot] = self._broadcast(buffer)
        self._mark(version, "issued")
        self._forget(version - 2)  # while the last buckets are in flight (the host is idle on NCCL)
        for work in pending:
            if work is not None:
                self._wait(work, f"version {version} buckets")
        for work, slot in zip(direct, layout.direct_slots):
            self._wait(work, f"version {version} tensor {slot.name}")
        self._sync()
        seconds = time.perf_counter() - started
        self._mark(version, "synced")
        report = SyncReport(version, layout.total_bytes, layout.num_buckets, seconds, handshake)
        report.receivers = self._exchange_timings(version, [0.0, 0.0, 0.0])
        self._mark(version, "acked")
        return report

    def _layout(self, tensors: dict[str, "torch.Tensor"], version: int) -> tuple[Layout, str]:
        """`tensors` laid out as `version`, and the layout's id; planned once per tensor set (names,
        shapes and dtypes in order), as every version of a model has the same."""
        key = tuple((name, tensor.shape, tensor.dtype) for name, tensor in tensors.items())
        if key != self._plan_key:
            slots = plan_layout(tensors.items(), version, self.bucket_bytes, self.direct_bytes).slots
            text = slots_to_json(slots)
            self._plan_key, self._plan = key, (slots, text, slots_digest(text))
        slots, _, digest = self._plan
        return Layout(version, self.bucket_bytes, slots), digest

    def _await_receivers(self, version: int, timeout_s: float | None, cancel: threading.Event | None) -> None:
        try:
            self._await(f"{version}/ready/{{}}", range(1, self.world_size),
                        self.timeout_s if timeout_s is None else timeout_s, cancel, f"version {version}")
        except WeightSyncError as error:
            self.keys.set(f"{version}/go", str(error) or "aborted")
            raise WeightSyncError(f"{error}; the version was aborted before any transfer (load it from "
                                  f"disk on those workers)") from error

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

    def _forget(self, version: int) -> None:
        if version < 0:
            return
        for key in [f"{version}/meta", f"{version}/go", *(f"{version}/ready/{r}" for r in range(1, self.world_size))]:
            try:
                self.keys.delete_key(key)
            except Exception:  # noqa: BLE001 - cleanup only; a missing key is fine
                pass

    # ---- receiver (rank ≥ 1) -------------------------------------------------------------
    def receive(self, version: int, targets: Mapping[str, "torch.Tensor"] | None = None
                ) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Join the broadcast of `version`; yield (name, tensor) as each tensor completes.

        A tensor whose name is in `targets` (same shape, dtype and device, contiguous) is written into
        that tensor in place and yielded as it; others land in fresh tensors on this group's device
        (so a caller detects a misfit by identity, after the transfer, without breaking it). When
        `targets` is a FlatWeights that fits the version's layout, the buckets land in its buffer with
        no unpack copy. Timings go back to the sender with the acknowledgement; `last_layout` keeps
        the version's layout (for `FlatWeights.adopt`). Consume the iterator fully.
        """
        if self.rank == 0:
            raise FailedPrecondition("rank 0 (the trainer) sends; it does not receive")
        self._check()
        self._mark(version, "receive")
        started = time.perf_counter()
        self.keys.set(f"{version}/ready/{self.rank}", "1")
        self._mark(version, "ready set")
        try:
            meta = json.loads(self.keys.get(f"{version}/meta"))
            slots = self._layouts.get(meta["layout"])
            if slots is None:  # a tensor set this rank has not seen in this generation
                slots = self._layouts[meta["layout"]] = slots_from_json(self.keys.get(f"layouts/{meta['layout']}").decode())
        except Exception as error:  # noqa: BLE001
            raise WeightSyncError(f"no metadata for version {version} from the trainer: {error}") from error
        self._mark(version, "meta got")
        layout = Layout(int(meta["version"]), int(meta["bucket_bytes"]), slots)
        in_place = isinstance(targets, FlatWeights) and targets.fits(layout)
        destinations = {} if in_place else {s.name: _destination(s, targets, self.device) for s in layout.slots}
        self._mark(version, "planned")
        try:
            verdict = self.keys.get(f"{version}/go").decode()
        except Exception as error:  # noqa: BLE001
            raise WeightSyncError(f"no go for version {version} from the trainer: {error}") from error
        if verdict:
            raise WeightSyncError(f"version {version} was aborted by the sender: {verdict}")
        self.last_layout = layout
        handshake = time.perf_counter() - started
        started = time.perf_counter()
        self._mark(version, "go got")
        direct = [(slot, self._broadcast(_bytes_of_inplace(destinations[slot.name]))) for slot in layout.direct_slots]
        for slot, work in direct:
            self._wait(work, f"version {version} tensor {slot.name}")
            yield slot.name, destinations[slot.name]
        if in_place:
            yield from self._receive_in_place(targets, layout)
        else:
            yield from self._receive_unpacking(destinations, layout)
        self._mark(version, "waited")
        self._sync()
        seconds = time.perf_counter() - started
        self._mark(version, "synced")
        self._exchange_timings(version, [seconds, handshake, float(layout.total_bytes)])
        self._mark(version, "acked")

    def _receive_in_place(self, flat: FlatWeights, layout: Layout) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Every bucket straight into its slice of `flat`'s buffer (no unpack copy); all receives are
        issued at once (they run in order on the group's stream), then each tensor is yielded once its
        last bucket is in."""
        pending = [self._broadcast(flat.bucket(layout, bucket)) for bucket in range(layout.num_buckets)]
        self._mark(layout.version, "issued")
        slots = iter(sorted((s for s in layout.slots if not s.direct), key=lambda s: s.offset))
        slot = next(slots, None)
        for bucket, work in enumerate(pending):
            self._wait(work, f"version {layout.version} bucket {bucket}")
            high = (bucket + 1) * layout.bucket_bytes
            while slot is not None and slot.offset + slot.nbytes <= high:
                yield slot.name, flat[slot.name]
                slot = next(slots, None)

    def _receive_unpacking(self, destinations: dict[str, "torch.Tensor"], layout: Layout
                           ) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Buckets into two reused buffers, each unpacked into the destinations while the next is in flight."""
        version = layout.version
        remaining = {s.name: s.nbytes for s in layout.slots if not s.direct}
        pending: list[Any] = [None, None]
        for bucket in range(layout.num_buckets + 1):
            if bucket < layout.num_buckets:  # issue the receive of bucket k ...
                low = bucket * layout.bucket_bytes
                size = min(layout.bucket_bytes, layout.stream_bytes - low)
                pending[bucket % 2] = self._broadcast(self._buffer(bucket % 2)[:size])
                if bucket == 0:
                    self._mark(version, "first issued")
            if bucket == 0:
                continue
            done = bucket - 1  # ... then unpack bucket k-1 while bucket k is in flight
            self._wait(pending[done % 2], f"version {version} bucket {done}")
            buffer, low = self._buffer(done % 2), done * layout.bucket_bytes
            for slot, start, end in layout.overlapping(done):
                target = _bytes_of_inplace(destinations[slot.name])
                target[start - slot.offset:end - slot.offset].copy_(buffer[start - low:end - low])
                remaining[slot.name] -= end - start
                if remaining[slot.name] == 0:
                    yield slot.name, destinations[slot.name]
            # The next receive into this buffer is issued after this unpack was queued, and a
            # collective waits for the current stream at issue: no extra synchronisation needed.


def _destination(slot: TensorSlot, targets: Mapping[str, Any] | None, device: Any) -> "torch.Tensor":
    import torch

    dtype = getattr(torch, slot.dtype)
    target = targets.get(slot.name) if targets is not None else None
    if (target is not None and tuple(target.shape) == slot.shape and target.dtype == dtype
            and target.is_contiguous() and target.device == torch.device(device)):
        return target
    # No fitting target: receive into a fresh tensor anyway. Raising here would leave the sender
    # blocked in a collective this rank never joins; the caller sees `tensor is not targets[name]`.
    return torch.empty(slot.shape, dtype=dtype, device=device)


def _bytes_of_inplace(tensor: "torch.Tensor") -> "torch.Tensor":
    import torch

    return tensor.data.view(-1).view(torch.uint8)


def join_generation(previous: WeightsGroup | None, host: str, port: int | str, rank: int | str,
                    world_size: int | str, backend: str, device: str, timeout_s: float | str,
                    bucket_mb: int | str, generation: int | str) -> WeightsGroup:
    """A worker rank's move to `generation`: close the generation it was in, then join the new one
    (blocks until every rank is there). Arguments may arrive as strings (over /collective_rpc)."""
    if previous is not None:
        previous.close()
    return WeightsGroup(host, int(port), int(rank), int(world_size), backend, device=device,
                        timeout_s=float(timeout_s), bucket_bytes=int(bucket_mb) * 2**20, generation=int(generation))
