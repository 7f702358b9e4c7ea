"""Elastic hybrid replicas beside a Megatron-Core core rank, on CPU (fp32, torch AdamW).

The same drive as tests/unit/test_elastic_math.py — real TCP side channels, real snapshots on
disk — with `trainer.backend: megatron` on both sides: the hybrid builds a MegatronBackend itself
(TP = PP = 1) from the `prepare` frame and loads the core's Megatron state from the snapshot. The
reference is one Megatron rank training on the union of the samples every replica trained on in
each step (tests/unit/test_backend_contract.py shows one larger batch equals a hook's injection).
In one process the hybrids are threads (Megatron's process groups are process-wide; core and
hybrids share its one-rank world); the `slow` test runs the hybrid as its own process, in its own
one-process world, through `python -m libra.services.trainer.elastic.hybrid --endpoint`.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from libra.errors import FailedPrecondition
from libra.redis_server import free_port
from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.elastic import backends
from libra.services.trainer.elastic import snapshot as snap
from libra.services.trainer.elastic.core_hooks import ElasticCore
from libra.services.trainer.elastic.hybrid import EXIT_JOIN_FAILED, EXIT_RELEASED
from libra.services.trainer.elastic.manifest import HybridState
from tests.ranks import spawn_ranks
from tests.unit.test_elastic_math import (GROUP, GROUPS, VOCAB, Run, _groups, _join, _params, _wait,
                                         step_until_two_hybrids)

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir) -> str:
    return tiny_qwen2_dir  # the contract suite's tiny Qwen2 (tests/unit/conftest.py)


def _config(max_grad_norm: float = 1e6, **megatron) -> TrainerConfig:
    return TrainerConfig(backend={"type": "megatron", **megatron}, lr=1e-3, micro_batch_size=2, torch_threads=1,
                         groups_per_step=GROUPS, group_size=GROUP, max_grad_norm=max_grad_norm)


def _backend(model_dir: str, max_grad_norm: float = 1e6):
    from libra.services.trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(_config(max_grad_norm), seed=0)
    backend.load(model_dir)
    return backend


class MegatronRun(Run):
    """test_elastic_math's Run with a Megatron core rank and a Megatron reference."""

    def __init__(self, model_dir: str, tmp_path, max_grad_norm: float = 1e6, **core_options):
        self.config = _config(max_grad_norm)
        self.backend = _backend(model_dir, max_grad_norm)
        self.reference = _backend(model_dir, max_grad_norm)
        self.core = ElasticCore(self.backend, snapshot_root=str(tmp_path / "snapshots"), verify_lockstep=True,
                                **core_options)
        self.backend.gradient_hook = self.core
        self.step = 0
        self.manifests = {}
        self.core_params: dict[int, list[torch.Tensor]] = {}


def _in_lockstep(hybrid, run, steps) -> None:
    for step in steps:
        assert all(torch.equal(a, b) for a, b in zip(hybrid.params[step], run.core_params[step])), step


def test_two_megatron_hybrids_join_by_snapshot_train_in_lockstep_and_leave(model_dir, tmp_path):
    from libra.services.trainer.megatron.backend import MegatronBackend

    run = MegatronRun(model_dir, tmp_path, max_grad_norm=0.5)  # clipped: hybrids clip as the core does
    first = _join(run, "h-a")  # steps 1, 2 without it; snapshot of the state after step 1, step 2 replayed
    assert isinstance(first.replica.backend, MegatronBackend)
    second = _join(run, "h-b")  # steps 3, 4: h-a trains, h-b joins from a snapshot with Adam state
    run.run(3)  # steps 5..7 with both
    run.core.release("h-a")
    run.run(2)  # steps 8, 9: h-a gone at the boundary, h-b trains on
    assert [run.manifests[s].replicas for s in range(1, 10)] == [1, 1, 2, 2, 3, 3, 3, 2, 2]
    first.thread.join(10)
    assert first.code == EXIT_RELEASED and run.core.membership.hybrid("h-a").state == HybridState.RELEASED
    assert sorted(first.params) == [2, 3, 4, 5, 6, 7] and sorted(second.params) == [4, 5, 6, 7, 8, 9]
    _in_lockstep(first, run, range(2, 8))  # step 2 replayed in the catch-up: bitwise the core's state too
    _in_lockstep(second, run, range(4, 10))
    assert not run.core.failures  # the per-step parameter digests agreed
    run.assert_equal_to_reference(atol=1e-5)
    run.core.close()


