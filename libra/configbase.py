"""The base of every typed config: unknown keys are errors, every field documented and bounded."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

ADDRESS_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


class Section(BaseModel):
    """A config section: frozen, strict about unknown keys, validated once at start."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def check_address(value: str, field: str) -> str:
    """Validate a HOST:PORT peer address."""
    match = ADDRESS_RE.match(value or "")
    if not match or not (1 <= int(match.group(1)) <= 65535):
        raise ValueError(f"{field} must be HOST:PORT with a port in 1..65535, got {value!r}")
    return value
