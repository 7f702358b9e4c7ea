"""Micro-batches of like length against micro-batches in arrival order (trainer.micro_batch_tokens 0).

Without a token budget the trainer right-pads each micro-batch to its longest sequence
(`TrainBatch.plan`). Taken in the order the trajectories finished, one long sequence pads a
micro-batch of short ones; taken shortest first, sequences of like length share a micro-batch.
The loss is a sum over tokens, so the gradient is the same either way.

For each recorded trace (the trajectories a real run finished, in the order they finished: the
batches a trainer would have built), batches of `--batch` sequences, micro-batches of `--micro`:

- padded token slots per batch (rows x width, summed over micro-batches): exact, no timing;
- CPU seconds of a forward and backward pass of the quickstart's model (random weights,
  transformers' LlamaForCausalLM, one torch thread) over those padded micro-batches, both orders
  on the same batches, alternating.

    .venv/bin/python benchmarks/padded_chunks.py [--batch 64] [--micro 16] [--timed 20]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TRACES = {"quickstart": RESULTS / "quickstart-trace.jsonl", "code agent": RESULTS / "code-agent-trace.jsonl"}


def in_order(lengths: list[int], micro: int) -> list[list[int]]:
    return [list(range(i, min(i + micro, len(lengths)))) for i in range(0, len(lengths), micro)]


def like_length(lengths: list[int], micro: int) -> list[list[int]]:
    from libra.services.trainer.backend import TrainBatch, TrainSequence

    batch = TrainBatch([TrainSequence([1] * n, 1, [1] * (n - 1), [0.0] * (n - 1), 0.0) for n in lengths])
    return batch.plan(micro)  # the trainer's own plan


def slots(lengths: list[int], plan: list[list[int]]) -> int:
    return sum(len(chunk) * max(lengths[i] for i in chunk) for chunk in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences per training batch")
    parser.add_argument("--micro", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--timed", type=int, default=20, help="batches of each trace timed (both orders)")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from libra.traces import files

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=384, max_position_embeddings=1024))

    def step_cpu(lengths: list[int], plan: list[list[int]]) -> float:
        started = time.process_time()
        for chunk in plan:
            width = max(lengths[i] for i in chunk)
            ids = torch.randint(1, 256, (len(chunk), width))
            mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in chunk])
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        return time.process_time() - started

    print(f"batches of {args.batch} sequences, micro-batches of {args.micro}, in the order a run finished them")
    print(f"{'trace':12} {'batches':>7} {'slots, in order':>16} {'like length':>12} {'ratio':>6}   "
          f"{'CPU s, in order':>15} {'like length':>12} {'ratio':>6}")
    for name, path in TRACES.items():
        specs = files.read(path)  # in the order the run finished them
        lengths_all = [s.total_tokens for s in specs]
        batches = [lengths_all[i:i + args.batch] for i in range(0, len(lengths_all) - args.batch + 1, args.batch)]
        old = sum(slots(b, in_order(b, args.micro)) for b in batches)
        new = sum(slots(b, like_length(b, args.micro)) for b in batches)
        cpu_old = cpu_new = 0.0
        for b in batches[:args.timed]:
            cpu_old += step_cpu(b, in_order(b, args.micro))
            cpu_new += step_cpu(b, like_length(b, args.micro))
        print(f"{name:12} {len(batches):>7} {old:>16,} {new:>12,} {new / old:>6.2f}   "
              f"{cpu_old:>15.2f} {cpu_new:>12.2f} {cpu_new / cpu_old:>6.2f}   ({min(len(batches), args.timed)} timed)",
              flush=True)


if __name__ == "__main__":
    main()
