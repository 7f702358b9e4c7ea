"""The economics of a plan change: what moving between two plans costs, and whether a gain pays for it.

`Replanner` (replan.py) decides when to search and which plan the search found; this module only
prices the move. It knows the cost model's plans (`search.Candidate`) and the model's sizes, not
triggers, gates, calibration or any clock.

Acceptance (per step: the predicted step time max(T_train, T_rollout) of the same recent trace
under the calibrated model, for the plan in force and for the best candidate):

    gain_s = (predicted_current_s - predicted_new_s) * horizon_steps
    net_s  = gain_s - transition_cost_s
    apply iff net_s > 0 and net_s / (predicted_current_s * horizon_steps) >= min_gain_ratio (+ margin)

(horizon_steps: at most the steps the run has left; margin: the replays' error measured on earlier
moves, audit.py)

Transition cost (`transition_cost_s`): the side that changes stalls while its GPUs drain, start
new processes and load state; both sides change in parallel, so the cost is the larger stall.
  training   layout changed: drain_s + process_start_s + (bf16 weights + fp32 master/Adam shard)
             per GPU / load_gbps          (a synchronous job: the whole side stalls)
  rollout    instances removed or added: (drain_s + process_start_s + weights per GPU / load_gbps)
             x the share of rollout GPUs whose instance changes (the others keep serving)
"""

from __future__ import annotations

from collections import Counter

from libra.services.planner.config import ReplanSettings
from libra.services.planner.hardware import ModelSpec
from libra.services.planner.search import Candidate


def transition_cost_s(old: Candidate | None, new: Candidate, model: ModelSpec, settings: ReplanSettings) -> float:
    """Seconds of lost progress when moving from `old` to `new` (see the module docstring)."""
    if old is None:
        return 0.0
    load_bps = settings.load_gbps * 1e9
    train = 0.0
    if old.layout != new.layout:
        l = new.layout
        state = model.total_params * (model.bytes_per_param + 12.0 / l.dp) / (l.tp * l.pp)
        train = settings.drain_s + settings.process_start_s + state / load_bps
    before, after = Counter(dict(old.rollout)), Counter(dict(new.rollout))
    added, removed = after - before, before - after
    changed = max(sum(tp * n for tp, n in added.items()), sum(tp * n for tp, n in removed.items()))
    rollout = 0.0
    if changed:
        # the narrowest new instance loads the most weight bytes per GPU (all load in parallel)
        per_gpu = model.weight_bytes / min(added) if added else 0.0
        share = min(1.0, changed / max(1, new.rollout_gpus, old.rollout_gpus))
        rollout = (settings.drain_s + settings.process_start_s + per_gpu / load_bps) * share
    return max(train, rollout)


def accept(current_s: float, new_s: float, cost_s: float, settings: ReplanSettings, horizon: int | None = None,
           margin: float = 0.0) -> tuple[bool, float, str]:
    """(apply?, gain_s, reason) of moving from a plan predicted at `current_s` per step to one at
    `new_s` at a transition cost of `cost_s` (the acceptance rule in the module docstring), the gain
    counted over `horizon` steps (default `horizon_steps`; the replanner passes fewer when the run
    ends sooner) and the ratio required raised by `margin` (the replays' measured error, audit.py)."""
    horizon = horizon or settings.horizon_steps
    gain = (current_s - new_s) * horizon
    net = gain - cost_s
    ratio = net / (current_s * horizon) if current_s > 0 else 0.0
    numbers = (f"predicted {current_s:.2f}s -> {new_s:.2f}s per step; gain {gain:.1f}s over {horizon} steps, "
               f"transition {cost_s:.1f}s, net {net:.1f}s ({ratio:.1%})")
    if net <= 0:
        return False, gain, f"not applied: gain does not pay for the transition ({numbers})"
    required = settings.min_gain_ratio + margin
    if ratio < required:
        why = (f"min_gain_ratio {settings.min_gain_ratio:.1%}" if not margin else
               f"min_gain_ratio {settings.min_gain_ratio:.1%} + the replays' measured error {margin:.1%}")
        return False, gain, f"not applied: net gain below {why} ({numbers})"
    return True, gain, f"applied: {numbers}"


PlanKey = tuple  # (tp, pp, dp, micro_batch, the rollout instances sorted): what makes two plans the same


def plan_key(plan: Candidate) -> PlanKey:
    """A plan's identity, hashable and JSON-able as a list (the audit keeps undone moves by it)."""
    l = plan.layout
    return (l.tp, l.pp, l.dp, l.micro_batch, tuple(sorted(tuple(pair) for pair in plan.rollout)))


def same_plan(a: Candidate, b: Candidate) -> bool:
    """True when moving from `a` to `b` changes nothing (same layout, same rollout instances)."""
    return plan_key(a) == plan_key(b)