def test_megatron_snapshot_round_trip_restores_model_and_adam_state(model_dir, tmp_path):
    """A snapshot taken after two steps, loaded into a fresh Megatron backend: the next step matches."""
    from libra.services.trainer.torch_backend import TorchBackend

    config = _config()
    core = _backend(model_dir)
    for step in (1, 2):
        core.train_step(_groups(step, GROUPS), config)
    captured = snap.capture(core, 2)
    assert set(captured.optimizer_state[0]) == {"main", "exp_avg", "exp_avg_sq"} and captured.extra["adam_step"] == 2
    path = snap.write(captured, str(tmp_path / "snap"), 3, backends.prepare_meta(core))
    replica = _backend(model_dir)
    assert snap.load(path, replica) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(core.model), _params(replica.model)))
    core.train_step(_groups(3, GROUPS), config)
    replica.train_step(_groups(3, GROUPS), config)  # equal only if Adam's moments and step came back too
    assert all(torch.equal(a, b) for a, b in zip(_params(core.model), _params(replica.model)))
    with pytest.raises(ValueError, match="holds a megatron backend's state, not a torch one"):
        torch_backend = TorchBackend(TrainerConfig(torch_threads=1))
        torch_backend.load(model_dir)
        snap.load(path, torch_backend)


def test_a_hybrid_whose_gradient_layout_differs_fails_its_join_with_the_reason(model_dir, tmp_path, monkeypatch):
    from tests.unit.test_elastic_math import Hybrid

    run = MegatronRun(model_dir, tmp_path)
    good = backends.prepare_meta(run.backend)
    assert good["backend"] == "megatron" and good["layout"][0] == ["embedding.word_embeddings.weight", 0, VOCAB * 32]
    assert backends.layout_mismatch(good["layout"], good["layout"]) == ""
    assert "parameters" in backends.layout_mismatch(good["layout"][1:], good["layout"])

    shifted = [[name, start + 1, end + 1] for name, start, end in good["layout"]]
    original = backends.prepare_meta
    monkeypatch.setattr(backends, "prepare_meta", lambda backend: {**original(backend), "layout": shifted})
    run.core.admit("h-odd")
    hybrid = Hybrid(run.core, "h-odd")
    _wait(lambda: run.core.endpoint.link("h-odd") is not None)
    run.run(1)  # `prepare` sent; the hybrid builds, compares and refuses
    hybrid.thread.join(60)
    assert hybrid.code == EXIT_JOIN_FAILED
    _wait(lambda: not run.core.endpoint._control.empty())
    run.run(1)
    record = run.core.membership.hybrid("h-odd")
    assert record.state == HybridState.FAILED and "flat gradient layouts differ" in record.reason
    run.core.close()


def test_a_tensor_parallel_megatron_core_refuses_hybrids_at_admission(tmp_path):
    from libra.services.trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(_config(tensor_parallel=2))
    assert "trainer.backend.tensor_parallel=2" in backend.hybrid_refusal()
    core = ElasticCore(backend, snapshot_root=str(tmp_path))  # installed on every run: the core still trains
    try:
        with pytest.raises(FailedPrecondition, match="cannot admit hybrid h-1: .*tensor_parallel=2"):
            core.admit("h-1")
    finally:
        core.close()
    with pytest.raises(ValueError, match="tensor_parallel=2, pipeline_parallel=1 must be 1"):
        backends.build({"backend": "megatron", "model_dir": "", "config": _config(tensor_parallel=2).model_dump()},
                       1, "cpu")
    assert MegatronBackend(_config()).hybrid_refusal() is None  # TP = PP = 1 (distributed optimizer: GPUs only)


@pytest.mark.slow
def test_a_megatron_hybrid_process_joins_trains_in_lockstep_and_is_released(model_dir, tmp_path):
    """The hybrid in its own process and its own one-process world: it builds Megatron from `prepare`."""
    run = MegatronRun(model_dir, tmp_path, join_timeout_s=600.0)
    run.core.admit("h-p")
    process = subprocess.Popen([sys.executable, "-m", "libra.services.trainer.elastic.hybrid",
                                "--endpoint", run.core.endpoint.address, "--replica-id", "h-p"])
    try:
        deadline = time.monotonic() + 600
        while not run.manifests or not run.manifests[run.step].hybrids:
            assert time.monotonic() < deadline and process.poll() is None, "the hybrid did not become active"
            time.sleep(0.1)  # connect, build, snapshot, load, catch up: the core keeps stepping
            run.run(1)
        active_from = run.step
        run.run(3)
        run.core.release("h-p")
        run.run(1)
        assert process.wait(60) == EXIT_RELEASED
    finally:
        process.kill()
        process.wait()
    assert [s for s, m in run.manifests.items() if m.hybrids] == list(range(active_from, active_from + 4))
    assert not run.core.failures  # lockstep: the hybrid's parameter digest matched the core's every step
    assert set(run.core.history[active_from + 3][1]) == {"core-0", "h-p"}
    run.assert_equal_to_reference(atol=1e-5)
    run.core.close()



