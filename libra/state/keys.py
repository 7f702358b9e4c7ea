"""The Redis key schema of one run: every key Libra writes, named in one place.

Owns key names only: no Redis client, no encoding. `docs/state.md` documents each key's type,
fields, writers, readers and atomicity; change both together and bump `SCHEMA_VERSION` whenever
an existing key changes its type or the meaning of a field.

Every key of a run starts with ``libra:{run_id}:``. The braces are literal: they are a Redis
Cluster hash tag, so all keys of a run live in one slot and the multi-key Lua scripts and
MULTI blocks of the store stay valid on a cluster.
"""

from __future__ import annotations

import re

from libra.errors import InvalidArgument

SCHEMA_VERSION = 1
"""Version of this key schema, stored at `Keys.schema`; a store refuses a run of another version."""

PREFIX = "libra"
COMPLETED_GROUP = "trainer"
"""Consumer group of the completed-trajectory stream (the trainer's data loaders)."""
HISTORY_KINDS = ("turn", "step")

_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_MAX_ID_LENGTH = 512


def check_run_id(run_id: str) -> str:
    """Return `run_id` if it is a valid run id (the same rule as `RunConfig.run_id`)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise InvalidArgument(
            f"run id must be 1-64 characters of letters, digits, '_', '.', '-'; got {run_id!r}")
    return run_id


def check_name(value: str, what: str) -> str:
    """A name that becomes one key segment (scope, blob name): no ':' so keys cannot collide."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidArgument(f"{what} must be 1-128 characters of letters, digits, '_', '.', '-'; got {value!r}")
    return value


def check_id(value: str, what: str) -> str:
    """An opaque id (trajectory, group, member, request): non-empty, bounded, no whitespace."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string; got {value!r}")
    if len(value) > _MAX_ID_LENGTH or any(ch.isspace() for ch in value):
        raise InvalidArgument(f"{what} must be at most {_MAX_ID_LENGTH} characters without whitespace")
    return value


def check_history_kind(kind: str) -> str:
    if kind not in HISTORY_KINDS:
        raise InvalidArgument(f"history kind must be one of {HISTORY_KINDS}; got {kind!r}")
    return kind


class Keys:
    """Key names of one run; one property or method per key (see docs/state.md)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = check_run_id(run_id)
        self.prefix = f"{PREFIX}:{{{run_id}}}:"

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- schema and idempotency ------------------------------------------------------------
    @property
    def schema(self) -> str:
        """String: the SCHEMA_VERSION this run was created with."""
        return self._key("schema")

    def request(self, scope: str, request_id: str) -> str:
        """String with TTL: marker that a request id was seen in a scope."""
        return self._key("req", check_name(scope, "scope"), check_id(request_id, "request id"))

    def reply(self, scope: str, request_id: str) -> str:
        """String with TTL: the first answer to a request, returned to replays."""
        return self._key("reply", check_name(scope, "scope"), check_id(request_id, "request id"))

    def claim(self, scope: str, request_id: str) -> str:
        """String with a short TTL (a lease): the token of the call running a request now."""
        return self._key("claim", check_name(scope, "scope"), check_id(request_id, "request id"))

    # -- trajectories and groups -----------------------------------------------------------
    def trajectory(self, trajectory_id: str) -> str:
        """Hash: scalar fields of one trajectory plus the serialized proto in `data`."""
        return self._key("traj", check_id(trajectory_id, "trajectory id"))

    def group(self, group_id: str) -> str:
        """Hash: a GRPO group's prompt, size, oldest admissible version and progress counters."""
        return self._key("group", check_id(group_id, "group id"))

    def group_trajectories(self, group_id: str) -> str:
        """Set: trajectory ids stored for a group (the group index)."""
        return self._key("group", check_id(group_id, "group id"), "trajs")

    @property
    def inflight_groups(self) -> str:
        """Set: ids of registered groups that have not finished."""
        return self._key("groups", "inflight")

    @property
    def completed(self) -> str:
        """Stream: one entry per completed or failed trajectory, read by the trainer."""
        return self._key("completed")

    @property
    def completed_group(self) -> str:
        """Name of the completed stream's consumer group (not a key)."""
        return COMPLETED_GROUP

    # -- policy versions -------------------------------------------------------------------
    @property
    def policy_version(self) -> str:
        """String counter: the latest published policy version (absent = 0)."""
        return self._key("version")

    @property
    def weights(self) -> str:
        """Hash: version -> JSON {path, published_at} of each published weight set (path "": not on disk)."""
        return self._key("weights")

    @property
    def base_model(self) -> str:
        """String: the directory of the run's base model (what every version's weights fit); rollout
        workers may start on it while the trainer prepares version 1."""
        return self._key("base_model")

    # -- runtime history -------------------------------------------------------------------
    def history(self, kind: str) -> str:
        """Capped stream of HistoryRecord protos, one per turn or per training step."""
        return self._key("history", check_history_kind(kind))

    # -- trainer ---------------------------------------------------------------------------
    @property
    def trainer_progress(self) -> str:
        """Hash: step, version, data position, checkpoint path."""
        return self._key("trainer", "progress")

    @property
    def step_records(self) -> str:
        """Hash: step -> serialized per-step record."""
        return self._key("trainer", "steps")

    @property
    def step_index(self) -> str:
        """Sorted set: step numbers of `step_records` (score = step) for range reads."""
        return self._key("trainer", "steps", "index")

    # -- membership and plans --------------------------------------------------------------
    def member(self, member_id: str) -> str:
        """Hash: generation, role, payload, updated_at of one pool member."""
        return self._key("member", check_id(member_id, "member id"))

    @property
    def members(self) -> str:
        """Set: ids of the current members."""
        return self._key("members")

    @property
    def membership_epoch(self) -> str:
        """String counter: bumped whenever the set of members or their roles changes."""
        return self._key("members", "epoch")

    @property
    def plan(self) -> str:
        """Hash: generation, data (serialized Plan), updated_at of the current plan."""
        return self._key("plan")

    @property
    def plan_decisions(self) -> str:
        """Capped list: serialized planner decisions, oldest first."""
        return self._key("plan", "decisions")

    # -- small named records (scheduler state) ---------------------------------------------
    def blob(self, name: str) -> str:
        """Hash: generation, payload, updated_at of a small named record."""
        return self._key("blob", check_name(name, "record name"))

    @property
    def scheduler_tree(self) -> str:
        """The scheduler's C-MLFQ signature trees (a blob named `scheduler.tree`)."""
        return self.blob("scheduler.tree")

    @property
    def scheduler_live(self) -> str:
        """Hash: trajectory id -> JSON of its routing state (placement, level, recent replies), for
        every trajectory the scheduler routed and that has not finished."""
        return self._key("scheduler", "live")

    @property
    def scheduler_learned(self) -> str:
        """Stream with ids 0-N: what each finished trajectory taught (its state before the finish)
        since the tree blob was saved; trimmed when the tree is saved."""
        return self._key("scheduler", "learned")

    @property
    def scheduler_meta(self) -> str:
        """Hash: `rotation` (the tie-breaking counter), `tree_learned` (the last learned entry the
        saved tree includes)."""
        return self._key("scheduler", "meta")
