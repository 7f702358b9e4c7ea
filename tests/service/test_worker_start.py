"""The gateway's first workers start while the trainer prepares its first version
(services/rollout/first_start.py; real hf engine workers, real Redis).

- Nothing starts before the trainer names the run's base model (nor on a model Redis names outside
  the run directory, nor on a directory with no model in it); once it does, the plan's workers start on it, and when version 1 is on disk
  (here: other weights than the base's) they load it before they are handed over (to join
  routing), serving exactly version 1's weights.
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


def test_workers_start_on_the_base_model_and_hold_version_1_before_they_are_handed_over(
        weights, tmp_path, store, arun):
    from libra.plans import Bucket, Plan
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.first_start import FirstStart
    from libra.services.rollout.workers import WorkerPool
    from tests.service.test_engine_contract import PROMPT, trainer_logprobs

    run_dir = tmp_path / "run"
    pool = WorkerPool(WorkerConfig.model_validate({"engine": "hf", "max_model_len": 256, "base_port": 0}),
                      run_dir / "logs" / "workers")
    first = FirstStart(store, pool, run_dir)
    plan = Plan(0, None, (Bucket("short", 1, 100, 1),))
    base = run_dir / "model" / "base"
    shutil.copytree(weights["base"], base)

    async def scenario() -> None:
        waiting = asyncio.create_task(first.wait(plan))
        await asyncio.sleep(0.5)
        assert not pool.workers  # no base model named, no version: nothing starts
        await store.set_base_model(str(weights["base"]))  # a model outside the run directory: refused
        await asyncio.sleep(1.2)
        assert not pool.workers
        await store.set_base_model(str(run_dir / "model" / "gone"))  # inside, but no model there: not yet
        await asyncio.sleep(1.2)
        assert not pool.workers
        await store.set_base_model(str(base))
        deadline = time.monotonic() + 10
        while not pool.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            assert list(pool.workers) == ["short-0"], "no worker started on the named base model"
            worker = pool.workers["short-0"]
            assert worker.process.model_dir == base and worker.version == 0
            v1 = run_dir / "weights" / "v1"
            shutil.copytree(weights["sharp"], v1)
            assert await store.publish_version(1, str(v1))
            version, path, early = await asyncio.wait_for(waiting, 120)
            assert (version, path) == (1, str(v1)) and early is not None
            assert await first.load(early, path, version) == [worker] and worker.version == 1
            assert await worker.client.policy_version() == 1
            from libra import event_loop  # the engine serves HTTP on the run's event loop ("auto")
            assert f'"event_loop": "{event_loop.chosen("auto")}"' in worker.process.log_path.read_text()
            turn = await worker.client.generate(PROMPT, 8, temperature=0.0)
            assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)
            # a restarted gateway: version 1 is on disk, so nothing starts early
            assert await asyncio.wait_for(FirstStart(store, pool, run_dir).wait(plan), 10) == (1, str(v1), None)
            assert list(pool.workers) == ["short-0"]
        finally:
            waiting.cancel()
            await pool.stop_all()

    arun(scenario())
