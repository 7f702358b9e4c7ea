"""weights: colocated on CPU: what the config refuses, the clear failure on a machine without CUDA,
the descriptor's checks, an engine that refuses a version leaving its weights alone, and the
gateway's fallback to disk. (The CUDA IPC path itself: tests/gpu/test_colocated.py.)"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch

from libra.config import build_run_config
from libra.errors import ConfigError, FailedPrecondition
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.weight_delivery import WeightDelivery
from libra.services.rollout.workers import PoolWorker, WorkerPool
from libra.v1 import common_pb2
from libra.weights import ipc
from libra.weights.config import ColocatedWeights
from libra.weights.layout import plan_layout

GPU_ENGINE = {"rollout": {"worker": {"dtype": "bfloat16", "engine": {"type": "hf", "device": "cuda:0"}}},
              "trainer": {"backend": "megatron"}}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_the_config_names_what_colocated_needs():
    config = build_run_config({**GPU_ENGINE, "weights": "colocated"}, env={})
    assert config.weights.type == "colocated" and config.weights.mode == "share"
    wrong = [({"weights": "colocated"}, "engine: {type: hf, device: cuda:0}"),
             ({**GPU_ENGINE, "weights": "colocated", "trainer": {"backend": "torch"}}, "trainer.backend: megatron"),
             ({**GPU_ENGINE, "weights": "colocated",
               "rollout": {"worker": {"engine": {"type": "hf", "device": "cuda:1"}}}}, "device: cuda:0"),
             ({**GPU_ENGINE, "weights": {"type": "colocated", "mode": "copy"},
               "rollout": {"worker": {"dtype": "float32", "engine": {"type": "hf", "device": "cuda"}}}},
              "rollout.worker.dtype: bfloat16"),
             ({**GPU_ENGINE, "weights": {"type": "colocated", "mode": "mmap"}}, "mode")]
    for tree, fix in wrong:
        with pytest.raises(ConfigError, match="colocated|mode") as error:
            build_run_config(tree, env={})
        assert fix in str(error.value), str(error.value)


@no_cuda
def test_without_cuda_the_trainer_refuses_at_start():
    from libra.services.trainer.publisher import WeightPublisher

    config = build_run_config({**GPU_ENGINE, "weights": "colocated"}, env={})
    with pytest.raises(FailedPrecondition, match="weights: colocated needs CUDA on the trainer and an hf engine on "
                                                 "the same GPU"):
        WeightPublisher.check(config)
    WeightPublisher.check(build_run_config({}, env={}))  # disk: nothing to refuse
    from libra.checks import check_weights

    with pytest.raises(ConfigError, match="needs CUDA"):  # libra up refuses before starting anything (exit 2)
        check_weights(config)
    with pytest.raises(FailedPrecondition, match="needs CUDA"):
        ipc.ColocatedExport([("w", torch.zeros(4))], "share", "cpu")


def _descriptor(version: int = 3, mode: str = "share", **changes) -> str:
    layout = plan_layout([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))], 0, ipc.STREAM_BUCKET)
    handle = {"device": 0, "numel": layout.stream_bytes, "offset": 0, "handle": "aGFuZGxl", "storage_bytes": 64,
              "storage_offset": 0, "counter": None, "counter_offset": 0, "event": None, "event_sync": False}
    raw = {"version": version, "mode": mode, "slot": version % ipc.slots(mode), "layout": layout.to_json(),
           "buffers": [handle] * ipc.slots(mode), **changes}
    return json.dumps(raw)


def test_descriptors_are_checked_before_anything_opens():
    version, mode, slot, layout, buffers = ipc.parse(_descriptor())
    assert (version, mode, slot, [s.name for s in layout.slots], len(buffers)) == (3, "share", 1, ["w", "b"], 2)
    assert ipc.parse(_descriptor(mode="copy"))[2] == 0
    for bad in ("{", _descriptor(slot=2), _descriptor(mode="copy", buffers=[]), _descriptor().replace("share", "mmap")):
        with pytest.raises(ValueError, match="colocated weights"):
            ipc.parse(bad)


def test_a_cpu_engine_refuses_and_keeps_its_weights(tiny_qwen2_dir):
    from libra.services.rollout.engines.hf_engine import HFEngine

    engine = HFEngine(tiny_qwen2_dir, device="cpu", policy_version=2)
    try:
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        answer = engine.receive_colocated(_descriptor(version=3), 3)
        assert "needs CUDA" in answer["error"] and engine.version == 2 and not engine.dirty
        assert "is of version 3, not 4" in engine.receive_colocated(_descriptor(version=3), 4)["error"]
        assert all(torch.equal(before[n], p) for n, p in engine.model.named_parameters())
    finally:
        engine.stop()


class _Process:
    alive = True


class _Engine:
    """A worker's client that refuses colocated versions (as a misfit would) and loads from disk."""

    base_url = "http://fake"

    def __init__(self):
        self.version, self.calls = 1, []

    async def receive_colocated(self, descriptor, version, timeout_s):
        self.calls.append(("colocated", version))
        return [{"error": "ValueError: the trainer's tensors do not fit this model"}]

    async def load_weights(self, path, version):
        self.calls.append(("disk", version))
        self.version = version


def test_the_gateway_falls_back_to_disk_and_says_behind_without_a_path(tmp_path):
    pool = WorkerPool(WorkerConfig(), pathlib.Path("unused"))
    engine = _Engine()
    pool.workers["w0"] = PoolWorker("w0", "short", 1, _Process(), engine, version=1,
                                    state=common_pb2.WORKER_STATE_SERVING)
    delivery = WeightDelivery(pool, ColocatedWeights(), tmp_path)
    done = asyncio.run(delivery.deliver(2, "", None, _descriptor(version=2)))
    assert [(a.ok, a.version) for a in done.acks] == [(False, 1)] and "not on disk yet" in done.acks[0].error
    assert pool.workers["w0"].state == common_pb2.WORKER_STATE_SERVING  # weights unchanged: still serving v1
    (tmp_path / "v2").mkdir()
    done = asyncio.run(delivery.deliver(2, str(tmp_path / "v2"), None, _descriptor(version=2)))
    assert [(a.ok, a.version) for a in done.acks] == [(True, 2)]
    assert engine.calls == [("colocated", 2), ("colocated", 2), ("disk", 2)]
