"""The training-backend interface, the batch it consumes, and the tensors that feed a model.

Owns: `TrainBackend` (what every backend — plain torch, Megatron-Core — must do),
`TrainSequence`/`TrainBatch` (one trajectory as the trainer sees it: token ids end to end, never
re-tokenised), how a batch is cut into micro-batches (`TrainBatch.plan`: a sequence count, or a
token budget filled first-fit-decreasing), `pack`, which turns one micro-batch into tensors on the
*target grid* (right-padded rows, or every sequence concatenated into one row), and the two ways a
backend writes files atomically (`write_weights_dir`, `atomic_torch_save`).
Must not know: Redis, gRPC, rollout workers, which backend is in use. Torch is imported lazily
so the control plane can import the dataclasses without it.

Target grid. A sequence of L tokens has L−1 next-token targets; the log-prob of token t comes
from the logits at t−1. Per-token tensors have shape (B, T−1) where column j is token j+1:

    tokens      p0  p1  p2  r0  r1  r2  <pad>       prompt_length = 3, response = r0 r1 r2
    target j        0   1   2   3   4   5
    response         .   .   ✓   ✓   ✓   .          loss_mask / behaviour / advantage live at ✓

Concatenated (packed) micro-batches are one row of every sequence back to back, no padding; the
same grid holds: the column that would score a sequence's first token from the previous
sequence's last is never a response column, and positions restart at 0 in each sequence
(`cu_seqlens` marks where each begins, for attention that stays inside its sequence):

    tokens      a0  a1  a2  b0  b1  b2  b3          cu_seqlens = (0, 3, 7)
    target j        0   1   2   3   4   5           column 2 (a2 → b0) crosses sequences: never ✓
    positions    0   1   2   0   1   2   3

Every per-token value lands in the same grid cell as when padded, the loss is the same sum over
the same tokens divided by the same count, so packing changes no arithmetic — only where the
padding's compute went.
"""

from __future__ import annotations

import abc
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from torch import Tensor

    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.gradient_hook import GradientHook


