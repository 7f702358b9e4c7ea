"""A short end-to-end GRPO run on two devices: torch training on one, the hf engine on the other,
weights synced over the weights group (NCCL on GPUs) after every step; reward and timings logged.

    trainer process (rank 0, --train-device)              hf engine server (rank 1, --engine-device)
    ────────────────────────────────────────              ──────────────────────────────────────────
    rollout: groups × samples calculator episodes ──HTTP──▶ /v1/completions (token ids + log-probs)
    GRPO step: group advantages, clipped loss, AdamW
    sync: WeightsGroup.send(version) ─────NCCL broadcast──▶ /collective_rpc libra_receive_weights
    log: reward, |trainer − engine| log-prob gap, rollout / train / sync seconds

A minimal in-process loop, not the services (no Redis, no gRPC: the H200 machine has neither):
the math is the trainer's (`pack`, `token_logprobs`, `group_advantages`, `policy_loss`), the
episodes follow the agent runner's rules (token ids end to end, tool results masked out, a
malformed turn gets a format-error result), and the engine is the real HTTP server. The loop is
synchronous (sample, train, sync), so the log-prob gap measures only engine-vs-trainer numerics.

    python benchmarks/gpu_e2e_grpo.py --model DIR --steps 8                       # two GPUs, NCCL
    python benchmarks/gpu_e2e_grpo.py --model DIR --backend gloo --train-device cpu --engine-device cpu --steps 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # NVLink multicast stays off (shared machines)


async def play(client, workload, tokenizer, prompt_id: int, sample: int, step: int, args, stop_ids):
    """One calculator episode on the engine; returns (ids, prompt_length, mask, behaviour, reward)."""
    from libra.workloads.base import FinalAnswer, Malformed, ToolCall, ToolResult, ToolStatus, TurnBudget

    episode = workload.episode(prompt_id, sample, step * 100_003 + prompt_id * 101 + sample,
                               TurnBudget(args.max_turns, args.max_new_tokens, args.max_total_tokens))
    ids = list(tokenizer(episode.prompt.text, add_special_tokens=True).input_ids)
    prompt_length, mask, behaviour, answer = len(ids), [], [], None
    for turn in range(args.max_turns):
        budget = episode.max_new_tokens(turn, len(ids))
        if budget <= 0:
            break
        seed = (step * 7919 + prompt_id * 131 + sample * 17 + turn) & 0x7FFFFFFF
        generation = await client.generate(ids, budget, temperature=1.0, top_p=1.0, stop_token_ids=stop_ids, seed=seed)
        ids += generation.token_ids
        mask += [1] * len(generation.token_ids)
        behaviour += generation.logprobs
        action = episode.parse_turn(tokenizer.decode(generation.token_ids, skip_special_tokens=False))
        if isinstance(action, FinalAnswer):
            answer = action
            break
        if isinstance(action, ToolCall):
            result = await episode.call_tool(action, 5.0)
        else:
            reason = action.reason if isinstance(action, Malformed) else "unrecognised turn"
            result = ToolResult(tool="format", status=ToolStatus.FAILURE, payload=reason)
        tool_ids = list(tokenizer(episode.render_tool_result(result), add_special_tokens=False).input_ids)
        ids += tool_ids
        mask += [0] * len(tool_ids)
        behaviour += [0.0] * len(tool_ids)
    reward = float(episode.reward(answer))
    await episode.close()
    return ids, prompt_length, mask, behaviour, reward


def train_step(model, optimizer, sequences, args) -> dict:
    """One GRPO step over `sequences` (micro-batched); returns loss metrics and the log-prob gap."""
    import torch

    from libra.services.trainer.backend import TrainBatch, pack, token_logprobs
    from libra.services.trainer.grpo import policy_loss

    device = next(model.parameters()).device
    batch = TrainBatch(sequences)
    tokens = batch.loss_tokens
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "gap_sum": 0.0}
    for micro in batch.micro_batches(args.micro_batch):
        packed = pack(micro, pad_id=0)
        moved = {k: getattr(packed, k).to(device) for k in ("input_ids", "attention_mask", "loss_mask",
                                                            "behaviour_logprobs", "advantages", "response_mask")}
        logits = model(input_ids=moved["input_ids"], attention_mask=moved["attention_mask"]).logits
        new = token_logprobs(logits, moved["input_ids"])
        loss, _ = policy_loss(new, moved["behaviour_logprobs"], moved["behaviour_logprobs"], moved["advantages"],
                              moved["loss_mask"], args.clip_low, args.clip_high, 2.0, 0.0, token_count=tokens)
        loss.backward()
        sums["loss"] += float(loss.detach())
        gap = ((new.detach() - moved["behaviour_logprobs"]).abs() * moved["loss_mask"]).sum()
        sums["gap_sum"] += float(gap)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": sums["loss"], "logprob_gap": sums["gap_sum"] / max(tokens, 1), "grad_norm": float(grad_norm),
            "loss_tokens": tokens}


class TorchTrainer:
    """The plain loop above: an HF model and torch AdamW on the training device."""

    def __init__(self, args, device, auto_model) -> None:
        import torch

        self.args = args
        self.model = auto_model.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device)
        self.model.config.use_cache = False
        self.model.eval()  # no dropout: the engine samples without it too
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)

    def step(self, sequences) -> dict:
        return train_step(self.model, self.optimizer, sequences, self.args)

    def named_tensors(self):
        return self.model.named_parameters()


class MegatronTrainer:
    """The trainer service's Megatron-Core backend (bf16, Megatron DDP + distributed optimizer),
    publishing its HF-named tensors to the engine over the same weights group."""

    def __init__(self, args, device) -> None:
        from libra.services.trainer.config import TrainerConfig
        from libra.services.trainer.megatron.backend import MegatronBackend

        self.config = TrainerConfig(lr=args.lr, micro_batch_size=args.micro_batch, max_grad_norm=1.0,
                                    clip_low=args.clip_low, clip_high=args.clip_high, backend="megatron")
        self.backend = MegatronBackend(self.config, seed=args.seed)
        self.backend.load(args.model)

    def step(self, sequences) -> dict:
        import torch

        from libra.services.trainer.backend import TrainBatch

        batch = TrainBatch(sequences)
        # the gap between the engine's sampling log-probs and the trainer's, on the weights it sampled with
        fresh = self.backend.compute_logprobs(batch)
        gap = sum(float(((f.float() - torch.tensor(s.behaviour_logprobs)).abs() * torch.tensor(s.loss_mask)).sum())
                  for f, s in zip(fresh, sequences))
        metrics = self.backend.train_step(batch, self.config)
        return {"loss": metrics["loss"], "logprob_gap": gap / max(batch.loss_tokens, 1),
                "grad_norm": metrics["grad_norm"], "loss_tokens": batch.loss_tokens}

    def named_tensors(self):
        return self.backend.hf_named_tensors()


def start_engine(args, port: int, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "libra.services.rollout.engines.hf_server", "--model", args.model, "--port", str(port),
               "--device", args.engine_device, "--dtype", args.dtype, "--max-model-len", str(args.max_total_tokens + 64),
               "--max-num-seqs", str(args.groups * args.group_size), "--policy-version", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)


def random_model(args, out: Path) -> str:
    """A randomly initialised Llama of --random-hidden/--random-layers with --model's tokenizer
    (to time a step at a realistic weight size; its reward stays near zero)."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    hidden = args.random_hidden
    config.update({"hidden_size": hidden, "intermediate_size": hidden * 4, "num_hidden_layers": args.random_layers,
                   "num_attention_heads": hidden // 128, "num_key_value_heads": hidden // 128, "head_dim": 128})
    torch.manual_seed(args.seed)
    with torch.device(args.train_device):
        model = LlamaForCausalLM(config)
    target = out / "random_model"
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(args.model) / name).exists():
            shutil.copy(Path(args.model) / name, target / name)
    del model
    return str(target)


async def run(args) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from libra.redis_server import free_port
    from libra.services.rollout.engines.client import EngineClient
    from libra.weights.group import WeightsGroup
    from libra.services.trainer.backend import TrainSequence
    from libra.services.trainer.grpo import group_advantages
    from libra.tiny_model import load_tokenizer, stop_token_ids
    from libra.workloads.base import build_workload
    from libra.workloads.config import CalculatorConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.random_hidden:
        args.model = random_model(args, out)
    port, group_port = free_port(), free_port()
    engine = start_engine(args, port, out / "e2e_engine.log")
    records: list[dict] = []
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=600)
    try:
        torch.manual_seed(args.seed)
        device = torch.device(args.train_device)
        if args.trainer == "megatron":
            trainer = MegatronTrainer(args, device)
        else:
            trainer = TorchTrainer(args, device, AutoModelForCausalLM)
        workload = build_workload(CalculatorConfig())
        tokenizer = load_tokenizer(args.model)
        stop_ids = stop_token_ids(tokenizer, workload) + [tokenizer.eos_token_id]
        started = time.monotonic()
        while not await client.health():
            if engine.poll() is not None or time.monotonic() - started > 300:
                raise RuntimeError(f"the engine did not start; see {out / 'e2e_engine.log'}")
            await asyncio.sleep(0.5)
        joined: dict = {}
        thread = threading.Thread(target=lambda: joined.update(group=WeightsGroup(
            "127.0.0.1", group_port, 0, 2, args.backend, device=str(device), timeout_s=300,
            bucket_bytes=args.bucket_mb * 2**20)))
        thread.start()
        await client._post("/collective_rpc", {"method": "libra_join_weights_group", "args": [
            "127.0.0.1", group_port, 1, 2, args.backend, 300, args.bucket_mb]}, timeout=330)
        thread.join()
        group = joined["group"]

        async def sync(version: int) -> dict:
            report: dict = {}
            sender = threading.Thread(target=lambda: report.update(r=group.send(trainer.named_tensors(), version)))
            began = time.perf_counter()
            sender.start()
            answer = await client._post("/collective_rpc", {"method": "libra_receive_weights", "args": [version]},
                                        timeout=600)
            sender.join()
            seconds = time.perf_counter() - began
            result = answer["results"][0]
            if "error" in result or "r" not in report:
                raise RuntimeError(f"version {version} did not arrive: {result}")
            if await client.policy_version() != version:
                raise RuntimeError(f"the engine reports version {await client.policy_version()}, expected {version}")
            r = report["r"]
            return {"sync_s": seconds, "sync_bytes": r.bytes, "sync_transfer_s": r.seconds,
                    "sync_gbps": r.gbps, "sync_engine_s": result["seconds"],
                    "sync_in_place": result.get("in_place")}  # straight into the engine's flat parameters

        first = await sync(1)  # the engine starts from the same directory; version 1 proves the path
        print(json.dumps({"step": 0, **first}), flush=True)
        version = 1
        for step in range(1, args.steps + 1):
            began = time.perf_counter()
            prompts = [(step - 1) * args.groups + g for g in range(args.groups)]
            episodes = await asyncio.gather(*(play(client, workload, tokenizer, p, s, step, args, stop_ids)
                                              for p in prompts for s in range(args.group_size)))
            rollout_s = time.perf_counter() - began
            rewards = [e[4] for e in episodes]
            advantages = group_advantages(rewards, [i // args.group_size for i in range(len(episodes))]).tolist()
            sequences = [TrainSequence(ids, plen, mask, behaviour, adv)
                         for (ids, plen, mask, behaviour, _), adv in zip(episodes, advantages)]
            began = time.perf_counter()
            metrics = await asyncio.to_thread(trainer.step, sequences)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_s = time.perf_counter() - began
            version += 1
            timing = await sync(version)
            record = {"step": step, "version": version, "mean_reward": sum(rewards) / len(rewards),
                      "trajectories": len(episodes), "generated_tokens": sum(sum(e[2]) for e in episodes),
                      "rollout_s": rollout_s, "train_s": train_s, **metrics, **timing}
            records.append(record)
            print(json.dumps(record), flush=True)
    finally:
        await client.close()
        engine.terminate()
        try:
            engine.wait(timeout=15)
        except subprocess.TimeoutExpired:
            engine.kill()
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory with the calculator tokenizer")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-total-tokens", type=int, default=384)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--trainer", default="torch", choices=("torch", "megatron"),
                        help="torch: an HF model + AdamW in this script; megatron: the Megatron-Core backend "
                             "(bf16 on GPUs: run the engine with --dtype bfloat16)")
    parser.add_argument("--train-device", default="cuda:0")
    parser.add_argument("--engine-device", default="cuda:1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--random-hidden", type=int, default=0, help="train a random Llama of this width instead")
    parser.add_argument("--random-layers", type=int, default=16)
    args = parser.parse_args()
    records = asyncio.run(run(args))
    Path(args.out, "e2e_records.json").write_text(json.dumps({"argv": sys.argv, "records": records}, indent=1))
    rewards = [r["mean_reward"] for r in records]
    params = records[0]["sync_bytes"] / 4 if args.dtype == "float32" else records[0]["sync_bytes"] / 2
    print(f"{params / 1e9:.3f}B parameters; reward first→last: {rewards[0]:.3f} → {rewards[-1]:.3f}; "
          f"mean sync {sum(r['sync_s'] for r in records) / len(records):.4f}s"
          f"; mean rollout {sum(r['rollout_s'] for r in records) / len(records):.2f}s; "
          f"mean train {sum(r['train_s'] for r in records) / len(records):.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
