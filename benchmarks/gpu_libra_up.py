"""`libra up` on a GPU machine through the real services, and its step-time breakdown.

    python benchmarks/gpu_libra_up.py --config configs/gpu-1.yaml --out DIR

What runs is exactly what a user runs: `libra up --config ... --fresh` (Redis, the five services as
separate processes over gRPC, the Megatron trainer and the hf engines on the GPU), against a Redis
this script starts so that the step records outlive the run. Afterwards every step record is read
from Redis and summarised: reward (first five steps → last five), every version reached every
engine (`workers_updated`), the trainer–engine log-prob gap on fresh sequences, and the step time
split into rollout wait, train and publish (its send: the export/broadcast, and rpc: rollout's
UpdateWeights). Beside it, the same figures of the script-only GPU loop (benchmarks/gpu_e2e_grpo.py,
no Redis, no gRPC) from its recorded run. Writes DIR/libra-up.json and DIR/libra-up-logs.tar.gz
(every service's and engine's log, the reward curve, the resolved config); prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks/results/gpu/session4/e2e_megatron_run2_records.json"


def libra_command() -> list[str]:
    found = shutil.which("libra")
    return [found] if found else [sys.executable, "-m", "libra.cli"]


async def read_records(url: str, run_id: str) -> list:
    from libra.service_base import connect_store
    from libra.v1 import trainer_pb2

    store = await connect_store(url, run_id, timeout_s=10)
    try:
        return [trainer_pb2.StepRecord.FromString(raw) for raw in await store.step_records(1)]
    finally:
        await store.close()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(records: list, engines: int) -> dict:
    rewards = [r.mean_reward for r in records]
    later = records[1:] or records  # the first step carries the fused kernels' compilation
    return {
        "steps": len(records), "reward_first5": statistics.fmean(rewards[:5]) if rewards else None,
        "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None, "rewards": rewards,
        "versions": [r.policy_version for r in records],
        "every_version_reached_every_engine": bool(records) and all(r.workers_updated == engines for r in records),
        "workers_updated": [r.workers_updated for r in records],
        "logprob_gap_median": _median([r.behaviour_logprob_gap for r in records if r.fresh_sequences]),
        "wait_s": _median([r.wait_seconds for r in later]), "train_s": _median([r.train_seconds for r in later]),
        "first_train_s": records[0].train_seconds if records else None,
        "publish_s": _median([r.publish_seconds for r in later]),
        "publish_send_s": _median([r.publish_send_seconds for r in later]),
        "publish_rpc_s": _median([r.publish_rpc_seconds for r in later]),
        "publish_write_s": _median([r.publish_write_seconds for r in later]),
        "trajectories_per_step": _median([r.trajectories for r in records]),
        "step_s": _median([r.wait_seconds + r.train_seconds + r.publish_seconds for r in later]),
    }


def baseline() -> dict:
    if not BASELINE.exists():
        return {}
    raw = json.loads(BASELINE.read_text())
    records = raw["records"]
    later = records[1:]
    rewards = [r["mean_reward"] for r in records]
    return {"source": str(BASELINE.relative_to(ROOT)), "argv": raw.get("argv"), "steps": len(records),
            "reward_first5": statistics.fmean(rewards[:5]), "reward_last5": statistics.fmean(rewards[-5:]),
            "wait_s": _median([r["rollout_s"] for r in later]), "train_s": _median([r["train_s"] for r in later]),
            "publish_s": _median([r["sync_s"] for r in later]),
            "logprob_gap_median": _median([r["logprob_gap"] for r in records]),
            "trajectories_per_step": _median([r["trajectories"] for r in records])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu-1.yaml")
    parser.add_argument("--out", default="/tmp/libra-gpu-out")
    parser.add_argument("--run-dir", default="", help="default: a fresh temporary directory")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds before libra up is stopped")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to libra up")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from libra.config import load_run_config
    from libra.redis_server import PrivateRedis

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = pathlib.Path(args.run_dir or tempfile.mkdtemp(prefix="libra-up-"))
    overrides = dict(item.split("=", 1) for item in args.set)
    config = load_run_config(args.config, overrides={**overrides, "run_dir": str(run_dir)}, env={})
    engines = sum(b.replicas for b in config.planner.buckets)
    redis = PrivateRedis(pathlib.Path(tempfile.mkdtemp(prefix="libra-up-redis-"))).start()
    command = [*libra_command(), "up", "--config", args.config, "--run-dir", str(run_dir), "--redis-url", redis.url,
               "--fresh", *(f"--set={item}" for item in args.set)]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    try:
        code = subprocess.run(command, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:  # libra up stops its services when it is killed (procs.py)
        code = "timeout"
    seconds = time.monotonic() - started
    try:
        records = asyncio.run(read_records(redis.url, config.run_id))
    finally:
        redis.stop()
    with tarfile.open(out / "libra-up-logs.tar.gz", "w:gz") as archive:
        for name in ("logs", "reward.png", "config.yaml"):
            if (run_dir / name).exists():
                archive.add(run_dir / name, arcname=name)
    result = {"command": command, "exit": code, "seconds": seconds, "engines": engines,
              "config": {k: config.model_dump(mode="json")[k] for k in ("weights", "trainer", "model", "planner")},
              "rollout_worker": config.rollout.worker.model_dump(mode="json"), "libra_up": summarise(records, engines),
              "script_only_e2e": baseline(),
              "records": [{f.name: v for f, v in r.ListFields()} for r in records]}
    (out / "libra-up.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    ours, theirs = result["libra_up"], result["script_only_e2e"]
    print(f"\nlibra up ({args.config}): exit {code} after {seconds:.0f} s, {ours['steps']} steps, "
          f"{engines} engines; every version reached every engine: {ours['every_version_reached_every_engine']}")
    print(f"{'':28} {'libra up':>12} {'script-only e2e':>16}")
    rows = [("reward first 5 steps", "reward_first5", "{:.3f}"), ("reward last 5 steps", "reward_last5", "{:.3f}"),
            ("trajectories / step", "trajectories_per_step", "{:.0f}"), ("rollout wait s (median)", "wait_s", "{:.3f}"),
            ("train s (median)", "train_s", "{:.3f}"), ("publish / sync s (median)", "publish_s", "{:.4f}"),
            ("  send (export) s", "publish_send_s", "{:.4f}"), ("  rpc (engines take it) s", "publish_rpc_s", "{:.4f}"),
            ("|trainer - engine| log-prob", "logprob_gap_median", "{:.2e}")]
    for label, key, fmt in rows:
        cells = [fmt.format(side[key]) if isinstance(side.get(key), (int, float)) else "-" for side in (ours, theirs)]
        print(f"{label:28} {cells[0]:>12} {cells[1]:>16}")
    ok = code == 0 and ours["steps"] == config.trainer.steps and ours["every_version_reached_every_engine"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
