"""Libra's durable state: one versioned Redis key schema per run and the async store over it.

Every service reaches Redis only through `StateStore`; key names live in `keys.Keys` and are
documented in docs/state.md.
"""

from libra.state.base import VersionedRecord
from libra.state.completed import CompletedEntry
from libra.state.keys import COMPLETED_GROUP, HISTORY_KINDS, SCHEMA_VERSION, Keys, check_run_id
from libra.state.redis_store import StateStore
from libra.state.trajectories import FINAL_STATUSES, GroupInfo
from libra.state.versions import PROGRESS_FIELDS, PublishedVersion

__all__ = [
    "COMPLETED_GROUP",
    "FINAL_STATUSES",
    "HISTORY_KINDS",
    "PROGRESS_FIELDS",
    "SCHEMA_VERSION",
    "CompletedEntry",
    "GroupInfo",
    "Keys",
    "PublishedVersion",
    "StateStore",
    "VersionedRecord",
    "check_run_id",
]
