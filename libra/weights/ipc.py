"""Colocated weights: policy versions between processes on one GPU through CUDA IPC handles.

When the trainer and an engine share a GPU (one-GPU machines, verl-style colocated runs), a
version needs neither an NCCL group between two processes on one device nor the disk: the
trainer lays the version out in an export buffer of its own (the weights group's byte stream,
libra/weights/layout.py), and the engine opens that buffer through its CUDA IPC handle.

    trainer (rank 0 of its GPU)                          hf engine (same GPU, another process)
    ───────────────────────────                          ─────────────────────────────────────
    ColocatedExport: 1 or 2 uint8 buffers (once),         open_buffers: cudaIpcOpenMemHandle (once
      their IPC handles exported once                       per buffer, cached)
    write(v): HF tensors ─D2D copy─▶ buffer[v % n],       share: every parameter becomes a view of
      synchronised                                          buffer[v % 2] (no copy; own memory freed)
    descriptor(v) ─ UpdateWeights(colocated=JSON) ─▶      copy:  buffer ─one D2D memcpy─▶ its own
      gateway ─ /collective_rpc ──────────────────▶         parameters (laid out flat once)

Two modes (`weights.mode`):
- share: two export buffers, version v in buffer v % 2. The engine serves v straight from the
  trainer's memory; the trainer writes v + 1 into the other buffer, and writes buffer v % 2
  again only for v + 2, after the engine confirmed v + 1 (publish waits for that): the buffer an
  engine decodes from is never written under it.
- copy: one export buffer; the engine copies it into its own parameters before confirming, so
  the trainer may overwrite it for the next version.

The descriptor is plain JSON (no pickle crosses an RPC): the layout, which buffer holds the
version, and per buffer the fields of torch's own CUDA IPC reduction (`reduce_tensor`), bytes in
base64. A buffer must stay alive while an engine has it open: the export lives as long as the
trainer's publisher. In share mode an engine's weights are the trainer's memory: a trainer that
exits takes them along (restart both). Pure torch; no torch.distributed, no HTTP.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any, Iterable

from libra.errors import FailedPrecondition
from libra.weights.layout import Layout, plan_layout

if TYPE_CHECKING:
    import torch

MODES = ("share", "copy")
NEEDS = "weights: colocated needs CUDA on the trainer and an hf engine on the same GPU"
STREAM_BUCKET = 1 << 30  # the layout's bucket size: unused here (nothing is broadcast), any multiple of 16


def check_cuda() -> None:
    """Refuse colocated weights where the trainer has no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise FailedPrecondition(f"{NEEDS}; this machine has no CUDA device (use weights: disk or group)")


def slots(mode: str) -> int:
    """Export buffers a mode needs: two for share (the engine decodes from one while the other is
    written), one for copy."""
    if mode not in MODES:
        raise ValueError(f"colocated weights mode must be one of {MODES}, got {mode!r}")
    return 2 if mode == "share" else 1


class ColocatedExport:
    """The trainer's export buffers of one tensor set (names, shapes, dtypes fixed at creation)."""

    def __init__(self, named: Iterable[tuple[str, "torch.Tensor"]], mode: str, device: Any):
        import torch

        check_cuda()
        self.mode = mode
        self.layout = plan_layout(((n, t) for n, t in named), 0, STREAM_BUCKET)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise FailedPrecondition(f"{NEEDS}; the trainer's weights are on {self.device}")
        self.buffers = [torch.empty(self.layout.stream_bytes, dtype=torch.uint8, device=self.device)
                        for _ in range(slots(mode))]
        self.handles = [export_handle(buffer) for buffer in self.buffers]  # once: each export counts a reference
        self._layout_json = self.layout.to_json()

    def fits(self, named: list[tuple[str, "torch.Tensor"]]) -> bool:
        """True when `named` is the tensor set the buffers were laid out for (same names, shapes, dtypes)."""
        return [(s.name, tuple(s.shape), s.dtype) for s in self.layout.slots] == [
            (n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]

    def write(self, named: list[tuple[str, "torch.Tensor"]], version: int) -> str:
        """Copy `named` into the buffer of `version` and wait for the copies; returns the descriptor
        (JSON) that UpdateWeights carries to the engines."""
        import torch

        if not self.fits(named):
            raise ValueError("colocated weights: the tensor set changed since the export buffers were laid out")
        slot = version % len(self.buffers)
        stream = self.buffers[slot]
        with torch.no_grad():
            for entry, (_, tensor) in zip(self.layout.slots, named):
                view = stream[entry.offset:entry.offset + entry.nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach())
        torch.cuda.synchronize(self.device)  # the engine reads the buffer once it hears of the version
        return json.dumps({"version": int(version), "mode": self.mode, "slot": slot, "layout": self._layout_json,
                           "buffers": self.handles})


def export_handle(buffer: "torch.Tensor") -> dict[str, Any]:
    """A JSON-safe CUDA IPC handle of a 1-D uint8 CUDA tensor (torch's own reduction, unpickled)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("export_handle: a 1-D uint8 CUDA tensor")
    _, args = reduce_tensor(buffer)
    (_, size, _, offset, _, _, device, handle, storage_bytes, storage_offset, _, counter, counter_offset,
     event, event_sync) = args
    return {"device": int(device), "numel": int(size[0]), "offset": int(offset), "handle": _b64(handle),
            "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset),
            "counter": _b64(counter), "counter_offset": int(counter_offset), "event": _b64(event),
            "event_sync": bool(event_sync)}


def open_handle(entry: dict[str, Any]) -> "torch.Tensor":
    """The tensor an `export_handle` describes, opened in this process (another than the exporter's)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([entry["numel"]]), (1,), entry["offset"], torch.UntypedStorage, torch.uint8,
        entry["device"], _bytes(entry["handle"]), entry["storage_bytes"], entry["storage_offset"], False,
        _bytes(entry["counter"]), entry["counter_offset"], _bytes(entry["event"]), entry["event_sync"])


def parse(descriptor: str) -> tuple[int, str, int, Layout, list[dict[str, Any]]]:
    """(version, mode, slot, layout, buffer handles) of a descriptor; ValueError names what is wrong."""
    try:
        raw = json.loads(descriptor)
        version, mode, slot = int(raw["version"]), str(raw["mode"]), int(raw["slot"])
        layout, buffers = Layout.from_json(raw["layout"]), list(raw["buffers"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"colocated weights: malformed descriptor ({type(error).__name__}: {error})") from None
    if mode not in MODES or not 0 <= slot < len(buffers) or len(buffers) != slots(mode):
        raise ValueError(f"colocated weights: descriptor of mode {mode!r} with {len(buffers)} buffers, slot {slot}")
    return version, mode, slot, layout, buffers


def views(stream: "torch.Tensor", layout: Layout) -> dict[str, "torch.Tensor"]:
    """Every tensor of `layout` as a view of `stream` (no copy)."""
    import torch

    return {s.name: stream[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in layout.slots}


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)