@dataclass(frozen=True)
class TrainSequence:
    """One trajectory: prompt + every later token (model turns and tool/environment tokens)."""

    token_ids: list[int]
    prompt_length: int  # tokens before the first generated token
    loss_mask: list[int]  # one per token after the prompt: 1 model-generated (trained), 0 tool/env
    behaviour_logprobs: list[float]  # aligned with loss_mask; ignored where the mask is 0
    advantage: float

    def __post_init__(self) -> None:
        response = len(self.token_ids) - self.prompt_length
        if self.prompt_length < 1:
            raise ValueError("TrainSequence.prompt_length must be >= 1 (token t is scored by the logits at t-1)")
        if response < 1:
            raise ValueError(f"TrainSequence has no tokens after its prompt of {self.prompt_length}")
        if len(self.loss_mask) != response or len(self.behaviour_logprobs) != response:
            raise ValueError(
                f"TrainSequence: loss_mask ({len(self.loss_mask)}) and behaviour_logprobs "
                f"({len(self.behaviour_logprobs)}) must both have len(token_ids) - prompt_length = {response} entries"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("TrainSequence.loss_mask entries must be 0 or 1")
        if not math.isfinite(self.advantage):
            raise ValueError(f"TrainSequence.advantage must be finite, got {self.advantage}")

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length


# What one more micro-batch costs, in padded tokens: a forward and backward pass has a fixed part
# besides its work per token. On the quickstart's model, one CPU thread, fitted with a term for
# attention's pairs (`benchmarks/padded_chunks.py --fit`, three runs on 12-05): 1.7-3.2 ms a
# micro-batch against 0.036-0.040 ms a padded token, 46-86 tokens, on the trainer's own pass and on
# transformers' model alike. The plans' CPU on recorded traces moved by under 2% between 24 and 128.
# Measured on CPU only: a GPU's fixed part per pass (kernel launches) is worth far more tokens, so
# there the plan keeps the fewest micro-batches (`micro_batch_cost`) until it is measured.
MICRO_BATCH_COST_TOKENS = 48


@dataclass(frozen=True)
class TrainBatch:
    """The sequences of one optimizer step (on this rank); whole GRPO groups, advantages already set."""

    sequences: list[TrainSequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def loss_tokens(self) -> int:
        """Tokens that carry loss: the denominator of the token-level mean."""
        return sum(sum(s.loss_mask) for s in self.sequences)

    def with_gradient(self, keep_one: bool = False) -> "TrainBatch":
        """The sequences with a non-zero advantage: with the policy term as the whole loss (no KL, no
        router loss), the only ones whose tokens add to the loss and its gradient. A group whose
        rewards are all equal has advantage 0 on every sequence (grpo.group_advantages), and
        -w min(r A, clip(r) A) is then 0 whatever the ratio r. The caller keeps the whole batch's
        `loss_tokens` as the token mean's denominator, so the update is the whole batch's.
        `keep_one`: never empty (the first sequence stays), for a backend whose step must run a
        micro-batch. The batch itself when nothing is left out."""
        kept = [s for s in self.sequences if s.advantage != 0.0]
        if not kept and keep_one and self.sequences:
            kept = [self.sequences[0]]
        return self if len(kept) == len(self.sequences) else TrainBatch(kept)

    def micro_batches(self, size: int) -> list[list[TrainSequence]]:
        """Chunks of at most `size` sequences of like length (`plan`; deterministic)."""
        return [[self.sequences[i] for i in indices] for indices in self.plan(size)]

    def plan(self, size: int, tokens: int = 0, chunk_cost: int | None = MICRO_BATCH_COST_TOKENS) -> list[list[int]]:
        """The micro-batches of this batch as lists of sequence indices (deterministic).

        `tokens` 0: chunks of at most `size` sequences of like length, cut where padding would cost
        more than a micro-batch does (`padded_chunks`, a micro-batch costing `chunk_cost` padded
        tokens; None: the fewest micro-batches, cut where they pad least): sorted shortest first, each
        chunk right-padded to its longest, so one long sequence no longer pads a chunk of `size` short
        ones (one 384-token sequence among 63 of ~40 tokens: 505 ms of CPU in fixed chunks of 16,
        134 ms so; benchmarks/padded_chunks.py). The policy loss is a sum over tokens, so its gradient
        does not depend on the chunks; an MoE's load-balancing loss, a statistic of each micro-batch,
        does, as it did on chunks in arrival order.
        `tokens` > 0: the token budget of a packed micro-batch: sequences, longest first, each into
        the first micro-batch with room for it (first-fit decreasing), a new one when none has; a
        sequence longer than the budget is a micro-batch of its own.
        """
        if size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {size}")
        if tokens < 0:
            raise ValueError(f"micro batch token budget must be >= 0, got {tokens}")
        lengths = [len(s.token_ids) for s in self.sequences]
        if not tokens:
            order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
            return [order[a:b] for a, b in padded_chunks([lengths[i] for i in order], size, chunk_cost)]
        bins: list[list[int]] = []
        room: list[int] = []
        for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            for slot, free in enumerate(room):
                if lengths[index] <= free:
                    bins[slot].append(index)
                    room[slot] -= lengths[index]
                    break
            else:
                bins.append([index])
                room.append(tokens - lengths[index])
        return bins


def micro_batch_cost(device: object, configured: int | None = None) -> int | None:
    """The `chunk_cost` of `TrainBatch.plan` for a trainer computing on `device` (a torch device or
    its name): `configured` (trainer.micro_batch_cost_tokens) if set, else MICRO_BATCH_COST_TOKENS
    on a CPU and None (the fewest micro-batches) on any other device."""
    if configured is not None:
        return configured
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    return MICRO_BATCH_COST_TOKENS if kind == "cpu" else None


def padded_chunks(lengths: list[int], size: int, chunk_cost: int | None = MICRO_BATCH_COST_TOKENS) -> list[tuple[int, int]]:
    """Cut `lengths` (ascending) into consecutive chunks [a, b) of at most `size`, minimising the
    padded tokens (each chunk's rows × its longest) plus `chunk_cost` a chunk: dynamic programming
    over the cut points, O(len × size). Ties go to fewer, larger chunks; so a batch of like lengths
    keeps chunks of `size`, and no chunk is wider or has more rows than the plain chunks of `size`
    had (their last holds the `size` longest). `chunk_cost` None: the fewest chunks (as many as the
    plain chunks), cut where they pad least (a chunk costs more than any padding can)."""
    n = len(lengths)
    if chunk_cost is None:
        chunk_cost = n * (lengths[-1] if lengths else 0) + 1
    best = [0] + [math.inf] * n  # best[j]: the cheapest cut of the first j
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = lengths[j - 1]
        for a in range(max(0, j - size), j):  # widest chunk first: a tie keeps it
            cost = best[a] + chunk_cost + (j - a) * width
            if cost < best[j]:
                best[j], cut[j] = cost, a
    chunks = []
    j = n
    while j > 0:
        chunks.append((cut[j], j))
        j = cut[j]
    return chunks[::-1]


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as tensors; per-token fields are on the target grid (B, T−1). Right-padded
    rows (`cu_seqlens` None), or every sequence concatenated into one row (B = 1, no padding)."""

    input_ids: Tensor  # (B, T) long, padded with pad_id
    attention_mask: Tensor | None  # (B, T) long, 1 on real tokens; None when concatenated
    response_mask: Tensor  # (B, T-1) bool, True on targets after the prompt
    loss_mask: Tensor  # (B, T-1) float, 1 on targets that are trained on
    behaviour_logprobs: Tensor  # (B, T-1) float
    advantages: Tensor  # (B, T-1) float, each sequence's advantage on its response targets
    response_lengths: list[int]
    position_ids: Tensor | None = None  # (1, T) long, restarting at 0 in each sequence; None when padded
    cu_seqlens: tuple[int, ...] | None = None  # where each sequence starts in the row, and T; None when padded

    @property
    def max_seqlen(self) -> int:
        """The longest sequence's length (the row width when padded)."""
        if self.cu_seqlens is None:
            return int(self.input_ids.shape[1])
        return max(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))


def pack(sequences: list[TrainSequence], pad_id: int = 0, concatenate: bool = False) -> PackedBatch:
    """`sequences` as a `PackedBatch` (float32 per-token values): one right-padded row each, or with
    `concatenate` all of them back to back in one row (positions restarting, `cu_seqlens` set)."""
    import torch

    if not sequences:
        raise ValueError("pack: no sequences")
    lengths = [len(s.token_ids) for s in sequences]
    if concatenate:
        rows, width = 1, sum(lengths)
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    else:
        rows, width = len(sequences), max(lengths)
        offsets = [row * width for row in range(len(sequences))]  # flat positions of each row's start
    input_ids = torch.full((rows * width,), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width), dtype=torch.bool)  # column j: target j on the grid
    loss_mask, behaviour, advantages = (torch.zeros((rows, width)) for _ in range(3))
    grid = [t.view(-1) for t in (response_mask, loss_mask, behaviour, advantages)]
    for seq, length, offset in zip(sequences, lengths, offsets):
        start, end = offset + seq.prompt_length - 1, offset + length - 1
        input_ids[offset : offset + length] = torch.tensor(seq.token_ids, dtype=torch.long)
        grid[0][start:end] = True
        grid[1][start:end] = torch.tensor(seq.loss_mask, dtype=torch.float32)
        grid[2][start:end] = torch.tensor(seq.behaviour_logprobs, dtype=torch.float32)
        grid[3][start:end] = seq.advantage
    input_ids = input_ids.view(rows, width)
    per_token = [t[:, : width - 1] for t in (response_mask, loss_mask, behaviour, advantages)]
    response_lengths = [s.response_length for s in sequences]
    if not concatenate:
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return PackedBatch(input_ids, attention_mask, *per_token, response_lengths)
    positions = torch.cat([torch.arange(length) for length in lengths])[None, :]
    bounds = tuple(offsets) + (width,)
    return PackedBatch(input_ids, None, *per_token, response_lengths, position_ids=positions, cu_seqlens=bounds)


