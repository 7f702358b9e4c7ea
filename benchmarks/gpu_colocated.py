"""Colocated weights on one GPU: time per policy version through CUDA IPC handles, at 1B and 7B.

    python benchmarks/gpu_colocated.py --sets 1b,7b --versions 5 --out DIR     # DIR/colocated.json, a table last

Two processes on one GPU, as `weights: colocated` runs them: a trainer process (spawned) holds the
version's HF tensors and a `ColocatedExport` (libra/weights/ipc.py), and this process holds the hf
engine's side — a real transformers model of the same shape and the engine's own weight-load code
(`HFWeightLoads.receive_colocated`, the method hf_server runs for the gateway). Per version: the
trainer changes its weights in place (as a step would), writes them into its export buffer
(`write`: device copies, synchronised), then the engine takes the version (`share`: its parameters
become views of the buffer; `copy`: one device copy into its own, laid-out-flat parameters).
Reported: the trainer's write, the engine's take and their sum, median over --versions after a
first version (which also opens the IPC handles and, in copy mode, lays the parameters out).
After the first and the last version the engine's weights are checked against the trainer's.

Tensor sets: benchmarks/gpu_weight_sync.py's Llama shapes ("1b": Llama-3.2-1B-like, 3.0 GB;
"7b": Llama-2-7B-like, 13.5 GB, bf16), so the figures sit beside that benchmark's two-GPU NCCL
path (the weights group, receiver flat: what the hf engine does), read from its recorded run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
NCCL_RUN = ROOT / "benchmarks/results/gpu/session4/sync_run2_flat_trace.json"
ARCH = {"tiny": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, vocab_size=1000,
                     num_attention_heads=4, num_key_value_heads=4),
        "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, vocab_size=128256,
                   num_attention_heads=32, num_key_value_heads=8),
        "7b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, vocab_size=32000,
                   num_attention_heads=32, num_key_value_heads=32)}


def llama_config(name: str):
    from transformers import LlamaConfig

    return LlamaConfig(**ARCH[name], tie_word_embeddings=False, max_position_embeddings=4096)


def trainer(set_name: str, modes: list[str], versions: int, requests, answers) -> None:
    """The trainer's process: its HF tensors, one export per mode, a version written on each request."""
    import torch

    from libra.weights.ipc import ColocatedExport

    try:
        from gpu_weight_sync import SETS, llama_shapes  # the same names and shapes as the NCCL benchmark

        generator = torch.Generator(device="cuda").manual_seed(1)
        named = [(n, torch.empty(s, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=generator))
                 for n, s in llama_shapes(*SETS[set_name])]
        for mode in modes:
            export = ColocatedExport(named, mode, "cuda:0")
            for version in range(1, versions + 2):
                assert requests.get() == (mode, version)
                with torch.no_grad():
                    for _, tensor in named:
                        tensor.add_(1.0 / 64)  # the weights change between versions, as a training step does
                torch.cuda.synchronize()
                started = time.perf_counter()
                descriptor = export.write(named, version)
                seconds = time.perf_counter() - started
                check = version in (1, versions + 1)
                answers.put((descriptor, seconds, {n: float(t.double().sum()) for n, t in named} if check else None))
            requests.get()  # the engine no longer uses this export's buffers
            del export
            torch.cuda.empty_cache()
        answers.put(("done", 0.0, None))
    except Exception as error:  # noqa: BLE001 - reported to the main process
        answers.put((None, 0.0, f"{type(error).__name__}: {error}"))


class Engine:
    """The hf engine's weight side (`HFWeightLoads`) around a real transformers model on the GPU."""

    def __init__(self, set_name: str):
        import torch
        from transformers import AutoModelForCausalLM

        from libra.services.rollout.engines.hf_weights import HFWeightLoads

        class Loads(HFWeightLoads):
            pass

        self.loads = Loads()
        with torch.device("cuda"):  # initialised on the GPU: seconds, not minutes, for 7B
            self.loads.model = AutoModelForCausalLM.from_config(llama_config(set_name), dtype=torch.bfloat16)
        self.loads.device, self.loads.version, self.loads.dirty = torch.device("cuda:0"), 0, None
        self.loads.weights_group, self.loads.refresh_kv = None, lambda: None

    def take(self, descriptor: str, version: int) -> float:
        started = time.perf_counter()
        answer = self.loads.receive_colocated(descriptor, version)
        seconds = time.perf_counter() - started
        if answer.get("version") != version:
            raise RuntimeError(f"the engine refused version {version}: {answer}")
        return seconds

    def sums(self) -> dict[str, float]:
        return {n: float(p.detach().double().sum()) for n, p in self.loads.model.named_parameters()}


