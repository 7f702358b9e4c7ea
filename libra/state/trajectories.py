"""Trajectory hashes and GRPO group bookkeeping.

Owns `traj:*`, `group:*` and `groups:inflight`, and the append to the completed stream that
completing a trajectory implies (reading that stream is `completed.py`'s job).

A trajectory in a final status (COMPLETED, FAILED, CONSUMED, REJECTED) is never overwritten by
`put_trajectory` or `complete_trajectory`, so a replayed update or completion is a no-op and each
trajectory enters the completed stream at most once. Only `mark_trajectories` changes a final
status (the trainer marks REJECTED or CONSUMED). A completed trajectory stores one policy version per
response token (`versions`, the engine's own per-token report) and `oldest_version`, their minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.errors import InvalidArgument, NotFound
from libra.state.base import StoreBase, text
from libra.state.keys import check_id
from libra.v1 import common_pb2

Status = common_pb2.TrajectoryStatus
FINAL_STATUSES = ("COMPLETED", "FAILED", "CONSUMED", "REJECTED")

_GUARD = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'COMPLETED' or status == 'FAILED' or status == 'CONSUMED' or status == 'REJECTED' then
  return false
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('SADD', KEYS[2], ARGV[1])
"""
# KEYS: trajectory, group index   ARGV: tid, gid, status, now, field/value pairs...
PUT_TRAJECTORY = _GUARD + "return 1\n"
# KEYS: trajectory, group index, group, inflight set, completed stream
COMPLETE_TRAJECTORY = _GUARD + """
local entry = redis.call('XADD', KEYS[5], '*', 'trajectory_id', ARGV[1], 'group_id', ARGV[2], 'status', ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HINCRBY', KEYS[3], ARGV[3] == 'FAILED' and 'failed' or 'completed', 1)
  local group = redis.call('HMGET', KEYS[3], 'completed', 'failed', 'samples')
  if tonumber(group[1] or 0) + tonumber(group[2] or 0) >= tonumber(group[3]) then
    if redis.call('SREM', KEYS[4], ARGV[2]) == 1 then
      redis.call('HSET', KEYS[3], 'finished_at', ARGV[4])
    end
  end
end
return entry
"""
# KEYS: trajectory   ARGV: now. A queued or running trajectory marked RUNNING: {data, status before}; a final
# one: {false, status}; an unknown one: false.
START_TRAJECTORY = """
local found = redis.call('HMGET', KEYS[1], 'data', 'status')
if not found[1] then return false end
if found[2] ~= 'QUEUED' and found[2] ~= 'RUNNING' then return {false, found[2]} end
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'updated_at', ARGV[1])
return {found[1], found[2]}
"""
# KEYS: group, inflight set   ARGV: gid, then field/value pairs
REGISTER_GROUP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
# KEYS: group, inflight set   ARGV: gid, now
FINISH_GROUP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HSETNX', KEYS[1], 'finished_at', ARGV[2])
return redis.call('SREM', KEYS[2], ARGV[1])
"""
# KEYS: trajectories...   ARGV: status, now
MARK_TRAJECTORIES = """
local changed = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'status', ARGV[1], 'updated_at', ARGV[2])
    changed = changed + 1
  end
