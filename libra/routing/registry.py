"""The policy registry: `make_policy` builds the configured routing policy.

It is the only module that knows every policy; the policies know only `policy.py` below them.
The clairvoyant heuristic is registered (so its name is taken and its error is clear) but never
built here: it needs the simulator's knowledge of the future, and the evaluation builds it by hand.
"""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.routing.baselines import LAMLFQ, Clairvoyant, LengthAware, LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.config import RoutingConfig
from libra.routing.policy import Policy
from libra.routing.prefix_tree import PrefixForest
from libra.routing.signatures import SizeThresholds

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (LoadBalance, CMLFQ, LengthAware, LAMLFQ, Clairvoyant)}
BUCKET_POLICIES = ("cmlfq", "length_aware", "la_mlfq")


def make_policy(config: RoutingConfig, buckets: list[tuple[str, int]] | None = None) -> Policy:
    """Build the configured policy; the bucket policies also need the buckets as (name, max_tokens)."""
    policy, kind = config.policy, config.policy.type
    if kind == "clairvoyant":
        raise InvalidArgument("scheduler.policy clairvoyant knows each trajectory's true remaining output: it is "
                              "for evaluation only (benchmarks/scheduler_eval.py); choose cmlfq or la_mlfq")
    if kind not in POLICIES:
        raise InvalidArgument(f"unknown scheduler policy {kind!r}; choose one of {sorted(POLICIES)}")
    if kind in BUCKET_POLICIES and not buckets:
        raise InvalidArgument(f"scheduler.policy {kind} needs the bucket list (planner.buckets)")
    if kind == "cmlfq":
        forest = PrefixForest(policy.min_visits, policy.p90_window, policy.max_prompt_trees, policy.max_tree_nodes)
        thresholds = SizeThresholds(policy.tool_small_max_tokens, policy.tool_medium_max_tokens)
        return CMLFQ(config.per_worker_cap_tokens, config.affinity, buckets, forest, thresholds,
                     policy.max_moves, policy.start_spill_factor, policy.min_visits_down)
    if kind == "la_mlfq":
        return LAMLFQ(config.per_worker_cap_tokens, config.affinity, buckets, policy.max_history)
    if kind == "length_aware":
        return LengthAware(config.per_worker_cap_tokens, config.affinity, buckets)
    return LoadBalance(config.per_worker_cap_tokens, config.affinity)
