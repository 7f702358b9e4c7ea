"""What exact behaviour log-probs cost: one vLLM worker's prefix-cache hit rate, rollout throughput
and log-prob gap under weight updates, for three ways of swapping the weights, side by side.

    in-place  before issue 18: the new weights go in between two steps; running requests keep their
              KV and the prefix cache keeps blocks computed by the old weights
    salt      in-place, but each request salts the prefix cache with the version the gateway knows
              (vLLM's `cache_salt`): no prefix reuse across versions, in-flight KV still mixed
    isolated  Libra now (engines/client.py): vLLM's pause(keep) with the caches cleared, load, label,
              resume; in-flight requests recompute their KV under the new weights

Every mode runs the same workload on the same server: `--groups` GRPO groups of `--samples`
conversations, each `--turns` turns of at most 40 sampled tokens (temperature 1, fixed seeds) with
a 12-token "tool result" between turns; a group's samples share a `--prompt`-token prompt (two of
vLLM's 128-token CPU blocks). `--updates` weight updates land while requests run, one after every
equal share of the turns; each version adds Gaussian noise (1% of each tensor's std, a training
step's worth) to the quickstart's tiny model. In-place and salt swap under pause(keep) without
clearing (their labels are exact; only the KV differs). Reported per mode (median over `--repeats`
interleaved runs), from vLLM's /metrics: prefix-cache hit rate of the requests' own prefills (Δ hits
/ Δ queried tokens), tokens computed (prefill and decode, `iteration_tokens_total`) per generated
token, preempted requests (vLLM counts their recompute in neither of the first two); generated
tokens per wall second and the engine's CPU milliseconds per generated token (its process group,
/proc); and the behaviour log-prob gap: mean |engine − trainer| per generated token, the trainer
(fp32, plain transformers) holding the token's own version.

    python benchmarks/logprob_isolation.py [--groups 4 --samples 8 --turns 3 --updates 4 --repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("in-place", "salt", "isolated")
MAX_TOKENS, TOOL_TOKENS, NOISE = 40, 12, 0.01


def make_versions(root: Path, count: int) -> list[Path]:
    """The quickstart's tiny model and `count - 1` noisy successors, each a model directory."""
    import torch
    from safetensors.torch import load_file, save_file

    from libra.model_config import ModelConfig
    from libra.tiny_model import create_tiny_model
    from libra.workloads.calculator import CalculatorWorkload
    from libra.workloads.config import CalculatorConfig

    base = create_tiny_model(ModelConfig(), CalculatorWorkload(CalculatorConfig()), root / "v0", seed=0)
    dirs, state = [base], load_file(str(base / "model.safetensors"))
    for version in range(1, count):
        generator = torch.Generator().manual_seed(version)
        state = {name: t + NOISE * t.float().std() * torch.randn(t.shape, generator=generator)
                 for name, t in state.items()}
        target = root / f"v{version}"
        shutil.copytree(base, target, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({name: t.contiguous() for name, t in state.items()}, str(target / "model.safetensors"))
        dirs.append(target)
    return dirs


async def generate(client, ids: list[int], seed: int, salt: str | None):
    """EngineClient.generate, plus a cache salt (the salt mode only)."""
    from dataclasses import replace

    from libra.services.rollout.engines.client import GENERATE_PATH, _generation, _only_choice, token_versions

    sampling = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0, "logprobs": 0, "seed": seed,
                "detokenize": False}
    body = {"model": client.model, "token_ids": ids, "sampling_params": sampling, "output_mode": "tokens",
            **({"cache_salt": salt} if salt else {})}
    choice = _only_choice(await client._post(GENERATE_PATH, body))
    generation = _generation(choice, [e["logprob"] for e in choice["logprobs"]["content"]], 0.0, "")
    return replace(generation, versions=token_versions(choice.get("weight_versions"), len(generation.token_ids)))


async def swap(client, mode: str, path: Path, version: int) -> None:
    """In-place and salt: pause without clearing, load, label, resume. Isolated: the client's own swap."""
    if mode == "isolated":
        await client.load_weights(str(path), version)
        return
    await client._post("/pause?mode=keep&clear_cache=false", {})
    await client._post("/collective_rpc", {"method": "libra_load_weights", "args": [str(path), str(version)]})
    await client._post("/update_weight_version", {"new_version": str(version)})
    await client._post("/resume", {})


