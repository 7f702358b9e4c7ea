"""Hybrid replicas as real processes: the trainer RPCs over gRPC + Redis, and a gloo core of two ranks.

1. The trainer's AdmitHybrid / ReleaseHybrid / GetStepManifest on a real gRPC server with a real
   Redis; the hybrid is `python -m libra.services.trainer.elastic.hybrid --trainer …` (it finds its
   lane through GetStepManifest), joins, trains in lockstep, is released and exits 0; a restarted
   trainer reads the membership back from Redis.
2. Two core ranks over gloo (spawned processes), one hybrid process attached to each rank, the
   gradients on the device channel (a private gloo pair group per hybrid, as NCCL on GPUs): both
   join, train, one is released (its pair group goes with it), the other SIGKILLs itself in the
   middle of a gradient transfer; the core finishes that step, marks it failed and carries on.
   The core's process-group objects are the same before and after (pair groups are never
   registered with torch.distributed), and the parameters equal a static run over the same samples.
   (The TCP channel's multi-process path is test 1; in one process both run in test_elastic_math.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from libra.redis_server import free_port
from libra.rpc import ServiceHost
from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.elastic.control import ElasticControl
from libra.services.trainer.elastic.core_hooks import ElasticCore
from libra.services.trainer.elastic.manifest import HybridState
from libra.services.trainer.elastic.work import split, widened_groups
from libra.services.trainer.server import TrainerService
from libra.services.trainer.torch_backend import TorchBackend
from libra.v1 import common_pb2, trainer_pb2 as P, trainer_pb2_grpc
from tests.service.helpers import code_of, run_config
from tests.ranks import spawn_ranks
from tests.unit.test_elastic_math import GROUP, GROUPS, _config, _groups, step_until_two_hybrids

pytestmark = pytest.mark.slow
HYBRID = [sys.executable, "-m", "libra.services.trainer.elastic.hybrid"]
DYING_HYBRID = [sys.executable, str(Path(__file__).with_name("elastic_dying_hybrid.py"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _meta(rid: str) -> common_pb2.RequestMeta:
    return common_pb2.RequestMeta(request_id=rid)


def _wait(predicate, timeout: float = 600.0, tick=lambda: time.sleep(0.05)) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        tick()


def test_trainer_rpcs_drive_a_hybrid_process_through_join_and_release(redis_url, run_id, tmp_path, arun,
                                                                      store, new_store, model_dir):
    service = TrainerService(run_config(redis_url, run_id, tmp_path))
    backend = TorchBackend(_config(), seed=0)
    backend.load(model_dir)
    core = ElasticCore(backend, snapshot_root=str(tmp_path / "snapshots"), verify_lockstep=True,
                       join_timeout_s=600.0)
    backend.gradient_hook = core
    service.elastic = ElasticControl(core, store)
    service.store = store  # where the RPC boundary keeps replies
    host = ServiceHost("trainer", service.service_names(), 0, "127.0.0.1")
    service.register(host.server)
    port = arun(host.start())
    stub = trainer_pb2_grpc.TrainerStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    step = 0

    def train_one() -> P.StepManifest:
        nonlocal step
        step += 1
        manifest = arun(service.elastic.begin_step(step))
        batch = _groups(step, service.elastic.widen(manifest, GROUPS))
        core_batch = service.elastic.hand_out(batch, GROUP, manifest)
        arun(asyncio.to_thread(backend.train_step, core_batch, _config()))
        service.elastic.end_step()
        return arun(stub.GetStepManifest(P.StepManifestRequest(step=step)))

    empty = arun(stub.GetStepManifest(P.StepManifestRequest(step=0)))
    assert empty.step == 0 and list(empty.lane_endpoints) == [core.endpoint.address] and not empty.hybrids
    assert code_of(arun, stub.AdmitHybrid(P.HybridRequest(meta=_meta("a0"), replica_id=""))) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(arun, stub.AdmitHybrid(P.HybridRequest(replica_id="h1"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(arun, stub.ReleaseHybrid(P.HybridRequest(meta=_meta("r0"), replica_id="nobody"))) == \
        grpc.StatusCode.NOT_FOUND
    admit_h1 = lambda rid: stub.AdmitHybrid(P.HybridRequest(meta=_meta(rid), replica_id="h1", generation=1))
    admitted = arun(admit_h1("a1"))
    assert admitted.applied
    assert arun(admit_h1("a1")) == admitted  # a replay answers the first reply
    assert not arun(admit_h1("a9")).applied  # a new request for the same admission changes nothing
    hybrids = arun(stub.GetStepManifest(P.StepManifestRequest(step=0))).hybrids
    assert len(hybrids) == 1  # admitted once
    joining = hybrids[0]
    assert joining.state == P.HYBRID_STATE_JOINING and joining.endpoint == core.endpoint.address

    process = subprocess.Popen([*HYBRID, "--trainer", f"127.0.0.1:{port}", "--run-id", run_id,
                                "--replica-id", "h1"])
    try:
        active = train_one()  # admission applied
        deadline = time.monotonic() + 600  # a loaded CI machine starts processes slowly
        while "h1" not in active.active_replicas and time.monotonic() < deadline:
            arun(asyncio.sleep(0.1))  # connect, build, snapshot, load, catch up (the core keeps stepping)
            active = train_one()
        assert list(active.active_replicas) == ["core-0", "h1"] and "h1" in active.acknowledged_by
        assert active.hybrids[0].state == P.HYBRID_STATE_ACTIVE and active.membership_epoch == 1
        train_one()
        assert arun(stub.ReleaseHybrid(P.HybridRequest(meta=_meta("r1"), replica_id="h1", generation=1))).applied
        released = train_one()
        assert list(released.active_replicas) == ["core-0"] and released.hybrids[0].state == P.HYBRID_STATE_RELEASED
        assert process.wait(60) == 0
        assert not core.failures  # the lockstep check passed on every step
    finally:
        process.kill()
        process.wait()
    # A restarted trainer knows the membership: h1 left; one admitted but never joined is rolled back.
    assert arun(stub.AdmitHybrid(P.HybridRequest(meta=_meta("a2"), replica_id="h2", generation=1))).applied
    arun(host.stop(0))
    core.close()
    again = ElasticControl(ElasticCore(backend, snapshot_root=str(tmp_path / "snapshots")), arun(new_store()))
    arun(again.restore())
    arun(again.begin_step(step + 1))
    records = again.core.membership.records
    assert records["h1"].state == HybridState.RELEASED and records["h2"].state == HybridState.JOINING
    again.core.close()


# -- two core ranks over gloo ---------------------------------------------------------------------
def _pg_state() -> tuple:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return id(dist.group.WORLD), tuple(sorted(id(g) for g in c10d._world.pg_map)), c10d._world.group_count


def _core_rank(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    backend = TorchBackend(_config(), seed=0)
    backend.load(model_dir)
    core = ElasticCore(backend, dp_rank=rank, core_ranks=world, snapshot_root=f"{out}-snapshots-{rank}",
                       grad_deadline_s=120.0, join_timeout_s=600.0, verify_lockstep=True, channel="group")
    backend.gradient_hook = core
    groups_at_start = _pg_state()
    processes: dict[str, subprocess.Popen] = {}
    record = {"manifests": {}, "seconds": {}, "channels": {}}
    die_flag = f"{out}-die-{rank}"
    if rank == 0:
        core.admit("h-a")
        core.admit("h-b")

    def gate() -> None:
        """Test pacing only: let this rank's joining hybrids connect / load before the boundary."""
        for r in core.membership.records.values():
            if r.dp_rank == rank and r.state == HybridState.JOINING and r.replica_id in processes:
                _wait(lambda: core.endpoint.link(r.replica_id) is not None)
                if r.replica_id in core._prepare_sent and not r.prepared:
                    _wait(lambda: not core.endpoint._control.empty())  # `prepared`
            if r.dp_rank == rank and r.state == HybridState.SNAPSHOT:
                _wait(lambda: not core.endpoint._control.empty())

    def one_step(step: int, kill: str | None = None) -> None:
        gate()
        manifest = core.begin_step(step)
        record["manifests"][step] = manifest.hybrids
        for r in core.membership.records.values():
            if r.dp_rank == rank and r.state == HybridState.JOINING and r.replica_id not in processes:
                processes[r.replica_id] = subprocess.Popen(
                    [*(DYING_HYBRID if r.replica_id == "h-b" else HYBRID), "--endpoint", core.endpoint.address,
                     "--replica-id", r.replica_id], env={**os.environ, "LIBRA_TEST_DIE_FLAG": die_flag})
        slices = split(_groups(step, widened_groups(GROUPS, manifest)), GROUP, manifest)
        core.assign(slices)
        if kill in core._slices:  # it SIGKILLs itself between this step's gradient header and its bytes
            Path(die_flag).touch()
        for replica in core._slices:
            record["channels"][replica] = core.endpoint.link(replica).channel
        began = time.monotonic()
        backend.train_step(slices[f"core-{rank}"], _config())
        record["seconds"][step] = time.monotonic() - began
        core.end_step()

    step = step_until_two_hybrids(one_step, core, then=2)
    if rank == 0:
        core.release("h-a")
    step += 1
    one_step(step)
    step += 1
    one_step(step, kill="h-b")
    step += 1
    one_step(step)
    record.update(failures=core.failures, exit_codes={k: p.wait(60) for k, p in processes.items()},
                  same_groups=_pg_state() == groups_at_start, steps=step,
                  params=[p.detach().clone() for p in backend.model.parameters()])
    torch.save(record, f"{out}-{rank}.pt")
    core.close()
    dist.destroy_process_group()


