"""The whole job as separate processes: `libra up` with real Redis, vLLM workers and GRPO.

Proves that trajectories flow gateway -> Redis stream -> trainer, that weights flow back with
versions every worker acknowledges (and that the workers then sample from exactly the trainer's
weights), that a rollout worker killed mid-run loses no trajectory, and that a second `libra up`
on the same Redis and run directory with more steps resumes from the checkpoint (and says so)
without losing or double-counting a trajectory.
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

from libra.errors import NotFound
from libra.redis_server import free_port
from libra.telemetry import record as run_record

pytestmark = pytest.mark.slow
GROUPS, SAMPLES = 4, 8


def _config(tmp_path: pathlib.Path) -> pathlib.Path:
    ports = ", ".join(f"{s}: 127.0.0.1:{free_port()}" for s in ("planner", "scheduler", "rollout", "trainer", "elastic"))
    config = tmp_path / "e2e.yaml"
    config.write_text(pathlib.Path("configs/quickstart.yaml").read_text()
                      + f"\naddresses: {{{ports}}}\nmetrics: {{base_port: 0}}\n")
    return config


def _worker_pids(run_dir: pathlib.Path) -> list[int]:
    """vLLM server processes whose model lives in this run's directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline and str(run_dir).encode() in cmdline:
            found.append(int(pid))
    return found


def _kill_a_worker_once_training(run_dir: pathlib.Path, killed: list[int], stop: threading.Event) -> None:
    while not stop.is_set() and not killed:
        if (run_dir / "weights" / "v3").exists():
            pids = _worker_pids(run_dir)
            if pids:
                os.killpg(os.getpgid(pids[0]), signal.SIGKILL)
                killed.append(pids[0])
        time.sleep(0.3)


def _up(config, redis_url, run_id, run_dir, steps: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "libra.cli", "up", "--config", str(config), "--redis-url", redis_url,
               "--run-id", run_id, "--run-dir", str(run_dir), "--set", f"trainer.steps={steps}",
               "--set", "trainer.warmup.steps=120", "--set", f"trainer.groups_per_step={GROUPS}",
               "--set", "trainer.checkpoint_every=2", "--set", "rollout.worker.base_port=0",
               "--set", "rollout.worker.engine=vllm"]  # the quickstart's engine is hf; this test is vLLM's
    env = {**os.environ, "LIBRA_CACHE": str(run_dir.parent / "model-cache")}  # this test's own: it builds once
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    print(result.stdout[-3000:], result.stderr[-3000:])
    return result


def test_libra_up_trains_publishes_survives_a_dead_worker_and_resumes(tmp_path, redis_url, run_id):
    config, run_dir = _config(tmp_path), tmp_path / "run"
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_worker_once_training, args=(run_dir, killed, stop), daemon=True)
    killer.start()
    try:
        first = _up(config, redis_url, run_id, run_dir, steps=4)
    finally:
        stop.set()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "step   4/4" in first.stdout and (run_dir / "reward.png").stat().st_size > 10_000
    assert killed, "no vLLM worker was found to kill"
    assert not _worker_pids(run_dir), "libra up left worker processes behind"
    asyncio.run(_check_state(redis_url, run_id, steps=4))

    second = _up(config, redis_url, run_id, run_dir, steps=6)  # same Redis, same run dir: resume
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "step   6/6" in second.stdout
    assert f"resuming run {run_id} from step 4/6" in second.stdout  # and says so
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()  # this start's log; the first's is in logs.1
    assert '"event": "resumed"' in trainer_log and '"step": 4' in trainer_log  # from the step-4 checkpoint
    assert '"event": "warm start done"' not in trainer_log  # the model was not created again
    from libra import event_loop  # every service runs the run's event loop ("auto": uvloop where installed)
    for name in ("planner", "scheduler", "trainer", "rollout", "elastic"):
        serving = [line for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines() if '"serving"' in line]
        assert serving and f'"event_loop": "{event_loop.chosen("auto")}"' in serving[0], (name, serving)
    first_log = (run_dir / "logs.1" / "trainer.log").read_text()
    assert first_log.count('"event": "warm start done"') == 1
    # the fresh run published the base model's files as v1 and rolled out while its backend loaded
    # (the behaviour gap below holds for those batches too); the resumed one wrote its own version
    assert "version 1 is the base model's files" in first_log and "first groups submitted" in first_log
    assert "version 1 is the base model's files" not in trainer_log
    record = run_record.load(run_dir)  # both starts' run records, read as one (libra/telemetry)
    assert [row["step"] for row in record.steps] == list(range(1, 7)) and record.scheduler and record.decisions
    assert "run report: " in second.stdout and (run_dir / "report.html").stat().st_size > 50_000
    asyncio.run(_check_state(redis_url, run_id, steps=6))


