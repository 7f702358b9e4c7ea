"""What the trainer shows to the outside: phase, counters, and the committed step records.

The servicer reads it; the loop writes it. `wait_for_step` lets WatchSteps stream records as
they commit without polling.
"""

from __future__ import annotations

import asyncio

from libra.v1 import trainer_pb2

Phase = trainer_pb2.TrainerPhase
FINAL = (trainer_pb2.TRAINER_PHASE_DONE, trainer_pb2.TRAINER_PHASE_FAILED)


class TrainerStatus:
    def __init__(self, total_steps: int):
        self.phase = trainer_pb2.TRAINER_PHASE_WAITING_FOR_PEERS
        self.total_steps = total_steps
        self.step = 0
        self.policy_version = 0
        self.detail = ""
        self.records: dict[int, trainer_pb2.StepRecord] = {}
        self._changed = asyncio.Condition()

    async def set(self, phase: int | None = None, detail: str | None = None) -> None:
        async with self._changed:
            if phase is not None:
                self.phase = phase
            if detail is not None:
                self.detail = detail
            self._changed.notify_all()

    async def add_record(self, record: trainer_pb2.StepRecord) -> None:
        async with self._changed:
            self.records[record.step] = record
            self.step, self.policy_version = record.step, record.policy_version
            self._changed.notify_all()

    async def wait_for_step(self, step: int, timeout_s: float = 5.0) -> trainer_pb2.StepRecord | None:
        """The record of `step` once committed; None on timeout or when the run ended without it."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: step in self.records or self.phase in FINAL), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self.records.get(step)

    def to_proto(self) -> trainer_pb2.TrainerStatus:
        last = self.records.get(self.step)
        return trainer_pb2.TrainerStatus(
            phase=self.phase, step=self.step, total_steps=self.total_steps, policy_version=self.policy_version,
            last_mean_reward=last.mean_reward if last else 0.0, detail=self.detail)
