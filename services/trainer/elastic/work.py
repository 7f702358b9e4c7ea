"""Work for hybrids: how many groups a step takes and which replica trains which (pure).

With D core data-parallel ranks and H active hybrids, every replica gets the same share of whole
GRPO groups, s = groups_per_step / D, so the step consumes s × (D + H) groups: the core's batch
widened by the hybrids' share. Advantages are computed over the whole widened batch before it is
split (they are per group, and groups are never split across replicas). Replicas take contiguous
blocks of groups in manifest order: core-0 … core-{D-1}, then the hybrids by replica id — so a
hybrid attached to any core rank gets its own slice, not only hybrids of the first.

A slice travels to its hybrid in the `step` frame's header as `slice_to_wire` packs it: the
per-token lists as base64 of little-endian arrays (int32 ids, int8 mask, float64 log-probs,
exact), not JSON lists: 5× faster to encode on the core's critical path
(`benchmarks/slice_encoding.py`; docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import itertools
from typing import Any

from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.elastic.manifest import StepManifest


def group_share(groups_per_step: int, core_ranks: int) -> int:
    if core_ranks < 1:
        raise ValueError(f"core_ranks must be >= 1, got {core_ranks}")
    if groups_per_step % core_ranks:
        raise ValueError(f"trainer.groups_per_step ({groups_per_step}) must be a multiple of the core "
                         f"data-parallel size ({core_ranks}) so every replica trains the same number of groups")
    return groups_per_step // core_ranks


def widened_groups(groups_per_step: int, manifest: StepManifest) -> int:
    """Groups a step consumes: the core's groups_per_step plus one share per active hybrid."""
    return group_share(groups_per_step, manifest.core_ranks) * manifest.replicas


def split(batch: TrainBatch, group_size: int, manifest: StepManifest) -> dict[str, TrainBatch]:
    """Whole groups per replica, keyed by "core-<rank>" and by hybrid replica id."""
    sequences = batch.sequences
    replicas = manifest.active_ids
    if len(sequences) % (group_size * len(replicas)):
        raise ValueError(f"split: {len(sequences)} sequences are not {len(replicas)} replicas × whole groups "
                         f"of {group_size}")
    per_replica = len(sequences) // len(replicas)
    return {replica: TrainBatch(sequences[i * per_replica : (i + 1) * per_replica])
            for i, replica in enumerate(replicas)}


def slice_to_wire(sequences: list[TrainSequence]) -> dict[str, Any]:
    """A slice's sequences as a JSON-safe dict (`slice_from_wire` inverts it exactly)."""
    import numpy as np

    def packed(values: Any, dtype: Any, count: int) -> str:
        array = np.fromiter(itertools.chain.from_iterable(values), dtype=dtype, count=count)
        return base64.b64encode(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()).decode()

    tokens = sum(len(s.token_ids) for s in sequences)
    response = sum(len(s.loss_mask) for s in sequences)
    return {"lengths": [len(s.token_ids) for s in sequences], "prompt_lengths": [s.prompt_length for s in sequences],
            "advantages": [s.advantage for s in sequences],
            "token_ids": packed((s.token_ids for s in sequences), np.int32, tokens),
            "loss_mask": packed((s.loss_mask for s in sequences), np.int8, response),
            "behaviour_logprobs": packed((s.behaviour_logprobs for s in sequences), np.float64, response)}


def slice_from_wire(wire: dict[str, Any]) -> list[TrainSequence]:
    import numpy as np

    def unpacked(key: str, dtype: str) -> list:
        return np.frombuffer(base64.b64decode(wire[key]), dtype=np.dtype(dtype)).tolist()

    ids, masks, logprobs = unpacked("token_ids", "<i4"), unpacked("loss_mask", "<i1"), unpacked("behaviour_logprobs", "<f8")
    out, at, at_response = [], 0, 0
    for length, prompt, advantage in zip(wire["lengths"], wire["prompt_lengths"], wire["advantages"]):
        response = length - prompt
        out.append(TrainSequence(ids[at:at + length], prompt, masks[at_response:at_response + response],
                                 logprobs[at_response:at_response + response], advantage))
        at, at_response = at + length, at_response + response
    return out
