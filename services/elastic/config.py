"""Typed config of the elastic coordinator."""

from __future__ import annotations

from pydantic import Field

from libra.configbase import Section


class ElasticConfig(Section):
    """Membership registry settings."""

    heartbeat_timeout_s: float = Field(30.0, gt=0, le=3600,
                                       description="a member with no heartbeat for this long is marked offline")