async def _check_state(redis_url: str, run_id: str, steps: int) -> None:
    from libra.state import StateStore
    from libra.v1 import common_pb2, trainer_pb2

    store = await StateStore.connect(redis_url, run_id)
    try:
        records = [trainer_pb2.StepRecord.FromString(b) for b in await store.step_records(1)]
        assert [r.step for r in records] == list(range(1, steps + 1))
        assert all(r.trajectories == GROUPS * SAMPLES for r in records)
        # workers sample from exactly the weights the trainer holds (tiny numeric differences only)
        fresh = [r for r in records if r.fresh_sequences]
        assert fresh and all(r.behaviour_logprob_gap < 0.02 for r in fresh), [r.behaviour_logprob_gap for r in fresh]
        # the check recomputes at most trainer.logprob_check_sequences (8) of a batch's fresh sequences
        assert all(r.fresh_sequences <= 8 for r in records), [r.fresh_sequences for r in records]
        version = await store.current_version()
        assert version >= steps + 1
        # every step's version reached at least one worker (the step record counts those holding it)
        assert all(r.workers_updated >= 1 for r in records), [(r.step, r.workers_updated) for r in records]
        # entries delivered but unacked belong to groups still incomplete when the run ended; they
        # are handed out again after a restart. What a step used was acked at its checkpoint:
        assert await store.pending_count() <= await store.completed_length() - steps * GROUPS * SAMPLES
        consumed = 0
        for index in range(400):
            try:
                info = await store.group_info(f"g{index}")
            except NotFound:
                continue
            trajs = await store.get_trajectories(list(info.trajectory_ids))
            for traj in trajs:
                if traj.status == common_pb2.TRAJECTORY_STATUS_CONSUMED:
                    consumed += 1
                    assert len(traj.loss_mask) == len(traj.token_ids) - traj.prompt_length == len(traj.logprobs)
        assert consumed == steps * GROUPS * SAMPLES  # none lost, none counted twice
        turns = await store.read_history("turn", 100_000)
        assert {t.bucket for t in turns} == {"short", "long"}
        assert all(t.batch >= 1 for t in turns)  # each turn's mean batch over its span, itself included
        assert all(t.engine_batch == 0 for t in turns)  # vLLM reports no batch of its own (the hf engine does)
        assert all(t.gap_seconds > 0 for t in turns)  # each turn's time since its trajectory's previous one
        assert all(0 < t.route_seconds <= t.gap_seconds for t in turns)  # of it, the wait for the route
        assert all(t.trajectory_id.startswith("g") and "-s" in t.trajectory_id for t in turns)  # whose turn
        assert all(t.worker_id for t in turns) and len({t.worker_id for t in turns}) >= 2  # which engine served it
        places: dict[str, list[int]] = {}
        for t in turns:
            places.setdefault(t.trajectory_id, []).append(t.turn_number)
        # each turn's place, from 1 (a trajectory replayed after the restart records its turns again)
        assert all(set(p) == set(range(1, max(p) + 1)) for p in places.values()), places
        assert any(len(p) > 1 for p in places.values())
        records = await store.read_history("step", 100_000)
        # the trainer's seconds outside its timers: on every record but a trainer process's first (no
        # predecessor: this run's trainer started twice)
        assert records and all(r.overhead_seconds >= 0 for r in records)
        assert records[0].overhead_seconds == 0 and sum(r.overhead_seconds == 0 for r in records) <= 2
    finally:
        await store.close()
