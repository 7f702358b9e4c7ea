"""The arithmetic of asynchronous GRPO: group advantages, the clipped token-level loss, staleness.

Owns: turning group rewards into advantages, the per-token policy objective with truncated
importance weights for off-policy correction, and the admission rule that bounds staleness.
Must not know: models, optimizers, batches on disk or in Redis. Tensors in, tensors out; no I/O,
no clock, no randomness.

Three log-probabilities meet in the loss (all per response token):

    behaviour  ─ what the rollout worker reported when it sampled the token (policy version v_b,
                 recorded per token; exact: no token attends to KV of another version, so it is
                 what v_b's weights compute over the whole sequence, and w corrects for v_b alone)
    old        ─ the trainer's log-prob before this update (recomputed, or = behaviour)
    new        ─ the trainer's log-prob now, with gradient

    ratio = exp(new − old)                  clipped to [1 − clip_low, 1 + clip_high], PPO min
    w     = min(exp(old − behaviour), cap)  truncated importance weight, no gradient
    kl    = k3(new ‖ behaviour)             optional penalty, kl_coef
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # torch is imported where it computes: the trainer's service imports this module
    from torch import Tensor  # before its backend, and names the base model before paying for torch

EPS = 1e-6
# exp() of a log-ratio beyond this is already saturated for any sane clip; bounding it keeps a
# single corrupted behaviour log-prob from turning the whole batch into inf/nan.
MAX_LOG_RATIO = 20.0

T = TypeVar("T")


def group_advantages(
    rewards: Sequence[float] | Tensor, group_ids: Sequence[object] | Tensor, eps: float = EPS
) -> Tensor:
    """A_i = (r_i − mean of its group) / (std of its group + eps); exactly 0 in a zero-variance group.

    Group ids may be any hashable values. The std is the population std (divide by n), the usual
    GRPO choice; a group of one sample has zero variance and so zero advantage.
    """
    import torch

    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != r.numel():
        raise ValueError(f"group_advantages: {r.numel()} rewards but {len(ids)} group ids")
    index: dict[object, int] = {}
    groups = torch.tensor([index.setdefault(g, len(index)) for g in ids], dtype=torch.long)
    n_groups = len(index)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, r) / count
    centred = r - mean[groups]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups, centred**2) / count
    std = var.sqrt()[groups]
    # A constant group's mean can round away from its value (3 × 0.7 / 3 ≠ 0.7), leaving noise
    # that eps would not hide; decide "zero variance" on the rewards themselves: max == min.
    low = torch.full((n_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, groups, r, "amin")
    high = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, groups, r, "amax")
    varies = (high > low)[groups]
    adv = torch.where(varies, centred / (std + eps), torch.zeros_like(r))
    return adv.to(torch.float32)


def policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages_per_token: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    kl_coef: float = 0.0,
    *,
    token_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level clipped GRPO loss (to minimise) and its metrics; all inputs share one shape.

    Aggregation is DAPO-style: the sum over masked tokens divided by `token_count`, which defaults
    to the number of masked tokens here. A caller that splits a batch into micro-batches (or ranks)
    passes the token count of the whole batch so the accumulated gradient equals the batch's.
    Metrics are detached sums-over-tokens divided by the same count, so they add up the same way.
    """
    import torch

    _check_shapes(new_logprobs, old_logprobs, behaviour_logprobs, advantages_per_token, mask)
    m = mask.to(new_logprobs.dtype)
    denom = m.sum() if token_count is None else torch.as_tensor(token_count, dtype=m.dtype)
    denom = denom.clamp(min=1.0)
    old = old_logprobs.detach()
    behaviour = behaviour_logprobs.detach()
    adv = advantages_per_token.detach().to(new_logprobs.dtype)

    ratio = torch.exp((new_logprobs - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    tis = torch.exp((old - behaviour).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).clamp(max=tis_cap)
    per_token = -tis * surrogate
    kl = k3_kl(new_logprobs, behaviour)
    if kl_coef > 0:
        per_token = per_token + kl_coef * kl
    loss = (per_token * m).sum() / denom

    with torch.no_grad():
        # A token is "clipped" when the clipped branch won the min, i.e. its gradient is zero.
        was_clipped = (clipped * adv < ratio * adv).to(m.dtype)
        metrics = {
            "clip_fraction": (was_clipped * m).sum() / denom,
            "ratio_mean": (ratio * m).sum() / denom,
            "kl": (kl * m).sum() / denom,
            "tis_mean": (tis * m).sum() / denom,
        }
    return loss, metrics


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref): exp(ref − π) − (ref − π) − 1, always ≥ 0."""
    import torch

    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _check_shapes(*tensors: Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"policy_loss: all per-token inputs must share one shape, got {sorted(shapes)}")


def staleness(current_version: int, token_versions: Iterable[int]) -> int:
    """Policy-version lag of a trajectory: current version − the oldest version of any of its tokens."""
    versions = list(token_versions)
    if not versions:
        raise ValueError("staleness: a trajectory without token versions has no staleness")
    oldest = min(versions)
    if oldest > current_version:
        raise ValueError(f"staleness: token version {oldest} is newer than the current version {current_version}")
    return current_version - oldest


def admit(
    trajectories: Iterable[T],
    current_version: int,
    max_staleness: int,
    versions_of: Callable[[T], Iterable[int]] = lambda t: t.token_versions,  # type: ignore[attr-defined]
    group_of: Callable[[T], object] | None = None,
) -> tuple[list[T], list[T]]:
    """Split trajectories into (admitted, rejected): admitted ones have staleness ≤ max_staleness.

    Order is kept within each list. `versions_of` reads a trajectory's per-token policy versions
    (by default its `token_versions` attribute). With `group_of`, a group is admitted or rejected
    as a whole — one stale sample rejects its siblings — so only whole groups enter a batch.
    """
    if max_staleness < 0:
        raise ValueError(f"admit: max_staleness must be >= 0, got {max_staleness}")
    items = list(trajectories)
    fresh = [staleness(current_version, versions_of(t)) <= max_staleness for t in items]
    if group_of is not None:
        stale_groups = {group_of(t) for t, ok in zip(items, fresh) if not ok}
        fresh = [group_of(t) not in stale_groups for t in items]
    admitted = [t for t, ok in zip(items, fresh) if ok]
    rejected = [t for t, ok in zip(items, fresh) if not ok]
    return admitted, rejected
