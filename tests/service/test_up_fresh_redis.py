"""`libra up --fresh` on a Redis that outlives `libra up` (redis.url given): the run's keys go with
the old run directory, another run's keys stay (real Redis, the run's real key schema)."""

from __future__ import annotations

from libra import run_dir


def test_fresh_deletes_only_this_runs_keys(redis_url, run_id, new_store, arun):
    async def fill(store):
        await store.set_trainer_progress({"step": 3, "version": 4, "data_position": 24, "checkpoint_path": "x"})
        await store.put_member("short-0", b"member", 0, "rollout")
        return await store.trainer_progress()

    other = f"{run_id}-other"
    assert arun(fill(arun(new_store())))["step"] == 3
    assert arun(fill(arun(new_store(other))))["step"] == 3
    assert run_dir.clear_redis_run(redis_url, run_id) >= 3  # progress, the member, the member set and epoch
    mine, theirs = arun(new_store()), arun(new_store(other))
    assert arun(mine.trainer_progress()) == {} and arun(mine.list_members()) == []
    assert arun(theirs.trainer_progress())["step"] == 3 and len(arun(theirs.list_members())) == 1
