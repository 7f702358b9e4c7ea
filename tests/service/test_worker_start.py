"""The gateway's workers start while the trainer prepares its first version (real hf engine workers,
real Redis, the real RolloutService).

- Nothing starts before the trainer names the run's base model (nor on a model Redis names outside
  the run directory); once it does, the plan's workers start on it, and when version 1 is on disk
  (here: other weights than the base's) they load it and join routing only then, serving exactly
  version 1's weights.
- With a version already on disk (a restarted gateway) nothing starts early: the workers start on
  that version.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tests.fixtures_model import two_weight_sets

    return two_weight_sets(tmp_path_factory.mktemp("weights"))  # version 1 will be "sharp"


class Joins:
    """The gateway's membership: records which workers join routing, holding which version."""

    def __init__(self):
        self.joined: list[tuple[str, int]] = []

    async def join(self, worker) -> None:
        self.joined.append((worker.worker_id, worker.version))


def test_workers_start_on_the_base_model_and_join_once_they_hold_version_1(weights, tmp_path, store, run_id, arun):
    from libra.config import RunConfig
    from libra.plans import Bucket, Plan
    from libra.services.rollout.server import RolloutService
    from tests.service.test_engine_contract import PROMPT, trainer_logprobs

    config = RunConfig.model_validate({
        "run_id": run_id, "run_dir": str(tmp_path / "run"),
        "rollout": {"worker": {"engine": "hf", "max_model_len": 256, "base_port": 0}}})
    gateway = RolloutService(config)
    gateway.store, gateway.membership = store, Joins()
    plan = Plan(0, None, (Bucket("short", 1, 100, 1),))

    base = tmp_path / "run" / "model" / "base"
    shutil.copytree(weights["base"], base)

    async def scenario() -> None:
        waiting = asyncio.create_task(gateway._wait_for_weights(plan))
        await asyncio.sleep(0.5)
        assert not gateway.pool.workers  # no base model named, no version: nothing starts
        await store.set_base_model(str(weights["base"]))  # a model outside the run directory: refused
        await asyncio.sleep(1.2)
        assert not gateway.pool.workers
        await store.set_base_model(str(base))
        deadline = time.monotonic() + 10
        while not gateway.pool.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            assert list(gateway.pool.workers) == ["short-0"], "no worker started on the named base model"
            worker = gateway.pool.workers["short-0"]
            assert worker.process.model_dir == base
            v1 = tmp_path / "run" / "weights" / "v1"
            shutil.copytree(weights["sharp"], v1)
            assert await store.publish_version(1, str(v1))
            version, path, early = await asyncio.wait_for(waiting, 120)
            assert (version, path) == (1, str(v1)) and early is not None
            assert gateway.membership.joined == []  # none joins before it holds version 1
            await gateway._join_early(early, path, version)
            assert gateway.membership.joined == [("short-0", 1)]
            assert await worker.client.policy_version() == 1
            turn = await worker.client.generate(PROMPT, 8, temperature=0.0)
            assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)
            # a restarted gateway: version 1 is on disk, so nothing starts early
            assert await asyncio.wait_for(gateway._wait_for_weights(plan), 10) == (1, str(v1), None)
            assert list(gateway.pool.workers) == ["short-0"]
        finally:
            waiting.cancel()
            await gateway.pool.stop_all()

    arun(scenario())
