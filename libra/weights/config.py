"""The run config's `weights:` section: how each policy version travels from the trainer to the
rollout workers. A union on `type` (the trainer and the rollout gateway read the same section):

    weights: disk                 every version is written as safetensors under RUN_DIR/weights/vN
                                  and every worker loads it from there
    weights: {type: group, backend: gloo, bucket_mb: 256, disk_every: 1, ...}
                                  every version is broadcast over the weights group (NCCL on GPUs,
                                  gloo on CPU); the disk copy leaves the critical path (below)

    weights: {type: colocated, mode: share, disk_every: 1}
                                  the trainer and the hf engines share a GPU: every version goes
                                  through CUDA IPC handles of the trainer's export buffer
                                  (libra/weights/ipc.py), no NCCL group and no disk on the way

In group and colocated modes the disk copy is the fallback and the durable record: the version a trainer
publishes at its start (rollout starts its workers on it), every `disk_every`-th version (written
in the background, while the next batch is collected), and any version a worker could not get
over the group (written then, on demand, and sent again with its path). A worker that starts
later loads the newest version on disk and reports it until the next version reaches it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from libra.configbase import Section, check_address, tagged_union


class DiskWeights(Section):
    """Every version through the disk: written under RUN_DIR/weights/vN, loaded by every worker."""

    type: Literal["disk"] = Field("disk", description="disk: safetensors under RUN_DIR/weights/vN")


class GroupWeights(Section):
    """Every version over the weights group (trainer = rank 0, one rank per worker TP rank)."""

    type: Literal["group"] = Field("group", description="group: a broadcast from the trainer to every worker")
    address: str = Field("127.0.0.1:29610", description="HOST:PORT of the weights group's store (hosted by the trainer)")
    backend: Literal["nccl", "gloo"] = Field("gloo", description="collective backend (nccl: GPU workers; gloo: CPU)")
    bucket_mb: int = Field(256, ge=1, le=16384, description="bucket size of the broadcast (MiB)")
    sync_timeout_s: float = Field(120.0, gt=0, le=7200,
                                  description="time a worker may take to join one version's broadcast")
    disk_every: int = Field(
        1, ge=0, le=1_000_000,
        description="also write every K-th version to RUN_DIR/weights/vN, in the background (what restarted and "
                    "newly started workers load); 0: only the first version and those a worker missed")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value, "weights.address")


class ColocatedWeights(Section):
    """Every version through CUDA IPC handles: trainer and hf engines on one GPU (libra/weights/ipc.py)."""

    type: Literal["colocated"] = Field("colocated", description="colocated: the trainer's export buffer, opened "
                                                                "by the hf engines on the same GPU")
    mode: Literal["share", "copy"] = Field(
        "share", description="share: the engines' parameters are views of the trainer's buffer (two buffers, "
                             "alternating by version: no copy, and no weights of the engine's own); copy: one "
                             "buffer, each engine copies it into its own parameters (one device copy)")
    sync_timeout_s: float = Field(120.0, gt=0, le=7200, description="time an engine may take to take one version")
    disk_every: int = Field(
        1, ge=0, le=1_000_000,
        description="also write every K-th version to RUN_DIR/weights/vN, in the background (what restarted and "
                    "newly started workers load); 0: only the first version and those a worker missed")


WeightsConfig = tagged_union("weights", DiskWeights, GroupWeights, ColocatedWeights, default="disk")
"""The `weights` section: `disk` (default), `group` or `colocated`; `weights: group` is short for `{type: group}`."""
