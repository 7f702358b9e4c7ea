"""Micro-batches in arrival order, in fixed chunks of like length, and cut where padding costs more than a
micro-batch (the trainer's plan; trainer.micro_batch_tokens 0).

Without a token budget the trainer right-pads each micro-batch to its longest sequence
(`TrainBatch.plan`). Taken in the order the trajectories finished, one long sequence pads a
micro-batch of short ones; taken shortest first in chunks of `--micro`, sequences of like length
share a micro-batch, but the chunk holding the longest still pads `--micro` rows to it; the
trainer's plan (`padded_chunks`) cuts the sorted sequences where the padding saved is worth more
than one more micro-batch (MICRO_BATCH_COST_TOKENS). The loss is a sum over tokens, so the
gradient is the same in every case.

For each recorded trace (the trajectories a real run finished, in the order they finished: the
batches a trainer would have built), batches of `--batch` sequences, micro-batches of `--micro`:

- padded token slots per batch (rows x width, summed over micro-batches): exact, no timing;
- first, the quickstart's case alone: one 384-token sequence among 36-40-token ones, fixed chunks
  against the trainer's plan, CPU of the trainer's own pass (best of 3);
- CPU seconds of a forward and backward pass of the quickstart's model (random weights,
  transformers' LlamaForCausalLM, one torch thread) over those padded micro-batches, the three
  plans on the same batches, alternating;
- `--fit`: the CPU milliseconds of one micro-batch of R rows × W tokens for a few R and W, and the
  least-squares fixed cost per micro-batch and cost per padded token (what MICRO_BATCH_COST_TOKENS
  stands for), on transformers' model and on the trainer's own pass (libra/llama_forward.py).

    .venv/bin/python benchmarks/padded_chunks.py [--batch 64] [--micro 16] [--timed 20] [--fit]
    python3 benchmarks/padded_chunks.py --cuda [--hidden 2048] [--layers 16]   # the fit on a GPU
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
    """Shortest first, chunks of `micro` (the trainer's plan before padded_chunks)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + micro] for i in range(0, len(order), micro)]


def trainers(lengths: list[int], micro: int) -> list[list[int]]:
    from libra.services.trainer.backend import TrainBatch, TrainSequence

    batch = TrainBatch([TrainSequence([1] * n, 1, [1] * (n - 1), [0.0] * (n - 1), 0.0) for n in lengths])
    return batch.plan(micro)  # the trainer's own plan


def slots(lengths: list[int], plan: list[list[int]]) -> int:
    return sum(len(chunk) * max(lengths[i] for i in chunk) for chunk in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences per training batch")
    parser.add_argument("--micro", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--timed", type=int, default=20, help="batches of each trace timed (every plan)")
    parser.add_argument("--fit", action="store_true", help="also fit the fixed and per-token cost of a micro-batch")
    parser.add_argument("--cuda", action="store_true",
                        help="only the fit, on the GPU: a Llama of --hidden/--layers in bf16, wall milliseconds of a "
                             "forward and backward pass (what trainer.micro_batch_cost_tokens stands for there)")
    parser.add_argument("--hidden", type=int, default=2048, help="with --cuda: hidden size (heads of 128)")
    parser.add_argument("--layers", type=int, default=16, help="with --cuda: layers")
    args = parser.parse_args()
    if args.cuda:
        fit_cuda(args.hidden, args.layers)
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from libra.llama_forward import LlamaForward
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

    own = LlamaForward(model.config.to_dict())  # the trainer's own pass on the same config

    def own_cpu(lengths: list[int], plan: list[list[int]]) -> float:
        started = time.process_time()
        for chunk in plan:
            width = max(lengths[i] for i in chunk)
            ids = torch.randint(1, 256, (len(chunk), width))
            positions = torch.arange(width).expand_as(ids)
            logits = own(ids, torch.ones_like(ids), positions, None, last_only=False)[0]
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
        return time.process_time() - started

    # The quickstart's case: one trajectory that ran to its 384-token limit among ~40-token ones.
    outlier = [36 + i % 5 for i in range(args.batch - 1)] + [384]
    fixed, cut = like_length(outlier, args.micro), trainers(outlier, args.micro)
    own_cpu(outlier, cut)  # warm
    fixed_ms = 1000 * min(own_cpu(outlier, fixed) for _ in range(3))
    cut_ms = 1000 * min(own_cpu(outlier, cut) for _ in range(3))
    print(f"one 384-token sequence among {args.batch - 1} of 36-40, the trainer's own pass: fixed chunks "
          f"{len(fixed)} micro-batches, {slots(outlier, fixed):,} slots, {fixed_ms:.0f} ms CPU; the trainer's plan "
          f"{len(cut)}, {slots(outlier, cut):,} slots, {cut_ms:.0f} ms ({cut_ms / fixed_ms:.2f}x)")

    plans = {"in order": in_order, "like length": like_length, "trainer": trainers}
    print(f"batches of {args.batch} sequences, micro-batches of {args.micro}, in the order a run finished them")
    print(f"{'trace':12} {'batches':>7} " + " ".join(f"{'slots, ' + name:>20}" for name in plans)
          + "   " + " ".join(f"{'CPU s, ' + name:>20}" for name in plans) + "   trainer / like length (slots, CPU)")
    for name, path in TRACES.items():
        specs = files.read(path)  # in the order the run finished them
        lengths_all = [s.total_tokens for s in specs]
        batches = [lengths_all[i:i + args.batch] for i in range(0, len(lengths_all) - args.batch + 1, args.batch)]
        slot = {p: sum(slots(b, plan(b, args.micro)) for b in batches) for p, plan in plans.items()}
        cpu = dict.fromkeys(plans, 0.0)
        for b in batches[:args.timed]:
            for p, plan in plans.items():
                cpu[p] += step_cpu(b, plan(b, args.micro))
        print(f"{name:12} {len(batches):>7} " + " ".join(f"{slot[p]:>20,}" for p in plans) + "   "
              + " ".join(f"{cpu[p]:>20.2f}" for p in plans)
              + f"   {slot['trainer'] / slot['like length']:.2f}, {cpu['trainer'] / max(cpu['like length'], 1e-9):.2f}"
              f"   ({min(len(batches), args.timed)} timed)", flush=True)
    if args.fit:
        print("transformers' LlamaForCausalLM:")
        fit(step_cpu)
        print("the trainer's own pass (libra/llama_forward.py):")
        fit(own_cpu)


def fit_cuda(hidden: int, layers: int) -> None:
    """The fit on the GPU: a Llama of `hidden` x `layers` (random weights, bf16, SDPA), a forward and
    backward pass of a micro-batch of uniform rows, wall milliseconds (synchronised, best of 3)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                         intermediate_size=hidden * 4, max_position_embeddings=8192, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"{torch.cuda.get_device_name()}: Llama {hidden} x {layers} ({params / 1e9:.2f}B parameters), bf16")

    def step_wall(lengths: list[int], plan: list[list[int]]) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for chunk in plan:
            width = max(lengths[i] for i in chunk)
            ids = torch.randint(1, 32000, (len(chunk), width), device="cuda")
            mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in chunk], device="cuda")
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    fit(step_wall, grid=((1, 4, 16), (128, 512, 2048)), unit="ms wall")


def fit(step_cpu, grid=((1, 4, 16), (32, 96, 192)), unit: str = "ms CPU") -> None:
    """Least squares of ms = fixed + per_token x rows x width + per_pair x rows x width² (attention)
    over a grid of uniform micro-batches."""
    import torch

    rows, ys = [], []
    for r in grid[0]:
        for w in grid[1]:
            step_cpu([w] * r, [list(range(r))])  # warm
            ms = 1000 * min(step_cpu([w] * r, [list(range(r))]) for _ in range(3))
            rows.append([1.0, r * w, r * w * w])
            ys.append([ms])
            print(f"  {r:>2} rows x {w:>4} tokens: {ms:7.1f} {unit}")
    fixed, per_token, per_pair = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                                    torch.tensor(ys, dtype=torch.float64)).solution.flatten().tolist()
    print(f"fit: {fixed:.2f} ms a micro-batch + {per_token:.4f} ms a padded token + {per_pair * 1e6:.2f} ns a "
          f"token pair (a micro-batch costs {fixed / per_token:.0f} padded tokens)")

if __name__ == "__main__":
    main()
