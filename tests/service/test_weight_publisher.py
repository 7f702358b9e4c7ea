"""The trainer's publisher with weights: group, against a real Redis and a hand-written rollout:
which versions land on disk, when, and what a worker that the group misses then loads.

The design this checks (services/trainer/publisher.py): a version sent over the group is published
without a disk copy; every `disk_every`-th one is written in the background after its reply; a
version some worker could not get over the group is written at once and sent again with its path;
a generation that cannot deliver (rollout's workers changed) is replaced at once. A starting worker
loads the newest version on disk and reports exactly that one. The transport itself (real engines,
real broadcasts) is tests/service/test_weight_sync.py.
"""

from __future__ import annotations

import pathlib

import pytest

from libra.errors import NotFound
from libra.redis_server import free_port
from libra.v1 import rollout_pb2


class Backend:
    """The part of a TrainBackend the publisher uses: a model to send, a weight set to write."""

    def __init__(self):
        import torch

        self.model = torch.nn.Linear(2, 2)
        self.writes: list[str] = []

    def save_weights(self, out_dir: str) -> None:
        path = pathlib.Path(out_dir)
        path.mkdir(parents=True)
        (path / "model.safetensors").write_text(repr(self.model.weight.tolist()))
        self.writes.append(path.name.removesuffix(".partial"))  # written to a staging directory first


class Rollout:
    """Answers UpdateWeights as the gateway would for two workers a and b, as each test step says."""

    def __init__(self):
        self.requests: list[rollout_pb2.UpdateWeightsRequest] = []
        self.behind: set[str] = set()  # workers the group does not reach (without a path: not ok)
        self.serving = ["a", "b"]
        self.unusable = ""

    async def UpdateWeights(self, request, timeout=None):
        self.requests.append(request)
        members = {m.worker_id for m in request.group.members}
        unusable = self.unusable if request.HasField("group") else ""
        self.unusable = ""  # a generation for the serving workers works
        acks = [rollout_pb2.WorkerAck(worker_id=w, version=request.version,
                                      ok=bool(request.path) or (not unusable and w in members and w not in self.behind))
                for w in self.serving]
        return rollout_pb2.UpdateWeightsResponse(version=request.version, acks=acks, group_unusable=unusable,
                                                 serving=[rollout_pb2.GroupMember(worker_id=w, tp=1)
                                                          for w in self.serving])


def test_group_versions_reach_the_disk_every_k_versions_in_the_background_and_on_demand(tmp_path, store, run_id,
                                                                                        arun):
    from libra.config import RunConfig
    from libra.services.trainer.publisher import WeightPublisher

    config = RunConfig.model_validate({"run_id": run_id, "run_dir": str(tmp_path / "run"), "trainer": {
        "max_staleness": 0}, "weights": {"type": "group", "address": f"127.0.0.1:{free_port()}",
                                          "sync_timeout_s": 30, "disk_every": 2}})
    backend, rollout = Backend(), Rollout()
    publisher = WeightPublisher(config, backend, store, rollout)
    weights = tmp_path / "run" / "weights"

    async def scenario() -> None:
        assert await publisher.record(1) == str(weights / "v1")  # the start: on disk, rollout starts on it
        await publisher.deliver(1)
        assert rollout.requests[-1].path == str(weights / "v1") and not rollout.requests[-1].HasField("group")

        # v2 goes over the group with no disk copy on the critical path; it is written after the reply
        report = await publisher.publish(2)
        assert not rollout.requests[-1].path and [m.worker_id for m in rollout.requests[-1].group.members] == ["a", "b"]
        assert report.write_seconds == 0 and report.workers_updated == 2 and backend.writes == ["v1"]
        await publisher.settle()
        assert backend.writes == ["v1", "v2"] and await store.weights_path(2) == str(weights / "v2")

        # v3 (not a multiple of disk_every) misses b in the group: written at once, sent again with its path
        rollout.behind = {"b"}
        report = await publisher.publish(3)
        rollout.behind = set()
        assert [r.path for r in rollout.requests[-2:]] == ["", str(weights / "v3")]
        assert not rollout.requests[-1].HasField("group") and rollout.requests[-1].meta.request_id == "weights-v3-disk"
        assert report.write_seconds > 0 and report.workers_updated == 2
        assert await store.weights_path(3) == str(weights / "v3")

        # v4: rollout's workers changed since its last reply; the generation is replaced at once
        rollout.serving, rollout.unusable = ["a"], "workers ['b'] of generation 3 are not here"
        report = await publisher.publish(4)
        first, second = rollout.requests[-2:]
        assert [m.worker_id for m in second.group.members] == ["a"] and second.group.generation > first.group.generation
        assert report.workers_updated == 1 and not second.path  # over the group: no disk on the critical path
        await publisher.settle()  # 4 is a multiple of disk_every: written in the background

        # v5: over the group, never written. A worker starting now loads v4 and says v4 until v6 reaches it
        await publisher.publish(5)
        await publisher.settle()
        assert "v5" not in backend.writes
        with pytest.raises(NotFound, match="not written to disk"):
            await store.weights_path(5)
        latest = await store.latest_on_disk()
        assert (latest.version, latest.path) == (4, str(weights / "v4"))
        assert sorted(p.name for p in weights.iterdir()) == ["v2", "v3", "v4"]  # v1 pruned (max_staleness 0)
        await publisher.close()

    arun(scenario())


def test_a_fresh_run_publishes_the_base_models_files_as_version_1_and_a_later_start_does_not(tmp_path, store,
                                                                                              run_id, arun):
    """`first_version_from`: with no version in Redis or weights/, the base model's files become v1
    (hard links inside the weights directory, where rollout accepts paths; Redis names them) before
    any backend exists; once a version exists, nothing is published and the start writes its own."""
    import os

    from libra.config import RunConfig
    from libra.services.trainer.publisher import WeightPublisher

    config = RunConfig.model_validate({"run_id": run_id, "run_dir": str(tmp_path / "run")})
    base = tmp_path / "run" / "model" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights of the base model")
    publisher = WeightPublisher(config, None, store, Rollout())  # no backend yet: none is needed

    async def scenario() -> None:
        assert await publisher.first_version_from(base) == 1
        v1 = tmp_path / "run" / "weights" / "v1"
        assert sorted(p.name for p in v1.iterdir()) == ["config.json", "model.safetensors"]
        assert os.path.samefile(v1 / "model.safetensors", base / "model.safetensors")  # linked, not written
        latest = await store.latest_on_disk()
        assert (latest.version, latest.path) == (1, str(v1)) and await store.current_version() == 1
        # a restarted trainer (v1 in Redis): not fresh; its first version is 2, from its own weights
        assert await publisher.first_version_from(base) is None and await publisher.first_version(0) == 2
        (v1 / "model.safetensors").unlink()  # pruning a version never touches the base model
        assert (base / "model.safetensors").read_bytes() == b"weights of the base model"

    arun(scenario())
