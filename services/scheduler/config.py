"""Typed config of the scheduler service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libra.configbase import Section


class SchedulerConfig(Section):
    """Routing policy and its limits."""

    policy: Literal["load_balance"] = Field("load_balance",
                                            description="routing policy (load_balance: least outstanding tokens)")
    per_worker_cap_tokens: int = Field(1_000_000, ge=1,
                                       description="outstanding tokens above which a worker is skipped if another has room")
    affinity: bool = Field(True, description="keep a trajectory on its worker between turns (prefix cache)")
