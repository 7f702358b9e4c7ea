"""Mixture of experts and LoRA on one GPU: MFU of a small MoE next to a dense model of the same
active size, and LoRA's memory and step time next to full fine-tuning.

    python benchmarks/gpu_moe_lora.py --out DIR --only moe    # DIR/moe_lora_moe.json, a table last
    python benchmarks/gpu_moe_lora.py --out DIR --only lora   # DIR/moe_lora_lora.json (both: moe,lora)

A GRPO train_step (forward + backward over every micro-batch, the clipped token-level loss, the
optimizer step) in bf16 of `--batch` sequences × `--seq` tokens, micro-batches of `--micro`.

    moe    Megatron backend, a Qwen3-MoE-shaped model (every layer: E routed experts of width I_e,
           top-k renormalised, the load-balancing loss on; experts as Megatron's SequentialMLP —
           no grouped GEMM without Transformer Engine) against the dense Qwen3 model whose MLP is
           one MLP of width k·I_e: the same active parameters (bar the router's H·E per layer)
    lora   a ~1B Qwen2-style dense model (benchmarks/gpu_train_mfu.py's): full fine-tuning against
           LoRA (rank --lora-rank on all seven projections), on the Megatron backend (our adapter
           layers) and the torch backend (peft)

MFU counts active parameters, as benchmarks/gpu_train_mfu.py counts a dense model's:
6·N_active (matmuls, the LM head included, the router too) + 6·L·d·s (causal attention) FLOPs per
token over the 989.4 TFLOP/s dense bf16 peak. Memory is the peak CUDA allocation of the run above
what the process held before it. Up to three processes (create the part's models; its Megatron runs;
its torch runs), each run in turn inside its process with its memory freed before the next.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_train_mfu import PEAK_BF16, _import_paths, _sync  # noqa: E402 - the same peak and paths

MOE_RUNS = ("moe-megatron", "dense-megatron")
LORA_RUNS = ("full-megatron", "lora-megatron", "full-torch", "lora-torch")


# ---- models -------------------------------------------------------------------------------------

def moe_config(args: argparse.Namespace, dense: bool):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.moe_hidden, num_hidden_layers=args.moe_layers,
                  num_attention_heads=args.moe_heads, num_key_value_heads=args.moe_kv_heads,
                  head_dim=args.moe_hidden // args.moe_heads, max_position_embeddings=max(4096, args.seq),
                  tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)
    if dense:
        return Qwen3Config(**common, intermediate_size=args.topk * args.expert_width)
    return Qwen3MoeConfig(**common, intermediate_size=args.topk * args.expert_width, moe_intermediate_size=args.expert_width,
                          num_experts=args.experts, num_experts_per_tok=args.topk, norm_topk_prob=True,
                          router_aux_loss_coef=0.001)


def dense_1b_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=max(4096, args.seq), tie_word_embeddings=True, rope_theta=1e6,
                       rms_norm_eps=1e-6, use_sliding_window=False)


def model_dirs(args: argparse.Namespace) -> dict[str, str]:
    return {name: os.path.join(args.scratch, name) for name in ("moe", "dense-active", "dense-1b")}


def create(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    parts = set(args.only.split(","))
    wanted = (("moe", moe_config(args, False), "moe"), ("dense-active", moe_config(args, True), "moe"),
              ("dense-1b", dense_1b_config(args), "lora"))
    for name, config, part in wanted:
        path = model_dirs(args)[name]
        if part not in parts or os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        with torch.device(_device()):
            model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(path)
        out[name] = sum(p.numel() for p in model.parameters())
        del model
    return out


def flops_per_token(config, seq: int) -> tuple[float, int]:
    """(causal FLOPs per token counting active parameters, active matmul parameters) of an HF config."""
    h, layers = config.hidden_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    experts = getattr(config, "num_experts", 0) or 0
    mlp = (3 * h * config.moe_intermediate_size * config.num_experts_per_tok + h * experts if experts
           else 3 * h * config.intermediate_size)
    active = layers * (h * (q + 2 * kv) + q * h + mlp) + config.vocab_size * h
    return 6 * active + 6 * layers * q * seq, active


# ---- runs ---------------------------------------------------------------------------------------

def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to debug this script on tiny shapes


def train_batch(args: argparse.Namespace, vocab: int):
    import torch

    from libra.services.trainer.backend import TrainBatch, TrainSequence

    generator = torch.Generator().manual_seed(1000)
    sequences = []
    for i in range(args.batch):
        tokens = torch.randint(3, vocab, (args.seq,), generator=generator).tolist()
        response = args.seq - 1
        sequences.append(TrainSequence(tokens, 1, [1] * response, [-10.0] * response, 1.0 if i % 2 else -1.0))
    return TrainBatch(sequences)


def trainer_config(args: argparse.Namespace, backend: str, lora: bool):
    from libra.services.trainer.config import TrainerConfig

    settings = {"type": "megatron"} if backend == "megatron" else "torch"
    return TrainerConfig(lr=1e-5, micro_batch_size=args.micro, max_grad_norm=1.0, backend=settings,
                         lora={"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if lora else None)


def load(name: str, args: argparse.Namespace):
    """The backend of run `name`, loaded (torch: moved to the GPU in bf16 with fused AdamW)."""
    import torch

    kind, backend_type = name.split("-")
    model_dir = model_dirs(args)[{"moe": "moe", "dense": "dense-active"}.get(kind, "dense-1b")]
    config = trainer_config(args, backend_type, lora=kind == "lora")
    if backend_type == "megatron":
        from libra.services.trainer.megatron.backend import MegatronBackend

        backend = MegatronBackend(config, seed=0)
        backend.load(model_dir)
        return backend, model_dir
    from libra.services.trainer.torch_backend import TorchBackend

    backend = TorchBackend(config, seed=0)
    backend.load(model_dir)
    cuda = torch.cuda.is_available()
    backend.model.to(_device(), torch.bfloat16 if cuda else torch.float32)
    backend._optimizer = torch.optim.AdamW([p for p in backend.model.parameters() if p.requires_grad],
                                           lr=config.lr, fused=cuda)
    return backend, model_dir


def run(name: str, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if cuda else 0
    started = time.perf_counter()
    backend, model_dir = load(name, args)
    result = {"load_seconds": time.perf_counter() - started, "parameters": backend.num_parameters(),
              "trainable_parameters": sum(p.numel() for p in backend.model.parameters() if p.requires_grad)}
    hf_config = AutoConfig.from_pretrained(model_dir)
    batch = train_batch(args, hf_config.vocab_size)
    steps = []
    for index in range(args.warmup + args.steps):
        _sync()
        began = time.perf_counter()
        metrics = backend.train_step(batch, backend.config)
        _sync()
        if index >= args.warmup:
            steps.append(time.perf_counter() - began)
    seconds = sum(steps) / len(steps)
    fpt, active = flops_per_token(hf_config, args.seq)
    tokens = args.batch * args.seq
    result.update(step_seconds=seconds, tokens_per_second=tokens / seconds, active_parameters=active,
                  flops_per_token=fpt, mfu=tokens / seconds * fpt / PEAK_BF16, loss=metrics["loss"],
                  router_aux_loss=metrics.get("router_aux_loss"),
                  peak_memory_gib=(torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else 0.0)
    del backend
    gc.collect()
    return result


def worker(args: argparse.Namespace) -> None:
    _import_paths()
    import torch

    results = {}
    if args.worker == "create":
        try:
            results["create"] = {"ok": True, "parameters": create(args)}
        except Exception as error:  # noqa: BLE001 - reported; the runs then fail on a missing model
            results["create"] = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    for name in filter(None, args.runs.split(",")):
        try:
            results[name] = {"ok": True, **run(name, args)}
        except Exception as error:  # noqa: BLE001 - a failed run is reported, the others still run
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            print(results[name]["traceback"], file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(json.dumps({name: {k: v for k, v in results[name].items() if k != "traceback"}}), flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for result in results.values():
        result.update(device=device, torch=torch.__version__)
    pathlib.Path(args.out, f"moe_lora_{args.worker}.json").write_text(json.dumps(results, indent=2) + "\n")


# ---- the driver ---------------------------------------------------------------------------------

def shape_args(args: argparse.Namespace) -> list[str]:
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "moe_hidden", "moe_layers", "moe_heads",
            "moe_kv_heads", "experts", "topk", "expert_width", "lora_rank", "seq", "micro", "batch", "steps", "warmup")
    out = []
    for key in keys:
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + ["--out", args.out, "--scratch", args.scratch, "--only", args.only]


def main_all(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    parts = set(args.only.split(","))
    megatron = [r for r in (MOE_RUNS if "moe" in parts else ()) + (LORA_RUNS if "lora" in parts else ())
                if r.endswith("megatron")]
    torch_runs = [r for r in LORA_RUNS if r.endswith("torch")] if "lora" in parts else []
    script = [sys.executable, str(pathlib.Path(__file__).resolve())]
    for worker_name in ("create", "megatron", "torch"):  # an earlier part's files are not this one's
        pathlib.Path(args.out, f"moe_lora_{worker_name}.json").unlink(missing_ok=True)
    for worker_name, runs in (("create", []), ("megatron", megatron), ("torch", torch_runs)):
        if worker_name != "create" and not runs:
            continue
        started = time.perf_counter()
        command = script + ["--worker", worker_name, "--runs", ",".join(runs)] + shape_args(args)
        try:
            subprocess.run(command, check=False, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            pathlib.Path(args.out, f"moe_lora_{worker_name}.json").write_text(json.dumps(
                {r: {"ok": False, "error": f"timeout after {args.run_timeout} s"} for r in runs}))
        print(f"== {worker_name}: {time.perf_counter() - started:.1f} s", flush=True)
    summary = {"command": " ".join(sys.argv), "shape": vars(args), "runs": {}}
    for worker_name in ("create", "megatron", "torch"):
        path = pathlib.Path(args.out, f"moe_lora_{worker_name}.json")
        if path.exists():
            summary["runs"].update(json.loads(path.read_text()))
    runs = summary["runs"]
    for lora_run, full_run in (("lora-megatron", "full-megatron"), ("lora-torch", "full-torch")):
        if runs.get(lora_run, {}).get("ok") and runs.get(full_run, {}).get("ok"):
            if runs[full_run]["peak_memory_gib"] > 0:  # 0 on a CPU (a debugging run)
                runs[lora_run]["memory_vs_full"] = runs[lora_run]["peak_memory_gib"] / runs[full_run]["peak_memory_gib"]
            runs[lora_run]["step_time_vs_full"] = runs[lora_run]["step_seconds"] / runs[full_run]["step_seconds"]
    if runs.get("moe-megatron", {}).get("ok") and runs.get("dense-megatron", {}).get("ok"):
        runs["moe-megatron"]["mfu_vs_dense"] = runs["moe-megatron"]["mfu"] / runs["dense-megatron"]["mfu"]
    pathlib.Path(args.out, f"moe_lora_{args.only.replace(',', '_')}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'run':15} {'params':>8} {'active':>8} {'trained':>8} {'s/step':>7} {'tok/s':>8} {'MFU':>6} {'GiB':>6}  vs")
    for name in (*MOE_RUNS, *LORA_RUNS):
        run_result = runs.get(name)
        if run_result is None:
            continue
        if not run_result.get("ok"):
            print(f"{name:15} {run_result.get('error', 'failed')[:100]}")
            continue
        versus = " ".join(f"{k}={run_result[k]:.2f}" for k in ("mfu_vs_dense", "memory_vs_full", "step_time_vs_full")
                          if k in run_result)
        print(f"{name:15} {run_result['parameters'] / 1e6:7.0f}M {run_result['active_parameters'] / 1e6:7.0f}M "
              f"{run_result['trainable_parameters'] / 1e6:7.1f}M {run_result['step_seconds']:7.3f} "
              f"{run_result['tokens_per_second']:8.0f} {run_result['mfu']:6.1%} {run_result['peak_memory_gib']:6.1f}  "
              f"{versus}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--scratch", default="/tmp/libra-gpu-bench/moe-lora")
    parser.add_argument("--only", default="moe,lora", help="moe, lora or both (comma-separated)")
    parser.add_argument("--worker", choices=["create", "megatron", "torch"], default=None)
    parser.add_argument("--runs", default="")
    parser.add_argument("--run-timeout", type=int, default=150, help="seconds each of the three processes may take")
    parser.add_argument("--vocab", type=int, default=32000)
    # the ~1B dense model of the LoRA part (benchmarks/gpu_train_mfu.py's)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    # the MoE and its dense twin
    parser.add_argument("--moe-hidden", type=int, default=2048)
    parser.add_argument("--moe-layers", type=int, default=8)
    parser.add_argument("--moe-heads", type=int, default=16)
    parser.add_argument("--moe-kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        main_all(args)


if __name__ == "__main__":
    main()
