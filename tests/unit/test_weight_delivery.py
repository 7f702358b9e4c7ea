"""The gateway's weight delivery with hand-written engine fakes (no processes): which way each worker
gets a version, what a worker that misses one reports, how it comes back, and what happens when a
version sent over the group is not on disk yet (the trainer's second call, with the path).

The same paths with real engines and a real trainer: tests/service/test_weight_sync.py.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from libra.errors import InvalidArgument
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.engines.client import EngineError
from libra.services.rollout.weight_delivery import WeightDelivery
from libra.services.rollout.workers import PoolWorker, WorkerPool
from libra.v1 import common_pb2
from libra.weights.config import GroupWeights
from libra.weights.roster import GroupRecord, Roster

SERVING, UNHEALTHY = common_pb2.WORKER_STATE_SERVING, common_pb2.WORKER_STATE_UNHEALTHY


class Process:
    engine, base_url = "fake", "http://fake"

    def __init__(self):
        self.alive = True


class Engine:
    """A worker's client: answers /collective_rpc and load_weights like an engine, records the calls."""

    base_url = "http://fake"

    def __init__(self):
        self.version = 1
        self.calls: list[tuple[str, int]] = []
        self.failing_loads = 0  # the next this many loads fail in transport
        self.receive_answer = None  # None: {"version": v} (and it holds v); else this answer, unchanged

    async def _post(self, path, body, timeout=None):
        method, args = body["method"], body["args"]
        if method == "libra_join_weights_group":
            self.calls.append(("join", int(args[-1])))
            return {"results": [{"rank": args[2]}]}
        if method == "libra_leave_weights_group":
            self.calls.append(("leave", 0))
            return {"results": [{"left": True}]}
        assert method == "libra_receive_weights"
        self.calls.append(("group", args[0]))
        if self.receive_answer is not None:
            return {"results": self.receive_answer}
        self.version = args[0]
        return {"results": [{"version": args[0]}]}

    async def receive_weights(self, version, timeout_s):  # EngineClient's: the method's per-rank results
        return (await self._post("/collective_rpc", {"method": "libra_receive_weights", "args": [version]}))["results"]

    async def load_weights(self, path, version):
        self.calls.append(("disk", version))
        if self.failing_loads:
            self.failing_loads -= 1
            raise EngineError("injected: connection reset")
        self.version = version


def _pool(*names: str, weights_dir: pathlib.Path | None = None) -> tuple[WorkerPool, WeightDelivery, dict[str, Engine]]:
    pool = WorkerPool(WorkerConfig(), pathlib.Path("unused"))
    engines = {}
    for name in names:
        engines[name] = Engine()
        pool.workers[name] = PoolWorker(name, "short", 1, Process(), engines[name], version=1, state=SERVING)
    return pool, WeightDelivery(pool, GroupWeights(), weights_dir), engines


def test_a_worker_that_misses_a_version_says_so_leaves_routing_and_comes_back_when_one_reaches_it():
    pool, delivery, engines = _pool("a", "b")
    engines["b"].failing_loads = 2  # the load and its one retry
    acks = {a.worker_id: a for a in asyncio.run(delivery.from_disk(2, "/weights/v2"))}
    assert acks["a"].ok and acks["a"].version == 2
    assert not acks["b"].ok and acks["b"].version == 1 and "connection reset" in acks["b"].error
    assert pool.workers["b"].state == UNHEALTHY and pool.version_of("b") == engines["b"].version == 1
    assert [w.worker_id for w in pool.take_failed()] == ["b"] and pool.take_failed() == []  # deregistered once
    assert delivery.take_recovered() == []
    acks = asyncio.run(delivery.from_disk(3, "/weights/v3"))  # the next version is tried on it again
    assert all(a.ok and a.version == 3 for a in acks) and pool.workers["b"].state == SERVING
    assert [w.worker_id for w in delivery.take_recovered()] == ["b"]  # the gateway registers it again
    assert pool.version_of("b") == engines["b"].version == 3 and engines["b"].calls == [("disk", 2)] * 2 + [("disk", 3)]


def test_members_join_a_new_generation_receive_over_it_and_others_load_from_disk():
    pool, delivery, engines = _pool("a", "b", "c")
    record = GroupRecord(4, 2, Roster.of([("a", 1), ("b", 1)]))
    asyncio.run(delivery.over_group(2, "/weights/v2", record))
    assert engines["a"].calls == [("join", 4), ("group", 2)] and engines["b"].calls == [("join", 4), ("group", 2)]
    assert engines["c"].calls == [("disk", 2)]  # not a rank of generation 4 (started since)
    asyncio.run(delivery.over_group(3, "/weights/v3", record))  # same generation: no join
    assert engines["a"].calls[-1] == ("group", 3) and len(engines["a"].calls) == 3
    smaller = GroupRecord(5, 4, Roster.of([("a", 1)]))  # b left the roster
    asyncio.run(delivery.over_group(4, "/weights/v4", smaller))
    assert engines["b"].calls[-2:] == [("leave", 0), ("disk", 4)]
    assert engines["a"].calls[-2:] == [("join", 5), ("group", 4)]
    assert {pool.version_of(w) for w in "abc"} == {4}


