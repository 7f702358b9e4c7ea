"""A decode step's KV append in the engine's own forward pass (libra/llama_forward.py `_extend`):
written in place into a buffer with room, against `torch.cat` of the whole cache at every step (what
the pass did before, and what transformers' dynamic cache does).

The quickstart's tiny model on CPU, one torch thread, `STEPS` decode steps of `ROWS` rows from a past
of `PAST` positions, no rows leaving (the engine copies the cache whenever rows finish or join, so
in a run the gain is smaller where they churn). CPU time per decode pass, the two interleaved
`--rounds` times (the order flipped every round), the ratio of medians printed last.

    .venv/bin/python benchmarks/kv_append.py [--rounds 5] [--shapes 12x64 12x256 32x256 64x512]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_model(directory: pathlib.Path) -> pathlib.Path:
    """The quickstart's model shape (configs/quickstart.yaml), random weights, saved as transformers does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def decode_cpu_ms(model, rows: int, past: int, steps: int) -> float:
    """CPU milliseconds per decode pass over `steps` steps of `rows` rows from a `past`-position cache."""
    import torch

    cache = [(torch.randn(rows, model.kv_heads, past, model.head_dim),
              torch.randn(rows, model.kv_heads, past, model.head_dim)) for _ in model.model.layers]
    mask = torch.ones(rows, past, dtype=torch.long)
    ids = torch.randint(0, 500, (rows, 1))
    started = time.thread_time()
    with torch.inference_mode():
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            _, cache = model.forward(ids, mask, mask.sum(1, keepdim=True) - 1, cache)
    return (time.thread_time() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shapes", nargs="+", default=["12x64", "12x256", "32x256", "64x512"],
                        help="ROWSxPAST: rows decoding together and the cache's positions when they start")
    args = parser.parse_args()

    import torch

    from libra import llama_forward

    torch.set_num_threads(1)
    in_place = llama_forward._extend

    def concatenated(cached, new):
        return torch.cat([cached, new], dim=2)

    with tempfile.TemporaryDirectory() as tmp:
        model = llama_forward.LlamaForward.load(tiny_model(pathlib.Path(tmp)))
    print(f"torch {torch.__version__}, 1 thread, {args.steps} decode steps per timing, {args.rounds} rounds")
    print(f"{'rows x past':>12} {'cat ms/pass':>12} {'in place ms/pass':>17} {'in place / cat':>15}")
    for shape in args.shapes:
        rows, past = (int(x) for x in shape.split("x"))
        timings: dict[str, list[float]] = {"cat": [], "in place": []}
        for index in range(args.rounds):
            order = [("cat", concatenated), ("in place", in_place)]
            for name, extend in (order if index % 2 == 0 else order[::-1]):
                llama_forward._extend = extend
                timings[name].append(decode_cpu_ms(model, rows, past, args.steps))
        llama_forward._extend = in_place
        cat, own = statistics.median(timings["cat"]), statistics.median(timings["in place"])
        print(f"{shape:>12} {cat:12.3f} {own:17.3f} {own / cat:14.2f}x")


if __name__ == "__main__":
    main()
