"""Weights that live side by side in one byte buffer, laid out as the weights group's byte stream.

The weights group (libra/weights/group.py) cuts a version's tensors into one virtual byte stream
(libra/weights/layout.py) and moves it bucket by bucket. When a side's tensors already sit in one buffer
at exactly the stream's offsets, a bucket *is* a slice of that buffer: the sender broadcasts the
slice as it is and the receiver receives straight into it, with no pack or unpack copy. On two
H200s a 3 GB version moved at 84.4% of a plain broadcast with the receiver flat, 78.9% with both
sides copying (13.5 GB: 87.0% either way; docs/benchmarks.md, weight sync).

`FlatWeights.adopt` moves a model's own tensors into such a buffer: each tensor's `.data` becomes a
view of it, so the objects the model holds (parameters, tied weights) stay the same and later
in-place loads (disk, unpacked buckets) still land in them. The hf engine adopts its parameters
after the first version it receives; a trainer can adopt the tensors it exports. `fits` checks,
every version, that the layout still matches and no tensor was moved out of the buffer since
(then the group falls back to packing). Pure torch; no torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping

from libra.weights.layout import Layout

if TYPE_CHECKING:
    import torch


def _signature(layout: Layout) -> tuple:
    return tuple((s.name, tuple(s.shape), s.dtype, s.offset, s.nbytes) for s in layout.slots)


class FlatWeights(Mapping[str, "torch.Tensor"]):
    """Tensors (in `layout`'s order) whose data are views of one uint8 buffer, `stream`, at the
    layout's offsets. A read-only mapping name → the tensor objects that were adopted."""

    def __init__(self, layout: Layout, tensors: dict[str, "torch.Tensor"], stream: "torch.Tensor"):
        self.layout, self._tensors, self.stream = layout, tensors, stream
        self._signature = _signature(layout)

    def __getitem__(self, name: str) -> "torch.Tensor":
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @classmethod
    def adopt(cls, tensors: Mapping[str, "torch.Tensor"], layout: Layout) -> "FlatWeights | None":
        """Move `tensors` named in `layout` into one buffer laid out as it; None (nothing moved) when
        the layout has tensors broadcast on their own, or names a tensor `tensors` lacks or holds with
        another shape, dtype or device. Costs one copy of those tensors, and memory for them twice
        while it runs (the buffer is allocated first, so running out of memory moves nothing)."""
        import torch

        if layout.direct_slots or not layout.slots:
            return None
        chosen = {}
        device = None
        for slot in layout.slots:
            tensor = tensors.get(slot.name)
            if (tensor is None or tuple(tensor.shape) != tuple(slot.shape)
                    or str(tensor.dtype).removeprefix("torch.") != slot.dtype
                    or (device is not None and tensor.device != device)):
                return None
            device = tensor.device
            chosen[slot.name] = tensor
        stream = torch.empty(layout.stream_bytes, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for slot in layout.slots:
                tensor = chosen[slot.name]
                view = stream[slot.offset:slot.offset + slot.nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.data)
                tensor.data = view  # the same object, now backed by the buffer; its old storage is freed
        return cls(layout, chosen, stream)

    def fits(self, layout: Layout) -> bool:
        """True when `layout` cuts exactly these tensors at exactly these offsets and every tensor is
        still backed by the buffer there (nobody replaced its data since `adopt`)."""
        if layout.slots is not self.layout.slots and _signature(layout) != self._signature:
            return False
        base = self.stream.data_ptr()
        return all(self._tensors[s.name].data_ptr() == base + s.offset and self._tensors[s.name].is_contiguous()
                   for s in layout.slots)

    def bucket(self, layout: Layout, index: int) -> "torch.Tensor":
        """The bytes of bucket `index` of `layout`: a view of the buffer (no copy)."""
        low = index * layout.bucket_bytes
        return self.stream[low:min(low + layout.bucket_bytes, layout.stream_bytes)]
