"""Which training layouts a plan may use: the rules that do not depend on cost (the GPUs each side
must keep, whole nodes, a batch of whole GRPO groups, every data-parallel replica given groups,
evenly unless `uneven_splits_up_to` allows otherwise). They change with how a batch is divided
among replicas, not with how the search (search.py) enumerates and prunes; the search, the
shortlist of moves (shortlist.py) and the colocated simulator (sim/colocated.py) all ask them.

Must not know: costs, the trace, Redis or RPCs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from libra.services.planner import placement

if TYPE_CHECKING:
    from libra.services.planner.search import SearchConfig


def layout_filter(gpus: int, dp: int, batch: int, per_node: int, whole: bool, config: "SearchConfig") -> str:
    """Why a training layout of `gpus` GPUs in `dp` replicas is not allowed, or "" when it is."""
    if gpus < config.min_train_gpus:
        return f"fewer than min_train_gpus={config.min_train_gpus} for training"
    if config.total_gpus - gpus < config.min_rollout_gpus:
        return f"fewer than min_rollout_gpus={config.min_rollout_gpus} left for rollout"
    if whole:
        rule = placement.whole_node_rule(gpus, config.total_gpus, per_node)
        if rule:
            return rule
    if batch % config.group_size:
        return f"a batch of {batch} is not whole GRPO groups of {config.group_size}"
    return data_parallel_rule(dp, batch, config)


def data_parallel_rule(dp: int, batch: int, config: "SearchConfig") -> str:
    """Why `dp` replicas cannot split a batch of `batch` sequences (whole GRPO groups), or "": every
    replica needs a group, and the groups divide evenly unless `uneven_splits_up_to` allows otherwise."""
    groups = batch // config.group_size
    if groups < dp:
        return f"a DP replica would get no GRPO group of {config.group_size} in a batch of {batch}"
    if groups % dp and config.total_gpus > config.uneven_splits_up_to:
        return (f"a DP replica would train more groups of {config.group_size} than another "
                f"(uneven_splits_up_to={config.uneven_splits_up_to})")
    return ""
