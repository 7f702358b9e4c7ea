"""Typed config of the scheduler service: the routing policy it runs and that policy's limits.

Every field is a routing setting (`libra.routing.config.RoutingConfig`, shared with the planner's
simulator); settings of the service alone would be added here.
"""

from __future__ import annotations

from libra.routing.config import RoutingConfig


class SchedulerConfig(RoutingConfig):
    """Routing policy (load_balance, cmlfq, length_aware or la_mlfq, each with its own settings) and its limits."""
