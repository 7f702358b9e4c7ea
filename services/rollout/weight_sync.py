"""The weights group: trainer → rollout workers weight broadcast over NCCL (GPU) or gloo (CPU).

One group per run, created once and reused for every policy version. The trainer is rank 0 and
each worker engine process (each TP rank of a vLLM worker) is one rank ≥ 1. The group is built
from its own TCPStore (hosted by the trainer) and a standalone `ProcessGroupNCCL`/`ProcessGroupGloo`,
never `init_process_group`, so it cannot collide with the trainer's own training group.

One version, as the two sides see it (the store carries the handshake, the group the bytes):

    sender (rank 0)                                   receiver (rank r)
    ───────────────                                   ─────────────────
                                                      set v{N}/ready/{r}
    wait all v{N}/ready/* (timeout) ─ missing? ─▶     get v{N}/meta ─▶ {"abort": why} → WeightSyncError
    set v{N}/meta = names, shapes, dtypes, layout
    bucket 0: pack ─▶ broadcast ┐                     recv bucket 0 ┐
    bucket 1: pack (overlaps) ─▶│ broadcast           recv bucket 1 │ unpack 0 (overlaps)
      …  (two buffers, reused once their broadcast is done)            …
    wait all v{N}/done/* ─▶ SyncReport                set v{N}/done/{r} = timings

Tensors of at least `direct_bytes` (the big matrices: almost all the bytes) are broadcast one by
one straight from the trainer's parameter into the worker's, with no copy on either side; the
many small ones (norms, biases, small projections) are one virtual byte stream (each tensor
16-byte aligned) cut into fixed-size buckets, so a tensor larger than a bucket spans several and
the buffers never grow. Direct tensors go first, in layout order, then the buckets. Receivers copy each
chunk straight into a target tensor (the engine's own parameter) when one is given, else into a
fresh tensor, and yield every tensor once it is complete.

Failure rules: a receiver that does not join a version within the timeout makes the sender abort
that version *before* any collective starts (the group stays usable; the caller marks the worker
unhealthy or retries it over the disk path). A failure inside a collective (a receiver that dies
mid-broadcast) breaks the group: every later call raises until it is rebuilt. On NCCL a dead peer
is only noticed at the group's timeout. This module knows torch.distributed only: not HTTP, Redis
or engines.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from libra.errors import FailedPrecondition, Unavailable

if TYPE_CHECKING:
    import torch

ALIGN = 16  # bytes; every tensor starts at a multiple, so a bucket slice can be viewed as any dtype
DEFAULT_BUCKET_BYTES = 256 * 2**20
DEFAULT_DIRECT_BYTES = 8 * 2**20  # tensors this big are broadcast on their own (no pack/unpack copy)
BACKENDS = ("nccl", "gloo")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


class WeightSyncError(Unavailable):
    """A version could not be delivered: a receiver missed it, or the group broke mid-transfer."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the version's byte stream."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # in the packed byte stream; -1 for a tensor broadcast on its own
    nbytes: int

    @property
    def direct(self) -> bool:
        return self.offset < 0


