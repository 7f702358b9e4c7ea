"""Training throughput and MFU of the trainer's backends on GPUs (one GRPO train_step = fwd+bwd+Adam).

One command runs every configuration, each in its own process so that no run inherits another's
CUDA memory or process groups:

    python benchmarks/gpu_train_mfu.py --out DIR            # all runs below, summary in DIR/summary.json

    create        a random-initialised Qwen2-style model (~1.0B parameters, bf16 safetensors)
    torch         the plain torch backend (HF model, bf16 params, SDPA, AdamW) on 1 GPU: the baseline
    megatron-local    MegatronBackend, Megatron's stock local layer spec (unfused attention), 1 GPU
    megatron-sdpa     MegatronBackend with the torch-SDPA core attention (megatron_specs), 1 GPU
    megatron-sdpa-unfused  the same without Megatron's fused SwiGLU / cross entropy (fused_kernels: false)
    megatron-sdpa-tp2 the same with tensor parallelism 2 over 2 GPUs (torchrun)
    megatron-sdpa-pp2 the same with pipeline parallelism 2 over 2 GPUs (1F1B schedule)
    megatron-sdpa-dp2 the same with data parallelism 2 (distributed optimizer) over 2 GPUs

FLOPs per token, the usual dense-transformer count (Narayanan et al. 2021; PaLM appendix B):
    6·N                matmul parameters N = all layer weights + the LM-head matrix (V·H);
                       the embedding lookup is not a matmul and is not counted
    + 6·L·d·s          attention scores and values (QKᵀ and AV, fwd 2 + bwd 4 per multiply-add)
                       with causal masking, i.e. half of the 12·L·d·s "full attention" convention
                       (L layers, d = heads·head_dim, s = sequence length)
MFU = tokens/s × FLOPs/token ÷ (GPUs × 989.4 TFLOP/s dense bf16 peak of an H100/H200 SXM).
`mfu_palm` also reports the 12·L·d·s convention for comparison with published figures.

Each run: `--warmup` steps, then `--steps` timed steps (CUDA-synchronised wall clock) of
`--batch` sequences × `--seq` tokens in micro-batches of `--micro`, every token after the first
trained on. Outputs: one JSON per run and summary.json (with ratios against the torch run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEAK_BF16 = 989.4e12


def _import_paths() -> None:
    """`libra.services` is mapped by the editable install; a bare checkout gets the same by path."""
    sys.path.insert(0, str(ROOT))
    import importlib
    import types

    import libra

    try:
        importlib.import_module("libra.services")
    except ModuleNotFoundError:
        package = types.ModuleType("libra.services")
        package.__path__ = [str(ROOT / "services")]
        sys.modules["libra.services"] = package
        libra.services = package  # type: ignore[attr-defined]


def model_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq), tie_word_embeddings=True, rope_theta=1e6,
        rms_norm_eps=1e-6, use_sliding_window=False)


def flops_per_token(args: argparse.Namespace) -> tuple[float, float, int]:
    """(causal FLOPs/token, PaLM-convention FLOPs/token, matmul parameters N)."""
    head_dim = args.hidden // args.heads
    q, kv = args.heads * head_dim, args.kv_heads * head_dim
    per_layer = args.hidden * (q + 2 * kv) + q * args.hidden + 3 * args.hidden * args.intermediate
    matmul = args.layers * per_layer + args.vocab * args.hidden
    attention = 6 * args.layers * q * args.seq
    return 6 * matmul + attention, 6 * matmul + 2 * attention, matmul


def create(args: argparse.Namespace) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(model_config(args)).to(torch.bfloat16)
    model.save_pretrained(args.model_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - started}


def batch(args: argparse.Namespace, shard: int = 0):
    import torch

    from libra.services.trainer.backend import TrainBatch, TrainSequence

    generator = torch.Generator().manual_seed(1000 + shard)
    sequences = []
    for i in range(args.batch):
        tokens = torch.randint(3, args.vocab, (args.seq,), generator=generator).tolist()
        response = args.seq - 1
        sequences.append(TrainSequence(tokens, 1, [1] * response, [-10.0] * response, 1.0 if i % 2 else -1.0))
    return TrainBatch(sequences)


def trainer_config(args: argparse.Namespace, spec: str | None = None, tp: int = 1):
    """The torch backend's config, or with a layer `spec` the Megatron backend's."""
    from libra.services.trainer.config import TrainerConfig

    backend = "torch" if spec is None else {"type": "megatron", "tensor_parallel": tp, "pipeline_parallel": args.pp,
                                            "layer_spec": spec, "fused_kernels": args.fused}
    return TrainerConfig(lr=1e-5, micro_batch_size=args.micro, max_grad_norm=1.0, backend=backend)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to debug this script on a tiny model


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(backend, args: argparse.Namespace, train_batch, config) -> dict:
    import torch

    losses = []
    for _ in range(args.warmup):
        losses.append(backend.train_step(train_batch, config)["loss"])
    _sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        losses.append(backend.train_step(train_batch, config)["loss"])
    _sync()
    seconds = (time.perf_counter() - started) / args.steps
    if args.profile:  # one more step under the profiler: where the GPU time goes, by kernel
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            backend.train_step(train_batch, config)
            _sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70),
              flush=True)
    memory = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return {"step_seconds": seconds, "losses": losses, "max_memory_gib": memory}


def run_megatron(args: argparse.Namespace) -> dict:
    import torch

    from libra.services.trainer.megatron.backend import MegatronBackend

    config = trainer_config(args, args.spec, args.tp)
    backend = MegatronBackend(config, seed=0)
    started = time.perf_counter()
    backend.load(args.model_dir)
    load_seconds = time.perf_counter() - started
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    result = {"load_seconds": load_seconds, "parameters": backend.num_parameters(), "dp": dp, "tp": args.tp, "pp": args.pp,
              "gpus": torch.distributed.get_world_size()}
    result.update(time_steps(backend, args, batch(args, shard=dp_rank), config))
    result["tokens_per_step"] = args.batch * args.seq * dp
    if args.checkpoint_check:
        try:
            result["checkpoint_roundtrip_equal"] = checkpoint_roundtrip(backend, args, config, dp_rank)
        except Exception as error:  # noqa: BLE001 - the timings above stay reported
            result["checkpoint_error"] = f"{type(error).__name__}: {error}"
            result["checkpoint_traceback"] = traceback.format_exc()
    return result


def checkpoint_roundtrip(backend, args: argparse.Namespace, config, dp_rank: int) -> bool:
    """Save (distributed checkpoint), step, load: the model must be back to the saved weights."""
    import torch
    import torch.distributed as dist

    path = os.path.join(args.scratch, f"ckpt-{args.spec}-tp{args.tp}", "step1.pt")
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    dist.barrier()
    backend.save_checkpoint(path, {"step": 1})
    saved = {k: v.detach().clone() for k, v in backend.model.state_dict().items() if not k.endswith("_extra_state")}
    small = args.batch
    args.batch = args.micro
    backend.train_step(batch(args, shard=dp_rank), config)
    args.batch = small
    extra = backend.load_checkpoint(path)
    now = backend.model.state_dict()
    equal = extra == {"step": 1} and all(torch.equal(saved[k], now[k]) for k in saved)
    flag = torch.tensor([1.0 if equal else 0.0], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def run_torch(args: argparse.Namespace) -> dict:
    import dataclasses

    import torch

    from libra.services.trainer.backend import PackedBatch, pack, token_logprobs
    from libra.services.trainer.torch_backend import TorchBackend

    class CudaTorchBackend(TorchBackend):
        """The torch backend's step, on one GPU: bf16 parameters, tensors moved to the device."""

        def load(self, model_dir: str) -> None:
            super().load(model_dir)
            cuda = torch.cuda.is_available()
            self._model = self._model.to(_device(), torch.bfloat16 if cuda else torch.float32)
            self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=self.config.lr,
                                                weight_decay=self.config.weight_decay, fused=cuda)

        def _forward(self, sequences):
            packed = pack(sequences)
            packed = PackedBatch(**{f.name: _to_cuda(getattr(packed, f.name)) for f in dataclasses.fields(packed)})
            logits = self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
            return packed, token_logprobs(logits, packed.input_ids)

    config = trainer_config(args)
    backend = CudaTorchBackend(config, seed=0)
    started = time.perf_counter()
    backend.load(args.model_dir)
    result = {"load_seconds": time.perf_counter() - started, "parameters": backend.num_parameters(), "gpus": 1,
              "attn_implementation": getattr(backend.model.config, "_attn_implementation", None)}
    result.update(time_steps(backend, args, batch(args), config))
    result["tokens_per_step"] = args.batch * args.seq
    return result