MEAN_METRICS = ("kl", "ratio_mean", "tis_mean")  # per-token means of policy_loss that a zero advantage does not zero


def gradient_batch(batch: TrainBatch, config: Any, other_loss: bool = False, keep_one: bool = False) -> TrainBatch:
    """What a step computes of `batch`: `with_gradient` when `config.skip_zero_advantage` and the loss
    is the policy term alone (kl_coef 0, and no `other_loss` such as an MoE router's, which every
    token feeds); else the whole batch."""
    if not config.skip_zero_advantage or config.kl_coef > 0 or other_loss:
        return batch
    return batch.with_gradient(keep_one)


def as_trained_means(sums: dict[str, float], batch: TrainBatch, trained: TrainBatch) -> dict[str, float]:
    """`sums` of a step over `trained`, a part of `batch`: the MEAN_METRICS (sums over `trained`'s
    tokens divided by the batch's token count) rescaled to means over `trained`'s tokens, in the
    units the whole batch would have given them (on one rank exact; over data-parallel ranks each
    rank's mean weighs by its share of the batch's tokens). The other sums are unchanged: the loss
    and clip_fraction of a token with advantage 0 are 0. A step with no token to train reports 0 for
    each (no micro-batch ran)."""
    for name in ("loss", "clip_fraction", *MEAN_METRICS):
        sums.setdefault(name, 0.0)
    if trained is batch or not trained.loss_tokens:
        return sums
    scale = batch.loss_tokens / trained.loss_tokens
    for name in MEAN_METRICS:
        sums[name] *= scale
    return sums


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob of each next token, (B, T−1): log_softmax(logits[:, t−1])[token t], in float32."""
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather − logsumexp avoids materialising a second (B, T, V) log-softmax tensor.
    return shifted.gather(-1, targets).squeeze(-1) - shifted.logsumexp(-1)


def unpack(per_token: Tensor, packed: PackedBatch) -> list[Tensor]:
    """Per-sequence response slices of a (B, T−1) target-grid tensor, in order (either layout:
    the grid's response cells, read row by row, are the sequences' responses one after another)."""
    return list(per_token[packed.response_mask.to(per_token.device)].split(packed.response_lengths))


class TrainBackend(abc.ABC):
    """What the trainer needs from a training engine. One instance per rank.

    Distributed backends are called identically on every rank; each rank passes its own shard of
    the step's batch, and the backend makes the update equal to a single-process step over the
    union (token-level mean over all ranks' loss tokens). Save methods are collective: every rank
    calls them, the backend decides who writes.

    `gradient_hook`: when set, elastic hybrid replicas take part in `train_step` (`gradient_hook.py`).
    """

    gradient_hook: GradientHook | None = None

    @abc.abstractmethod
    def load(self, model_dir: str) -> None:
        """Load an HF-format model directory (weights, config, tokenizer files) and build the optimizer."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrainBatch) -> list[Tensor]:
        """Per sequence, the float32 log-probs of its response tokens (len = response_length); no grad."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, config: TrainerConfig) -> dict[str, float]:
        """One optimizer step over `batch` (micro-batched, accumulated, clipped); returns metrics."""

    @abc.abstractmethod
    def save_weights(self, out_dir: str) -> None:
        """Write a complete HF model directory (safetensors + config + tokenizer files) for vLLM."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Atomically write model, optimizer, RNG state and `extra` (plain Python values) to `path`."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (after `load`); returns its `extra`."""

    @abc.abstractmethod
    def num_parameters(self) -> int:
        """Number of parameters of the full model (LoRA adapters not counted: what a step computes with)."""


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".safetensors.index.json", ".bin.index.json")


def write_weights_dir(out_dir: str, model_dir: str | None, write: Callable[[str], None]) -> None:
    """Write a complete HF model directory at `out_dir`, atomically, for the rollout workers.

    `write(staging)` puts the weights (and whatever config it writes) into an empty staging
    directory; the source directory's other top-level files (config, tokenizer, chat template,
    generation config) are copied beside them unless already there; then the staging directory
    replaces `out_dir` in one rename, so a worker never reads half a weight set.
    """
    staging = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    write(staging)
    if model_dir and os.path.isdir(model_dir):
        for name in sorted(os.listdir(model_dir)):
            source, target = os.path.join(model_dir, name), os.path.join(staging, name)
            if os.path.isfile(source) and not name.endswith(WEIGHT_SUFFIXES) and not os.path.exists(target):
                shutil.copy2(source, target)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(staging, out_dir)


def write_safetensors_dir(out_dir: str, model_dir: str | None, state: dict[str, Any]) -> None:
    """`write_weights_dir` of one model.safetensors holding `state` (name → tensor), as transformers
    saves a model: what a backend that is not transformers' own model publishes."""
    from safetensors.torch import save_file

    write_weights_dir(out_dir, model_dir, lambda staging: save_file(
        {name: tensor.contiguous() for name, tensor in state.items()}, os.path.join(staging, "model.safetensors"),
        metadata={"format": "pt"}))


def atomic_torch_save(state: dict[str, Any], path: str) -> None:
    """`torch.save(state)` to `path` so that a crash leaves the old file or the new one, never half of one."""
    import torch

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    staging = f"{path}.tmp-{os.getpid()}"
    with open(staging, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # make the rename itself durable
    finally:
        os.close(descriptor)
