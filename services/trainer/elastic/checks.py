"""What the core checks of a hybrid: its gradient frame of a step, and lockstep of its parameters.

`param_digest` runs on both sides (the hybrid sends its digest with its gradient when the core
asks); `bad_gradient` is the core's verdict on one frame. Pure: no sockets, no process groups.
"""

from __future__ import annotations

from typing import Any

from libra.services.trainer.elastic.side_channel import CLOSED


def param_digest(model: Any) -> str:
    """A hash of every parameter's bytes: equal digests mean bitwise-equal replicas (lockstep check)."""
    import hashlib

    import torch

    digest = hashlib.blake2b(digest_size=16)
    for p in model.parameters():  # as raw bytes: numpy has no bfloat16
        digest.update(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def bad_gradient(frame: Any, step: int, numel: int, deadline_s: float, digest: str) -> str:
    """Why a hybrid's gradient frame of `step` cannot be used (empty: it can): missed deadline,
    closed connection, another step, another size, or parameters that left lockstep."""
    if frame is None:
        return f"missed the gradient deadline of {deadline_s} s in step {step}"
    if frame.kind == CLOSED:
        return f"the hybrid's connection closed during step {step}"
    if frame.header.get("step") != step:
        return f"sent the gradient of step {frame.header.get('step')} during step {step}"
    if frame.tensor().numel() != numel:
        return f"sent a gradient of {frame.tensor().numel()} values, expected {numel}"
    if digest and frame.header.get("param_digest") != digest:
        return f"its parameters diverged from the core's before step {step} (lockstep check)"
    return ""
