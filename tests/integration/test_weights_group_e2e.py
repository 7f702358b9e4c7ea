"""`libra up` with weights: group: real services as processes, hf engines, gloo on CPU.

Every policy version after the first (which the workers start on, from disk) reaches every serving
worker over the weights group (none from disk, none missed), and no step writes the weights to disk
on its critical path. While training is paused, rollout's layout changes as an elastic plan would
change it (a worker started, another drained): the next version goes on a new generation of the
group whose ranks are the new layout (the trainer's roster from rollout's last reply is stale, so
rollout refuses the old generation and the trainer forms the new one at once), no version waits for
the sync timeout, and rollout keeps generating until the last step, with the new worker holding
the last version.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from libra.redis_server import free_port

pytestmark = pytest.mark.slow
STEPS = 6
TOKEN = "weights-group-e2e-token-0123456789"
SYNC_TIMEOUT_S = 30  # a version that waited for it would show in publish_seconds


def _config(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    addresses = {s: f"127.0.0.1:{free_port()}" for s in ("planner", "scheduler", "rollout", "trainer", "elastic")}
    config = tmp_path / "group.yaml"
    config.write_text(pathlib.Path("configs/quickstart.yaml").read_text()
                      + f"\naddresses: {json.dumps(addresses)}\nmetrics: {{base_port: 0}}\n")
    return config, addresses


def _events(log: pathlib.Path, name: str) -> list[dict]:
    lines = (json.loads(line) for line in log.read_text().splitlines() if line.startswith("{"))
    return [e for e in lines if e.get("event") == name]


async def _change_layout(addresses: dict[str, str], redis_url: str, run_id: str) -> tuple[int, str]:
    """Once both workers hold version 3, pause training, start a `long` worker, drain `short-0`, resume."""
    from libra.rpc import channel
    from libra.security import Security
    from libra.state import StateStore
    from libra.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    def meta(name: str) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=f"{name}-{time.monotonic_ns()}", run_id=run_id)

    store = await StateStore.connect(redis_url, run_id)
    security = Security(TOKEN)  # the run's token (libra up was given it in LIBRA_TOKEN)
    trainer_channel, rollout_channel = channel(addresses["trainer"], security=security), \
        channel(addresses["rollout"], security=security)
    try:
        trainer = trainer_pb2_grpc.TrainerStub(trainer_channel)
        rollout = rollout_pb2_grpc.RolloutStub(rollout_channel)
        deadline = time.monotonic() + 400
        while True:
            try:
                listed = await rollout.ListWorkers(rollout_pb2.ListWorkersRequest(run_id=run_id), timeout=10)
            except grpc.aio.AioRpcError:  # rollout is still starting
                listed = rollout_pb2.ListWorkersResponse()
            if sum(w.policy_version >= 3 for w in listed.workers) >= 2:
                break
            assert time.monotonic() < deadline, "version 3 never reached both workers"
            await asyncio.sleep(0.2)
        await trainer.Pause(trainer_pb2.PauseRequest(meta=meta("pause")), timeout=10)
        # takes the step lock: returns once the step in progress (and its publish) is committed
        await trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(meta=meta("checkpoint")), timeout=120)
        paused_at = await store.current_version()
        started = await rollout.StartWorkers(rollout_pb2.StartWorkersRequest(
            meta=meta("start"), buckets=[common_pb2.BucketSpec(name="long", tp=1, max_tokens=512, replicas=1)]),
            timeout=300)
        await rollout.DrainWorker(rollout_pb2.DrainWorkerRequest(meta=meta("drain"), worker_id="short-0",
                                                                 timeout_seconds=30), timeout=60)
        await trainer.Resume(trainer_pb2.PauseRequest(meta=meta("resume")), timeout=10)
        return paused_at, started.workers[0].worker_id
    finally:
        await trainer_channel.close()
        await rollout_channel.close()
        await store.close()


async def _records(redis_url: str, run_id: str) -> list:
    from libra.state import StateStore
    from libra.v1 import trainer_pb2

    store = await StateStore.connect(redis_url, run_id)
    try:
        return [trainer_pb2.StepRecord.FromString(b) for b in await store.step_records(1)]
    finally:
        await store.close()


def test_versions_arrive_over_the_group_and_follow_a_layout_change(tmp_path, redis_url, run_id):
    config, addresses = _config(tmp_path)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "libra.cli", "up", "--config", str(config), "--redis-url", redis_url,
               "--run-id", run_id, "--run-dir", str(run_dir), "--set", f"trainer.steps={STEPS}",
               "--set", "trainer.warmup.steps=4", "--set", "trainer.groups_per_step=2",
               "--set", "trainer.group_size=4", "--set", "trainer.checkpoint_every=100",
               "--set", "rollout.worker.engine=hf", "--set", "weights.type=group",
               "--set", "rollout.worker.base_port=0",
               "--set", f"weights.sync_timeout_s={SYNC_TIMEOUT_S}",
               "--set", f"weights.address=127.0.0.1:{free_port()}"]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "LIBRA_TOKEN": TOKEN})
    try:
        paused_at, added = asyncio.run(_change_layout(addresses, redis_url, run_id))
        output, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # `libra up` stops its services on Ctrl-C
            output, _ = up.communicate(timeout=120)
    print(output[-3000:])
    assert up.returncode == 0, output[-3000:]

    logs = run_dir / "logs"
    generations = _events(logs / "trainer.log", "weights group: new generation")
    assert [(g["version"], g["workers"]) for g in generations] == [
        (2, ["long-1", "short-0"]), (paused_at + 1, sorted(["long-1", added]))]
    sent = {e["version"]: e for e in _events(logs / "trainer.log", "weights sent over the group")}
    assert sorted(sent) == list(range(2, STEPS + 2))
    assert all(e["receivers"] == e["world_size"] - 1 == 2 for e in sent.values())
    delivered = {e["version"]: e for e in _events(logs / "rollout.log", "version delivered")}  # the last of each
    assert sorted(delivered[1]["held"]) == ["long-1", "short-0"] and not delivered[1]["from_disk"]  # they started on v1
    for version in range(2, STEPS + 2):
        expected = ["long-1", "short-0"] if version <= paused_at else sorted(["long-1", added])
        assert delivered[version]["over_group"] == expected and not delivered[version]["from_disk"], delivered[version]
        assert not delivered[version]["missed"] and not delivered[version]["behind"]
    records = asyncio.run(_records(redis_url, run_id))
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert max(r.publish_seconds for r in records) < SYNC_TIMEOUT_S / 3, [r.publish_seconds for r in records]
    # no step wrote the weights on its critical path; each sent them and called rollout
    assert all(r.publish_write_seconds == 0 and r.publish_send_seconds > 0 and r.publish_rpc_seconds > 0
               for r in records), records
    assert [r.workers_updated for r in records] == [2] * STEPS  # the last on the new layout, as the log says
