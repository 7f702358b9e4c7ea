"""Packed against padded micro-batches on one GPU: useful-token throughput and MFU on a long-tailed batch.

    python benchmarks/gpu_packing.py --out DIR          # every run below; DIR/packing.json, a table last

A GRPO train_step (forward + backward over every micro-batch, the clipped token-level loss, the
optimizer step) of the ~1B Qwen2-style model of benchmarks/gpu_train_mfu.py (bf16) on one batch of
`--sequences` sequences whose lengths follow an R2E-like agentic distribution: log-normal around
`--median` tokens, clipped to [--shortest, --longest] (a few hundred to 30,000 tokens in one batch).

    megatron-padded   MegatronBackend, micro_batch_size sequences per micro-batch, each right-padded
                      to the longest in it (what the trainer did before packing); the size is the most
                      that fits the same peak tokens as the packed budget (--budget // --longest, >= 1)
    megatron-padded-x2  the same with twice as many sequences per micro-batch (twice the peak memory)
    megatron-padded-x4  four times as many (a padded trainer's micro-batch of a few sequences; may not fit)
    megatron-packed   MegatronBackend, micro_batch_tokens = --budget: sequences concatenated (THD),
                      first-fit decreasing, attention kept inside each sequence (trainer.packed_attention)
    megatron-packed-sdpa  the same with one SDPA call per sequence instead of the varlen kernel
    torch-padded / torch-packed   the plain torch backend (HF model, bf16, fused AdamW), the same two ways

Useful tokens are the sequences' own tokens (no padding). FLOPs count them only, as
benchmarks/gpu_train_mfu.py does per token (6·N for the matmuls, LM head included, plus causal
attention 6·layers·d·Lᵢ for a token of a sequence of length Lᵢ), so MFU is useful work over the
989.4 TFLOP/s dense bf16 peak, whatever the padding cost. Each run is its own process (no shared
CUDA memory or compile caches); a run that fails or runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_train_mfu import PEAK_BF16, _import_paths, _sync, create  # noqa: E402 - the same model and FLOP count

WORKERS = ("create", "megatron-padded", "megatron-padded-x2", "megatron-padded-x4", "megatron-packed",
           "megatron-packed-sdpa", "torch-padded", "torch-packed")
RUNS = WORKERS[1:]


def lengths(args: argparse.Namespace) -> list[int]:
    """R2E-like trajectory lengths: log-normal, long-tailed, clipped (deterministic in --seed)."""
    import random

    generator = random.Random(args.seed)
    drawn = [int(round(math.exp(generator.gauss(math.log(args.median), args.sigma)))) for _ in range(args.sequences)]
    drawn[0] = args.longest  # the tail is in every batch: one trajectory at the context limit
    return [min(args.longest, max(args.shortest, n)) for n in drawn]


def batch(args: argparse.Namespace):
    """Multi-turn shaped sequences: a prompt of ~10%, then model turns with tool output masked out."""
    import torch

    from libra.services.trainer.backend import TrainBatch, TrainSequence

    generator = torch.Generator().manual_seed(args.seed)
    sequences = []
    for i, length in enumerate(lengths(args)):
        prompt = max(1, length // 10)
        response = length - prompt
        tokens = torch.randint(3, args.vocab, (length,), generator=generator).tolist()
        mask = [0 if (j // 256) % 3 == 2 else 1 for j in range(response)]  # every third 256-token span: tool
        sequences.append(TrainSequence(tokens, prompt, mask, [-10.0] * response, 1.0 if i % 2 else -1.0))
    return TrainBatch(sequences)


def useful_flops(args: argparse.Namespace, sizes: list[int]) -> float:
    """FLOPs of one step counting the sequences' own tokens only (no padding)."""
    head_dim = args.hidden // args.heads
    q, kv = args.heads * head_dim, args.kv_heads * head_dim
    per_layer = args.hidden * (q + 2 * kv) + q * args.hidden + 3 * args.hidden * args.intermediate
    matmul = args.layers * per_layer + args.vocab * args.hidden
    return sum(6 * matmul * n + 6 * args.layers * q * n * n for n in sizes)


