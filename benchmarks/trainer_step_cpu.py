"""CPU time of one GRPO step: Libra's torch trainer against the plain loop's training step, on the
same batch, side by side in one process.

benchmarks/quickstart_race.py races the whole quickstart against benchmarks/sync_grpo_loop.py; this
isolates the training half. Both load the quickstart's cached warm-started model (the trainer on its
own forward pass, `trainer.backend.forward: auto`; the loop on transformers' model, as it runs in the
race) and take optimizer steps on one batch of 64 sequences (8 groups of 8, prompts of 12-20 tokens,
10-60 generated, seeded), micro-batches of 16, one torch thread, interleaved rounds.

    .venv/bin/python benchmarks/trainer_step_cpu.py [--config configs/quickstart.yaml] [--steps 15] [--rounds 2]
        [--equal-groups K]

Prints the median CPU milliseconds per step of each and their ratio, per round. With --equal-groups K,
K of the 8 groups have advantage 0 (their rewards all equal), and Libra's trainer also runs with
`trainer.skip_zero_advantage: false` (every sequence through the passes) beside its default.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def batch(seed: int = 0, sequences: int = 64, group: int = 8, vocab: int = 300, equal_groups: int = 0):
    from libra.services.trainer.backend import TrainBatch, TrainSequence

    rng = random.Random(seed)
    train, rows = [], []
    for index in range(sequences):
        prompt = rng.randint(12, 20)
        ids = [rng.randint(3, vocab) for _ in range(prompt + rng.randint(10, 60))]
        mask = [1 if rng.random() < 0.8 else 0 for _ in range(len(ids) - prompt)]  # tool tokens carry no loss
        advantage = 0.0 if index // group < equal_groups else rng.choice((-1.0, 1.0))  # equal rewards: 0
        train.append(TrainSequence(token_ids=ids, prompt_length=prompt, loss_mask=mask,
                                   behaviour_logprobs=[-1.0] * len(mask), advantage=advantage))
        rows.append({"ids": ids, "prompt_length": prompt, "mask": mask, "reward": advantage, "group": index // group})
    return TrainBatch(train), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=15, help="steps of each per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--equal-groups", type=int, default=0,
                        help="groups (of 8) whose rewards are all equal, so advantage 0 (30-35%% of the groups of the "
                             "headline's 30-step CPU runs: ~1 in 8 over their first 10 steps, 3-4 over their last 10; "
                             "benchmarks/equal_reward_groups.py)")
    args = parser.parse_args()
    import os
    import tempfile

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.sync_grpo_loop import load_config, parse_args
    from benchmarks.sync_grpo_loop import train_step as loop_step
    from libra.services.trainer.model_state import base_model
    from libra.services.trainer.torch_backend import TorchBackend

    torch.set_num_threads(1)
    config = load_config(parse_args(["--config", args.config]))
    trainer = config.trainer.model_copy(update={"torch_threads": 1})
    scratch = tempfile.TemporaryDirectory(prefix="trainer-step-")
    model_dir = str(Path(scratch.name) / "base")
    base_model(config, Path(model_dir))  # the warm-started weights libra up starts from (the model cache)
    ours = TorchBackend(trainer, seed=0)
    ours.load(model_dir)
    whole_config = trainer.model_copy(update={"skip_zero_advantage": False})
    if args.equal_groups:  # every sequence through the passes, as before the skip
        whole = TorchBackend(whole_config, seed=0)
        whole.load(model_dir)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=trainer.lr)
    train, rows = batch(equal_groups=args.equal_groups)
    print(f"the quickstart's warm-started model; trainer on {'its own forward pass' if ours.own_forward else 'transformers'}; "
          f"64 sequences, micro-batches of {trainer.micro_batch_size}")

    def cpu_ms(step) -> float:
        times = []
        for _ in range(args.steps):
            started = time.process_time()
            step()
            times.append(time.process_time() - started)
        return statistics.median(times) * 1000

    for round_ in range(args.rounds):
        a = cpu_ms(lambda: ours.train_step(train, trainer))
        b = cpu_ms(lambda: loop_step(theirs, optimizer, rows, trainer))
        line = (f"round {round_ + 1}: Libra's trainer {a:.1f} ms CPU per step, the plain loop's {b:.1f} ms "
                f"({a / b:.2f}x)")
        if args.equal_groups:
            c = cpu_ms(lambda: whole.train_step(train, whole_config))
            line += f"; Libra's trainer with every sequence in the passes {c:.1f} ms (skipping: {a / c:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