def _to_cuda(value):
    import torch

    return value.to(_device()) if isinstance(value, torch.Tensor) else value


def worker(args: argparse.Namespace) -> None:
    _import_paths()
    import torch

    rank = int(os.environ.get("RANK", "0"))
    try:
        if args.worker == "create":
            result = create(args)
        elif args.worker == "torch":
            result = run_torch(args)
        else:
            result = run_megatron(args)
        fpt, fpt_palm, matmul = flops_per_token(args)
        if "step_seconds" in result:
            tokens_s = result["tokens_per_step"] / result["step_seconds"]
            gpus = result["gpus"]
            result.update(tokens_per_second=tokens_s, tflops_per_gpu=tokens_s * fpt / gpus / 1e12,
                          mfu=tokens_s * fpt / (gpus * PEAK_BF16), mfu_palm=tokens_s * fpt_palm / (gpus * PEAK_BF16),
                          matmul_parameters=matmul, flops_per_token=fpt)
        result["ok"] = True
    except Exception as error:  # noqa: BLE001 - a failed run is reported, the others still run
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    result.update(name=args.name, torch=torch.__version__, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if rank == 0:
        pathlib.Path(args.out, f"train_{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "traceback", "checkpoint_traceback")}),
          flush=True)
    if result.get("checkpoint_traceback"):
        print(result["checkpoint_traceback"], file=sys.stderr, flush=True)
    if not result["ok"]:
        print(result.get("traceback", ""), file=sys.stderr, flush=True)


def shape_args(args: argparse.Namespace) -> list[str]:
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "seq", "micro", "batch", "steps", "warmup")
    out = ["--profile"] if args.profile else []
    for key in keys:
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + ["--model-dir", args.model_dir, "--out", args.out, "--scratch", args.scratch]


