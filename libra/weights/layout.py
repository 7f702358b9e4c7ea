"""How one policy version's tensors are laid out for the weights group (libra/weights/group.py).

Tensors of at least `direct_bytes` are broadcast on their own; the rest form one virtual byte
stream (each tensor 16-byte aligned) cut into fixed-size buckets. The layout travels as JSON in
the version's handshake, so both sides cut the same bytes the same way. Pure: no torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch

ALIGN = 16  # bytes; every tensor starts at a multiple, so a bucket slice can be viewed as any dtype
# Tensors this big are broadcast on their own (no pack/unpack copy); None: every tensor through the
# buckets, the faster choice measured on H200 (libra/weights/group.py's docstring).
DEFAULT_DIRECT_BYTES: int | None = None
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


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

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "bucket_bytes": self.bucket_bytes, "slots": _rows(self.slots)})

    @staticmethod
    def from_json(text: str) -> "Layout":
        raw = json.loads(text)
        return Layout(raw["version"], raw["bucket_bytes"], _slots(raw["slots"]))


def _rows(slots: tuple[TensorSlot, ...]) -> list[list]:  # offset -1 marks a direct tensor
    return [[s.name, list(s.shape), s.dtype, s.offset, s.nbytes] for s in slots]


def _slots(rows: list[list]) -> tuple[TensorSlot, ...]:
    return tuple(TensorSlot(n, tuple(shape), d, o, b) for n, shape, d, o, b in rows)


def slots_to_json(slots: tuple[TensorSlot, ...]) -> str:
    """The slots as JSON; what `slots_digest` names."""
    return json.dumps(_rows(slots))


def slots_from_json(text: str) -> tuple[TensorSlot, ...]:
    return _slots(json.loads(text))


def slots_digest(text: str) -> str:
    """A short name for a slots JSON: versions of the same tensor set share it (sent once per generation)."""
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


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
