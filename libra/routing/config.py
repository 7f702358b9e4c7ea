"""Which routing policy runs and its limits: the typed config of `libra.routing`.

The scheduler service's config (`scheduler:` in a run config) is this config; the planner's
simulator builds one per simulated run. It knows nothing of workers or traces.

The policy is a union on its `type`, each variant with only the settings it uses::

    scheduler:
      policy: cmlfq                 # short for {type: cmlfq}: every C-MLFQ setting at its default
      per_worker_cap_tokens: 2500   # every policy has the cap and affinity
    scheduler:
      policy: {type: cmlfq, min_visits: 5, max_moves: 2}
    scheduler:
      policy: {type: la_mlfq, max_history: 5000}

A setting of another policy (`min_visits` under load_balance) is an error naming the policy it
belongs to, and so is one written beside `policy` rather than in it (the layout before the union).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from libra.configbase import Section, tagged_union


class LoadBalancePolicy(Section):
    """load_balance: the serving worker with the fewest outstanding tokens, rotating among ties."""

    type: Literal["load_balance"] = Field("load_balance", description="policy type")


class LengthAwarePolicy(Section):
    """length_aware: the bucket that fits the turn's prompt length."""

    type: Literal["length_aware"] = Field("length_aware", description="policy type")


class LaMlfqPolicy(Section):
    """la_mlfq: start short (or where the prompt's history says), demote as output grows."""

    type: Literal["la_mlfq"] = Field("la_mlfq", description="policy type")
    max_history: int = Field(10_000, ge=1, le=10_000_000,
                             description="prompts kept in the history table (least recently finished evicted)")


class CmlfqPolicy(Section):
    """cmlfq: bucket levels from the prompt's history, work done and tool-outcome prefixes (C-MLFQ)."""

    type: Literal["cmlfq"] = Field("cmlfq", description="policy type")
    tool_small_max_tokens: int = Field(256, ge=0, le=10_000_000,
                                       description="tool payloads up to this many tokens are 'small'")
    tool_medium_max_tokens: int = Field(2048, ge=1, le=10_000_000,
                                        description="tool payloads up to this many tokens are 'medium', above 'large'")
    min_visits: int = Field(3, ge=1, le=1_000_000,
                            description="finished trajectories a prefix needs before it can move one")
    p90_window: int = Field(64, ge=1, le=4096, description="observations per prefix-tree node kept for the p90")
    max_prompt_trees: int = Field(10_000, ge=1, le=10_000_000,
                                  description="per-prompt trees kept (least recently learned evicted)")
    max_tree_nodes: int = Field(250_000, ge=16, le=100_000_000,
                                description="nodes a prefix tree may hold; one that grows past it keeps its most "
                                "visited half (bounds memory and the stored blob: 0.3-0.75 KB per node)")
    min_visits_down: int = Field(20, ge=1, le=1_000_000,
                                 description="finished trajectories a prefix needs before it can move one to a "
                                 "shorter bucket (a long trajectory on a slow bucket costs more than the reverse)")
    max_moves: int = Field(4, ge=0, le=1000,
                           description="tool-outcome moves after which a trajectory is pinned against the tree "
                           "(hysteresis; work done still moves it up)")
    start_spill_factor: float = Field(2.0, ge=0, le=1000,
                                      description="a new trajectory of a prompt never seen starts in a longer bucket "
                                      "when the shortest bucket's least loaded worker carries more than this many "
                                      "times the load of that bucket's least loaded worker (0: always start shortest)")

    @model_validator(mode="after")
    def _spill_factor_is_off_or_at_least_one(self) -> "CmlfqPolicy":
        if 0 < self.start_spill_factor < 1:
            raise ValueError(f"scheduler.policy.start_spill_factor must be 0 (off) or >= 1, got "
                             f"{self.start_spill_factor}: below 1 a new trajectory would leave the shortest bucket "
                             "even when it is less loaded")
        return self

    @model_validator(mode="after")
    def _down_needs_at_least_min_visits(self) -> "CmlfqPolicy":
        # left at its default it is simply at least min_visits (a thinner prefix moves nothing anyway)
        if "min_visits_down" in self.model_fields_set and self.min_visits_down < self.min_visits:
            raise ValueError(f"scheduler.policy.min_visits_down ({self.min_visits_down}) must be >= "
                             f"scheduler.policy.min_visits ({self.min_visits}): a prefix below min_visits moves "
                             "nothing, so a smaller min_visits_down would never apply")
        return self

    @model_validator(mode="after")
    def _size_thresholds_ordered(self) -> "CmlfqPolicy":
        if self.tool_medium_max_tokens <= self.tool_small_max_tokens:
            raise ValueError(f"scheduler.policy.tool_medium_max_tokens ({self.tool_medium_max_tokens}) must be "
                             f"greater than scheduler.policy.tool_small_max_tokens ({self.tool_small_max_tokens})")
        return self


POLICY_VARIANTS = (LoadBalancePolicy, CmlfqPolicy, LengthAwarePolicy, LaMlfqPolicy)
PolicyConfig = tagged_union("scheduler.policy", *POLICY_VARIANTS)
"""The `scheduler.policy` section: one policy and its settings (a bare name is short for `{type: NAME}`)."""


class RoutingConfig(Section):
    """Routing policy and its limits (each policy's own settings live in `policy`)."""

    policy: PolicyConfig = Field(
        default_factory=LoadBalancePolicy,
        description="routing policy (load_balance: least outstanding tokens; cmlfq: bucket levels from the "
                    "prompt's history, work done and tool-outcome prefixes; length_aware: bucket fitting the prompt "
                    "length; la_mlfq: start short, demote as output grows, per-prompt history)")
    per_worker_cap_tokens: int = Field(1_000_000, ge=1,
                                       description="outstanding tokens above which a worker is skipped if another has room")
    affinity: bool = Field(True, description="keep a trajectory on its worker between turns (prefix cache)")

    @model_validator(mode="before")
    @classmethod
    def _policy_settings_inside_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        chosen = data.get("policy")
        chosen = chosen.get("type") if isinstance(chosen, dict) else chosen
        for key in data:
            if chosen == "la_mlfq" and key == "max_prompt_trees":  # its name before the union
                raise ValueError("scheduler.max_prompt_trees of la_mlfq is now its history size: write "
                                 "scheduler.policy: {type: la_mlfq, max_history: ...}")
            owners = [v.model_fields["type"].default for v in POLICY_VARIANTS if key in v.model_fields]
            if key not in cls.model_fields and key != "type" and owners:
                raise ValueError(f"scheduler.{key} is a setting of policy {' or '.join(owners)}: write it inside "
                                 f"the policy, scheduler.policy: {{type: {owners[0]}, {key}: ...}}")
        return data
