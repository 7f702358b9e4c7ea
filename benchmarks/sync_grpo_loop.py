"""A plain single-process synchronous GRPO loop on a Libra run config's task: the baseline the
quickstart races (benchmarks/quickstart_race.py).

What a careful user would write on a laptop, with nothing of Libra's machinery:

    for step in 1..steps:
        prompts ─▶ transformers `generate` (batched, left-padded, KV cache; every row of the batch at
                   once, one call per turn) ─▶ tool calls ─▶ next turn for the rows still going
                ─▶ rewards ─▶ group advantages ─▶ one AdamW step on the clipped token-level loss
                   (micro-batches, gradients summed over the batch)

The same task (the config's workload, its prompts in the trainer's order), the same warm-started
weights (the model cache's entry, services/trainer/model_state.base_model), the same
hyper-parameters (trainer.lr, clip, groups_per_step x group_size, micro_batch_size, rollout's
temperature and turn budgets) and Libra's own loss code (services/trainer/grpo.py). On-policy:
every token of a batch is sampled by the weights it trains, so the old log-probs are the new ones
detached (ratio 1 at the step), as single-update GRPO libraries do.

    .venv/bin/python benchmarks/sync_grpo_loop.py --config configs/quickstart.yaml [--steps N] [--threads T]

Prints one JSON line per step (step, t: wall clock at its end, started: its start, reward,
generate_s, train_s, turns, tokens) and, with --out, writes them there too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--steps", type=int, default=0, help="GRPO steps (0: trainer.steps)")
    parser.add_argument("--threads", type=int, default=1, help=(
        "torch intra-op threads (1: a 0.47M-parameter model gains nothing from more; on a busy 2-core machine "
        "2 threads took 7x the CPU time, spinning)"))
    parser.add_argument("--out", default="", help="also write the step lines to this file")
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace):
    import yaml

    from libra.config import load_run_config

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return load_run_config(args.config, overrides)


class Rollout:
    """Multi-turn batched sampling with `generate`: one call per turn over the rows still playing."""

    def __init__(self, model, tokenizer, workload, config):
        from libra.tiny_model import stop_token_ids
        from libra.workloads.base import TurnBudget

        self.model, self.tokenizer, self.workload, self.cfg = model, tokenizer, workload, config.rollout
        self.seed = config.seed
        self.stop_ids = stop_token_ids(tokenizer, workload) + [tokenizer.eos_token_id]
        self.budget = TurnBudget(self.cfg.max_turns, self.cfg.max_new_tokens, self.cfg.max_total_tokens)
        self.loop = asyncio.new_event_loop()  # the workload's tools are coroutines

    def play(self, prompt_ids: list[int], group_size: int) -> list[dict]:
        from libra.workloads.base import FinalAnswer

        rows = []
        for prompt_id in prompt_ids:
            for sample in range(group_size):
                episode = self.workload.episode(prompt_id, sample, self.seed + sample, self.budget)
                ids = list(self.tokenizer(episode.prompt.text, add_special_tokens=True).input_ids)
                rows.append({"episode": episode, "ids": ids, "prompt_length": len(ids), "mask": [],
                             "answer": None, "done": False, "group": prompt_id, "turns": 0})
        for turn in range(self.budget.max_turns):
            live = [r for r in rows if not r["done"]]
            budgets = [r["episode"].max_new_tokens(turn, len(r["ids"])) for r in live]
            for row, budget in zip(live, budgets):
                row["done"] = budget <= 0
            live = [(r, b) for r, b in zip(live, budgets) if b > 0]
            if not live:
                break
            outputs = self.generate([r["ids"] for r, _ in live], max(b for _, b in live))
            calls = []
            for (row, budget), generated in zip(live, outputs):
                generated = generated[:budget]
                row["ids"] += generated
                row["mask"] += [1] * len(generated)
                row["turns"] += 1
                action = row["episode"].parse_turn(self.tokenizer.decode(generated, skip_special_tokens=False))
                if isinstance(action, FinalAnswer):
                    row["answer"], row["done"] = action, True
                else:
                    calls.append((row, action))
            results = self.loop.run_until_complete(self.tools(calls))
            for (row, _), text in zip(calls, results):
                tool_ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                row["ids"] += tool_ids
                row["mask"] += [0] * len(tool_ids)
        for row in rows:
            row["reward"] = float(row["episode"].reward(row["answer"]))
            self.loop.run_until_complete(row["episode"].close())
        return rows

    async def tools(self, calls: list) -> list[str]:
        return await asyncio.gather(*(self.tool(row, action) for row, action in calls))

    async def tool(self, row: dict, action) -> str:
        from libra.workloads.base import Malformed, ToolCall, ToolResult, ToolStatus

        episode = row["episode"]
        if isinstance(action, ToolCall):
            result = await episode.call_tool(action, 5.0)
        else:
            reason = action.reason if isinstance(action, Malformed) else "unrecognised turn"
            result = ToolResult(tool="format", status=ToolStatus.FAILURE, payload=reason)
        return episode.render_tool_result(result)

    def generate(self, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Sampled continuations (each up to and including its stop id) of left-padded `contexts`."""
        import torch

        pad = self.tokenizer.pad_token_id
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                      temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=0,
                                      max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=pad)
        continuations = []
        for row in out[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in self.stop_ids]
            continuations.append(row[:ends[0] + 1] if ends else row)
        return continuations