@dataclass(frozen=True)
class Layout:
    """The tensors of one version and how they are cut into buckets."""

    version: int
    bucket_bytes: int
    slots: tuple[TensorSlot, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes the version moves (direct tensors and the packed stream)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def stream_bytes(self) -> int:
        return max((s.offset + s.nbytes for s in self.slots if not s.direct), default=0)

    @property
    def direct_slots(self) -> tuple[TensorSlot, ...]:
        return tuple(s for s in self.slots if s.direct)

    @property
    def num_buckets(self) -> int:
        return -(-self.stream_bytes // self.bucket_bytes)

    def overlapping(self, bucket: int) -> Iterator[tuple[TensorSlot, int, int]]:
        """(slot, start, end) byte ranges of the stream that bucket `bucket` holds, per tensor."""
        low, high = bucket * self.bucket_bytes, (bucket + 1) * self.bucket_bytes
        for slot in self.slots:
            if slot.direct:
                continue
            start, end = max(low, slot.offset), min(high, slot.offset + slot.nbytes)
            if start < end:
                yield slot, start, end

    def to_json(self) -> str:  # offset -1 marks a direct tensor
        return json.dumps({"version": self.version, "bucket_bytes": self.bucket_bytes,
                           "slots": [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in self.slots]})

    @staticmethod
    def from_json(text: str) -> "Layout":
        raw = json.loads(text)
        return Layout(raw["version"], raw["bucket_bytes"],
                      tuple(TensorSlot(n, tuple(shape), d, o, b) for n, shape, d, o, b in raw["slots"]))


def plan_layout(named: Iterable[tuple[str, "torch.Tensor"]], version: int, bucket_bytes: int,
                direct_bytes: int | None = None) -> Layout:
    """Lay `named` tensors out: those of at least `direct_bytes` (None: never) broadcast on their
    own, the rest in a byte stream (16-byte aligned) for `bucket_bytes` buckets."""
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    slots, offset, seen = [], 0, set()
    for name, tensor in named:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which the weights group does not carry")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weight set")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if direct_bytes is not None and nbytes >= direct_bytes:
            slots.append(TensorSlot(name, tuple(tensor.shape), dtype, -1, nbytes))
            continue
        slots.append(TensorSlot(name, tuple(tensor.shape), dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    if not slots:
        raise ValueError("the weight set holds no tensors")
    return Layout(int(version), int(bucket_bytes), tuple(slots))


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


class WeightsGroup:
    """This process's membership of the weights group (rank 0: trainer, ranks ≥ 1: workers)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 60.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 direct_bytes: int | None = DEFAULT_DIRECT_BYTES):
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
        self.device = torch.device(device)
        self.timeout_s, self.bucket_bytes = float(timeout_s), int(bucket_bytes)
        self.direct_bytes = direct_bytes
        self.broken: str | None = None
        timeout = datetime.timedelta(seconds=timeout_s)
        # wait_for_workers=False: the trainer must not block until workers exist; the process
        # group's own rendezvous (below) waits for every rank with the timeout.
        self.store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        pg_store = dist.PrefixStore("libra-weights/pg", self.store)
        self.keys = dist.PrefixStore("libra-weights/v", self.store)
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
        self._buffers: list[Any] = []

    # ---- shared --------------------------------------------------------------------------
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
            raise FailedPrecondition(f"the weights group is broken ({self.broken}); rebuild it (restart "
                                     f"the workers' group membership) or publish over the disk path")

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
             join_timeout_s: float | None = None) -> SyncReport:
        """Broadcast `named` tensors as `version` to every receiver; return its timings.

        Raises WeightSyncError naming the ranks that did not join within `join_timeout_s` (the
        version is aborted before any byte moves; the group stays usable), or when a collective
        fails (the group is then broken).
        """
        if self.rank != 0:
            raise FailedPrecondition("only rank 0 (the trainer) sends weights")
        self._check()
        tensors = dict(named)
        layout = plan_layout(tensors.items(), version, self.bucket_bytes, self.direct_bytes)
        started = time.perf_counter()
        self._await_receivers(version, join_timeout_s)
        self.keys.set(f"{version}/meta", layout.to_json())
        handshake = time.perf_counter() - started
        started = time.perf_counter()
        direct = [self._broadcast(_bytes_of(tensors[slot.name])) for slot in layout.direct_slots]
        pending: list[Any] = [None, None]
        for bucket in range(layout.num_buckets):
            slot = bucket % 2
            if pending[slot] is not None:  # the buffer's previous broadcast must be done first
                self._wait(pending[slot], f"version {version} bucket {bucket - 2}")
            buffer = self._buffer(slot)
            for tensor_slot, start, end in layout.overlapping(bucket):
                source = _bytes_of(tensors[tensor_slot.name])
                low = bucket * layout.bucket_bytes
                buffer[start - low:end - low].copy_(source[start - tensor_slot.offset:end - tensor_slot.offset],
                                                    non_blocking=True)
            pending[slot] = self._broadcast(buffer)
        for work in pending:
            if work is not None:
                self._wait(work, f"version {version} final buckets")
        for work, slot in zip(direct, layout.direct_slots):
            self._wait(work, f"version {version} tensor {slot.name}")
        self._sync()
        seconds = time.perf_counter() - started
        report = SyncReport(version, layout.total_bytes, layout.num_buckets, seconds, handshake)
        report.receivers = self._collect_done(version)
        self._forget(version - 2)
        return report

    def _await_receivers(self, version: int, timeout_s: float | None) -> None:
        keys = [f"{version}/ready/{r}" for r in range(1, self.world_size)]
        timeout = datetime.timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        try:
            self.keys.wait(keys, timeout)
        except Exception as error:  # noqa: BLE001 - the store raises a plain RuntimeError/DistStoreError on timeout
            missing = [r for r, key in zip(range(1, self.world_size), keys) if not self.keys.check([key])]
            reason = f"ranks {missing} did not join version {version} within {timeout.total_seconds():.0f}s"
            self.keys.set(f"{version}/meta", json.dumps({"abort": reason}))
            raise WeightSyncError(f"{reason}; the version was aborted before any transfer (mark those "
                                  f"workers unhealthy or load the version from disk)") from error

    def _collect_done(self, version: int) -> dict[int, dict[str, float]]:
        keys = [f"{version}/done/{r}" for r in range(1, self.world_size)]
        try:
            self.keys.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as error:  # noqa: BLE001
            raise WeightSyncError(f"receivers did not confirm version {version}: {error}") from error
        return {r: json.loads(self.keys.get(key)) for r, key in zip(range(1, self.world_size), keys)}

    def _forget(self, version: int) -> None:
        if version < 0:
            return
        for key in [f"{version}/meta", *(f"{version}/{k}/{r}" for k in ("ready", "done")
                                          for r in range(1, self.world_size))]:
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
        (so a caller detects a misfit by identity, after the transfer, without breaking it). Timings go
        to the store for the sender's report. Consume the iterator fully.
        """
        if self.rank == 0:
            raise FailedPrecondition("rank 0 (the trainer) sends; it does not receive")
        self._check()
        started = time.perf_counter()
        self.keys.set(f"{version}/ready/{self.rank}", "1")
        try:
            raw = self.keys.get(f"{version}/meta").decode()
        except Exception as error:  # noqa: BLE001
            raise WeightSyncError(f"no metadata for version {version} from the trainer: {error}") from error
        if "abort" in json.loads(raw):
            raise WeightSyncError(f"version {version} was aborted by the sender: {json.loads(raw)['abort']}")
        layout = Layout.from_json(raw)
        handshake = time.perf_counter() - started
        destinations = {s.name: _destination(s, targets, self.device) for s in layout.slots}
        remaining = {s.name: s.nbytes for s in layout.slots}
        started = time.perf_counter()
        direct = [(slot, self._broadcast(_bytes_of_inplace(destinations[slot.name]))) for slot in layout.direct_slots]
        for slot, work in direct:
            self._wait(work, f"version {version} tensor {slot.name}")
            yield slot.name, destinations[slot.name]
        pending: list[Any] = [None, None]
        for bucket in range(layout.num_buckets + 1):
            if bucket < layout.num_buckets:  # issue the receive of bucket k ...
                pending[bucket % 2] = self._broadcast(self._buffer(bucket % 2))
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
        self._sync()
        seconds = time.perf_counter() - started
        self.keys.set(f"{version}/done/{self.rank}", json.dumps(
            {"seconds": seconds, "handshake_seconds": handshake, "bytes": layout.total_bytes}))


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