def test_two_core_ranks_over_gloo_with_a_hybrid_on_each_rank(model_dir, tmp_path):
    port = free_port()
    out = str(tmp_path / "rank")
    # spawn, not fork: the test process has threads by now (gRPC, executors, transformers' loader
    # pool) and a forked child can deadlock on a lock one of them held (seen in CI).
    spawn_ranks(_core_rank, (2, model_dir, port, out), 2)
    ranks = [torch.load(f"{out}-{r}.pt", weights_only=False) for r in range(2)]
    zero, one = ranks
    assert zero["same_groups"] and one["same_groups"]  # membership changes built no process group
    steps = zero["steps"]
    hybrids = {s: dict(m) for s, m in zero["manifests"].items()}
    assert hybrids[steps - 4] == {"h-a": 0, "h-b": 1}  # a hybrid on each core rank
    assert hybrids[steps - 2] == {"h-b": 1} and hybrids[steps] == {}  # h-a released, h-b failed
    assert zero["exit_codes"]["h-a"] == 0 and one["exit_codes"]["h-b"] == -signal.SIGKILL
    assert zero["channels"] == {"h-a": "group/gloo"} and one["channels"] == {"h-b": "group/gloo"}
    assert not zero["failures"] and [(s, r) for s, r, _ in one["failures"]] == [(steps - 1, "h-b")]
    assert "closed" in one["failures"][0][2]  # the receive in flight failed: its peer is gone
    assert one["seconds"][steps - 1] < 60.0  # finished without it, long before the deadline (120 s)
    assert all(torch.equal(a, b) for a, b in zip(zero["params"], one["params"]))

    reference = TorchBackend(_config(), seed=0)
    reference.load(model_dir)
    from libra.services.trainer.elastic.manifest import StepManifest

    for step in range(1, steps + 1):
        manifest = StepManifest(step, 0, 2, zero["manifests"][step])
        slices = split(_groups(step, widened_groups(GROUPS, manifest)), GROUP, manifest)
        dropped = "h-b" if step == steps - 1 else None
        reference.train_step(TrainBatch([s for r, b in slices.items() if r != dropped for s in b.sequences]),
                             _config())
    for p, q in zip(zero["params"], reference.model.parameters()):
        assert torch.allclose(p, q, atol=2e-6), (p - q).abs().max()
