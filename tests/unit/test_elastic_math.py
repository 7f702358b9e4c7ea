"""The elastic data plane's math and joins, in one process: a core rank and hybrid replicas in threads.

Everything is real except process boundaries: real TCP side channels, real snapshots on disk, the
real torch backend. The reference is a plain (static) run of the same backend over the union of
the samples every replica trained on in each step; tests/unit/test_torch_backend.py shows that
equals a data-parallel run. Multi-process runs over gloo live in tests/service/test_elastic_join.py.
The tests marked `CHANNELS` run twice: gradients inside the TCP frames, and over a private gloo
pair group per hybrid (`channel="group"`: the path NCCL takes on GPUs).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.elastic.core_hooks import ElasticCore
from libra.services.trainer.elastic.hybrid import EXIT_LOST, EXIT_JOIN_FAILED, EXIT_RELEASED, HybridReplica
from libra.services.trainer.elastic.manifest import HybridState, Membership
from libra.services.trainer.elastic.side_channel import HybridLink
from libra.services.trainer.elastic.work import split, widened_groups
from libra.services.trainer.torch_backend import TorchBackend

VOCAB, GROUP, GROUPS = 64, 2, 2
CHANNELS = pytest.mark.parametrize("channel", ["tcp", "group"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _config(max_grad_norm: float = 1e6) -> TrainerConfig:
    # No clipping by default: Adam and clipping hide a wrong gradient scale, so gradients are compared too.
    return TrainerConfig(lr=1e-3, micro_batch_size=2, torch_threads=1, groups_per_step=GROUPS, group_size=GROUP,
                         max_grad_norm=max_grad_norm)


def _backend(model_dir: str) -> TorchBackend:
    backend = TorchBackend(_config(), seed=0)
    backend.load(model_dir)
    return backend


def _groups(step: int, count: int) -> TrainBatch:
    """`count` whole groups for a step; different lengths and masks so token weighting matters."""
    sequences = []
    for g in range(count):
        for i in range(GROUP):
            gen = torch.Generator().manual_seed(1000 * step + 10 * g + i)
            prompt, response = 2 + (g + i) % 3, 3 + (step + g + 2 * i) % 5
            tokens = torch.randint(1, VOCAB, (prompt + response,), generator=gen).tolist()
            mask = [0 if (j == 1 and g % 2) else 1 for j in range(response)]
            behaviour = (-torch.rand(response, generator=gen) - 3.5).tolist()
            sequences.append(TrainSequence(tokens, prompt, mask, behaviour, 1.0 if i == 0 else -1.0))
    return TrainBatch(sequences)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class Hybrid:
    """A hybrid replica in a thread, recording its parameters after every step it applies."""

    def __init__(self, core: ElasticCore, replica_id: str, replica_class=HybridReplica, **options):
        self.params: dict[int, list[torch.Tensor]] = {}
        self.replica = replica_class(HybridLink(core.endpoint.address, replica_id), replica_id,
                                     on_step=lambda step, b: self.params.__setitem__(step, _params(b.model)),
                                     **options)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.replica.run()


def _wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def step_until_two_hybrids(one_step, core: ElasticCore, then: int, limit: int = 200) -> int:
    """The multi-rank drivers' opening: `one_step(n)` until the manifest carries two hybrids (at most
    `limit` steps), then `then` steps more; returns the last step number."""
    step = 0
    while step < limit and len(core.manifest.hybrids if core.manifest else ()) < 2:
        step += 1
        one_step(step)
    for _ in range(then):
        step += 1
        one_step(step)
    return step


def _control_pending(core: ElasticCore, replica_id: str | None = None, kind: str | None = None) -> bool:
    """A control frame waits for the core's next boundary (from `replica_id`, of `kind`, when given).

    Name both where another hybrid may still be talking: a late frame of one hybrid must not pass
    for another's (under load that let a step run before the second hybrid was prepared)."""
    return any((replica_id is None or r == replica_id) and (kind is None or f.kind == kind)
               for r, f in list(core.endpoint._control.queue))


def _caught_up_pending(core: ElasticCore, step: int) -> bool:
    return any(f.kind == "caught_up" and f.header["step"] >= step for _, f in list(core.endpoint._control.queue))


