"""The routing policies' names, without pydantic: what the CLI offers as choices at start-up
(libra/cli.py) and what the config's `policy.type` accepts (config.py)."""

from __future__ import annotations

import typing
from typing import Literal

PolicyName = Literal["load_balance", "cmlfq", "length_aware", "la_mlfq"]
"""The policies a service may run (the evaluation-only clairvoyant heuristic is built by hand)."""

POLICY_NAMES: tuple[str, ...] = typing.get_args(PolicyName)