# -- two Megatron core ranks over gloo, a hybrid process on each ------------------------------------
def _megatron_core_rank(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    """One core rank (its own process); the hybrid processes it starts inherit RANK / MASTER_ADDR and
    must still build a world of their own."""
    import os

    from libra.services.trainer.elastic.work import split, widened_groups

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    backend = _backend(model_dir, max_grad_norm=0.5)
    core = ElasticCore(backend, dp_rank=rank, core_ranks=world, snapshot_root=f"{out}-snapshots-{rank}",
                       join_timeout_s=600.0, verify_lockstep=True, channel="group")
    backend.gradient_hook = core
    processes: dict[str, subprocess.Popen] = {}
    record: dict = {"manifests": {}}
    if rank == 0:
        core.admit("h-a")
        core.admit("h-b")

    def gate() -> None:
        """Test pacing only: let this rank's joining hybrid connect, build and load before a boundary."""
        for r in core.membership.records.values():
            if r.dp_rank == rank and r.state == HybridState.JOINING and r.replica_id in processes:
                _wait(lambda: core.endpoint.link(r.replica_id) is not None, 300)
                if r.replica_id in core._prepare_sent and not r.prepared:
                    _wait(lambda: not core.endpoint._control.empty(), 300)
            if r.dp_rank == rank and r.state == HybridState.SNAPSHOT:
                _wait(lambda: not core.endpoint._control.empty(), 300)

    def one_step(step: int) -> None:
        gate()
        manifest = core.begin_step(step)
        record["manifests"][step] = manifest.hybrids
        for r in core.membership.records.values():
            if r.dp_rank == rank and r.state == HybridState.JOINING and r.replica_id not in processes:
                processes[r.replica_id] = subprocess.Popen(
                    [sys.executable, "-m", "libra.services.trainer.elastic.hybrid", "--endpoint",
                     core.endpoint.address, "--replica-id", r.replica_id])
        slices = split(_groups(step, widened_groups(GROUPS, manifest)), GROUP, manifest)
        core.assign(slices)
        backend.train_step(slices[f"core-{rank}"], _config(0.5))
        core.end_step()

    step = step_until_two_hybrids(one_step, core, then=3)
    if rank == 0:
        core.release("h-a")
    step += 1
    one_step(step)
    if rank == 0:
        core.release("h-b")
    step += 1
    one_step(step)
    record.update(failures=core.failures, exit_codes={k: p.wait(60) for k, p in processes.items()}, steps=step,
                  params=[p.detach().clone() for p in backend.model.parameters()])
    torch.save(record, f"{out}-{rank}.pt")
    core.close()
    from libra.services.trainer import ranks

    ranks.leave()  # as a trainer rank does after a clean stop (gloo's threads must not outlive the interpreter)


@pytest.mark.slow
def test_two_megatron_core_ranks_with_a_hybrid_process_each_equal_one_rank_on_the_whole_batch(model_dir, tmp_path):
    from libra.services.trainer.elastic.manifest import StepManifest
    from libra.services.trainer.elastic.work import split, widened_groups

    port = free_port()
    out = str(tmp_path / "rank")
    spawn_ranks(_megatron_core_rank, (2, model_dir, port, out), 2)
    zero, one = (torch.load(f"{out}-{r}.pt", weights_only=False) for r in range(2))
    steps = zero["steps"]
    hybrids = {s: dict(m) for s, m in zero["manifests"].items()}
    assert hybrids[steps - 2] == {"h-a": 0, "h-b": 1} and hybrids[steps - 1] == {"h-b": 1} and hybrids[steps] == {}
    assert zero["exit_codes"] == {"h-a": EXIT_RELEASED} and one["exit_codes"] == {"h-b": EXIT_RELEASED}
    assert not zero["failures"] and not one["failures"]  # every step's lockstep digests agreed
    assert all(torch.equal(a, b) for a, b in zip(zero["params"], one["params"]))
    reference = _backend(model_dir, max_grad_norm=0.5)
    for step in range(1, steps + 1):
        manifest = StepManifest(step, 0, 2, zero["manifests"][step])
        batch = split(_groups(step, widened_groups(GROUPS, manifest)), GROUP, manifest)
        reference.train_step(TrainBatch([s for b in batch.values() for s in b.sequences]), _config(0.5))
    for p, q in zip(zero["params"], reference.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