class Run:
    """Drives a core rank step by step and the static reference beside it."""

    def __init__(self, model_dir: str, tmp_path, max_grad_norm: float = 1e6, **core_options):
        self.config = _config(max_grad_norm)
        self.backend = _backend(model_dir)
        self.reference = _backend(model_dir)
        self.core = ElasticCore(self.backend, snapshot_root=str(tmp_path / "snapshots"), verify_lockstep=True,
                                **core_options)
        self.backend.gradient_hook = self.core
        self.step = 0
        self.manifests = {}
        self.core_params: dict[int, list[torch.Tensor]] = {}

    def run(self, steps: int, reference_drop: tuple[str, ...] = ()) -> None:
        for _ in range(steps):
            self.step += 1
            manifest = self.core.begin_step(self.step)
            self.manifests[self.step] = manifest
            batch = _groups(self.step, widened_groups(GROUPS, manifest))
            slices = split(batch, GROUP, manifest)
            self.core.assign(slices)
            self.backend.train_step(slices["core-0"], self.config)
            self.core.end_step()
            trained = [s for replica, b in slices.items() if replica not in reference_drop for s in b.sequences]
            self.reference.train_step(TrainBatch(trained), self.config)
            self.core_params[self.step] = _params(self.backend.model)

    def assert_equal_to_reference(self, atol: float = 2e-6) -> None:
        for p, q in zip(self.backend.model.parameters(), self.reference.model.parameters()):
            assert torch.allclose(p, q, atol=atol), (p - q).abs().max()
            # the last step's gradient itself (scale included): a token mean over what was trained on
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), (p.grad - q.grad).abs().max()


def _admit(run: Run, replica_id: str, **options) -> Hybrid:
    """Admit and connect before the next step; after two steps the snapshot is being written."""
    run.core.admit(replica_id)
    hybrid = Hybrid(run.core, replica_id, **options)
    _wait(lambda: run.core.endpoint.link(replica_id) is not None)
    run.run(1)  # admission applied; `prepare` sent (the hybrid builds its model)
    _wait(lambda: _control_pending(run.core, replica_id, "prepared"))
    run.run(1)  # connected and prepared → snapshot of the state after the previous step
    return hybrid


def _join(run: Run, replica_id: str, **options) -> Hybrid:
    """Admit before the next step and drive boundaries until the replica is active from the third."""
    hybrid = _admit(run, replica_id, **options)
    _wait(lambda: hybrid.replica.backend is not None and _control_pending(run.core, replica_id, "loaded"))
    return hybrid


@CHANNELS
def test_update_with_hybrids_equals_plain_data_parallel_and_stays_in_lockstep(model_dir, tmp_path, channel):
    run = Run(model_dir, tmp_path, channel=channel)
    first = _join(run, "h-a")
    second = _join(run, "h-b")
    run.run(3)
    assert [run.manifests[s].replicas for s in range(1, 8)] == [1, 1, 2, 2, 3, 3, 3]
    assert run.manifests[7].active_ids == ["core-0", "h-a", "h-b"]
    run.assert_equal_to_reference()
    for hybrid, since in ((first, 3), (second, 5)):
        for step in range(since, 8):
            assert all(torch.equal(a, b) for a, b in zip(hybrid.params[step], run.core_params[step])), step
    assert {"core-0", "h-a", "h-b"} <= run.core.history[7][1]  # the step was acknowledged by all three
    assert run.manifests[7].epoch == 2 and run.manifests[5].epoch == 2 and run.manifests[4].epoch == 1
    expected = "group/gloo" if channel == "group" else "tcp"
    assert run.core.endpoint.link("h-a").channel == expected and first.replica.link.channel == expected
    run.core.close()