def main_all(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    script = [sys.executable, str(pathlib.Path(__file__).resolve())]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(pathlib.Path(__file__).resolve())]
    runs = [("create", script, ["--worker", "create"]),
            ("megatron-sdpa", script, ["--worker", "megatron", "--spec", "sdpa"]),
            ("megatron-sdpa-unfused", script, ["--worker", "megatron", "--spec", "sdpa", "--no-fused"]),
            ("megatron-local", script, ["--worker", "megatron", "--spec", "local"]),
            ("torch", script, ["--worker", "torch"]),
            ("megatron-sdpa-tp2", torchrun, ["--worker", "megatron", "--spec", "sdpa", "--tp", "2"]),
            ("megatron-sdpa-pp2", torchrun, ["--worker", "megatron", "--spec", "sdpa", "--pp", "2"]),
            ("megatron-sdpa-dp2", torchrun, ["--worker", "megatron", "--spec", "sdpa", "--tp", "1", "--checkpoint-check"])]
    selected = set(args.only.split(",")) if args.only else None
    for name, launcher, extra in runs:
        if selected and name not in selected and name != "create":
            continue
        if name == "create" and os.path.exists(os.path.join(args.model_dir, "config.json")):
            continue
        command = launcher + extra + ["--name", name] + shape_args(args)
        started = time.perf_counter()
        try:
            subprocess.run(command, check=False, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            pathlib.Path(args.out, f"train_{name}.json").write_text(json.dumps({"name": name, "ok": False, "error": "timeout"}))
        print(f"== {name}: {time.perf_counter() - started:.1f} s", flush=True)
    summary = {"command": " ".join(sys.argv), "shape": vars(args), "runs": {}}
    for path in sorted(pathlib.Path(args.out).glob("train_*.json")):
        run = json.loads(path.read_text())
        summary["runs"][run.get("name", path.stem)] = {k: v for k, v in run.items()
                                                       if k not in ("losses", "traceback", "checkpoint_traceback")}
    base = summary["runs"].get("torch", {}).get("tokens_per_second")
    for run in summary["runs"].values():
        if base and run.get("tokens_per_second"):
            run["speedup_vs_torch"] = run["tokens_per_second"] / base
    pathlib.Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'run':20} {'tok/s':>10} {'s/step':>8} {'TFLOP/s/GPU':>11} {'MFU':>6} {'MFU(palm)':>9} {'x torch':>7} {'GiB':>6}")
    for name, run in summary["runs"].items():
        if not run.get("tokens_per_second"):
            print(f"{name:20} {run.get('error', 'no timing')}")
            continue
        print(f"{name:20} {run['tokens_per_second']:10.0f} {run['step_seconds']:8.3f} {run['tflops_per_gpu']:11.1f} "
              f"{run['mfu']:6.1%} {run['mfu_palm']:9.1%} {run.get('speedup_vs_torch', float('nan')):7.2f} "
              f"{run['max_memory_gib']:6.1f}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--scratch", default="/tmp/libra-gpu-bench")
    parser.add_argument("--model-dir", default="/tmp/libra-gpu-bench/qwen2-1b")
    parser.add_argument("--worker", choices=["create", "torch", "megatron"], default=None)
    parser.add_argument("--name", default="run")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--spec", choices=["sdpa", "local"], default="sdpa")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--checkpoint-check", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one extra step")
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                        help="trainer.backend.fused_kernels (fused SwiGLU and cross entropy)")
    parser.add_argument("--run-timeout", type=int, default=240)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        worker(arguments)
    else:
        main_all(arguments)
