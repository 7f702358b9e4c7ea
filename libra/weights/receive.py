"""The receivers' side of the weights group (ranks ≥ 1, the rollout engines): `WeightsReceiver`,
mixed into `libra.weights.group.WeightsGroup`, which provides the store keys, the process group and the
shared helpers.

One version: ready, the meta (and the layout, once per id), where every byte lands (straight into
a FlatWeights buffer, or unpacked from two reused buffers into the targets or fresh tensors), the
go, the buckets, the acknowledgement.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from libra.errors import FailedPrecondition
from libra.weights.flat import FlatWeights
from libra.weights.layout import Layout, TensorSlot, slots_from_json
from libra.weights.send import WeightSyncError

if TYPE_CHECKING:
    import torch


class WeightsReceiver:
    """`receive` and its helpers; see libra.weights.group.WeightsGroup for the attributes they use."""

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
            layout_id = meta["layout"]
            slots = self._layouts.get(layout_id)
            if slots is None:  # a tensor set this rank has not seen in this generation
                slots = self._layouts[layout_id] = slots_from_json(self.keys.get(f"layouts/{layout_id}").decode())
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
