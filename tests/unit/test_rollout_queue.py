"""The gateway's queue of trajectories waiting for a runner (services/rollout/server.py): the wait is
measured (a histogram, `libra_rollout_queue_wait_seconds`) and is not part of the first turn's gap,
which counts from the moment a runner takes the trajectory (the simulator plays the runners' limit
as such, `SimConfig.max_in_flight`)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from libra.services.rollout import server


def test_a_trajectorys_wait_for_a_runner_is_measured_and_its_play_starts_from_the_taking():
    service = server.RolloutService.__new__(server.RolloutService)  # the queue and its runner loop alone
    service.queue, service.queued, service.queued_at = asyncio.Queue(), set(), {}
    service.accepting, service.playing = True, 0
    played = []

    async def play(tid, taken_at):
        played.append((tid, taken_at, service.playing))
        service.accepting = False  # one trajectory, then the runner stops
    service._play = play
    name = "libra_rollout_queue_wait_seconds"
    count, total = (REGISTRY.get_sample_value(f"{name}_{k}") or 0.0 for k in ("count", "sum"))
    queued = time.monotonic() - 0.3  # queued 0.3 s ago: every runner was busy

    async def main():
        service.queued.add("g0-s0")
        service.queued_at["g0-s0"] = queued
        service.queue.put_nowait("g0-s0")
        await service._run_trajectories()
    asyncio.run(main())
    [(tid, taken_at, playing)] = played
    assert tid == "g0-s0" and playing == 1 and service.playing == 0 and not service.queued_at
    assert taken_at - queued >= 0.3 and taken_at <= time.monotonic()  # the gap's origin: the taking
    assert REGISTRY.get_sample_value(f"{name}_count") == count + 1
    assert REGISTRY.get_sample_value(f"{name}_sum") - total >= 0.3
