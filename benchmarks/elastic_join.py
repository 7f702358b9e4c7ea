"""What a joining hybrid replica costs the core: step time during the join vs steady state, and join latency.

    core rank(s) (--device)                               hybrid (subprocess, --hybrid-device)
    ───────────────────────                               ────────────────────────────────────
    steady:  N steps, no hybrid            (baseline)
    admit ─▶ steps go on ─────────── process starts, connects, builds its model (startup window)
    boundary: snapshot copied, shards written in a thread ─▶ loads the shards  (join window)
    each step's gradient streamed as it ends ────────────▶ replays them, caught up
    boundary: active ─▶ M steps with the hybrid (widened batch, gradient over the side channel)

The core is D data-parallel ranks (--core-ranks; processes over gloo when D > 1) of the plain
torch backend with the real `ElasticCore`; the hybrid is the real
`python -m libra.services.trainer.elastic.hybrid` process.
Control frames go over the TCP side channel; gradients (the hybrid's, the reduced one back, the
catch-up) go by --channel: tcp (in the frames; staged through host memory on GPUs), group (a
private two-rank group per hybrid: NCCL between two GPUs, gloo otherwise), auto (group when both
are on GPUs, else tcp). The core's own process group is never used for the hybrid. Every step
time includes the boundary (membership freeze, snapshot copy) and the full train step.

    python benchmarks/elastic_join.py                                   # CPU, one core rank
    python benchmarks/elastic_join.py --channel group                   # CPU, gradients over gloo
    python benchmarks/elastic_join.py --core-ranks 2                    # CPU, two core ranks over gloo
    python benchmarks/elastic_join.py --device cuda:0 --hybrid-device cuda:1 --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off (shared machines)


def make_model(path: str, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 128),
                         vocab_size=args.vocab, max_position_embeddings=args.seq_len * 2)
    LlamaForCausalLM(config).save_pretrained(path)


def groups(step: int, count: int, args):
    import torch

    from libra.services.trainer.backend import TrainBatch, TrainSequence

    sequences = []
    gen = torch.Generator().manual_seed(step)
    prompt = args.seq_len // 4
    for g in range(count):
        for i in range(args.group_size):
            tokens = torch.randint(1, args.vocab, (args.seq_len,), generator=gen).tolist()
            response = args.seq_len - prompt
            behaviour = (-torch.rand(response, generator=gen) - 3.0).tolist()
            sequences.append(TrainSequence(tokens, prompt, [1] * response, behaviour, 1.0 if i % 2 else -1.0))
    return TrainBatch(sequences)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="core device: cpu or cuda:N (cuda: one core rank)")
    parser.add_argument("--hybrid-device", default="cpu", help="hybrid device: cpu or cuda:N")
    parser.add_argument("--core-ranks", type=int, default=1, help="core data-parallel ranks (processes, gloo)")
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch",
                        help="the core's training backend (the hybrid builds the same; megatron: one core rank)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2, help="groups per step per replica")
    parser.add_argument("--steady-steps", type=int, default=10)
    parser.add_argument("--active-steps", type=int, default=5)
    parser.add_argument("--max-join-steps", type=int, default=1000, help="give up if not active after this many")
    parser.add_argument("--max-catch-up-steps", type=int, default=64,
                        help="gradients the core may keep for a join in progress (device memory)")
    parser.add_argument("--max-join-s", type=float, default=180.0,
                        help="give up if not active this many seconds after admission (bounds the run)")
    parser.add_argument("--channel", choices=("auto", "tcp", "group"), default="auto",
                        help="how gradients travel: auto (group on two GPUs, else tcp), tcp, group")
    parser.add_argument("--grad-deadline-s", type=float, default=60.0,
                        help="a hybrid's gradient (and every pair-group transfer) must arrive within this")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each core rank and the hybrid")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.core_ranks > 1 and args.device != "cpu":
        parser.error("--core-ranks > 1 runs on CPU over gloo; on GPUs use one core rank")
    if args.core_ranks > 1 and args.backend == "megatron":
        parser.error("--backend megatron runs one core rank")
    return args


def run_rank(rank: int, world: int, args: argparse.Namespace, model_dir: str, work: str, port: int) -> None:
    """One core rank: steady steps, a hybrid joins (launched by rank 0), active steps, release."""
    import torch

    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.elastic.core_hooks import ElasticCore
    from libra.services.trainer.elastic.manifest import HybridState
    from libra.services.trainer.elastic.work import split, widened_groups
    from libra.services.trainer.torch_backend import TorchBackend

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    settings = ("torch" if args.backend == "torch"  # megatron: hybrids need the whole reduced gradient
                else {"type": "megatron", "distributed_optimizer": False})
    config = TrainerConfig(lr=1e-4, micro_batch_size=args.group_size * args.groups, torch_threads=args.threads,
                           groups_per_step=args.groups * world, group_size=args.group_size, backend=settings)
    if args.backend == "megatron":  # the core rank's GPU (or the CPU) is chosen by Megatron's init
        from libra.services.trainer.megatron.backend import MegatronBackend

        if args.device.startswith("cuda"):
            os.environ["LOCAL_RANK"] = str(torch.device(args.device).index or 0)
        backend = MegatronBackend(config)
        backend.load(model_dir)
    else:
        backend = TorchBackend(config)
        backend.load(model_dir)
        backend.to(args.device)
    core = ElasticCore(backend, dp_rank=rank, core_ranks=world, snapshot_root=os.path.join(work, "snapshots"),
                       snapshot_shards=args.shards, max_catch_up_steps=args.max_catch_up_steps,
                       channel=args.channel, grad_deadline_s=args.grad_deadline_s)
    backend.gradient_hook = core
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    step, rows, channel = 0, [], ""

    def one_step(phase: str) -> None:
        nonlocal step, channel
        step += 1
        began = time.perf_counter()
        manifest = core.begin_step(step)
        batch = groups(step, widened_groups(config.groups_per_step, manifest), args)
        slices = split(batch, args.group_size, manifest)
        core.assign(slices)
        backend.train_step(slices[f"core-{rank}"], config)
        core.end_step()
        sync()
        record = core.membership.hybrid("h-bench")
        link = core.endpoint.link("h-bench")
        channel = link.channel if link is not None else channel  # this rank's, if it owns the hybrid
        rows.append({"step": step, "phase": phase, "seconds": time.perf_counter() - began,
                     "state": record.state.value if record else "", "replicas": manifest.replicas,
                     **core.step_timings})

    for _ in range(3):
        one_step("warmup")
    for _ in range(args.steady_steps):
        one_step("steady")
    admitted_at, started = step + 1, time.monotonic()
    if rank == 0:
        core.admit("h-bench")
    hybrid = None
    snapshot_at = active_at = None
    def in_time() -> bool:  # every rank must take the same decision (each step is a collective)
        return not any(_all_gather(time.monotonic() - started >= args.max_join_s))

    while active_at is None and step - admitted_at < args.max_join_steps and in_time():
        record = core.membership.hybrid("h-bench")
        if rank == 0 and hybrid is None and record is not None:  # started once its core rank is known
            hybrid = subprocess.Popen(
                [sys.executable, "-m", "libra.services.trainer.elastic.hybrid", "--endpoint",
                 core.lane_endpoints[record.dp_rank], "--replica-id", "h-bench", "--threads", str(args.threads),
                 "--device", args.hybrid_device], cwd=ROOT)
        phase = "startup" if record is None or record.state == HybridState.JOINING else "join"
        one_step(phase)
        record = core.membership.hybrid("h-bench")
        if record.state == HybridState.FAILED:
            raise SystemExit(f"the join failed: {record.reason}")
        if record.state == HybridState.SNAPSHOT and snapshot_at is None:
            snapshot_at, snapshot_clock = step, time.monotonic()
            rows[-1]["phase"] = "join"  # the boundary that copied the snapshot belongs to the join
        if record.state == HybridState.ACTIVE:
            active_at, active_clock = step, time.monotonic()
            rows[-1]["phase"] = "active"
    if active_at is None:
        if hybrid is not None:
            hybrid.kill()
        raise SystemExit(f"the hybrid did not become active within {args.max_join_steps} steps or "
                         f"{args.max_join_s} s (--max-join-steps, --max-join-s)")
    for _ in range(args.active_steps - 1):
        one_step("active")
    # Lockstep: one more step in which the hybrid sends a hash of its parameters and the core compares
    # it with its own (a mismatch fails the hybrid); not timed (both hash every byte on the host).
    core.verify_lockstep = True
    one_step("lockstep")
    core.verify_lockstep = False
    record = core.membership.hybrid("h-bench")
    lockstep = _all_gather(record is not None and record.state == HybridState.ACTIVE)
    if not all(lockstep):
        raise SystemExit(f"the lockstep check failed: {record.reason if record else 'hybrid gone'}")
    if rank == 0:
        core.release("h-bench")
    one_step("released")
    code = hybrid.wait(60) if hybrid is not None else None
    core.close()
    channels = _all_gather(channel)  # the owning rank knows its link's channel
    if rank == 0:
        report(args, rows, backend.num_parameters(), world, code, admitted_at, snapshot_at, active_at,
               snapshot_clock, active_clock, started, next((c for c in channels if c), "?"))


def _all_gather(value):
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def report(args, rows, params, world, code, admitted_at, snapshot_at, active_at, snapshot_clock, active_clock,
           started, channel) -> None:
    def values(phase: str) -> list[float]:
        return [r["seconds"] for r in rows if r["phase"] == phase]

    def median(phase: str) -> float:
        return statistics.median(values(phase)) if values(phase) else float("nan")

    def mean(phase: str) -> float:
        return statistics.fmean(values(phase)) if values(phase) else float("nan")

    steady = median("steady")

    def extra(phase: str) -> float:
        """Seconds the core lost in a phase against steady-state steps (spikes included)."""
        return sum(v - steady for v in values(phase))

    result = {
        "backend": args.backend, "device": args.device, "hybrid_device": args.hybrid_device, "core_ranks": world,
        "channel_flag": args.channel, "channel": channel,
        "params": params, "steady_step_s": steady,
        "startup_step_s": median("startup"), "join_step_s": median("join"), "active_step_s": median("active"),
        "join_vs_steady": median("join") / steady, "startup_vs_steady": median("startup") / steady,
        "join_mean_vs_steady": mean("join") / steady, "join_extra_s": extra("join"),
        "first_active_step_s": values("active")[0],
        "join_steps": len(values("join")), "startup_steps": len(values("startup")),
        "admission_to_active_steps": active_at - admitted_at, "snapshot_to_active_steps": active_at - snapshot_at,
        "snapshot_to_active_s": active_clock - snapshot_clock, "admission_to_active_s": active_clock - started,
        "hybrid_exit_code": code, "rows": rows,
        "lockstep_step": next(r["step"] for r in rows if r["phase"] == "lockstep"),
    }
    print(f"model: {params / 1e6:.2f} M parameters; {world} core rank(s) on {args.device}, "
          f"hybrid on {args.hybrid_device}; gradient channel: {channel} (--channel {args.channel})")
    print(f"{'phase':<36}{'median s':>9}{'vs steady':>10}{'mean s':>8}{'vs steady':>10}{'extra s':>8}{'steps':>6}")
    for label, phase in (("steady state (baseline)", "steady"), ("hybrid process starting", "startup"),
                         ("join: snapshot write/load, catch-up", "join"), ("hybrid active (widened batch)", "active")):
        print(f"{label:<36}{median(phase):>9.4f}{median(phase) / steady:>9.3f}x{mean(phase):>8.4f}"
              f"{mean(phase) / steady:>9.3f}x{extra(phase):>8.2f}{len(values(phase)):>6}")
    active = [r for r in rows if r["phase"] == "active"][1:]  # after the activation step
    if active and "inject_s" in active[0]:
        parts = {k: statistics.median(r.get(k, 0.0) for r in active) for k in ("start_s", "inject_s", "deliver_s")}
        result["active_parts_s"] = parts
        print("active steps, median core time in the hybrid's share: sending its slice "
              f"{parts['start_s'] * 1e3:.1f} ms, waiting for and adding its gradient {parts['inject_s'] * 1e3:.1f} ms, "
              f"sending the reduced gradient {parts['deliver_s'] * 1e3:.1f} ms")
    print(f"lockstep: the hybrid's parameter hash equalled the core's in step {result['lockstep_step']}")
    print(f"first active step (activation: last catch-up gradients, then the step): "
          f"{result['first_active_step_s']:.3f} s")
    print(f"join latency: {result['snapshot_to_active_steps']} steps ({result['snapshot_to_active_s']:.2f} s) "
          f"from the snapshot boundary; {result['admission_to_active_steps']} steps "
          f"({result['admission_to_active_s']:.2f} s) from admission incl. process start; hybrid exit {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def main() -> None:
    args = parse_args()
    work = tempfile.mkdtemp(prefix="libra-elastic-bench-")
    model_dir = os.path.join(work, "model")
    make_model(model_dir, args)
    if args.core_ranks == 1:
        run_rank(0, 1, args, model_dir, work, 0)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # fork: the ranks inherit the imported modules (each runs torch with --threads intra-op threads).
    mp.start_processes(run_rank, args=(args.core_ranks, args, model_dir, work, port), nprocs=args.core_ranks,
                       join=True, start_method="fork")


if __name__ == "__main__":
    main()
