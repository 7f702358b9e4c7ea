"""Policy versions and the trainer's durable progress.

Owns `version`, `weights` (where each version's weight set is on disk, if it is), `base_model`
(the model every version is a weight set of) and the `trainer:*` keys (progress for exact
resume, and per-step records).

The policy version moves by exactly one per published weight set: `publish_version` is a Lua
compare-and-set, so two trainers (or a trainer and its restarted self) can never both publish
version v, and a replay of the very same publication is a no-op. Versions never go backwards: a
trainer that knows of a later version than Redis does (its checkpoint, its weights on disk, after
Redis lost data) raises the counter to it first (`raise_version`), so no version number, and no
`weights/vN` name, is ever used twice. A version sent over the weights
group is published before it is on disk (path empty); `record_path` adds its path once written.
Which worker holds which version is not kept here: the gateway reports it (UpdateWeights replies,
ListWorkers), and every token carries the version that produced it.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from libra.errors import Conflict, InvalidArgument, NotFound
from libra.state.base import StoreBase, text

# KEYS: version counter, weights hash   ARGV: version, path, record JSON
# Returns {1, version} published, {0, version} identical replay, {-1, current} conflict.
PUBLISH_VERSION = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if wanted == current and wanted > 0 then
  local stored = redis.call('HGET', KEYS[2], ARGV[1])
  if stored and cjson.decode(stored)['path'] == ARGV[2] then return {0, current} end
end
if wanted ~= current + 1 then return {-1, current} end
redis.call('SET', KEYS[1], wanted)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return {1, wanted}
"""

# KEYS: version counter   ARGV: floor. The counter becomes max(counter, floor); returns it.
RAISE_VERSION = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if floor > current then
  redis.call('SET', KEYS[1], floor)
  return floor