end
return changed
"""


def status_name(status: int) -> str:
    """TRAJECTORY_STATUS_COMPLETED -> 'COMPLETED' (the form stored in Redis)."""
    return Status.Name(status).removeprefix("TRAJECTORY_STATUS_")


@dataclass(frozen=True)
class GroupInfo:
    """A GRPO group: `samples` trajectories of one prompt, admitted at `min_version`."""

    group_id: str
    prompt_id: str
    samples: int
    min_version: int
    completed: int
    failed: int
    created_at: float
    finished_at: float | None
    trajectory_ids: tuple[str, ...]

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


def check_response(traj: common_pb2.Trajectory) -> None:
    """Every response token (after the prompt) has its loss-mask bit, behaviour log-prob and the policy
    version that produced it: the trainer's staleness, importance weights and log-prob gap read them
    per token. InvalidArgument naming the field that disagrees."""
    response = len(traj.token_ids) - traj.prompt_length
    for name in ("loss_mask", "logprobs", "versions"):
        if len(getattr(traj, name)) != response:
            raise InvalidArgument(f"trajectory {traj.trajectory_id!r}: {name} has {len(getattr(traj, name))} entries "
                                  f"for {response} response tokens (token_ids after prompt_length); one per token")


class TrajectoryStore(StoreBase):
    """Trajectories and groups (mixed into `StateStore`)."""

    def _fields(self, traj: common_pb2.Trajectory, status: str) -> list:
        oldest = min(traj.versions) if traj.versions else ""
        return ["trajectory_id", traj.trajectory_id, "prompt_id", traj.prompt_id, "group_id", traj.group_id,
                "sample_index", traj.sample_index, "status", status, "reward", repr(traj.reward),
                "turns", traj.turns, "oldest_version", oldest, "updated_at", repr(self._clock()),
                "data", traj.SerializeToString()]

    def _trajectory_args(self, traj: common_pb2.Trajectory, status: str) -> list:
        check_id(traj.trajectory_id, "trajectory id")
        check_id(traj.group_id, "group id")
        return [traj.trajectory_id, traj.group_id, status, repr(self._clock()), *self._fields(traj, status)]

    def _put_call(self, traj: common_pb2.Trajectory) -> tuple[list[str], list]:
        status = status_name(traj.status)
        if status in FINAL_STATUSES:
            raise InvalidArgument(f"put_trajectory cannot store status {status}; use complete_trajectory "
                                  "or mark_trajectories")
        keys = [self.keys.trajectory(traj.trajectory_id), self.keys.group_trajectories(traj.group_id)]
        return keys, self._trajectory_args(traj, status)

    async def put_trajectory(self, traj: common_pb2.Trajectory) -> bool:
        """Store a trajectory; False (and nothing written) if it is already in a final status."""
        return bool(await self._eval(PUT_TRAJECTORY, *self._put_call(traj)))

    async def put_trajectories(self, trajs: list[common_pb2.Trajectory]) -> list[bool]:
        """`put_trajectory` for each, in order, in one round trip; all are checked before any is written."""
        calls = [self._put_call(traj) for traj in trajs]
        return [bool(reply) for reply in await self._eval_each(PUT_TRAJECTORY, calls)]

    async def complete_trajectory(self, traj: common_pb2.Trajectory) -> str | None:
        """Store a finished trajectory and append it to the completed stream, atomically.

        The status is FAILED if `traj.status` is FAILED, else COMPLETED. Returns the stream entry
        id, or None if the trajectory was already final (a replay: nothing is written). A COMPLETED
        one must carry one loss-mask bit, behaviour log-prob and policy version per response token
        (`check_response`).
        """
        status = "FAILED" if traj.status == Status.TRAJECTORY_STATUS_FAILED else "COMPLETED"
        if status == "COMPLETED":
            check_response(traj)
        gid = traj.group_id
        keys = [self.keys.trajectory(traj.trajectory_id), self.keys.group_trajectories(gid),
                self.keys.group(gid), self.keys.inflight_groups, self.keys.completed]
        entry = await self._eval(COMPLETE_TRAJECTORY, keys, self._trajectory_args(traj, status))
        return text(entry) if entry else None

    async def start_trajectory(self, trajectory_id: str) -> common_pb2.Trajectory | None:
        """Mark a QUEUED (or RUNNING: replayed) trajectory RUNNING and return it, in one round trip; None,
        and nothing written, if it is final. NotFound if unknown."""
        found = await self._eval(START_TRAJECTORY, [self.keys.trajectory(trajectory_id)], [repr(self._clock())])
        if not found:
            raise NotFound(f"trajectory {trajectory_id!r} not found in run {self.run_id!r}")
        data, _status = found
        if not data:
            return None
        traj = common_pb2.Trajectory.FromString(data)
        traj.status = Status.TRAJECTORY_STATUS_RUNNING
        return traj

    async def get_trajectory(self, trajectory_id: str) -> common_pb2.Trajectory:
        """The stored trajectory (with its current status); NotFound if unknown."""
        found = await self.get_trajectories([trajectory_id])
        return found[0]

    async def get_trajectories(self, trajectory_ids: list[str],
                               missing_ok: bool = False) -> list[common_pb2.Trajectory | None]:
        """Several trajectories in one round trip, in the order asked.

        An unknown id raises NotFound, or gives None in its place with `missing_ok`.
        """
        redis = await self._ready()
        async with redis.pipeline(transaction=False) as pipe:
            for tid in trajectory_ids:
                pipe.hmget(self.keys.trajectory(tid), "data", "status")
            replies = await pipe.execute()
        trajectories = []
        for tid, (data, status) in zip(trajectory_ids, replies):
            if data is None and missing_ok:
                trajectories.append(None)
                continue
            if data is None:
                raise NotFound(f"trajectory {tid!r} not found in run {self.run_id!r}")
            traj = common_pb2.Trajectory.FromString(data)
            traj.status = Status.Value("TRAJECTORY_STATUS_" + text(status))
            trajectories.append(traj)
        return trajectories

    async def mark_trajectories(self, trajectory_ids: list[str], status: int) -> int:
        """Set the status of existing trajectories (unknown ids are skipped); how many changed."""
        if not trajectory_ids:
            return 0
        keys = [self.keys.trajectory(tid) for tid in trajectory_ids]
        return int(await self._eval(MARK_TRAJECTORIES, keys, [status_name(status), repr(self._clock())]))

    def _register_call(self, group_id: str, prompt_id: str, samples: int, min_version: int) -> tuple[list[str], list]:
        if samples < 1 or min_version < 0:
            raise InvalidArgument(f"group {group_id!r}: samples must be >= 1 and min_version >= 0")
        fields = ["prompt_id", check_id(prompt_id, "prompt id"), "samples", samples,
                  "min_version", min_version, "completed", 0, "failed", 0, "created_at", repr(self._clock())]
        return [self.keys.group(group_id), self.keys.inflight_groups], [group_id, *fields]

    async def register_group(self, group_id: str, prompt_id: str, samples: int, min_version: int) -> bool:
        """Admit a group of `samples` trajectories; False if it was registered before (a replay)."""
        return bool(await self._eval(REGISTER_GROUP, *self._register_call(group_id, prompt_id, samples, min_version)))

    async def register_groups(self, groups: list[tuple[str, str, int, int]]) -> list[bool]:
        """`register_group` for each (group id, prompt id, samples, min version), in order, in one round
        trip; all are checked before any is written. A group id twice in the list: the second is a replay."""
        calls = [self._register_call(*group) for group in groups]
        return [bool(reply) for reply in await self._eval_each(REGISTER_GROUP, calls)]

    async def group_info(self, group_id: str) -> GroupInfo:
        """A registered group and the trajectory ids stored for it; NotFound if unknown."""
        redis = await self._ready()
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.group(group_id))
            pipe.smembers(self.keys.group_trajectories(group_id))
            found, members = await pipe.execute()
        if not found:
            raise NotFound(f"group {group_id!r} not found in run {self.run_id!r}")
        finished = found.get(b"finished_at")
        return GroupInfo(group_id=group_id, prompt_id=text(found[b"prompt_id"]), samples=int(found[b"samples"]),
                         min_version=int(found[b"min_version"]), completed=int(found[b"completed"]),
                         failed=int(found[b"failed"]), created_at=float(found[b"created_at"]),
                         finished_at=float(finished) if finished is not None else None,
                         trajectory_ids=tuple(sorted(text(m) for m in members)))

    async def finish_group(self, group_id: str) -> bool:
        """Mark a group finished early (abandoned); False if already finished, NotFound if unknown."""
        keys = [self.keys.group(group_id), self.keys.inflight_groups]
        removed = int(await self._eval(FINISH_GROUP, keys, [group_id, repr(self._clock())]))
        if removed < 0:
            raise NotFound(f"group {group_id!r} not found in run {self.run_id!r}")
        return bool(removed)

    async def inflight_groups(self) -> int:
        """How many registered groups have not finished (for admission control)."""
        redis = await self._ready()
        return int(await redis.scard(self.keys.inflight_groups))

    async def inflight_group_ids(self) -> list[str]:
        """Ids of registered groups that have not finished (to resume them after a restart), sorted."""
        redis = await self._ready()
        return sorted(text(group_id) for group_id in await redis.smembers(self.keys.inflight_groups))
