"""Tool-outcome signatures: the alphabet of C-MLFQ's causal prefix tree.

A tool return becomes the string `tool:size:status`:

- `tool` is the tool's name (a `:` inside it becomes `_`, so a signature always has three fields);
- `size` is `small`, `medium` or `large` from the payload's token count and two thresholds
  (`small` up to `small_max_tokens`, `medium` up to `medium_max_tokens`, `large` above);
- `status` is the *structured* outcome the workload reports (`success`, `failure`, `timeout`),
  never a guess from words such as "error" in free text.

This module knows nothing of workers, buckets or trees; it only names outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.errors import InvalidArgument

STATUSES = ("success", "failure", "timeout")
SIZES = ("small", "medium", "large")


@dataclass(frozen=True)
class SizeThresholds:
    """Payload token counts that split small from medium and medium from large."""

    small_max_tokens: int = 256
    medium_max_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.small_max_tokens < 0:
            raise InvalidArgument(f"small_max_tokens must be >= 0, got {self.small_max_tokens}")
        if self.medium_max_tokens <= self.small_max_tokens:
            raise InvalidArgument(f"medium_max_tokens ({self.medium_max_tokens}) must be greater than "
                                  f"small_max_tokens ({self.small_max_tokens})")


def size_class(payload_tokens: int, thresholds: SizeThresholds) -> str:
    """`small`, `medium` or `large` for a payload of `payload_tokens` tokens."""
    if payload_tokens < 0:
        raise InvalidArgument(f"payload_tokens must be >= 0, got {payload_tokens}")
    if payload_tokens <= thresholds.small_max_tokens:
        return "small"
    if payload_tokens <= thresholds.medium_max_tokens:
        return "medium"
    return "large"


def check_status(status: str) -> str:
    """The status itself if it is one of STATUSES; otherwise a ValueError saying which are allowed."""
    if status not in STATUSES:
        raise InvalidArgument(f"tool status must be one of {', '.join(STATUSES)} (the structured outcome "
                              f"the workload reports), got {status!r}")
    return status


def signature(tool: str, status: str, payload_tokens: int, thresholds: SizeThresholds) -> str:
    """The `tool:size:status` signature of one tool return."""
    if not tool:
        raise InvalidArgument("tool name is required to build a signature")
    check_status(status)
    return f"{tool.replace(':', '_')}:{size_class(payload_tokens, thresholds)}:{status}"
