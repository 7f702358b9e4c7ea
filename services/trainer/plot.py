"""Reward curve of a run as a PNG (what people look at first)."""

from __future__ import annotations

import pathlib
from typing import Sequence

from libra.v1 import trainer_pb2


def reward_curve(records: Sequence[trainer_pb2.StepRecord], out: pathlib.Path, title: str) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    rewards = [r.mean_reward for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 1.3])
    top.plot(steps, rewards, marker="o", ms=3, lw=1.2, label="mean reward of the batch")
    if len(rewards) >= 5:
        window = 5
        smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
                  for i in range(len(rewards))]
        top.plot(steps, smooth, lw=2.2, label=f"moving mean ({window} steps)")
    top.set_ylabel("reward")
    top.set_ylim(-0.02, 1.02)
    top.grid(alpha=0.3)
    top.legend(loc="lower right")
    top.set_title(title)
    bottom.bar(steps, [r.wait_seconds for r in records], label="wait for rollout", color="#bbbbbb")
    bottom.bar(steps, [r.train_seconds for r in records], bottom=[r.wait_seconds for r in records],
               label="train", color="#4c72b0")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("training step")
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
