"""StateStore against a real redis-server: atomicity, compare-and-set, idempotency, recovery."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from libra.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from libra.state import Keys, StateStore
from libra.v1 import common_pb2

S = common_pb2.TrajectoryStatus


def trajectory(tid: str, group: str = "g0", sample: int = 0, status: int = S.TRAJECTORY_STATUS_RUNNING,
               reward: float = 0.0) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        trajectory_id=tid, prompt_id="p0", group_id=group, sample_index=sample, status=status,
        prompt_length=3, token_ids=[1, 2, 3, 10, 11], loss_mask=[1, 1], logprobs=[-0.5, -0.25],
        versions=[4, 5], reward=reward, turns=1,
        tool_events=[common_pb2.ToolEvent(turn=1, tool="python", status=common_pb2.TOOL_STATUS_SUCCESS)])


async def race(*calls) -> list:
    """Run calls concurrently; results and exceptions in call order."""
    return await asyncio.gather(*calls, return_exceptions=True)


async def complete_all(store: StateStore, ids: list[str], group: str = "g0") -> None:
    for sample, tid in enumerate(ids):
        await store.complete_trajectory(trajectory(tid, group, sample, reward=1.0))


def test_keys_share_one_prefix_and_reject_bad_run_ids() -> None:
    keys = Keys("run-1")
    assert keys.trajectory("t1") == "libra:{run-1}:traj:t1"
    assert keys.history("turn").startswith(keys.prefix)
    for bad in ("", "a b", "x:y", "r" * 65):
        with pytest.raises(InvalidArgument):
            Keys(bad)
    with pytest.raises(InvalidArgument):
        keys.history("epoch")


def test_trajectory_round_trip(store: StateStore, arun) -> None:
    original = trajectory("t1")
    assert arun(store.put_trajectory(original)) is True
    assert arun(store.get_trajectory("t1")) == original
    with pytest.raises(NotFound):
        arun(store.get_trajectory("missing"))
    assert arun(store.get_trajectories(["missing", "t1"], missing_ok=True)) == [None, original]
    assert arun(store.mark_trajectories(["t1", "missing"], S.TRAJECTORY_STATUS_QUEUED)) == 1
    assert arun(store.get_trajectory("t1")).status == S.TRAJECTORY_STATUS_QUEUED


def test_complete_twice_appends_one_entry_and_finishes_the_group(store: StateStore, arun) -> None:
    assert arun(store.register_group("g0", "p0", samples=2, min_version=3)) is True
    assert arun(store.register_group("g0", "p0", samples=2, min_version=3)) is False
    assert arun(store.inflight_groups()) == 1
    assert arun(store.inflight_group_ids()) == ["g0"]
    first = arun(store.complete_trajectory(trajectory("t0", reward=1.0)))
    assert first is not None
    assert arun(store.complete_trajectory(trajectory("t0", reward=9.0))) is None
    assert arun(store.put_trajectory(trajectory("t0"))) is False  # a late update cannot reopen it
    stored = arun(store.get_trajectory("t0"))
    assert (stored.status, stored.reward) == (S.TRAJECTORY_STATUS_COMPLETED, 1.0)
    assert arun(store.completed_length()) == 1
    arun(store.complete_trajectory(trajectory("t1", sample=1, status=S.TRAJECTORY_STATUS_FAILED)))
    group = arun(store.group_info("g0"))
    assert (group.completed, group.failed, group.finished) == (1, 1, True)
    assert group.trajectory_ids == ("t0", "t1")
    assert arun(store.inflight_groups()) == 0
    assert arun(store.finish_group("g0")) is False
    with pytest.raises(NotFound):
        arun(store.group_info("nope"))


def test_restarted_consumer_gets_its_pending_entries_back(store: StateStore, new_store, arun) -> None:
    arun(complete_all(store, ["t0", "t1", "t2"]))
    before = arun(store.read_completed("trainer-0", count=2))
    assert [entry.trajectory_id for entry in before] == ["t0", "t1"]
    assert arun(store.read_completed("trainer-0", count=2))[0].trajectory_id == "t2"
    assert arun(store.read_completed("trainer-0", count=10)) == []  # never twice from one store

    restarted = arun(new_store())  # the trainer crashed: same consumer name, new process
    again = arun(restarted.read_completed("trainer-0", count=2))
    assert again == before
    rest = arun(restarted.read_completed("trainer-0", count=10))
    assert [entry.trajectory_id for entry in rest] == ["t2"]
    assert arun(restarted.pending_count()) == 3
    assert arun(restarted.ack_completed([entry.entry_id for entry in again + rest])) == 3
    assert arun(restarted.pending_count()) == 0
    statuses = [t.status for t in arun(restarted.get_trajectories(["t0", "t1", "t2"]))]
    assert statuses == [S.TRAJECTORY_STATUS_CONSUMED] * 3
    assert arun(restarted.ack_completed([before[0].entry_id])) == 0  # a replayed ack is a no-op
    assert arun(arun(new_store()).read_completed("trainer-0", count=10, block_ms=10)) == []


def test_thousands_of_entries_are_acked_in_one_call(store: StateStore, arun) -> None:
    # A trainer discarding a long backlog at once (seen: 1,156 stale groups) acks more entries than
    # one Lua unpack holds; every one is acked and its trajectory marked CONSUMED.
    ids = [f"t{i}" for i in range(9000)]
    arun(complete_all(store, ids))
    entries = arun(store.read_completed("trainer-0", count=len(ids)))
    assert len(entries) == len(ids)
    assert arun(store.ack_completed([entry.entry_id for entry in entries])) == len(ids)
    assert arun(store.pending_count()) == 0
    statuses = {t.status for t in arun(store.get_trajectories([ids[0], ids[4500], ids[-1]]))}
    assert statuses == {S.TRAJECTORY_STATUS_CONSUMED}


def test_live_consumer_claims_a_dead_consumers_entries(store: StateStore, new_store, arun) -> None:
    arun(complete_all(store, ["t0", "t1"]))
    dead = arun(store.read_completed("trainer-dead", count=10))
    live = arun(new_store())
    assert arun(live.claim_stale("trainer-live", min_idle_ms=60_000)) == []  # not idle long enough
    claimed = arun(live.claim_stale("trainer-live", min_idle_ms=0))
    assert claimed == dead
    assert arun(live.claim_stale("trainer-live", min_idle_ms=0)) == []  # already handed out
    assert arun(live.read_completed("trainer-live", count=10)) == []
    assert arun(live.ack_completed([entry.entry_id for entry in claimed])) == 2
    assert arun(live.pending_count()) == 0


def test_publish_version_is_compare_and_set(store: StateStore, arun) -> None:
    assert arun(store.current_version()) == 0
    with pytest.raises(Conflict):
        arun(store.publish_version(2, "/w/2"))
    assert arun(store.publish_version(1, "/w/1")) is True
    assert arun(store.publish_version(1, "/w/1")) is False  # replay of the same publication
    with pytest.raises(Conflict):
        arun(store.publish_version(1, "/w/other"))
    assert arun(store.current_version()) == 1
    assert arun(store.weights_path(1)) == "/w/1"
    with pytest.raises(NotFound):
        arun(store.weights_path(2))


def test_a_version_published_before_its_disk_copy_gets_its_path_later(store: StateStore, arun) -> None:
    assert arun(store.latest_on_disk()) is None
    assert arun(store.publish_version(1, "/w/1")) is True
    assert arun(store.publish_version(2, "")) is True  # sent over the weights group, not on disk yet
    assert arun(store.publish_version(2, "")) is False  # a replay
    assert arun(store.current_version()) == 2
    with pytest.raises(NotFound, match="not written to disk"):
        arun(store.weights_path(2))
    assert arun(store.latest_on_disk()).path == "/w/1"  # what a starting worker loads
    published_at = arun(store.published_version(2)).published_at
    arun(store.record_path(2, "/w/2"))
    assert arun(store.weights_path(2)) == "/w/2" and arun(store.published_version(2)).published_at == published_at
    assert arun(store.latest_on_disk())[:2] == (2, "/w/2")
    with pytest.raises(NotFound):
        arun(store.record_path(3, "/w/3"))


def test_the_base_model_is_named_once_the_trainer_has_it(store: StateStore, arun) -> None:
    assert arun(store.base_model()) == ""  # before: workers wait for version 1
    arun(store.set_base_model("/run/model/base"))
    assert arun(store.base_model()) == "/run/model/base"
    with pytest.raises(InvalidArgument, match="must not be empty"):
        arun(store.set_base_model(""))


def test_concurrent_publishers_exactly_one_wins(new_store, arun) -> None:
    first, second = arun(new_store()), arun(new_store())

    for version in range(1, 21):
        outcomes = arun(race(first.publish_version(version, f"/a/{version}"),
                             second.publish_version(version, f"/b/{version}")))
        assert sorted(type(o).__name__ for o in outcomes) == ["Conflict", "bool"]
        winner = "/a/" if outcomes[0] is True else "/b/"
        assert arun(first.weights_path(version)) == f"{winner}{version}"
    assert arun(second.current_version()) == 20


def test_idempotency_replays_return_the_first_answer(store: StateStore, arun) -> None:
    assert arun(store.once("trainer.publish", "req-1")) is True
    assert arun(store.once("trainer.publish", "req-1")) is False
    assert arun(store.once("rollout.submit", "req-1")) is True  # scopes are separate
    assert arun(store.recall_result("trainer.publish", "req-1")) is None
    assert arun(store.remember_result("trainer.publish", "req-1", b"first")) is True
    assert arun(store.remember_result("trainer.publish", "req-1", b"second")) is False
    assert arun(store.recall_result("trainer.publish", "req-1")) == b"first"
    arun(store.once("trainer.submit", "req-9"))  # its work failed: the retry must run again
    arun(store.forget_request("trainer.submit", "req-9"))
    assert arun(store.once("trainer.submit", "req-9")) is True
    with pytest.raises(InvalidArgument):
        arun(store.once("trainer.publish", ""))
    with pytest.raises(InvalidArgument):
        arun(store.once("bad:scope", "req-2"))


def test_plan_generation_race_has_one_winner(store: StateStore, new_store, arun) -> None:
    assert arun(store.get_plan()) is None
    base = common_pb2.Plan(generation=1, source="config", training=common_pb2.TrainingLayout(gpus=2, dp=2))
    assert arun(store.put_plan(base)) is True
    assert arun(store.put_plan(base)) is False  # replay
    other = arun(new_store())
    plans = [common_pb2.Plan(generation=2, source="replan", reason=reason) for reason in ("a", "b")]
    outcomes = arun(race(store.put_plan(plans[0]), other.put_plan(plans[1])))
    assert sorted(type(o).__name__ for o in outcomes) == ["Conflict", "bool"]
    assert arun(store.get_plan()) == plans[0 if outcomes[0] is True else 1]
    with pytest.raises(Conflict):
        arun(store.put_plan(common_pb2.Plan(generation=1, reason="stale")))
    for index in range(5):
        arun(store.append_plan_decision(f"d{index}".encode()))
    assert arun(store.plan_decisions(limit=2)) == [b"d3", b"d4"]


def test_member_writes_are_compare_and_set(store: StateStore, new_store, arun) -> None:
    assert arun(store.put_member("w0", b"serving", expected_generation=0, role="rollout")) == 1
    with pytest.raises(Conflict):
        arun(store.put_member("w0", b"again", expected_generation=0, role="rollout"))
    assert arun(store.membership_epoch()) == 1
    assert arun(store.put_member("w0", b"draining", expected_generation=1, role="rollout")) == 2
    assert arun(store.membership_epoch()) == 1  # same role: the set did not change
    assert arun(store.put_member("w0", b"joining", expected_generation=2, role="hybrid")) == 3
    assert arun(store.membership_epoch()) == 2
    other = arun(new_store())
    outcomes = arun(race(store.put_member("w0", b"x", 3, "hybrid"), other.put_member("w0", b"y", 3, "hybrid")))
    assert sorted(type(o).__name__ for o in outcomes) == ["Conflict", "int"]
    record = arun(store.get_member("w0"))
    assert (record.generation, record.role) == (4, "hybrid")
    assert record.payload == (b"x" if outcomes[0] == 4 else b"y")
    arun(store.put_member("w1", b"core", role="core"))
    assert [m.name for m in arun(store.list_members())] == ["w0", "w1"]
    assert arun(store.remove_member("w1", expected_generation=1)) is True
    assert arun(store.remove_member("w1")) is False
    assert arun(store.get_member("w1")) is None
    assert arun(store.membership_epoch()) == 4


def test_history_streams_are_capped(new_store, arun) -> None:
    store = arun(new_store(history_maxlen=10))
    for index in range(500):
        arun(store.append_history("turn", common_pb2.HistoryRecord(output_tokens=index)))
    length = arun(store.history_length("turn"))
    assert 10 <= length <= 110  # approximate trimming frees whole stream nodes (100 entries)
    latest = arun(store.read_history("turn", count=3))
    assert [(r.kind, r.output_tokens) for r in latest] == [("turn", 497), ("turn", 498), ("turn", 499)]
    assert arun(store.read_history("step", count=3)) == []
    with pytest.raises(InvalidArgument):
        arun(store.append_history("step", common_pb2.HistoryRecord(kind="turn")))


def test_trainer_progress_step_records_and_blobs(store: StateStore, arun) -> None:
    assert arun(store.trainer_progress()) == {}
    arun(store.set_trainer_progress({"step": 3, "version": 2, "checkpoint_path": "/ckpt/3"}))
    arun(store.set_trainer_progress({"data_position": 40}))
    assert arun(store.trainer_progress()) == {"step": 3, "version": 2, "checkpoint_path": "/ckpt/3",
                                              "data_position": 40}
    with pytest.raises(InvalidArgument):
        arun(store.set_trainer_progress({"epoch": 1}))
    for step in (2, 0, 1):
        arun(store.save_step_record(step, f"s{step}".encode()))
    arun(store.save_step_record(1, b"s1-rerun"))
    assert arun(store.step_records(1)) == [b"s1-rerun", b"s2"]
    assert arun(store.load_blob("scheduler.tree")) is None
    assert arun(store.save_blob("scheduler.tree", b"v1", expected_generation=0)) == 1
    with pytest.raises(Conflict):
        arun(store.save_blob("scheduler.tree", b"v2", expected_generation=0))
    assert arun(store.save_blob("scheduler.tree", b"v2")) == 2
    assert arun(store.load_blob("scheduler.tree")) == b"v2"


def test_schema_version_mismatch_is_refused(redis_url: str, run_id: str, new_store, arun) -> None:
    arun(new_store())  # writes the schema version of this code

    async def tamper() -> None:
        client = aioredis.from_url(redis_url)
        await client.set(Keys(run_id).schema, "999")
        await client.aclose()

    arun(tamper())
    with pytest.raises(FailedPrecondition, match="schema version 999"):
        arun(new_store())
    with pytest.raises(InvalidArgument):
        StateStore(aioredis.from_url(redis_url, decode_responses=True), run_id)


def test_groups_and_trajectories_stored_many_at_a_time_behave_as_one_at_a_time(store: StateStore, arun) -> None:
    """register_groups / put_trajectories (one round trip for the lot) answer exactly as the single calls
    would, in order: a group id seen before (or earlier in the same list) is a replay, a final trajectory
    is never reopened, and a bad entry anywhere writes nothing."""
    assert arun(store.register_group("g1", "p0", samples=1, min_version=0)) is True
    assert arun(store.register_groups([("g0", "p0", 2, 3), ("g1", "p0", 1, 0), ("g2", "p1", 1, 0),
                                       ("g2", "p1", 1, 0)])) == [True, False, True, False]
    assert sorted(arun(store.inflight_group_ids())) == ["g0", "g1", "g2"]
    assert arun(store.group_info("g0")).samples == 2 and arun(store.group_info("g2")).prompt_id == "p1"
    arun(store.complete_trajectory(trajectory("t0", reward=1.0)))
    queued = [trajectory(tid, sample=i, status=S.TRAJECTORY_STATUS_QUEUED) for i, tid in enumerate(["t0", "t1"])]
    assert arun(store.put_trajectories(queued)) == [False, True]
    assert arun(store.get_trajectory("t0")).status == S.TRAJECTORY_STATUS_COMPLETED
    assert arun(store.get_trajectory("t1")) == queued[1]
    assert arun(store.put_trajectories([])) == [] and arun(store.register_groups([])) == []
    with pytest.raises(InvalidArgument, match="samples must be >= 1"):
        arun(store.register_groups([("g7", "p0", 1, 0), ("g8", "p0", 0, 0)]))
    with pytest.raises(InvalidArgument, match="cannot store status COMPLETED"):
        arun(store.put_trajectories([trajectory("t7"), trajectory("t8", status=S.TRAJECTORY_STATUS_COMPLETED)]))
    assert arun(store.get_trajectories(["t7"], missing_ok=True)) == [None]
    assert "g7" not in arun(store.inflight_group_ids())


def test_starting_a_trajectory_marks_it_running_in_one_call_and_leaves_a_final_one_alone(store: StateStore,
                                                                                         arun) -> None:
    queued = trajectory("t0", status=S.TRAJECTORY_STATUS_QUEUED)
    arun(store.put_trajectory(queued))
    started = arun(store.start_trajectory("t0"))
    assert started.status == S.TRAJECTORY_STATUS_RUNNING and started.token_ids == queued.token_ids
    assert arun(store.get_trajectory("t0")).status == S.TRAJECTORY_STATUS_RUNNING
    assert arun(store.start_trajectory("t0")).status == S.TRAJECTORY_STATUS_RUNNING  # a replay after a restart
    arun(store.complete_trajectory(trajectory("t0", reward=1.0)))
    assert arun(store.start_trajectory("t0")) is None  # final: not reopened
    assert arun(store.get_trajectory("t0")).status == S.TRAJECTORY_STATUS_COMPLETED
    with pytest.raises(NotFound):
        arun(store.start_trajectory("missing"))


def test_history_records_appended_many_at_a_time_keep_their_order(store: StateStore, arun) -> None:
    records = [common_pb2.HistoryRecord(output_tokens=i) for i in range(5)]
    assert len(arun(store.append_histories("turn", records))) == 5 and arun(store.append_histories("turn", [])) == []
    assert [r.output_tokens for r in arun(store.read_history("turn", count=10))] == [0, 1, 2, 3, 4]
    with pytest.raises(InvalidArgument, match="appended as"):
        arun(store.append_histories("turn", [common_pb2.HistoryRecord(kind="step")]))
