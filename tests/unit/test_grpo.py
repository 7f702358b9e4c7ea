"""Unit tests of the GRPO arithmetic: advantages, the clipped token-level loss, staleness."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from libra.services.trainer.grpo import admit, group_advantages, k3_kl, policy_loss, staleness

CLIP = dict(clip_low=0.2, clip_high=0.28, tis_cap=2.0)


def _loss(new, old=None, behaviour=None, adv=None, mask=None, **overrides):
    new = torch.as_tensor(new, dtype=torch.float32).requires_grad_(True)
    old = new.detach().clone() if old is None else torch.as_tensor(old, dtype=torch.float32)
    behaviour = old.clone() if behaviour is None else torch.as_tensor(behaviour, dtype=torch.float32)
    adv = torch.ones_like(old) if adv is None else torch.as_tensor(adv, dtype=torch.float32)
    mask = torch.ones_like(old) if mask is None else torch.as_tensor(mask, dtype=torch.float32)
    loss, metrics = policy_loss(new, old, behaviour, adv, mask, **{**CLIP, "kl_coef": 0.0, **overrides})
    loss.backward()
    return loss.detach(), metrics, new.grad


# ---- advantages ----------------------------------------------------------------------------
def test_advantages_known_values():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], ["a"] * 4)
    # mean 0.5, population std 0.5 → ±1 (up to eps)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    adv = group_advantages([3.0, 1.0, 2.0], [7, 7, 7])
    std = math.sqrt(2 / 3)
    assert torch.allclose(adv, torch.tensor([1 / std, -1 / std, 0.0]), atol=1e-5)


def test_zero_variance_group_gives_exact_zeros():
    adv = group_advantages([0.7, 0.7, 0.7, 0.1, 0.9], ["a", "a", "a", "b", "b"])
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3] < 0 < adv[4]


def test_groups_are_independent():
    alone = group_advantages([1.0, 2.0, 4.0], ["x"] * 3)
    mixed = group_advantages([100.0, 1.0, -5.0, 2.0, 4.0, 100.0], ["y", "x", "y", "x", "x", "z"])
    assert torch.allclose(mixed[[1, 3, 4]], alone)
    assert mixed[5] == 0.0  # a single-sample group has no variance


def test_advantages_accept_tensors_and_check_lengths():
    adv = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([3, 3]))
    assert adv[0] < 0 < adv[1]
    with pytest.raises(ValueError, match="group ids"):
        group_advantages([1.0, 2.0], ["a"])


# ---- loss ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_follows_advantage_sign_at_ratio_one(sign):
    loss, metrics, grad = _loss([-1.0, -2.0, -0.5], adv=[sign] * 3)
    # loss is minimised: a positive advantage pushes log-probs up, i.e. a negative gradient.
    assert torch.all(torch.sign(grad) == -sign)
    assert torch.allclose(grad, torch.full((3,), -sign / 3))
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    assert float(metrics["clip_fraction"]) == 0.0


def test_clipped_ratio_with_positive_advantage_has_zero_gradient():
    old = torch.tensor([-1.0, -1.0])
    new = old + torch.tensor([math.log(1.5), math.log(1.1)])  # ratio 1.5 (> 1.28, clipped), 1.1 (inside)
    _, metrics, grad = _loss(new, old=old, adv=[1.0, 1.0])
    assert grad[0] == 0.0
    assert grad[1] < 0
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)


def test_low_ratio_with_negative_advantage_is_clipped_but_not_the_other_way():
    old = torch.tensor([-1.0, -1.0])
    new = old + math.log(0.5)  # ratio 0.5 < 0.8
    _, _, grad = _loss(new, old=old, adv=[-1.0, 1.0])
    assert grad[0] == 0.0  # already pushed down past the clip: no more push
    assert grad[1] < 0  # positive advantage at a low ratio still learns (PPO min)


def test_masked_tokens_do_not_change_loss_or_gradient():
    mask = [1.0, 0.0, 1.0]
    base, _, grad = _loss([-1.0, -2.0, -3.0], old=[-1.1, -2.0, -2.9], adv=[0.5, 0.5, 0.5], mask=mask)
    moved, _, grad2 = _loss([-1.0, -9.0, -3.0], old=[-1.1, 4.0, -2.9], behaviour=[-1.1, -7.0, -2.9],
                            adv=[0.5, 99.0, 0.5], mask=mask)
    assert torch.allclose(base, moved)
    assert grad[1] == 0.0 and grad2[1] == 0.0
    assert torch.allclose(grad[[0, 2]], grad2[[0, 2]])


def test_token_level_mean_and_explicit_token_count():
    loss, _, _ = _loss([-1.0, -1.0, -1.0, -1.0], adv=[1.0, 1.0, 0.0, 0.0], mask=[1, 1, 1, 0])
    assert float(loss) == pytest.approx(-2 / 3)  # the mean is over the 3 masked tokens
    loss, _, grad = _loss([-1.0, -1.0], adv=[1.0, 1.0], token_count=8.0)
    assert float(loss) == pytest.approx(-2 / 8)
    assert torch.allclose(grad, torch.full((2,), -1 / 8))


def test_truncated_importance_weight_is_capped_and_detached():
    old = torch.tensor([-1.0, -1.0, -1.0])
    behaviour = old - torch.tensor([math.log(5.0), math.log(1.5), 0.0])  # w = 5 → capped at 2, 1.5, 1
    _, metrics, grad = _loss(old, old=old, behaviour=behaviour, adv=[1.0, 1.0, 1.0])
    assert torch.allclose(grad, -torch.tensor([2.0, 1.5, 1.0]) / 3)
    assert float(metrics["tis_mean"]) == pytest.approx(4.5 / 3)
    _, metrics, _ = _loss(old, old=old, behaviour=old + 3.0, adv=[1.0, 1.0, 1.0])
    assert float(metrics["tis_mean"]) == pytest.approx(math.exp(-3.0))  # down-weighting is not capped


def test_kl_penalty_pulls_towards_behaviour():
    assert torch.allclose(k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])), torch.zeros(1))
    assert k3_kl(torch.tensor([-0.5]), torch.tensor([-1.0])) > 0
    behaviour = torch.tensor([-1.0])
    _, metrics, grad = _loss([-0.5], old=[-0.5], behaviour=behaviour, adv=[0.0], kl_coef=1.0, tis_cap=1.0)
    assert grad[0] > 0  # new is above behaviour: the penalty pushes it back down
    assert float(metrics["kl"]) > 0
    _, _, grad_off = _loss([-0.5], old=[-0.5], behaviour=behaviour, adv=[0.0], kl_coef=0.0)
    assert grad_off[0] == 0.0


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.zeros(3), torch.ones(3), 0.2, 0.2, 2.0)


# ---- staleness and admission ---------------------------------------------------------------------
def test_staleness_is_lag_of_oldest_token():
    assert staleness(5, [5, 5, 5]) == 0
    assert staleness(5, [3, 4, 5]) == 2
    with pytest.raises(ValueError):
        staleness(5, [])
    with pytest.raises(ValueError, match="newer"):
        staleness(2, [3])


def _traj(name, versions, group="g"):
    return SimpleNamespace(name=name, token_versions=versions, group=group)


def test_admit_splits_by_max_staleness_and_keeps_order():
    trajectories = [_traj("a", [4, 5]), _traj("b", [2, 5]), _traj("c", [5]), _traj("d", [3])]
    admitted, rejected = admit(trajectories, current_version=5, max_staleness=1)
    assert [t.name for t in admitted] == ["a", "c"]
    assert [t.name for t in rejected] == ["b", "d"]
    admitted, rejected = admit(trajectories, current_version=5, max_staleness=0)
    assert [t.name for t in admitted] == ["c"]


def test_admit_by_group_rejects_siblings_of_a_stale_sample():
    trajectories = [_traj("a1", [5], "a"), _traj("b1", [5], "b"), _traj("a2", [1], "a"), _traj("b2", [4], "b")]
    admitted, rejected = admit(trajectories, 5, 1, group_of=lambda t: t.group)
    assert [t.name for t in admitted] == ["b1", "b2"]
    assert [t.name for t in rejected] == ["a1", "a2"]
    with pytest.raises(ValueError):
        admit(trajectories, 5, -1)