def trainer_config(args: argparse.Namespace, run: str):
    from libra.services.trainer.config import TrainerConfig

    options: dict = dict(lr=1e-5, max_grad_norm=1.0)
    if "packed" in run:
        options.update(micro_batch_tokens=args.budget, packed_attention="sdpa" if run.endswith("-sdpa") else "auto")
    else:  # the most sequences whose padded rows fit the packed budget (xK: K times that, K times the memory)
        times = int(run.rsplit("-x", 1)[1]) if "-x" in run else 1
        options.update(micro_batch_size=max(1, args.budget // args.longest) * times)
    if run.startswith("megatron"):
        options["backend"] = {"type": "megatron", "layer_spec": "sdpa", "fused_kernels": args.fused}
    return TrainerConfig(**options)


def build(run: str, config, model_dir: str):
    import torch

    if run.startswith("megatron"):
        from libra.services.trainer.megatron.backend import MegatronBackend

        backend = MegatronBackend(config, seed=0)
        backend.load(model_dir)
        return backend
    from libra.services.trainer.torch_backend import TorchBackend

    cuda = torch.cuda.is_available()  # cpu: only to debug this script on a tiny model
    backend = TorchBackend(config, seed=0)
    backend.load(model_dir)  # fp32 from the file; the GPU step runs bf16 parameters, as gpu_train_mfu's torch run
    backend._model = backend.model.to("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    backend._optimizer = torch.optim.AdamW(backend.model.parameters(), lr=config.lr, fused=cuda)
    return backend


def worker(args: argparse.Namespace) -> None:
    _import_paths()
    import torch

    if args.worker == "create":
        print("created", create(args), flush=True)
        return
    result: dict = {"name": args.worker}
    try:
        config = trainer_config(args, args.worker)
        train_batch = batch(args)
        sizes = [len(s.token_ids) for s in train_batch.sequences]
        from libra.services.trainer.backend import micro_batch_cost

        plan = train_batch.plan(config.micro_batch_size, config.micro_batch_tokens,  # the trainer's own plan there
                                micro_batch_cost("cuda" if torch.cuda.is_available() else "cpu",
                                                 config.micro_batch_cost_tokens))
        rows = [sum(sizes[i] for i in micro) if config.micro_batch_tokens else len(micro) * max(sizes[i] for i in micro)
                for micro in plan]  # the tokens each micro-batch computes (padding included)
        started = time.perf_counter()
        backend = build(args.worker, config, args.model_dir)
        result["load_seconds"] = time.perf_counter() - started
        losses = []
        for _ in range(args.warmup):
            losses.append(backend.train_step(train_batch, config)["loss"])
        _sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            losses.append(backend.train_step(train_batch, config)["loss"])
        _sync()
        seconds = (time.perf_counter() - started) / args.steps
        useful, computed = sum(sizes), sum(rows)
        result.update(ok=True, step_seconds=seconds, useful_tokens=useful, computed_tokens=computed,
                      padding_fraction=1 - useful / computed, micro_batches=len(plan), widest_micro_batch=max(rows),
                      micro_batch_size=config.micro_batch_size, micro_batch_tokens=config.micro_batch_tokens,
                      useful_tokens_per_second=useful / seconds,
                      mfu_useful=useful_flops(args, sizes) / seconds / PEAK_BF16,
                      max_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
                      losses=losses)
        if args.profile and torch.cuda.is_available():
            result["profile"] = profile_step(backend, train_batch, config)
        if config.micro_batch_tokens:
            from libra.services.trainer.packed_attention import kernels_in_use

            result["packed_attention"] = kernels_in_use() or config.packed_attention
    except Exception as error:  # noqa: BLE001 - a failed run is reported; the others still run
        result.update(ok=False, error=f"{type(error).__name__}: {error}"[:500], traceback=traceback.format_exc())
    pathlib.Path(args.scratch, f"packing_{args.worker}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "traceback")}), flush=True)
    if not result["ok"]:
        print(result["traceback"], file=sys.stderr, flush=True)


KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "attn")),
                ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")))


def profile_step(backend, train_batch, config) -> dict:
    """One more step under the CUDA profiler: GPU time by kind of kernel (attention, matmul, the rest)
    and the top kernels, so that an MFU figure says where the step's time went."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend.train_step(train_batch, config)
        _sync()
    # CUDA activity only: the events are kernels and copies (no CPU ops whose time would count twice)
    kernels = [(e.key, t / 1e6) for e in prof.key_averages()
               if (t := getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) > 0]
    kinds: dict[str, float] = {}
    for name, seconds in kernels:
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name.lower() for m in marks)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    top = sorted(kernels, key=lambda k: -k[1])[:12]
    return {"gpu_seconds": sum(kinds.values()), "by_kind": kinds, "top": [[n[:90], s] for n, s in top]}


def shape_args(args: argparse.Namespace) -> list[str]:
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "sequences", "median", "sigma",
            "shortest", "longest", "budget", "steps", "warmup", "seed", "seq")
    out = ([] if args.fused else ["--no-fused"]) + (["--profile"] if args.profile else [])
    for key in keys:
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + ["--model-dir", args.model_dir, "--out", args.out, "--scratch", args.scratch]


def main_all(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    script = [sys.executable, str(pathlib.Path(__file__).resolve())]
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):  # in its own process: no CUDA held here
        subprocess.run(script + ["--worker", "create"] + shape_args(args), check=False, timeout=args.run_timeout)
    sizes = lengths(args)
    print(f"batch: {len(sizes)} sequences, {sum(sizes)} tokens, lengths {min(sizes)}..{max(sizes)} "
          f"(median {sorted(sizes)[len(sizes) // 2]})", flush=True)
    runs = [r for r in RUNS if r in args.only.split(",")] if args.only else list(RUNS)
    for name in runs:
        started = time.perf_counter()
        try:
            subprocess.run(script + ["--worker", name] + shape_args(args), check=False, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            pathlib.Path(args.scratch, f"packing_{name}.json").write_text(json.dumps({"name": name, "ok": False,
                                                                                      "error": "timeout"}))
        print(f"== {name}: {time.perf_counter() - started:.1f} s", flush=True)
    results = {}
    for name in runs:
        path = pathlib.Path(args.scratch, f"packing_{name}.json")
        results[name] = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"}
        path.unlink(missing_ok=True)
    for backend in ("megatron", "torch"):
        padded = max((run.get("useful_tokens_per_second") or 0 for name, run in results.items()
                      if name.startswith(f"{backend}-padded")), default=0)  # the best padded run that ran
        for name, run in results.items():
            if name.startswith(backend) and padded and run.get("useful_tokens_per_second"):
                run["vs_padded"] = run["useful_tokens_per_second"] / padded
    summary = {"command": " ".join(sys.argv), "lengths": sizes, "shape": vars(args), "runs": results,
               "goal": "packed >= 2x padded useful tokens/s, >= 40% MFU on useful tokens"}
    pathlib.Path(args.out, "packing.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\n{'run':22} {'useful tok/s':>12} {'s/step':>7} {'MFU useful':>10} {'x padded':>8} {'padding':>8} "
          f"{'micro':>5} {'GiB':>6}")
    for name, run in results.items():
        if not run.get("ok"):
            print(f"{name:22} {run.get('error', 'failed')[:90]}")
            continue
        print(f"{name:22} {run['useful_tokens_per_second']:12.0f} {run['step_seconds']:7.2f} {run['mfu_useful']:10.1%} "
              f"{run.get('vs_padded', float('nan')):8.2f} {run['padding_fraction']:8.1%} {run['micro_batches']:5d} "
              f"{run['max_memory_gib']:6.1f}")
    for name, run in results.items():
        if run.get("profile"):
            kinds, total = run["profile"]["by_kind"], run["profile"]["gpu_seconds"]
            print(f"{name}: GPU time of one profiled step {total:.2f} s: "
                  + ", ".join(f"{kind} {seconds:.2f} s ({seconds / total:.0%})" for kind, seconds in kinds.items()))
            for kernel, seconds in run["profile"]["top"][:6]:
                print(f"    {seconds:7.3f} s  {kernel}")
    return 0 if all(run.get("ok") for run in results.values()) else 1


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/libra-gpu-out", help="where packing.json goes (nothing else)")
    parser.add_argument("--scratch", default="/tmp/libra-gpu-bench/packing", help="each run's result, collected")
    parser.add_argument("--model-dir", default="/tmp/libra-gpu-bench/qwen2-1b-32k")
    parser.add_argument("--worker", choices=WORKERS, default=None)
    parser.add_argument("--only", default="megatron-padded,megatron-packed,torch-padded,torch-packed",
                        help=f"comma-separated runs of {RUNS} ('' for all)")
    parser.add_argument("--run-timeout", type=int, default=150)
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each run under the CUDA profiler: GPU time by kind of kernel")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                        help="trainer.backend.fused_kernels of the Megatron runs")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--median", type=int, default=2500, help="median trajectory length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.1, help="log-normal spread of the lengths")
    parser.add_argument("--shortest", type=int, default=300)
    parser.add_argument("--longest", type=int, default=30000)
    parser.add_argument("--budget", type=int, default=32768, help="micro_batch_tokens of the packed runs")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    # the model: gpu_train_mfu.py's ~1B Qwen2 (`create` reads these names)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32768, help="max_position_embeddings of the created model")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        worker(arguments)
    else:
        raise SystemExit(main_all(arguments))
