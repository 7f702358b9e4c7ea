"""Terminal progress of a run: trainer phase changes and one line per committed step."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from libra.config import RunConfig
from libra.rpc import channel
from libra.v1 import trainer_pb2, trainer_pb2_grpc

PHASES = {trainer_pb2.TRAINER_PHASE_WAITING_FOR_PEERS: "waiting for peers",
          trainer_pb2.TRAINER_PHASE_WARMUP: "warm start", trainer_pb2.TRAINER_PHASE_TRAINING: "training",
          trainer_pb2.TRAINER_PHASE_PAUSED: "paused", trainer_pb2.TRAINER_PHASE_DONE: "done",
          trainer_pb2.TRAINER_PHASE_FAILED: "failed"}


class ProgressPrinter:
    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self.records: list[trainer_pb2.StepRecord] = []
        self.next_step = 1  # the first step not printed yet (`libra up` sets a resumed run's)

    def _line(self, text: str) -> None:
        try:
            print(f"[{time.monotonic() - self.started:6.0f}s] {text}", file=self.stream, flush=True)
        except OSError:  # the terminal is gone (SIGHUP, a closed pipe): the run goes on, or stops, regardless
            pass

    def info(self, text: str) -> None:
        self._line(text)

    def error(self, text: str) -> None:
        self._line(f"ERROR {text}")

    def step(self, record: trainer_pb2.StepRecord, total: int) -> None:
        if record.step < self.next_step:  # already printed (a reconnect, or the catch-up after the end)
            return
        self.records.append(record)
        self.next_step = record.step + 1
        self._line(
            f"step {record.step:>3}/{total} reward {record.mean_reward:.3f} | {record.trajectories} traj "
            f"{record.mean_turns:.1f} turns stale {record.mean_staleness:.2f} rejected {record.rejected_stale} | "
            f"wait {record.wait_seconds:.1f}s train {record.train_seconds:.1f}s sync {record.publish_seconds:.1f}s"
            f" | v{record.policy_version} gap {record.behaviour_logprob_gap:.1e} ({record.fresh_sequences} fresh)")

    async def follow(self, config: RunConfig) -> None:
        """Print the trainer's status changes and its steps from `next_step` on (a resumed run: the
        step after its checkpoint) until cancelled; reconnects as needed. A trainer first seen done
        or failed (it trained between two polls) has its unprinted steps streamed before that line."""
        last_detail = ""
        while True:
            try:
                async with channel(config.address_of("trainer")) as chan:
                    stub = trainer_pb2_grpc.TrainerStub(chan)
                    status = await stub.GetStatus(trainer_pb2.TrainerStatusRequest(run_id=config.run_id), timeout=2)
                    if status.phase in (trainer_pb2.TRAINER_PHASE_DONE, trainer_pb2.TRAINER_PHASE_FAILED):
                        await self._stream(stub, config, status.total_steps, timeout=10)  # ends: nothing comes
                    detail = f"trainer: {PHASES.get(status.phase, 'starting')} {status.detail}".rstrip()
                    if detail != last_detail:
                        self._line(detail)
                        last_detail = detail
                    if status.phase == trainer_pb2.TRAINER_PHASE_TRAINING:
                        await self._stream(stub, config, status.total_steps)  # until the trainer is done
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0)

    async def _stream(self, stub, config: RunConfig, total: int, timeout: float | None = None) -> None:
        request = trainer_pb2.WatchStepsRequest(run_id=config.run_id, from_step=self.next_step)
        async for record in stub.WatchSteps(request, timeout=timeout):
            self.step(record, total)

    async def catch_up(self, config: RunConfig, total: int) -> None:
        """Print the steps the trainer committed that `follow` missed (the trainer exited between
        two of its polls): their records are in Redis, which outlives the trainer."""
        from libra.state import StateStore

        store = await StateStore.connect(config.redis.url, config.run_id)
        try:
            for data in await store.step_records(self.next_step):
                self.step(trainer_pb2.StepRecord.FromString(data), total)
        finally:
            await store.close()

    def finish(self, run_path) -> None:
        """The run's summary: mean reward of the first and last `reward_window` steps it printed."""
        if not self.records:
            self._line("finished")
            return
        window = reward_window(len(self.records))
        first = sum(r.mean_reward for r in self.records[:window]) / window
        last = sum(r.mean_reward for r in self.records[-window:]) / window
        self._line(f"finished {len(self.records)} steps: mean reward of the first {window} steps {first:.3f}, "
                   f"of the last {window} steps {last:.3f}; reward curve: {run_path / 'reward.png'}")


def reward_window(steps: int) -> int:
    """Steps averaged at each end of a run's summary: 10, as the README's table, from 20 steps on;
    half the run below that, so the two windows never overlap."""
    return 10 if steps >= 20 else max(1, steps // 2)
