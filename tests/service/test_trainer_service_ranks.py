"""`libra serve trainer` with `trainer.ranks: 2`: the command starts both ranks itself, rank 0 serves.

Real processes, real Redis, the Megatron backend on CPU (gloo): the leader creates and warm-starts
the model, both ranks load it (one collective call each), and the first policy version is
published (another); the trainer then waits for rollout, which this test does not start. SIGTERM
to the command reaches both ranks: the follower waits for the leader's stop, the leader drains and
stops it, everything exits 0. A config whose rank count cannot work is refused at start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _command(redis_url: str, run_id: str, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "libra.cli", "serve", "trainer", "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--redis-url", redis_url, "--run-id", run_id, "--run-dir", str(run_dir), "--port", "0",
            "--set", "trainer.backend={type: megatron, distributed_optimizer: false}",
            "--set", "trainer.warmup.steps=5", *extra]


@pytest.mark.slow
def test_two_trainer_ranks_start_publish_and_stop_together(redis_url, run_id, tmp_path):
    run_dir, log_path = tmp_path / "run", tmp_path / "trainer.log"
    env = {**os.environ, "LIBRA_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1",
           "LIBRA_TOKEN": "ranks-test-token-0123456789"}  # `libra serve` wants the run's token
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(_command(redis_url, run_id, run_dir, "--set", "trainer.ranks=2"), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "weights" / "v1" / "config.json").exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1.0)  # past the publish: waiting for rollout now
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert '"ranks": 2' in text and "trainer ranks started" in text
    assert '"event": "following rank 0"' in text and '"event": "released by the leader"' in text
    assert (run_dir / "weights" / "v1" / "model.safetensors").exists()


def test_a_rank_count_the_layout_cannot_use_is_refused_at_start(redis_url, run_id, tmp_path):
    result = subprocess.run(_command(redis_url, run_id, tmp_path / "run", "--set", "trainer.ranks=3",
                                     "--set", "trainer.backend.tensor_parallel=2"),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "trainer.ranks=3 is not a multiple of" in result.stdout + result.stderr
