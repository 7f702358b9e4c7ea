"""The gradient hook of elastic hybrid replicas, and the step arithmetic every backend shares.

Owns: `GradientHook`, the one point where elastic hybrid replicas enter a training step, with what
it reports (`HybridShare`, `HybridGradients`); and `train_step`, which turns the gradients of one
step's W replicas into the update — the step's totals, the hook's calls in order, the data-parallel
sum, ÷ W, the rescale for hybrids that missed the deadline, the metric means — written once for
every backend. A backend supplies only what is its own (`StepBackend`): its micro-batched backward,
its gradient as one flat tensor, sums over its data-parallel group, writing the final gradient
back, and its optimizer step. Must not know: which backend runs, sockets, membership, Redis.
Torch is imported lazily.

One step on core rank r (D core data-parallel ranks, H active hybrids, W = D + H replicas,
N = loss tokens of the whole widened batch):

    hook.share() ─▶ dp_sum(tokens, replicas, sequences) = (N, W, S) ─▶ hook.start(N/W, W)
      ─▶ accumulate_gradients: backward of Σ loss / (N/W) ─▶ flat = flat_gradients()
      ─▶ hook.inject(flat): + each arrived hybrid gradient ─▶ dp_sum(missed tokens m)
      ─▶ dp_sum_gradients(flat) ─▶ ÷ W ─▶ × N/(N − m) if m > 0 ─▶ hook.deliver(flat)
      ─▶ set_flat_gradients(flat) ─▶ step_optimizer (clip, step) ─▶ metric sums: dp_sum ÷ W

Math: replica i contributes g_i = ∇ Σ_{t∈i} ℓ_t · W/N; Σ_i g_i / W = ∇ (Σ_t ℓ_t / N), the token
mean over the widened batch — exactly a plain data-parallel run over W replicas on the same
samples. A hybrid that misses the deadline is absent from the sum; the result is rescaled by
N / (N − m), m its loss tokens, so it stays the token mean over what was trained on. Metric sums
were divided by N/W like the loss, so their sum over replicas ÷ W is the token mean too. With no
hook and one rank (W = 1) the same code runs: every sum is a no-op and ÷ 1 is exact.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from libra.services.trainer.backend import TrainBatch
    from libra.services.trainer.config import TrainerConfig


@dataclass(frozen=True)
class HybridShare:
    """What the hybrid replicas attached to this core rank contribute to a step (known before it)."""

    loss_tokens: float = 0.0  # loss tokens of the slices handed to them
    sequences: int = 0
    replicas: int = 0  # hybrids of this rank in the step's manifest


@dataclass(frozen=True)
class HybridGradients:
    """What actually arrived before the deadline (the loss tokens of hybrids that missed it are missing)."""

    missing_tokens: float = 0.0
    metric_sums: dict[str, float] = field(default_factory=dict)


class GradientHook(abc.ABC):
    """The one hook point of elastic hybrid replicas in a training step (backend-neutral).

    `train_step` calls, on every core rank and in this order, inside one step:

        share()            before the step's token/replica totals are summed (they include it)
        start(tc, W)       once the totals are known: hand the hybrids their work (token_count tc = N/W)
        inject(flat)       after local backward, BEFORE the data-parallel sum: add the hybrids'
                           gradients into the flat float32 gradient in place (waits up to a deadline)
        deliver(flat, c)   after the sum and normalisation, before clipping: the final gradient
                           goes back to the hybrids, which clip and step like the core
    """

    @abc.abstractmethod
    def share(self) -> HybridShare:
        """This rank's hybrids' part of the step (zero when none is active)."""

    @abc.abstractmethod
    def start(self, token_count: float, replicas: int, config: TrainerConfig) -> None:
        """Send this step's slices to this rank's hybrids (they compute while the core does)."""

    @abc.abstractmethod
    def inject(self, flat_grad: Tensor) -> HybridGradients:
        """Add the arrived hybrid gradients into `flat_grad` (in place) before the data-parallel sum."""

    @abc.abstractmethod
    def deliver(self, reduced_grad: Tensor, config: TrainerConfig) -> None:
        """Give the final (summed, normalised, unclipped) gradient to the contributing hybrids."""


class StepBackend(Protocol):
    """What a training backend supplies to `train_step` (a hybrid replica calls the same methods)."""

    def accumulate_gradients(self, batch: TrainBatch, config: TrainerConfig, token_count: float) -> dict[str, float]:
        """Zeroed gradients, then every micro-batch's gradient of Σ token loss / token_count; metric sums."""

    def flat_gradients(self) -> Tensor:
        """This rank's gradient as one flat tensor (it may share storage with the backend's buffer)."""

    def dp_sum(self, values: Tensor) -> Tensor:
        """A few float64 counts summed over the core data-parallel ranks (returned on any device)."""

    def dp_sum_gradients(self, flat: Tensor) -> Tensor:
        """`flat` (from flat_gradients, hybrids added) summed over the core data-parallel ranks."""

    def set_flat_gradients(self, flat: Tensor) -> None:
        """Make `flat` the gradient the optimizer steps with (a no-op when it is the backend's buffer)."""

    def step_optimizer(self, config: TrainerConfig) -> Any:
        """Clip the gradients and take one optimizer step; returns the pre-clip norm."""


def train_step(backend: StepBackend, batch: TrainBatch, config: TrainerConfig,
               hook: GradientHook | None) -> dict[str, float]:
    """One optimizer step over this rank's `batch` and its hybrids' slices; returns the step's metrics."""
    started = time.perf_counter()
    share = hook.share() if hook is not None else HybridShare()
    tokens, replicas, sequences = backend.dp_sum(_counts(
        batch.loss_tokens + share.loss_tokens, 1 + share.replicas, len(batch) + share.sequences)).tolist()
    if tokens == 0:
        raise ValueError("train_step: the batch has no loss tokens (every loss_mask is 0)")
    replicas = int(round(replicas))
    if hook is not None:
        hook.start(tokens / replicas, replicas, config)
    sums = backend.accumulate_gradients(batch, config, token_count=tokens / replicas)
    _reduce(backend, hook, tokens, replicas, sums, config)
    grad_norm = backend.step_optimizer(config)
    names = sorted(sums)
    values = backend.dp_sum(_counts(*(sums[name] for name in names))).tolist()
    result = {name: value / replicas for name, value in zip(names, values)}
    result.update(grad_norm=float(grad_norm), tokens=tokens, lr=config.lr, sequences=sequences,
                  seconds=time.perf_counter() - started)
    return result


def _reduce(backend: StepBackend, hook: GradientHook | None, tokens: float, replicas: int,
            sums: dict[str, float], config: TrainerConfig) -> None:
    """Hybrids' gradients in, the sum over the core ranks ÷ W (rescaled if a hybrid missed), the
    final gradient out to the hybrids and back into the backend."""
    flat = backend.flat_gradients()
    arrived = HybridGradients()
    if hook is not None:
        arrived = hook.inject(flat)
        for name, value in arrived.metric_sums.items():
            sums[name] += value
    # Summed on every rank (also without a hook): each rank rescales alike, and the ranks'
    # collectives stay the same whatever their hybrids did.
    (missing,) = backend.dp_sum(_counts(arrived.missing_tokens)).tolist()
    flat = backend.dp_sum_gradients(flat)
    flat /= replicas
    if missing > 0:
        flat *= tokens / (tokens - missing)
    if hook is not None:
        hook.deliver(flat, config)
    backend.set_flat_gradients(flat)


def _counts(*values: float) -> Tensor:
    import torch

    return torch.tensor([float(v) for v in values], dtype=torch.float64)
