"""The whole job as separate processes: `libra up` with real Redis, vLLM workers and GRPO.

Proves that trajectories flow gateway -> Redis stream -> trainer, that weights flow back with
versions every worker acknowledges, and that a rollout worker killed mid-run loses no trajectory.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow
STEPS = 4


def _small_config(tmp_path: pathlib.Path, run_id: str) -> pathlib.Path:
    from libra.redis_server import free_port

    ports = {s: free_port() for s in ("planner", "scheduler", "rollout", "trainer", "elastic")}
    worker_port = free_port()
    text = pathlib.Path("configs/quickstart.yaml").read_text()
    config = tmp_path / "e2e.yaml"
    overrides = (
        f"\naddresses: {{{', '.join(f'{k}: 127.0.0.1:{v}' for k, v in ports.items())}}}\n"
        "metrics: {base_port: 0}\n")
    config.write_text(text + overrides)
    return config, worker_port


def _kill_worker_when_training(run_dir: pathlib.Path, killed: list[int], stop: threading.Event) -> None:
    """Kill the vLLM worker of the `short` bucket once training has started (checkpoint 1 exists)."""
    while not stop.is_set():
        if any((run_dir / "weights").glob("v2")):
            for pid in os.listdir("/proc"):
                try:
                    cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"vllm.entrypoints.openai.api_server" in b" ".join(cmdline) and str(run_dir).encode() in b" ".join(cmdline):
                    if b"short-0" in b" ".join(cmdline) or not killed:
                        os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
                        killed.append(int(pid))
                        return
        time.sleep(0.5)


def test_libra_up_trains_publishes_and_survives_a_dead_worker(tmp_path, redis_url, run_id):
    config, _ = _small_config(tmp_path, run_id)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "libra.cli", "up", "--config", str(config), "--redis-url", redis_url,
               "--run-id", run_id, "--run-dir", str(run_dir),
               "--set", f"trainer.steps={STEPS}", "--set", "trainer.warmup.steps=120",
               "--set", "trainer.groups_per_step=4", "--set", "trainer.checkpoint_every=2",
               "--set", "rollout.worker.base_port=0"]
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_worker_when_training, args=(run_dir, killed, stop), daemon=True)
    killer.start()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
    print(result.stdout[-4000:], result.stderr[-4000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step {STEPS:>3}/{STEPS}" in result.stdout
    assert (run_dir / "reward.png").stat().st_size > 10_000
    assert killed, "the worker-killing thread never found a worker"
    asyncio.run(_check_state(redis_url, run_id))


async def _check_state(redis_url: str, run_id: str) -> None:
    from libra.state import StateStore
    from libra.v1 import common_pb2, trainer_pb2

    store = await StateStore.connect(redis_url, run_id)
    try:
        records = [trainer_pb2.StepRecord.FromString(b) for b in await store.step_records(1)]
        assert [r.step for r in records] == list(range(1, STEPS + 1))
        assert all(r.trajectories == 4 * 8 for r in records)
        # version 1 = warm-started weights, then one version per step, each acknowledged by a worker
        assert await store.current_version() == STEPS + 1
        for version in range(2, STEPS + 2):
            assert await store.worker_acks(version), f"no worker acknowledged version {version}"
        # every trajectory a step used is acked (consumed) once; none is pending after the last checkpoint
        assert await store.pending_count() == 0
        consumed = 0
        for group in range(0, 64):
            try:
                info = await store.group_info(f"g{group}")
            except Exception:
                continue
            trajs = await store.get_trajectories(list(info.trajectory_ids))
            consumed += sum(t.status == common_pb2.TRAJECTORY_STATUS_CONSUMED for t in trajs)
            for t in trajs:
                if t.status == common_pb2.TRAJECTORY_STATUS_CONSUMED:
                    assert len(t.loss_mask) == len(t.token_ids) - t.prompt_length
                    assert t.turns >= 1 and len(t.logprobs) == len(t.loss_mask)
        assert consumed == STEPS * 4 * 8
        turns = await store.read_history("turn", 10_000)
        assert {t.bucket for t in turns} == {"short", "long"}
    finally:
        await store.close()
