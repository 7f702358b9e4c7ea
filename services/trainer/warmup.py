"""Supervised warm start: teach the policy the workload's turn format from demonstrations before RL.

Demonstrations are tokenized segment by segment, exactly as the agent runner builds a trajectory
(the prompt with ``<bos>``, every later segment on its own, ids concatenated), so what SFT trains
on is what rollout will produce. Only the model-written segments are in the loss; prompts and tool
outputs are context. Plain torch on CPU; the result is saved back into the model directory.

This module knows the workload only through `demonstrations`; it knows nothing about Redis,
rollout workers or GRPO.
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any, Callable, Sequence

from libra.services.trainer.config import WarmupConfig
from libra.workloads.base import Segment, Workload

IGNORE = -100
WARMUP_FRACTION = 0.1
"""Share of the steps over which the learning rate ramps up linearly (then cosine to 10%)."""


def encode_segments(tokenizer: Any, segments: Sequence[Segment]) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is trained on.

    The first segment (the prompt) gets the tokenizer's special tokens (``<bos>``); every other
    segment is tokenized on its own without them, as rollout appends tool results.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for index, (text, trained) in enumerate(segments):
        piece = tokenizer(text, add_special_tokens=index == 0).input_ids
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def collate(examples: Sequence[tuple[list[int], list[bool]]], pad_id: int) -> dict[str, Any]:
    """Right-padded input ids, attention mask and labels (IGNORE outside trained tokens)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention[row, :len(ids)] = 1
        labels[row, :len(ids)] = torch.tensor([t if m else IGNORE for t, m in zip(ids, mask)])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def lr_factor(step: int, steps: int) -> float:
    """Linear ramp over the first WARMUP_FRACTION of the steps, then cosine decay to 0.1."""
    ramp = max(1, int(steps * WARMUP_FRACTION))
    if step < ramp:
        return (step + 1) / ramp
    progress = (step - ramp) / max(1, steps - ramp)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warm_start(model_dir: pathlib.Path, workload: Workload, cfg: WarmupConfig, seed: int,
               torch_threads: int, progress: Callable[[int, float], None] | None = None) -> dict:
    """Train the model in `model_dir` on demonstrations for cfg.steps steps; save it back there.

    Returns metrics: steps, first_loss, final_loss (mean of the last few steps), seconds, tokens
    (all tokens processed) and trained_tokens (tokens in the loss). `progress(done, loss)` is
    called after every step with the number of steps done (1 .. cfg.steps) and that step's loss.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from libra.tiny_model import load_tokenizer

    started = time.monotonic()
    metrics = {"steps": cfg.steps, "first_loss": float("nan"), "final_loss": float("nan"),
               "seconds": 0.0, "tokens": 0, "trained_tokens": 0}
    if cfg.steps == 0:
        return metrics
    torch.set_num_threads(torch_threads)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    examples = [encode_segments(tokenizer, demo)
                for demo in workload.demonstrations(cfg.steps * cfg.batch_size, seed)]
    batches = [collate(examples[start:start + cfg.batch_size], tokenizer.pad_token_id)
               for start in range(0, len(examples), cfg.batch_size)]
    losses = train_steps(model, batches, cfg.lr, progress)
    model.save_pretrained(str(model_dir))
    tail = losses[-max(1, min(10, len(losses) // 5)):]
    metrics.update(first_loss=losses[0], final_loss=sum(tail) / len(tail), seconds=time.monotonic() - started,
                   tokens=sum(int(b["attention_mask"].sum()) for b in batches),
                   trained_tokens=sum(int((b["labels"] != IGNORE).sum()) for b in batches))
    return metrics


def train_steps(model: Any, batches: Sequence[dict[str, Any]], lr: float,
                progress: Callable[[int, float], None] | None) -> list[float]:
    """One AdamW step of masked next-token cross-entropy per batch; the loss of each step."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, len(batches)))
    losses = []
    for step, batch in enumerate(batches):
        loss = model(**batch).loss  # transformers shifts the labels: position t predicts token t + 1
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, losses[-1])
    model.eval()
    return losses
