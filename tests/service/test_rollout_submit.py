"""The gateway's SubmitPrompts against a real Redis (services/rollout/server.py): a step's groups are
stored in a fixed number of round trips whatever their count (they used to cost ten each, one after
the other: a step of 8 groups took the gateway ~0.25 s to admit, and the synchronous designs waited for
its last group), the answer counts accepted groups and replays, every trajectory is queued once in
submission order, and a gateway recovering after a crash re-queues what was unfinished."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from libra.services.rollout import server
from libra.v1 import common_pb2, rollout_pb2

T = common_pb2


def gateway(store, finished: list) -> server.RolloutService:
    service = server.RolloutService.__new__(server.RolloutService)  # the queue and the store alone
    service.store = store
    service.queue, service.queued, service.queued_at = asyncio.Queue(), set(), {}

    async def forget(tid, prompt_id, generated, status):
        finished.append((tid, status))
    service.runner = SimpleNamespace(workload=SimpleNamespace(num_prompts=100),
                                     router=SimpleNamespace(finished=forget))
    return service


def groups(first: int, count: int, samples: int = 8) -> list[rollout_pb2.PromptGroup]:
    return [rollout_pb2.PromptGroup(group_id=f"g{g}", prompt_id=str(g % 100), samples=samples, min_version=0)
            for g in range(first, first + count)]


def queued(service) -> list[str]:
    """What a runner would take from the queue, in order (taken, as the runner does: no longer queued)."""
    out = []
    while not service.queue.empty():
        out.append(service.queue.get_nowait())
        service.queued.discard(out[-1])
    return out


def test_a_steps_groups_are_stored_in_a_fixed_number_of_round_trips(store, arun, monkeypatch) -> None:
    calls = []
    for name in ("register_groups", "put_trajectories", "get_trajectories"):
        method = getattr(store, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)
        monkeypatch.setattr(store, name, counted)
    service = gateway(store, [])
    assert arun(service.submit(groups(0, 64))) == (64, 0, 512)
    assert sorted(calls) == ["get_trajectories", "put_trajectories", "register_groups"]  # 64 groups: one chunk
    order = queued(service)
    assert order == [f"g{g}-s{s}" for g in range(64) for s in range(8)]
    stored = arun(store.get_trajectories(order))
    assert {t.status for t in stored} == {T.TRAJECTORY_STATUS_QUEUED}
    assert [(t.group_id, t.sample_index, t.prompt_id) for t in stored[8:10]] == [("g1", 0, "1"), ("g1", 1, "1")]
    calls.clear()
    monkeypatch.setattr(server, "SUBMIT_CHUNK_TRAJECTORIES", 100)  # 13 groups of 8 to a chunk: 3 chunks
    assert arun(service.submit(groups(64, 30))) == (30, 0, 240)
    assert calls.count("register_groups") == 3 and calls.count("put_trajectories") == 3
    assert queued(service) == [f"g{g}-s{s}" for g in range(64, 94) for s in range(8)]


def test_a_replayed_submit_queues_nothing_twice_and_skips_final_trajectories(store, arun) -> None:
    service = gateway(store, [])
    assert arun(service.submit(groups(0, 2, samples=2))) == (2, 0, 4)
    assert arun(service.submit(groups(0, 2, samples=2))) == (0, 2, 0)  # still queued: not again
    assert queued(service) == ["g0-s0", "g0-s1", "g1-s0", "g1-s1"]
    done = T.Trajectory(trajectory_id="g0-s0", prompt_id="0", group_id="g0", sample_index=0, prompt_length=1,
                        token_ids=[1, 2], loss_mask=[1], logprobs=[-0.1], versions=[0],
                        status=T.TRAJECTORY_STATUS_COMPLETED)
    arun(store.complete_trajectory(done))
    assert arun(service.submit(groups(0, 1, samples=2))) == (0, 1, 1)  # the replay re-queues the unfinished one
    assert queued(service) == ["g0-s1"]
    same_twice = groups(5, 1, samples=1) * 2  # one id twice in one request: the second is a replay
    assert arun(service.submit(same_twice)) == (1, 1, 1) and queued(service) == ["g5-s0"]


def test_a_recovering_gateway_requeues_the_unfinished_and_has_the_scheduler_forget_the_running(store, arun) -> None:
    first = gateway(store, [])
    arun(first.submit(groups(0, 1, samples=3)))
    running = arun(store.get_trajectory("g0-s1"))
    running.status = T.TRAJECTORY_STATUS_RUNNING
    arun(store.put_trajectory(running))
    finished: list = []
    second = gateway(store, finished)  # the first one died
    arun(second._recover())
    assert queued(second) == ["g0-s0", "g0-s1", "g0-s2"]
    assert finished == [("g0-s1", T.TRAJECTORY_STATUS_QUEUED)]