async def metrics(client) -> dict[str, float]:
    text = await client.get_text("/metrics")
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
             "vllm:iteration_tokens_total_sum")
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
            for name in names}


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of every process in process group `pgid`: the worker's server,
    engine core and model worker (Linux /proc)."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime (11) stime (12)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def run_mode(client, mode: str, versions: list[Path], args, pgid: int) -> tuple[dict, list]:
    """One pass of the workload under `mode`; its figures and the conversations it produced."""
    await swap(client, "isolated", versions[0], 0)  # every run starts from v0 and an empty cache
    known = {"version": 0}
    total_turns = args.groups * args.samples * args.turns
    every = total_turns // (args.updates + 1)
    done = {"turns": 0}
    due = asyncio.Event()

    async def conversation(group: int, sample: int) -> tuple[list[int], int, list]:
        prompt = [3 + (group * 37 + 11 * i) % 300 for i in range(args.prompt)]  # ids the tiny vocabulary has
        ids, turns = list(prompt), []
        for turn in range(args.turns):
            salt = f"v{known['version']}" if mode == "salt" else None
            out = await generate(client, ids, 1000 * group + 10 * sample + turn, salt)
            turns.append((len(ids), out))
            ids += out.token_ids + [5 + (turn + i) % 50 for i in range(TOOL_TOKENS)]
            done["turns"] += 1
            if done["turns"] % every == 0:
                due.set()
        return ids, len(prompt), turns

    async def updater() -> None:
        for version in range(1, args.updates + 1):
            await due.wait()
            due.clear()
            if done["turns"] == total_turns:  # the workload ended first: no update with nothing in flight
                return
            await swap(client, mode, versions[version], version)
            known["version"] = version

    before, started, cpu = await metrics(client), time.perf_counter(), group_cpu_seconds(pgid)
    update_task = asyncio.create_task(updater())
    conversations = await asyncio.gather(*(conversation(g, s) for g in range(args.groups)
                                           for s in range(args.samples)))
    seconds = time.perf_counter() - started
    due.set()
    await update_task
    cpu = group_cpu_seconds(pgid) - cpu
    after = await metrics(client)
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    tokens = sum(len(out.token_ids) for _, _, turns in conversations for _, out in turns)
    computed = after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"]
    figures = {"hit_rate": hits / max(queried, 1), "computed_per_token": computed / tokens,
               "preempted": after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
               "tokens_per_s": tokens / seconds, "cpu_ms_per_token": 1000 * cpu / tokens, "tokens": tokens,
               "updates": known["version"]}
    return figures, conversations


def behaviour_gap(conversations: list, versions: list[Path]) -> float:
    """Mean |engine − trainer| per generated token, the trainer holding the token's labelled version."""
    import torch
    from transformers import AutoModelForCausalLM

    from libra.services.trainer.backend import token_logprobs

    total = count = 0.0
    for version, path in enumerate(versions):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        for ids, _, turns in conversations:
            tokens = torch.tensor([ids])
            with torch.no_grad():
                ours = token_logprobs(model(input_ids=tokens).logits, tokens)[0].tolist()
            for start, out in turns:
                for i, (logprob, label) in enumerate(zip(out.logprobs, out.versions)):
                    if label == version:
                        total, count = total + abs(ours[start + i - 1] - logprob), count + 1
    return total / max(count, 1)


async def main_async(args) -> int:
    from libra.redis_server import free_port
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.engines.client import EngineClient
    from libra.services.rollout.engines.vllm_worker import log_tail
    from libra.services.rollout.workers import worker_process_class

    root = Path(tempfile.mkdtemp(prefix="libra-isolation-"))
    versions = make_versions(root, args.updates + 1)
    config = WorkerConfig(engine={"type": "vllm", "kv_cache_gib": 0.25}, max_model_len=512, max_num_seqs=64,
                          cpu_threads=1)
    port = args.port or free_port()
    worker = worker_process_class("vllm")(config, versions[0], 0, root / "logs", port=port).start()
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    try:
        await worker.wait_ready(timeout=600)
        async with EngineClient(worker.base_url, timeout_s=300) as client:
            for repeat in range(args.repeats):
                for mode in args.modes:
                    figures, conversations = await run_mode(client, mode, versions, args, worker.process.pid)
                    figures["gap"] = behaviour_gap(conversations, versions)
                    results[mode].append(figures)
                    print(f"run {repeat + 1} {mode:9s} " + " ".join(f"{k} {v:.4g}" for k, v in figures.items()),
                          flush=True)
    except Exception:
        print(f"the worker's log ends ({worker.log_path}, kept):\n{log_tail(worker.log_path, 40)}", file=sys.stderr)
        worker.stop()
        raise
    worker.stop()
    shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.groups} groups x {args.samples} samples x {args.turns} turns, {args.updates} updates in flight, "
          f"prompt {args.prompt} tokens; medians of {args.repeats} runs")
    print(f"{'mode':10s} {'prefix hit rate':>16s} {'computed/token':>15s} {'preempted':>10s} {'tokens/s':>9s} "
          f"{'engine CPU ms/token':>20s} {'|engine - trainer|':>19s}")
    for mode in args.modes:
        rows = results[mode]

        def median(key: str) -> float:
            return statistics.median(r[key] for r in rows)

        print(f"{mode:10s} {median('hit_rate'):16.1%} {median('computed_per_token'):15.2f} {median('preempted'):10.0f} "
              f"{median('tokens_per_s'):9.0f} {median('cpu_ms_per_token'):20.2f} {median('gap'):19.1e}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=260)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
