"""What a request to the rollout gateway may ask for: pure checks, each raising InvalidArgument
that names the field (the servicer calls them before the service does any work).

Bounds: a SubmitPrompts carries at most MAX_GROUPS groups of at most MAX_SAMPLES samples and
MAX_TRAJECTORIES trajectories in all; a DrainWorker waits at most MAX_DRAIN_S; a StartWorkers
names valid buckets and leaves the gateway with at most security.limits.max_workers workers.
"""

from __future__ import annotations

import math
from typing import Sequence

from libra.errors import InvalidArgument
from libra.plans import check_bucket
from libra.v1 import common_pb2, rollout_pb2

MAX_GROUPS = 10_000
MAX_SAMPLES = 4096
MAX_TRAJECTORIES = 100_000
MAX_ID = 256
MAX_DRAIN_S = 3600.0


def _check_id(value: str, field: str) -> None:
    if not value or len(value) > MAX_ID:
        raise InvalidArgument(f"{field} is required: 1-{MAX_ID} characters, got {len(value)}")


def check_groups(groups: Sequence[rollout_pb2.PromptGroup]) -> None:
    if not groups:
        raise InvalidArgument("groups is required: submit at least one prompt group")
    if len(groups) > MAX_GROUPS:
        raise InvalidArgument(f"groups: at most {MAX_GROUPS} per request, got {len(groups)}")
    total = 0
    for group in groups:
        _check_id(group.group_id, "groups[].group_id")
        if not group.prompt_id.isdigit() or len(group.prompt_id) > 12:
            raise InvalidArgument(f"groups[{group.group_id[:40]}].prompt_id must be a prompt's index (digits), "
                                  f"got {group.prompt_id[:40]!r}")
        if not 1 <= group.samples <= MAX_SAMPLES:
            raise InvalidArgument(f"groups[{group.group_id[:40]}].samples must be in 1..{MAX_SAMPLES}, "
                                  f"got {group.samples}")
        total += group.samples
    if total > MAX_TRAJECTORIES:
        raise InvalidArgument(f"the groups hold {total} samples; at most {MAX_TRAJECTORIES} per request")


def drain_timeout(seconds: float) -> float:
    """DrainWorker's wait (0: the default, 60 s)."""
    if seconds == 0:
        return 60.0
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_DRAIN_S):
        raise InvalidArgument(f"timeout_seconds must be in (0, {MAX_DRAIN_S:.0f}] (0: 60 s), got {seconds}")
    return seconds


def check_start(buckets: Sequence[common_pb2.BucketSpec], running: int, max_workers: int) -> None:
    """A StartWorkers: valid buckets (at least one replica each), and `running` + the new workers
    within `max_workers` (security.limits.max_workers)."""
    if not buckets:
        raise InvalidArgument("buckets is required: name at least one bucket to start workers for")
    for index, bucket in enumerate(buckets):
        check_bucket(bucket, f"buckets[{index}]", replicas_from=1)
    wanted = sum(b.replicas for b in buckets)
    if running + wanted > max_workers:
        raise InvalidArgument(f"starting {wanted} workers beside the {running} running would exceed "
                              f"security.limits.max_workers ({max_workers})")