@CHANNELS
def test_join_at_step_3_and_leave_at_step_7_equals_the_static_runs(model_dir, tmp_path, channel):
    run = Run(model_dir, tmp_path, max_grad_norm=0.5, channel=channel)  # clipped: hybrids clip as the core does
    hybrid = _join(run, "h-1")  # steps 1, 2 without it
    run.run(5)  # steps 3..7 with it
    run.core.release("h-1")
    run.run(3)  # steps 8..10 without it
    active = [s for s, m in run.manifests.items() if m.hybrids]
    assert active == [3, 4, 5, 6, 7]
    hybrid.thread.join(10)
    assert hybrid.code == EXIT_RELEASED
    assert all(torch.equal(a, b) for a, b in zip(hybrid.params[7], run.core_params[7]))
    assert sorted(hybrid.params) == [2, 3, 4, 5, 6, 7]  # step 2 replayed in the catch-up, then lockstep
    run.assert_equal_to_reference()
    assert run.core.membership.hybrid("h-1").state == HybridState.RELEASED
    run.core.close()


def test_snapshot_is_written_while_the_core_keeps_stepping(model_dir, tmp_path):
    writing = threading.Event()
    release_writer = threading.Event()

    def after_shard(index: int) -> None:
        writing.set()
        assert release_writer.wait(60)

    run = Run(model_dir, tmp_path, after_shard=after_shard)
    hybrid = _admit(run, "h-slow")  # boundary 2 takes the snapshot (state after step 1) and starts the writer
    assert writing.wait(30)
    run.run(3)  # steps 3, 4, 5 run while the snapshot is still being written
    assert hybrid.replica.backend is None and run.core.membership.hybrid("h-slow").state == HybridState.SNAPSHOT
    release_writer.set()
    _wait(lambda: hybrid.replica.backend is not None and _control_pending(run.core, "h-slow", "loaded"))
    run.run(1)  # boundary 6: steps 2..5 streamed to it; step 6 runs without it (and is streamed too)
    _wait(lambda: _caught_up_pending(run.core, 6))
    run.run(2)  # boundary 7: caught up, active from 7
    assert run.manifests[6].hybrids == () and run.manifests[7].hybrids == (("h-slow", 0),)
    assert sorted(hybrid.params) == [2, 3, 4, 5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert all(torch.equal(a, b) for a, b in zip(hybrid.params[step], run.core_params[step])), step
    run.assert_equal_to_reference()
    run.core.close()


class _Stalling(HybridReplica):
    """Receives its step and never answers (a hung device), until the test lets it go."""

    unblock = threading.Event()

    def _train(self, frame):
        if frame.header["step"] >= 9:
            self.unblock.wait(60)
            raise ConnectionError("stalled replica gives up")
        super()._train(frame)


@CHANNELS
def test_a_hybrid_that_dies_or_stalls_mid_step_is_marked_failed_and_the_core_carries_on(model_dir, tmp_path,
                                                                                       channel):
    _Stalling.unblock.clear()
    run = Run(model_dir, tmp_path, grad_deadline_s=3.0, channel=channel)
    dying = _join(run, "h-dies", die_at_step=4)  # active from 3, closes its connection in step 4
    run.run(1)
    assert run.manifests[3].hybrids == (("h-dies", 0),)
    run.run(1, reference_drop=("h-dies",))  # step 4: finished without it, token mean over what arrived
    assert [f[1] for f in run.core.failures] == ["h-dies"]
    run.assert_equal_to_reference()
    run.run(1)
    assert run.manifests[5].hybrids == () and run.core.membership.hybrid("h-dies").state == HybridState.FAILED
    dying.thread.join(10)
    assert dying.code == EXIT_LOST

    stalling = _join(run, "h-stalls", replica_class=_Stalling)  # steps 6, 7
    run.run(1)
    assert run.manifests[8].hybrids == (("h-stalls", 0),)
    started = time.monotonic()
    run.run(1, reference_drop=("h-stalls",))  # step 9: the deadline (3 s) passes, the core finishes
    assert 3.0 <= time.monotonic() - started < 3.0 + 10.0
    assert "deadline" in run.core.failures[-1][2]
    run.assert_equal_to_reference()
    _Stalling.unblock.set()
    stalling.thread.join(10)
    assert stalling.code == EXIT_LOST
    run.core.close()


def test_a_failed_snapshot_fetch_rolls_the_join_back(model_dir, tmp_path):
    import os

    def after_shard(index: int) -> None:  # the shard vanishes before the hybrid reads it
        if index == 0:
            os.remove(next(p for p in (tmp_path / "snapshots").glob("*/shard-0.pt")))

    run = Run(model_dir, tmp_path, after_shard=after_shard, snapshot_shards=2)
    hybrid = _admit(run, "h-bad")
    hybrid.thread.join(30)
    assert hybrid.code == EXIT_JOIN_FAILED
    _wait(lambda: _control_pending(run.core))
    run.run(2)
    _assert_rolled_back(run, tmp_path, "h-bad", "snapshot fetch failed")


def test_membership_freezes_changes_at_the_next_boundary_and_survives_a_restart():
    membership = Membership(core_ranks=2)
    membership.apply({"kind": "admit", "replica_id": "a", "generation": 1}, step=1)
    membership.apply({"kind": "admit", "replica_id": "b", "generation": 1}, step=1)
    assert [membership.hybrid(r).dp_rank for r in "ab"] == [0, 1]  # any core rank, not only the first
    manifest, actions = membership.freeze(1)
    assert manifest.hybrids == () and actions == []
    membership.apply({"kind": "connected", "replica_id": "a"}, step=1)
    assert membership.freeze(2)[1] == []  # not before its model is built
    membership.apply({"kind": "prepared", "replica_id": "a"}, step=2)
    _, actions = membership.freeze(2)
    assert [(a.kind, a.replica_id, a.snapshot_step) for a in actions] == [("snapshot", "a", 1)]
    membership.apply({"kind": "loaded", "replica_id": "a", "step": 1}, step=2)
    manifest, actions = membership.freeze(3)
    assert manifest.hybrids == (("a", 0),) and manifest.epoch == 1 and actions[0].kind == "activate"
    restored = Membership.from_json(membership.to_json())
    assert restored.hybrid("a").state == HybridState.FAILED and "restarted" in restored.hybrid("a").reason
    assert restored.freeze(4)[0].hybrids == () and restored.epoch == 2


def test_a_hybrid_whose_parameters_diverge_is_caught_by_the_lockstep_check(model_dir, tmp_path):
    run = Run(model_dir, tmp_path)
    hybrid = _join(run, "h-drift")
    run.run(1)  # step 3: active, digests agree
    assert not run.core.failures
    with torch.no_grad():  # the hybrid waits for its next frame; nudge one of its weights
        next(hybrid.replica.backend.model.parameters())[0, 0] += 1e-3
    run.run(1, reference_drop=("h-drift",))
    assert [(s, r) for s, r, _ in run.core.failures] == [(4, "h-drift")] and "diverged" in run.core.failures[0][2]
    run.assert_equal_to_reference()
    hybrid.thread.join(10)
    assert hybrid.code == EXIT_LOST
    run.core.close()


def test_a_join_that_times_out_or_whose_snapshot_write_fails_is_rolled_back(model_dir, tmp_path):
    now = [0.0]
    run = Run(model_dir, tmp_path, join_timeout_s=30.0, clock=lambda: now[0])
    run.core.admit("h-never")  # no process ever connects
    run.run(2)
    now[0] = 31.0
    run.run(2)
    record = run.core.membership.hybrid("h-never")
    assert record.state == HybridState.FAILED and "join_timeout_s" in record.reason

    def disk_full(index: int) -> None:
        raise OSError("No space left on device")

    run.core.after_shard = disk_full
    hybrid = _admit(run, "h-nodisk")  # the boundary that takes the snapshot starts the failing writer
    _wait(lambda: run.core.failures[-1][1] == "h-nodisk")
    run.run(1)  # the rollback: the hybrid is told `error`
    hybrid.thread.join(30)
    assert hybrid.code == EXIT_JOIN_FAILED
    _assert_rolled_back(run, tmp_path, "h-nodisk", "No space left")


def _assert_rolled_back(run: Run, tmp_path, replica: str, reason: str) -> None:
    """A failed join left nothing behind: the replica FAILED with `reason`, no snapshot files, no kept
    gradients, never in a manifest, and the core's parameters are the static run's. Closes the core."""
    record = run.core.membership.hybrid(replica)
    assert record.state == HybridState.FAILED and reason in record.reason
    assert not list((tmp_path / "snapshots").glob("*")) and not run.core._retained
    assert all(not m.hybrids for m in run.manifests.values())
    run.assert_equal_to_reference()
    run.core.close()
