"""Weight sync throughput: the weights group's bucketed broadcast against a plain broadcast.

Two processes, one per device (rank 0 = trainer, rank 1 = worker), over one weights group created
once (NCCL on GPUs, gloo on CPU for a dry run). For each tensor set (Llama-shaped, ~1B and ~7B
parameters in bf16 by default) it measures, in the same run and on the same communicator:

  plain      one broadcast of a single flat tensor of the same byte count (the ceiling)
  per-tensor one broadcast per tensor, no packing (what a naive sync does)
  group      WeightsGroup.send / receive: handshake, fixed-size buckets (double-buffered), the
             receiver unpacking straight into its own parameter tensors
  --flat     then the same with the receiver's tensors laid out as the stream (weight_flat: what the
             hf engine does after its first version; no unpack copy), then the sender's too (no pack)

and prints GB/s (bytes / seconds, seconds = median of the repeats) and group / plain. Checksums of
the received tensors are compared with the sender's, so a wrong transfer fails the run.

    python benchmarks/gpu_weight_sync.py --sets 1b,7b --repeats 5            # two GPUs, NCCL
    python benchmarks/gpu_weight_sync.py --backend gloo --devices cpu,cpu --sets tiny   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off (shared machines)

# (hidden, layers, intermediate, vocab, kv_heads ratio): Llama-3.2-1B-like and Llama-2-7B-like shapes
SETS = {"tiny": (256, 2, 512, 1000, 1), "1b": (2048, 16, 8192, 128256, 4), "7b": (4096, 32, 11008, 32000, 1)}


def llama_shapes(hidden: int, layers: int, inter: int, vocab: int, kv_ratio: int) -> list[tuple[str, tuple]]:
    kv = hidden // kv_ratio
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)), (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def checksum(tensors) -> float:
    return float(sum(t.double().sum() for t in tensors)) if tensors else 0.0


def _timed(fn, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def run_rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from libra.weights.flat import FlatWeights
    from libra.weights.group import WeightsGroup, plan_layout

    device = torch.device(args.devices.split(",")[rank])
    dtype = getattr(torch, args.dtype)
    group = WeightsGroup("127.0.0.1", port, rank, 2, args.backend, device=str(device), timeout_s=300,
                         bucket_bytes=args.bucket_mb * 2**20,
                         direct_bytes=args.direct_mb * 2**20 if args.direct_mb > 0 else None)
    results = []
    version = [0]  # policy versions only grow, across tensor sets too (the store keys are per version)
    for set_name in args.sets.split(","):
        shapes = llama_shapes(*SETS[set_name])
        generator = torch.Generator(device=device).manual_seed(1) if rank == 0 else None
        tensors = {}
        for name, shape in shapes:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if rank == 0:
                tensor.uniform_(-1, 1, generator=generator)
            else:
                tensor.zero_()
            tensors[name] = tensor
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        flat = torch.empty(total, dtype=torch.uint8, device=device)

        def broadcast(tensor):
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.group.broadcast([tensor], options).wait()

        def plain():
            broadcast(flat)

        def per_tensor():
            for tensor in tensors.values():
                broadcast(tensor)

        reports: dict[str, list] = {}
        mine = {"set": tensors}  # what this rank sends or receives into: the tensors, or them flat

        def synced(label: str = "group"):
            version[0] += 1
            if rank == 0:
                reports.setdefault(label, []).append(group.send(mine["set"], version[0]))
            else:
                for _ in group.receive(version[0], targets=mine["set"]):
                    pass

        def flatten(when: str) -> None:  # the same tensor objects, moved into one stream-shaped buffer
            if when == ("receiver" if rank else "sender"):
                mine["set"] = FlatWeights.adopt(tensors, plan_layout(tensors.items(), 0, group.bucket_bytes))
                assert mine["set"] is not None

        timings, checksums = {}, {}
        runs = [("plain", plain, None), ("per_tensor", per_tensor, None), ("group", synced, None)]
        if args.flat:  # the receiver's parameters flat (the hf engine), then the sender's too
            runs += [("group_rflat", lambda: synced("group_rflat"), "receiver"),
                     ("group_flat", lambda: synced("group_flat"), "sender")]
        traces = {}
        for label, fn, flat_side in runs:
            if flat_side:
                flatten(flat_side)
            for _ in range(args.warmup):
                _timed(fn, device)
            group.trace = [] if args.trace else None
            timings[label] = [_timed(fn, device) for _ in range(args.repeats)]
            if group.trace:
                traces[label] = group.trace
            group.trace = None
            if label.startswith("group"):  # check what one sync alone delivers
                if rank != 0:
                    for tensor in tensors.values():
                        tensor.zero_()
                synced("check")
                checksums[label] = checksum(list(tensors.values()))
            if label == "per_tensor":
                flat = None  # free it before the group runs
        record = {"set": set_name, "params": sum(t.numel() for t in tensors.values()), "bytes": total,
                  "tensors": len(tensors), "bucket_mb": args.bucket_mb, "direct_mb": args.direct_mb, "dtype": args.dtype,
                  "backend": args.backend, "checksums": checksums, "traces": traces,
                  **{f"{k}_s": statistics.median(v) for k, v in timings.items()},
                  **{f"{k}_all_s": v for k, v in timings.items()}}
        for label in timings:
            record[f"{label}_gbps"] = total / record[f"{label}_s"] / 1e9
            record[f"{label}_over_plain"] = record[f"{label}_gbps"] / record["plain_gbps"]
            if label in reports:  # the sender's own split of a sync: waiting for receivers, then the transfer
                record[f"{label}_send_handshake_s"] = statistics.median(r.handshake_seconds for r in reports[label])
                record[f"{label}_send_transfer_s"] = statistics.median(r.seconds for r in reports[label])
        record["group_over_plain"] = record["group_gbps"] / record["plain_gbps"]
        results.append(record)
        tensors = {}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _phases(sender: list, receiver: list) -> str:
    """Median time of every phase, both ranks, in ms after the sender's start of the same version (one
    host: perf_counter is the same monotonic clock in both processes)."""
    start = {version: t for version, phase, t in sender if phase == "send"}
    marks: dict[str, list[float]] = {}
    for rank, trace in (("S", sender), ("R", receiver)):
        for version, phase, t in trace:
            if version in start:
                marks.setdefault(f"{rank}:{phase}", []).append((t - start[version]) * 1e3)
    ordered = sorted(marks.items(), key=lambda item: statistics.median(item[1]))
    return ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in ordered)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", default="1b,7b", help=f"comma-separated, of {sorted(SETS)}")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--devices", default="cuda:0,cuda:1", help="device of rank 0 (sender) and rank 1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--direct-mb", type=int, default=0,
                        help="tensors of at least this many MiB are broadcast on their own (0: every tensor through buckets)")
    parser.add_argument("--flat", action="store_true",
                        help="also time the receiver's tensors flat (as the hf engine keeps them), then both sides flat")
    parser.add_argument("--trace", action="store_true",
                        help="print when each phase of a group sync happened on both ranks (median, ms after the sender's start)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="", help="write the JSON result here too")
    args = parser.parse_args()
    import tempfile

    import torch.multiprocessing as mp

    from libra.redis_server import free_port

    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(run_rank, args=(args, free_port(), scratch), nprocs=2, start_method="spawn")
        sent, received = (json.loads(Path(scratch, f"rank{r}.json").read_text()) for r in (0, 1))
    names = {"group": "group (pack + unpack)", "group_rflat": "group, receiver flat", "group_flat": "group, both flat"}
    print(f"{'set':>5} {'params':>8} {'GB':>7} {'plain GB/s':>11} {'per-tensor':>11}  (per-tensor / plain)")
    for mine, theirs in zip(sent, received):
        ok = {label: abs(value - theirs["checksums"][label]) <= 1e-6 * max(1.0, abs(value))
              for label, value in mine["checksums"].items()}
        mine["checksum_ok"] = all(ok.values())
        mine["receiver"] = {k: theirs[k] for k in theirs if k.endswith("_s") or k.endswith("_gbps")}
        print(f"{mine['set']:>5} {mine['params'] / 1e9:7.2f}B {mine['bytes'] / 1e9:7.2f} {mine['plain_gbps']:11.1f} "
              f"{mine['per_tensor_gbps']:11.1f}  ({mine['per_tensor_over_plain']:.1%})")
        for label, title in names.items():
            if f"{label}_s" not in mine:
                continue
            print(f"      {title:<24} {mine[f'{label}_gbps']:7.1f} GB/s {mine[f'{label}_over_plain']:7.1%} of plain"
                  f"  {mine[f'{label}_s'] * 1e3:6.2f} ms = handshake {mine[f'{label}_send_handshake_s'] * 1e3:.2f}"
                  f" + transfer {mine[f'{label}_send_transfer_s'] * 1e3:.2f} + acks; checksum ok {ok[label]}")
        print(f"      plain {mine['plain_s'] * 1e3:.2f} ms")
        for label in mine["traces"]:
            print(f"      trace of {names[label]}: " + _phases(mine["traces"][label], theirs["traces"][label]))
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv, "results": sent}, indent=1))
    return 0 if all(r["checksum_ok"] for r in sent) else 1


if __name__ == "__main__":
    raise SystemExit(main())
