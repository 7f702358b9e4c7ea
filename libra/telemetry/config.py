"""The run config's `telemetry:` section: what every service records about the run as it goes.

    telemetry:
      tensorboard: true              # event files in RUN_DIR/tensorboard/<service>/
      sample_s: 5                    # how often rollout and scheduler sample their state
      wandb: {project: libra, mode: offline}   # optional; needs `pip install wandb`

The run record (RUN_DIR/telemetry/<service>.jsonl) is always written: it is what `libra report`
reads. TensorBoard and Weights & Biases are views of the same values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libra.configbase import Section


class WandbConfig(Section):
    """Weights & Biases: one W&B run per service, grouped by the Libra run id (needs the wandb package)."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project the runs go to")
    entity: str = Field("", max_length=128, description="W&B entity (team or user); empty: your default entity")
    mode: Literal["online", "offline"] = Field(
        "offline", description="offline: write under RUN_DIR/wandb (upload later with `wandb sync`); online: stream")


class TelemetryConfig(Section):
    """The run record, TensorBoard event files and (optionally) Weights & Biases."""

    tensorboard: bool = Field(True, description="write TensorBoard event files to RUN_DIR/tensorboard/<service>/")
    sample_s: float = Field(5.0, ge=1.0, le=3600.0,
                            description="seconds between two samples of rollout throughput, turn latency, bucket "
                                        "occupancy and worker versions")
    wandb: WandbConfig | None = Field(None, description="log to Weights & Biases as well (null: off)")