def run_set(set_name: str, modes: list[str], versions: int) -> list[dict]:
    import torch

    context = multiprocessing.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    process = context.Process(target=trainer, args=(set_name, modes, versions, requests, answers), daemon=True)
    process.start()
    engine = Engine(set_name)
    nbytes = sum(p.numel() * p.element_size() for p in engine.loads.model.parameters())
    results = []
    try:
        for mode in modes:
            writes, takes = [], []
            checks_ok = True
            for version in range(1, versions + 2):
                requests.put((mode, version))
                descriptor, write_s, expected = answers.get(timeout=600)
                if descriptor is None:
                    raise RuntimeError(f"trainer process: {expected}")
                take_s = engine.take(descriptor, version)
                if expected is not None:
                    checks_ok = checks_ok and engine.sums() == expected
                writes.append(write_s)
                takes.append(take_s)
            engine.loads.own_weights()  # leave the trainer's buffers before the trainer drops them
            requests.put("release")
            write, take = statistics.median(writes[1:]), statistics.median(takes[1:])
            results.append({"set": set_name, "mode": mode, "bytes": nbytes, "versions": versions,
                            "write_s": write, "take_s": take, "total_s": write + take,
                            "first_write_s": writes[0], "first_take_s": takes[0], "weights_equal": checks_ok,
                            "write_all_s": writes, "take_all_s": takes,
                            "engine_memory_gib": torch.cuda.memory_allocated() / 2**30})
            print(json.dumps({k: v for k, v in results[-1].items() if not k.endswith("all_s")}), flush=True)
        answers.get(timeout=60)
    finally:
        process.join(60)
    return results


def nccl_figures() -> dict[str, float]:
    """The two-GPU weights group (receiver flat) per set, from gpu_weight_sync.py's recorded run."""
    if not NCCL_RUN.exists():
        return {}
    return {r["set"]: r["group_rflat_s"] for r in json.loads(NCCL_RUN.read_text())["results"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="1b,7b", help=f"comma-separated of {sorted(ARCH)}")
    parser.add_argument("--modes", default="share,copy")
    parser.add_argument("--versions", type=int, default=5, help="timed versions after the first")
    parser.add_argument("--out", default="/tmp/libra-gpu-out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for set_name in args.sets.split(","):
        results += run_set(set_name, args.modes.split(","), args.versions)
    nccl = nccl_figures()
    summary = {"command": " ".join(sys.argv), "results": results, "nccl_two_gpus_s": nccl,
               "nccl_source": str(NCCL_RUN.relative_to(ROOT))}
    pathlib.Path(args.out, "colocated.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{'set':4} {'GB':>6} {'mode':6} {'write ms':>9} {'take ms':>8} {'total ms':>9} {'GB/s':>7} "
          f"{'NCCL 2-GPU ms':>13} {'x NCCL':>7} {'first ms':>9} {'equal':>6}")
    for r in results:
        two_gpus = nccl.get(r["set"])
        print(f"{r['set']:4} {r['bytes'] / 1e9:6.2f} {r['mode']:6} {r['write_s'] * 1e3:9.2f} {r['take_s'] * 1e3:8.2f} "
              f"{r['total_s'] * 1e3:9.2f} {r['bytes'] / r['total_s'] / 1e9:7.0f} "
              f"{(two_gpus or float('nan')) * 1e3:13.2f} {(two_gpus or float('nan')) / r['total_s']:7.2f} "
              f"{(r['first_write_s'] + r['first_take_s']) * 1e3:9.1f} {str(r['weights_equal']):>6}")
    return 0 if results and all(r["weights_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
