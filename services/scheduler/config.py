"""Typed config of the scheduler service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from libra.configbase import Section


class SchedulerConfig(Section):
    """Routing policy and its limits (the C-MLFQ fields are ignored by load_balance)."""

    policy: Literal["load_balance", "cmlfq", "length_aware", "la_mlfq"] = Field(
        "load_balance", description="routing policy (load_balance: least outstanding tokens; "
                                    "cmlfq: bucket levels learned from tool-outcome prefixes; "
                                    "length_aware: bucket fitting the prompt length; "
                                    "la_mlfq: start short, demote as output grows, per-prompt history)")
    per_worker_cap_tokens: int = Field(1_000_000, ge=1,
                                       description="outstanding tokens above which a worker is skipped if another has room")
    affinity: bool = Field(True, description="keep a trajectory on its worker between turns (prefix cache)")
    tool_small_max_tokens: int = Field(256, ge=0, le=10_000_000,
                                       description="cmlfq: tool payloads up to this many tokens are 'small'")
    tool_medium_max_tokens: int = Field(2048, ge=1, le=10_000_000,
                                        description="cmlfq: tool payloads up to this many tokens are 'medium', above 'large'")
    min_visits: int = Field(3, ge=1, le=1_000_000,
                            description="cmlfq: finished trajectories a prefix needs before it can move one")
    p90_window: int = Field(64, ge=1, le=4096,
                            description="cmlfq: observations per prefix-tree node kept for the p90")
    max_prompt_trees: int = Field(10_000, ge=1, le=10_000_000,
                                  description="cmlfq: per-prompt trees kept (least recently learned evicted); "
                                              "la_mlfq: prompts kept in its history table")
    max_moves: int = Field(4, ge=0, le=1000,
                           description="cmlfq: bucket moves after which a trajectory is pinned (hysteresis)")
    start_spill_factor: float = Field(2.0, ge=0, le=1000,
                                      description="cmlfq: a new trajectory starts in a longer bucket when the "
                                      "shortest bucket's least loaded worker carries more than this many times "
                                      "the load of that bucket's least loaded worker (0: always start shortest)")

    @model_validator(mode="after")
    def _spill_factor_is_off_or_at_least_one(self) -> "SchedulerConfig":
        if 0 < self.start_spill_factor < 1:
            raise ValueError(f"scheduler.start_spill_factor must be 0 (off) or >= 1, got {self.start_spill_factor}: "
                             "below 1 a new trajectory would leave the shortest bucket even when it is less loaded")
        return self

    @model_validator(mode="after")
    def _size_thresholds_ordered(self) -> "SchedulerConfig":
        if self.tool_medium_max_tokens <= self.tool_small_max_tokens:
            raise ValueError(f"scheduler.tool_medium_max_tokens ({self.tool_medium_max_tokens}) must be greater "
                             f"than scheduler.tool_small_max_tokens ({self.tool_small_max_tokens})")
        return self