end
return current
"""

# KEYS: weights hash   ARGV: version, record JSON read, record JSON to write (compare-and-set).
# Returns 1 written, 0 when the record changed since it was read.
RECORD_PATH = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

PROGRESS_FIELDS: dict[str, type] = {
    "step": int,              # last committed training step
    "version": int,           # policy version after that step
    "data_position": int,     # prompts consumed from the dataset
    "checkpoint_path": str,   # directory of the last complete checkpoint
}


class PublishedVersion(NamedTuple):
    """Where the weights of one policy version are ("": not on disk), and when they were published."""

    version: int
    path: str
    published_at: float


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidArgument(f"policy version must be an int >= 1; got {version!r}")
    return version


def _check_progress(progress: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(progress) - set(PROGRESS_FIELDS))
    if unknown:
        raise InvalidArgument(f"unknown trainer progress fields {unknown}; known: {sorted(PROGRESS_FIELDS)}")
    for name, value in progress.items():
        kind = PROGRESS_FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < 0):
            raise InvalidArgument(f"trainer progress {name} must be a{' non-negative' if kind is int else ''} "
                                  f"{kind.__name__}; got {value!r}")
    return progress


class VersionStore(StoreBase):
    """Policy versions, where their weights are, and trainer progress (mixed into `StateStore`)."""

    async def current_version(self) -> int:
        """The latest published policy version; 0 before the first publication."""
        redis = await self._ready()
        return int(await redis.get(self.keys.policy_version) or 0)

    async def raise_version(self, floor: int) -> int:
        """Make the version counter at least `floor` (a version known to exist elsewhere: a
        checkpoint, a weights directory); never lowers it. Returns the counter."""
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise InvalidArgument(f"version floor must be an int >= 0; got {floor!r}")
        return int(await self._eval(RAISE_VERSION, [self.keys.policy_version], [floor]))

    async def publish_version(self, version: int, path: str) -> bool:
        """Publish weights at `path` as `version`, which must be current + 1; `path` "": the weights
        are not on disk (yet: `record_path` adds it).

        Returns True when this call published it, False when the same version with the same path
        was already published (a replay); raises Conflict for any other version.
        """
        _check_version(version)
        if not isinstance(path, str):
            raise InvalidArgument(f"weights path must be a string; got {path!r}")
        record = json.dumps({"path": path, "published_at": self._clock()})
        keys = [self.keys.policy_version, self.keys.weights]
        outcome, current = await self._eval(PUBLISH_VERSION, keys, [version, path, record])
        if outcome < 0:
            raise Conflict(f"cannot publish policy version {version}: the current version is {current}, "
                           f"so only {current + 1} can be published next")
        return outcome == 1

    async def published_version(self, version: int) -> PublishedVersion:
        """Path and time of a published version; NotFound if it was never published."""
        redis = await self._ready()
        stored = await redis.hget(self.keys.weights, str(int(version)))
        if stored is None:
            raise NotFound(f"policy version {version} was not published in run {self.run_id!r}")
        record = json.loads(stored)
        return PublishedVersion(int(version), record["path"], float(record["published_at"]))

    async def weights_path(self, version: int) -> str:
        """Where the weights of `version` are on disk; NotFound if it was never published or never
        written (sent over the weights group only)."""
        path = (await self.published_version(version)).path
        if not path:
            raise NotFound(f"policy version {version} of run {self.run_id!r} was not written to disk")
        return path

    async def record_path(self, version: int, path: str) -> None:
        """Add the disk path of `version`, published before it was written (weights: group)."""
        _check_version(version)
        if not path:
            raise InvalidArgument("weights path must not be empty")
        redis = await self._ready()
        stored = await redis.hget(self.keys.weights, str(version))
        if stored is None:
            raise NotFound(f"policy version {version} was not published in run {self.run_id!r}")
        record = json.dumps({**json.loads(stored), "path": path})  # in Python: Lua's cjson rounds floats
        if not await self._eval(RECORD_PATH, [self.keys.weights], [version, stored, record]):
            raise Conflict(f"the record of policy version {version} changed while its path was added; retry")

    async def latest_on_disk(self) -> PublishedVersion | None:
        """The newest published version whose weights are on disk; None before the first one."""
        redis = await self._ready()
        version = int(await redis.get(self.keys.policy_version) or 0)
        while version >= 1:  # a few steps at most: a version is written at least every disk_every
            stored = await redis.hget(self.keys.weights, str(version))
            if stored is not None and json.loads(stored)["path"]:
                record = json.loads(stored)
                return PublishedVersion(version, record["path"], float(record["published_at"]))
            version -= 1
        return None

    async def set_base_model(self, path: str) -> None:
        """Record where the run's base model is (a model directory of this machine)."""
        if not path:
            raise InvalidArgument("base model path must not be empty")
        redis = await self._ready()
        await redis.set(self.keys.base_model, path)

    async def base_model(self) -> str:
        """The run's base model directory; "" before the trainer has one."""
        redis = await self._ready()
        return text(await redis.get(self.keys.base_model))

    async def set_trainer_progress(self, progress: dict[str, Any]) -> None:
        """Update some fields of the trainer's progress record (see PROGRESS_FIELDS), in one write."""
        if not progress:
            return
        redis = await self._ready()
        await redis.hset(self.keys.trainer_progress, mapping={
            name: str(value) for name, value in _check_progress(progress).items()})

    async def trainer_progress(self) -> dict[str, Any]:
        """The trainer's progress record, typed; empty before the first step."""
        redis = await self._ready()
        found = await redis.hgetall(self.keys.trainer_progress)
        return {text(name): PROGRESS_FIELDS[text(name)](text(value)) for name, value in found.items()
                if text(name) in PROGRESS_FIELDS}

    async def save_step_record(self, step: int, record: bytes) -> None:
        """Store the record of a training step (a re-run step after a resume replaces it)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"step must be an int >= 0; got {step!r}")
        redis = await self._ready()
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.step_records, str(step), bytes(record))
            pipe.zadd(self.keys.step_index, {str(step): step})
            await pipe.execute()

    async def step_records(self, from_step: int = 0) -> list[bytes]:
        """Records of steps >= `from_step`, in step order."""
        redis = await self._ready()
        steps = await redis.zrangebyscore(self.keys.step_index, from_step, "+inf")
        if not steps:
            return []
        return [bytes(record) for record in await redis.hmget(self.keys.step_records, steps)
                if record is not None]
