"""How long the rollout gateway takes to admit a step's prompt groups (SubmitPrompts): the gateway's
store path now (every group registered, and every new trajectory stored, in one round trip each per
chunk of ~1,024 trajectories) against the path before it (per group: register, read its trajectories,
store each new one: ten round trips for a group of 8, one after the other), side by side.

Both run the gateway's own code against a real redis-server started as `libra up` starts it (an
append-only file, `appendfsync always`: every acknowledged write is on disk), one submission at a
time, nothing else using that Redis. The synchronous designs release a whole batch at once, and the
batch waits for the trajectories admitted last: in the headline's CPU runs (round 7) a step's 8
groups were taken over ~0.25 s of a ~0.59 s rollout, and the last-admitted group finished last in
15-16 of 29 steps.

    .venv/bin/python benchmarks/submit_latency.py [--groups 8 64 512] [--samples 8] [--rounds 5]

Prints, per number of groups, the median wall milliseconds until the last trajectory is queued for
each path (wall: the cost is waiting on Redis and its disk, not CPU), interleaved rounds, and the
ratio before / now.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from libra.redis_server import PrivateRedis  # noqa: E402
from libra.services.rollout import server  # noqa: E402
from libra.state import StateStore  # noqa: E402
from libra.v1 import common_pb2, rollout_pb2  # noqa: E402

T = common_pb2


def gateway(store: StateStore) -> server.RolloutService:
    """The gateway's submit path alone: its store, queue and the workload's prompt count."""
    service = server.RolloutService.__new__(server.RolloutService)
    service.store = store
    service.queue, service.queued, service.queued_at = asyncio.Queue(), set(), {}
    service.runner = SimpleNamespace(workload=SimpleNamespace(num_prompts=1_000_000))
    return service


async def per_group(service: server.RolloutService, groups: list[rollout_pb2.PromptGroup]) -> None:
    """The gateway's submit before this benchmark's change (commit 8386014), kept here as the baseline."""
    store = service.store
    for group in groups:
        await store.register_group(group.group_id, group.prompt_id, group.samples, group.min_version)
        ids = [f"{group.group_id}-s{i}" for i in range(group.samples)]
        existing = {t.trajectory_id: t for t in await store.get_trajectories(ids, missing_ok=True) if t}
        for index, tid in enumerate(ids):
            if tid not in existing:
                await store.put_trajectory(T.Trajectory(trajectory_id=tid, prompt_id=group.prompt_id,
                                                        group_id=group.group_id, sample_index=index,
                                                        status=T.TRAJECTORY_STATUS_QUEUED))
            service.queued.add(tid)
            service.queue.put_nowait(tid)


async def now(service: server.RolloutService, groups: list[rollout_pb2.PromptGroup]) -> None:
    await service.submit(groups)


async def one(url: str, run_id: str, how, count: int, samples: int) -> float:
    client = aioredis.from_url(url)
    try:
        store = StateStore(client, run_id)
        await store.inflight_groups()  # the schema check, once, before the clock starts
        service = gateway(store)
        groups = [rollout_pb2.PromptGroup(group_id=f"g{g}", prompt_id=str(g), samples=samples, min_version=0)
                  for g in range(count)]
        started = time.perf_counter()
        await how(service, groups)
        seconds = time.perf_counter() - started
        assert service.queue.qsize() == count * samples
        return seconds
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="libra-submit-") as directory:
        redis = PrivateRedis(Path(directory), persistent=True, appendfsync="always").start()
        try:
            print(f"redis-server with appendonly yes, appendfsync always, in {directory}; {args.rounds} "
                  f"interleaved rounds, groups of {args.samples}")
            print(f"{'groups':>7} {'before ms':>10} {'now ms':>8} {'before / now':>13}")
            for count in args.groups:
                times = {"before": [], "now": []}
                for round_ in range(args.rounds):
                    for name, how in (("before", per_group), ("now", now)):
                        run_id = f"submit-{name}-{count}-{round_}"
                        times[name].append(asyncio.run(one(redis.url, run_id, how, count, args.samples)))
                before, after = (statistics.median(times[k]) * 1000 for k in ("before", "now"))
                print(f"{count:>7} {before:>10.1f} {after:>8.1f} {before / after:>12.1f}x", flush=True)
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
