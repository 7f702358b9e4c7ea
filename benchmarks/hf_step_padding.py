"""What one decode step of the quickstart's tiny model (its warm-started weights, from the model cache)
costs on one CPU thread, by batch and by the padded context every row of the batch carries (the
transformers engine pads each row's KV cache to the batch's longest context,
services/rollout/engines/hf_engine.py): is a long context in the batch what slows every row at once
(docs/benchmarks.md, "Simulator against reality")?

    .venv/bin/python benchmarks/hf_step_padding.py [--threads 1] [--reps 60]

Prints milliseconds of CPU time per step (the model's forward with its cache, as the engine's
`_decode` calls it; not the sampling, the KV bookkeeping or the HTTP server around it), a row per
batch, a column per padded context, and each row's ratio longest / shortest context.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch
from transformers import LlamaForCausalLM

from libra.config import load_run_config
from libra.services.trainer.model_state import base_model


def step_ms(model, batch: int, context: int, reps: int, vocab: int) -> float:
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, vocab, (batch, context)), use_cache=True)
        cache, mask = out.past_key_values, torch.ones(batch, context, dtype=torch.long)
        last = torch.randint(0, vocab, (batch, 1))
        started = time.process_time()
        for _ in range(reps):
            longer = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            out = model(input_ids=last, attention_mask=longer, position_ids=mask.sum(1, keepdim=True),
                        past_key_values=cache, use_cache=True)
            cache, mask = out.past_key_values, longer
        return (time.process_time() - started) / reps * 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    where = pathlib.Path(tempfile.mkdtemp()) / "base"  # the quickstart's own warm-started model (model cache)
    base_model(load_run_config("configs/quickstart.yaml"), where)
    model = LlamaForCausalLM.from_pretrained(where).eval()
    vocab = model.config.vocab_size
    contexts = tuple(c for c in (32, 64, 128, 256) if c < model.config.max_position_embeddings)
    step_ms(model, 4, 32, args.reps, vocab)  # warm-up (the first calls allocate)
    print("batch  " + "  ".join(f"ctx {c:>4}" for c in contexts) + "   longest/shortest   (ms CPU per step)")
    for batch in (1, 4, 20, 64):
        row = [step_ms(model, batch, c, args.reps, vocab) for c in contexts]
        print(f"{batch:>5}  " + "  ".join(f"{ms:8.2f}" for ms in row) + f"   {row[-1] / row[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
