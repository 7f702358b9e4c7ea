"""The sender's side of the weights group (rank 0, the trainer): `WeightsSender`, mixed into
`libra.weights.group.WeightsGroup`, which provides the store keys, the process group and the shared helpers.

One version: the layout (planned once per tensor set, stored once per generation under its id),
then the meta, then — once every receiver is ready — the one-word go; then the buckets, packed
into two reused buffers (or sliced out of a FlatWeights buffer), the acknowledgement, and the
deletion of the version before last's keys while the last buckets are in flight.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from libra.errors import FailedPrecondition, Unavailable
from libra.weights.flat import FlatWeights
from libra.weights.layout import Layout, plan_layout, slots_digest, slots_to_json

if TYPE_CHECKING:
    import torch


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


class WeightsSender:
    """`send` and its helpers; see libra.weights.group.WeightsGroup for the attributes they use."""

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

    def _forget(self, version: int) -> None:
        if version < 0:
            return
        for key in [f"{version}/meta", f"{version}/go", *(f"{version}/ready/{r}" for r in range(1, self.world_size))]:
            try:
                self.keys.delete_key(key)
            except Exception:  # noqa: BLE001 - cleanup only; a missing key is fine
                pass
