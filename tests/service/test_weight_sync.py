"""The weights group over gloo with real processes, and the worker pool's group path end to end.

- Bucketed broadcast: tensors of mixed dtypes and sizes (several span buckets) arrive equal to the
  source, twice over the same group (created once), in place into targets or into fresh tensors.
- A receiver that does not join a version: the sender aborts it before any transfer with an error
  naming the rank; the other receiver is told; the group stays usable for the next version.
- A receiver that dies mid-broadcast: the sender raises WeightSyncError and the group is broken.
- The pool: two hf engines join the group; a version arrives over it (log-probs equal the trainer's
  on the new weights); a worker that is killed misses the next version: the sender names it, the
  pool marks it unhealthy, and the live worker gets that version retried over the disk path.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from libra.errors import FailedPrecondition
from libra.redis_server import free_port
from libra.services.rollout.weight_sync import Layout, WeightSyncError, WeightsGroup, plan_layout

pytestmark = pytest.mark.slow


def _tensors(version: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(version)
    out = {}
    for i, (shape, dtype) in enumerate([((300, 7), torch.float32), ((5,), torch.bfloat16), ((1, 1), torch.float16),
                                        ((64, 33), torch.bfloat16), ((3, 1000), torch.float32), ((2,), torch.int64)]):
        out[f"layer{i}.weight"] = (torch.randn(shape, generator=generator) * 100).to(dtype)
    return out


def _rank_main(rank: int, port: int, out_dir: str, scenario: str) -> None:
    import torch

    # direct_bytes=10000: the biggest tensor goes on its own, the rest through 4 KiB buckets (some span several)
    group = WeightsGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=5, bucket_bytes=4096, direct_bytes=10000)
    outcome: dict = {}
    try:
        for version in (1, 2):
            source = _tensors(version)
            skip = scenario == "miss" and rank == 2 and version == 1
            if rank == 0:
                try:
                    report = group.send(source.items(), version, join_timeout_s=3 if scenario == "miss" else None)
                    outcome[version] = {"buckets": report.buckets, "receivers": sorted(report.receivers)}
                except (WeightSyncError, FailedPrecondition) as error:
                    outcome[version] = {"error": str(error), "broken": group.broken}
            elif skip:
                outcome[version] = "skipped"
            else:
                targets = {k: torch.zeros_like(t) for k, t in source.items()} if rank == 1 else None
                try:
                    received = {}
                    for name, tensor in group.receive(version, targets):
                        received[name] = tensor
                        if scenario == "die" and rank == 2:
                            os._exit(3)  # a crash mid-broadcast
                    outcome[version] = {"equal": all(torch.equal(received[k], t) for k, t in source.items()),
                                        "in_place": targets is not None and all(received[k] is targets[k] for k in source)}
                except WeightSyncError as error:
                    outcome[version] = {"error": str(error)}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _spawn(tmp_path: Path, scenario: str) -> dict[int, dict]:
    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_main, args=(free_port(), str(tmp_path), scenario), nprocs=3,
                                 join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
    outcomes = {}
    for rank in range(3):
        path = tmp_path / f"rank{rank}.json"
        outcomes[rank] = json.loads(path.read_text()) if path.exists() else None
    return outcomes


def test_layout_cuts_tensors_into_aligned_buckets():
    import torch

    layout = plan_layout([("a", torch.zeros(5)), ("b", torch.zeros(40, dtype=torch.bfloat16))], 4, 32)
    assert [(s.offset, s.nbytes) for s in layout.slots] == [(0, 20), (32, 80)]  # b starts 16-byte aligned
    assert layout.num_buckets == 4 and Layout.from_json(layout.to_json()) == layout
    assert [(s.name, a, b) for s, a, b in layout.overlapping(1)] == [("b", 32, 64)]
    mixed = plan_layout([("a", torch.zeros(5)), ("big", torch.zeros(100)), ("b", torch.zeros(40, dtype=torch.bfloat16))],
                        4, 32, direct_bytes=400)
    assert [s.name for s in mixed.direct_slots] == ["big"] and mixed.total_bytes == 20 + 400 + 80
    assert mixed.stream_bytes == 112 and mixed.num_buckets == 4 and Layout.from_json(mixed.to_json()) == mixed
    assert "big" not in {s.name for bucket in range(4) for s, _, _ in mixed.overlapping(bucket)}
    with pytest.raises(ValueError, match="appears twice"):
        plan_layout([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_layout([("a", torch.zeros(1))], 1, 10)


def test_bucketed_broadcast_equals_the_source(tmp_path):
    outcomes = _spawn(tmp_path, "ok")
    for version in ("1", "2"):
        assert outcomes[0][version]["buckets"] == 4 and outcomes[0][version]["receivers"] == [1, 2]
        assert outcomes[1][version] == {"equal": True, "in_place": True}
        assert outcomes[2][version] == {"equal": True, "in_place": False}


def test_a_receiver_that_misses_a_version_is_named_and_the_group_survives(tmp_path):
    outcomes = _spawn(tmp_path, "miss")
    assert "ranks [2] did not join version 1" in outcomes[0]["1"]["error"] and not outcomes[0]["1"]["broken"]
    assert "aborted" in outcomes[1]["1"]["error"]
    assert outcomes[0]["2"]["receivers"] == [1, 2]  # the next version reaches everyone
    assert outcomes[1]["2"]["equal"] and outcomes[2]["2"]["equal"]


def test_a_receiver_that_dies_mid_broadcast_breaks_the_group(tmp_path):
    outcomes = _spawn(tmp_path, "die")
    assert outcomes[2] is None or outcomes[2] == {}  # it died before writing its outcome
    error = outcomes[0]["1"]
    assert "weights group failed" in error["error"] and error["broken"]
    assert "the weights group is broken" in outcomes[0]["2"]["error"]  # until it is rebuilt


# ---- the pool's group path with real hf engines ---------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tests.fixtures_model import make_random_llama

    root = tmp_path_factory.mktemp("weights")
    return {"base": make_random_llama(root / "base", seed=0),
            "sharp": make_random_llama(root / "sharp", seed=0, lm_head_scale=3.0)}


def _named_parameters(model_dir: Path) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_pool_receives_over_the_group_and_a_missing_worker_is_marked_unhealthy(weights, tmp_path, arun):
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.engine_client import EngineClient
    from libra.services.rollout.workers import PoolWorker, WorkerPool, worker_process_class
    from libra.v1 import common_pb2
    from tests.service.test_engine_contract import PROMPT, trainer_logprobs

    address = f"127.0.0.1:{free_port()}"
    config = WorkerConfig(engine="hf", max_model_len=256, cpu_threads=1, weight_sync="group",
                          weights_group_address=address, weights_sync_timeout_s=5, weights_bucket_mb=1)
    pool = WorkerPool(config, tmp_path)
    launcher = worker_process_class("hf")
    for index in range(2):
        process = launcher(config, weights["base"], index, tmp_path, port=free_port(), policy_version=1).start()
        pool.workers[f"w-{index}"] = PoolWorker(f"w-{index}", "short", 1, process, EngineClient(process.base_url),
                                                version=1)

    def trainer_side(result: dict, version: int, source: list) -> None:
        try:
            if "group" not in result:
                result["group"] = WeightsGroup("127.0.0.1", int(address.rsplit(":")[1]), 0, 3, "gloo",
                                               timeout_s=5, bucket_bytes=2**20)
            result["report"] = result["group"].send(source, version, join_timeout_s=3)
        except Exception as error:  # noqa: BLE001 - inspected by the test
            result["error"] = error

    async def scenario() -> None:
        await asyncio.gather(*(w.process.wait_ready(120) for w in pool.workers.values()))
        for worker in pool.workers.values():
            worker.state = common_pb2.WORKER_STATE_SERVING
        side: dict = {}
        sharp = _named_parameters(weights["sharp"])
        thread = threading.Thread(target=trainer_side, args=(side, 2, sharp))
        thread.start()
        await pool.join_weights_group(address, 1, 3)
        acks = await pool.receive_weights(2)
        await asyncio.to_thread(thread.join, 30)
        assert "error" not in side and all(a.ok and a.version == 2 for a in acks), (side, acks)
        assert sorted(side["report"].receivers) == [1, 2]
        turn = await pool.workers["w-0"].client.generate(PROMPT, 8, temperature=0.0)
        assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)
        # worker 1 crashes: version 3 cannot reach it
        victim = pool.workers["w-1"].process
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(timeout=10)
        base = _named_parameters(weights["base"])
        thread = threading.Thread(target=trainer_side, args=(side, 3, base))
        thread.start()
        acks = {a.worker_id: a for a in await pool.receive_weights(3, fallback_path=str(weights["base"]))}
        await asyncio.to_thread(thread.join, 30)
        assert isinstance(side["error"], WeightSyncError) and "ranks [2] did not join version 3" in str(side["error"])
        assert not acks["w-1"].ok and pool.workers["w-1"].state == common_pb2.WORKER_STATE_UNHEALTHY
        assert [w.worker_id for w in await pool.check_health()] == ["w-1"]  # the gateway deregisters it, once
        assert await pool.check_health() == []
        assert acks["w-0"].ok and acks["w-0"].version == 3  # retried over the disk path
        assert await pool.workers["w-0"].client.policy_version() == 3 and pool.version_of("w-0") == 3
        turn = await pool.workers["w-0"].client.generate(PROMPT, 8, temperature=0.0)
        assert turn.logprobs == pytest.approx(trainer_logprobs(weights["base"], PROMPT, turn.token_ids), abs=2e-4)

    try:
        arun(scenario())
    finally:
        arun(pool.stop_all())



def test_the_trainer_model_state_publishes_over_the_group(weights, tmp_path, arun):
    """ModelState (torch backend) hosts the group and sends; an hf worker of the pool receives."""
    from libra.config import RunConfig
    from libra.services.rollout.engine_client import EngineClient
    from libra.services.rollout.workers import PoolWorker, WorkerPool, worker_process_class
    from libra.services.trainer.model_state import ModelState
    from libra.services.trainer.torch_backend import TorchBackend
    from libra.v1 import common_pb2
    from tests.service.test_engine_contract import PROMPT, trainer_logprobs

    address = f"127.0.0.1:{free_port()}"
    config = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "rollout": {"worker": {
        "engine": "hf", "max_model_len": 256, "weight_sync": "group", "weights_group_address": address,
        "weights_sync_timeout_s": 30, "weights_bucket_mb": 1}}})
    backend = TorchBackend(config.trainer)
    backend.load(str(weights["sharp"]))  # the trainer's weights: the sharp model; the worker starts on base
    state = ModelState(config, backend, store=None)
    pool = WorkerPool(config.rollout.worker, tmp_path)
    process = worker_process_class("hf")(config.rollout.worker, weights["base"], 0, tmp_path, port=free_port()).start()
    pool.workers["w-0"] = PoolWorker("w-0", "short", 1, process, EngineClient(process.base_url))

    async def scenario() -> None:
        await process.wait_ready(120)
        pool.workers["w-0"].state = common_pb2.WORKER_STATE_SERVING
        await asyncio.gather(state.open_weights_group(2), pool.join_weights_group(address, 1, 2))
        acks, report = await asyncio.gather(pool.receive_weights(5), state.send_weights(5))
        assert acks[0].ok and acks[0].version == 5 and report.receivers[1]["bytes"] == report.bytes
        turn = await pool.workers["w-0"].client.generate(PROMPT, 8, temperature=0.0)
        assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)

    try:
        arun(scenario())
    finally:
        arun(pool.stop_all())