def train_step(model, optimizer, rows: list[dict], trainer) -> float:
    """One GRPO update on the batch: Libra's advantages and loss, micro-batched, one optimizer step."""
    import torch

    from libra.services.trainer.grpo import group_advantages, policy_loss

    advantages = group_advantages([r["reward"] for r in rows], [r["group"] for r in rows]).tolist()
    token_count = sum(sum(r["mask"]) for r in rows)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, len(rows), trainer.micro_batch_size):
        chunk = rows[start:start + trainer.micro_batch_size]
        width = max(len(r["ids"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        loss_mask = torch.zeros((len(chunk), width - 1))
        adv = torch.zeros((len(chunk), width - 1))
        for i, row in enumerate(chunk):
            n, p = len(row["ids"]), row["prompt_length"]
            ids[i, :n] = torch.tensor(row["ids"])
            attention[i, :n] = 1
            loss_mask[i, p - 1:n - 1] = torch.tensor(row["mask"], dtype=torch.float)  # position t predicts t + 1
            adv[i] = advantages[start + i]
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        new = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        old = new.detach()  # on-policy: the weights that sampled the batch are the ones being updated
        loss, _ = policy_loss(new, old, old, adv, loss_mask, trainer.clip_low, trainer.clip_high, trainer.tis_cap,
                              trainer.kl_coef, token_count=token_count)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
    optimizer.step()
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM

    from libra.services.trainer.loop import prompt_for
    from libra.services.trainer.model_state import base_model
    from libra.tiny_model import load_tokenizer
    from libra.workloads.base import build_workload

    torch.set_num_threads(args.threads)
    torch.manual_seed(config.seed)
    trainer, steps = config.trainer, args.steps or config.trainer.steps
    workload = build_workload(config.workload)
    out = open(args.out, "w") if args.out else None
    with tempfile.TemporaryDirectory(prefix="sync-grpo-") as scratch:
        model_dir = pathlib.Path(scratch) / "base"
        reused = base_model(config, model_dir)  # the warm-started weights libra up starts from
        print(json.dumps({"event": "model", "reused_from_cache": reused, "threads": args.threads}), flush=True)
        tokenizer = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()  # no dropout, as Libra's trainer and engines
        optimizer = torch.optim.AdamW(model.parameters(), lr=trainer.lr, weight_decay=trainer.weight_decay)
        rollout = Rollout(model, tokenizer, workload, config)
        position = 0
        for step in range(1, steps + 1):
            started = time.time()
            prompts = [prompt_for(p, workload.num_prompts, config.seed)
                       for p in range(position, position + trainer.groups_per_step)]
            position += trainer.groups_per_step
            rows = rollout.play(prompts, trainer.group_size)
            generated = time.time()
            train_step(model, optimizer, rows, trainer)
            line = {"step": step, "t": time.time(), "started": started,
                    "reward": sum(r["reward"] for r in rows) / len(rows), "generate_s": generated - started,
                    "train_s": time.time() - generated, "turns": sum(r["turns"] for r in rows) / len(rows),
                    "tokens": sum(len(r["ids"]) for r in rows)}
            print(json.dumps(line), flush=True)
            if out is not None:
                out.write(json.dumps(line) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