def test_an_unconfirmed_receive_is_retried_from_disk_and_a_gone_member_sends_everyone_to_disk():
    pool, delivery, engines = _pool("a", "b")
    record = GroupRecord(1, 2, Roster.of([("a", 1), ("b", 1)]))
    engines["b"].receive_answer = [{"tensors": 0}]  # an answer that does not name the version
    acks = asyncio.run(delivery.over_group(2, "/weights/v2", record))
    assert all(a.ok and a.version == 2 for a in acks) and engines["b"].calls[-2:] == [("group", 2), ("disk", 2)]
    pool.workers["a"].process.alive, engines["a"].failing_loads = False, 5  # a member died (refuses connections):
    acks = {a.worker_id: a for a in asyncio.run(delivery.over_group(3, "/weights/v3", record))}
    assert engines["b"].calls[-1] == ("disk", 3) and acks["b"].ok  # the group cannot deliver; nobody waits on it
    assert ("group", 3) not in engines["b"].calls
    assert not acks["a"].ok and pool.version_of("a") == 2 and engines["a"].calls[-1] == ("disk", 3)  # not retried


def test_a_version_not_on_disk_yet_leaves_unreached_workers_behind_until_the_trainer_sends_its_path():
    pool, delivery, engines = _pool("a", "b", "c")
    record = GroupRecord(2, 2, Roster.of([("a", 1), ("b", 1)]))
    engines["b"].receive_answer = [{"error": "WeightSyncError: injected"}]
    acks = {a.worker_id: a for a in asyncio.run(delivery.over_group(2, "", record))}
    assert acks["a"].ok and acks["a"].version == 2 and engines["a"].calls == [("join", 2), ("group", 2)]
    # b's receive failed: its weights may be half-received, so it leaves routing (nothing to load yet)
    assert not acks["b"].ok and acks["b"].version == 1 and pool.workers["b"].state == UNHEALTHY
    # c is not a rank of the generation: it keeps serving v1, and says so
    assert not acks["c"].ok and acks["c"].version == 1 and "not on disk yet" in acks["c"].error
    assert pool.workers["c"].state == SERVING and pool.version_of("c") == 1 and engines["c"].calls == []
    assert [w.worker_id for w in pool.take_failed()] == ["b"]
    assert delivery.serving_roster() == Roster.of([("a", 1), ("c", 1)])  # the next generation's roster
    # the trainer writes v2 and calls again with its path: only the workers behind load it
    acks = {a.worker_id: a for a in asyncio.run(delivery.from_disk(2, "/w/v2"))}
    assert all(a.ok and a.version == 2 for a in acks.values()) and sorted(acks) == ["a", "b", "c"]
    assert engines["a"].calls == [("join", 2), ("group", 2)]  # held it already: not loaded again
    assert engines["b"].calls[-1] == engines["c"].calls[-1] == ("disk", 2)
    assert pool.workers["b"].state == SERVING and [w.worker_id for w in delivery.take_recovered()] == ["b"]


def test_a_path_must_be_a_directory_under_the_run_weights_directory(tmp_path):
    weights = tmp_path / "run" / "weights"
    (weights / "v2").mkdir(parents=True)
    pool, delivery, engines = _pool("a", weights_dir=weights)
    with pytest.raises(InvalidArgument, match="outside the run's weights directory"):
        asyncio.run(delivery.deliver(2, str(tmp_path / "elsewhere"), None))
    with pytest.raises(InvalidArgument, match="outside the run's weights directory"):
        asyncio.run(delivery.deliver(2, str(weights / ".." / ".." / "v2"), None))
    with pytest.raises(InvalidArgument, match="not a directory"):
        asyncio.run(delivery.deliver(3, str(weights / "v3"), None))
    with pytest.raises(InvalidArgument, match="neither a path, a weights-group generation nor a colocated descriptor"):
        asyncio.run(delivery.deliver(3, "", None))
    assert engines["a"].calls == []
    delivered = asyncio.run(delivery.deliver(2, str(weights / "v2"), None))
    assert [a.ok for a in delivered.acks] == [True] and engines["a"].calls == [("disk", 2)]
    assert delivered.serving == Roster.of([("a", 1)]) and not delivered.group_unusable



def test_a_generation_that_cannot_deliver_says_why_and_names_the_live_serving_workers():
    pool, delivery, engines = _pool("a", "b")
    pool.workers["a"].process.alive = False  # a member died since the trainer's roster was taken
    done = asyncio.run(delivery.deliver(3, "", GroupRecord(1, 3, Roster.of([("a", 1), ("b", 1)]))))
    assert "workers ['a'] of generation 1 are not here" in done.group_unusable
    assert done.serving == Roster.of([("b", 1)])  # the trainer forms the next generation for these
    assert [a.ok for a in done.acks] == [False, False] and engines["b"].calls == []  # nothing touched yet
    assert pool.workers["b"].state == SERVING and pool.version_of("b") == 1
