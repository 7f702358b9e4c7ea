"""`libra up`'s progress lines: every committed step is printed once, even when the trainer trains
and finishes between two of the printer's polls (CI saw a one-step run print no step line)."""

from __future__ import annotations

import asyncio
import io

import grpc
import redis.asyncio as aioredis

from libra.config import build_run_config
from libra.progress import ProgressPrinter
from libra.state.versions import VersionStore
from libra.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.servicer import TrainerServicer
from services.trainer.status import TrainerStatus


class _Trainer:
    """What the servicer reads of a trainer: its run id and status (the real status object)."""

    def __init__(self, run_id: str, status: TrainerStatus):
        self.run_id, self.status = run_id, status


def _record(step: int) -> trainer_pb2.StepRecord:
    return trainer_pb2.StepRecord(step=step, mean_reward=0.25 * step, trajectories=4, policy_version=step)


def _config(run_id: str, port: int, redis_url: str = ""):
    return build_run_config({"run_id": run_id, "addresses": {"trainer": f"127.0.0.1:{port}"},
                             "redis": {"url": redis_url}}, env={})


def _step_lines(out: io.StringIO) -> list[str]:
    return [line.split("] ", 1)[1].split(" reward")[0] for line in out.getvalue().splitlines() if "] step " in line]


def test_a_trainer_first_seen_done_has_its_steps_printed_before_done(arun, run_id):
    async def scenario():
        status = TrainerStatus(total_steps=2)
        for step in (1, 2):
            await status.add_record(_record(step))
        await status.set(trainer_pb2.TRAINER_PHASE_DONE)  # trained and finished before the first poll
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(_Trainer(run_id, status)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = io.StringIO()
        printer = ProgressPrinter(out)
        follow = asyncio.create_task(printer.follow(_config(run_id, port)))
        try:
            for _ in range(100):
                if "trainer: done" in out.getvalue():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # a second poll: nothing printed twice
        finally:
            follow.cancel()
            await server.stop(None)
        lines = out.getvalue().splitlines()
        assert _step_lines(out) == ["step   1/2", "step   2/2"], out.getvalue()
        assert "trainer: done" in lines[-1] and sum("trainer: done" in line for line in lines) == 1, lines
        assert printer.next_step == 3

    arun(scenario())


def test_steps_the_printer_missed_are_read_back_from_redis_once(arun, redis_url, run_id):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        try:
            store = VersionStore(client, run_id)
            for step in (1, 2, 3):
                await store.save_step_record(step, _record(step).SerializeToString())
        finally:
            await client.aclose()
        out = io.StringIO()
        printer = ProgressPrinter(out)
        printer.step(_record(1), 3)  # printed while the trainer was up
        await printer.catch_up(_config(run_id, 1, redis_url), 3)  # the trainer exited: Redis has the rest
        await printer.catch_up(_config(run_id, 1, redis_url), 3)  # again: nothing new
        assert _step_lines(out) == ["step   1/3", "step   2/3", "step   3/3"], out.getvalue()
        assert [r.step for r in printer.records] == [1, 2, 3]

    arun(scenario())
