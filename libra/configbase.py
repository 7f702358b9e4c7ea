"""The base of every typed config: unknown keys are errors, every field documented and bounded."""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

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


def tagged_union(section: str, *variants: type[Section], default: str | None = None) -> Any:
    """The type of a config section that is one of `variants`, chosen by their `type` field (a
    pydantic discriminated union): each variant forbids the keys it ignores, so a setting another
    variant has cannot be written for this one, and the error says which variant it belongs to.

    `section: NAME` (a string, e.g. `--set weights=group`) is short for `section: {type: NAME}`;
    a mapping without `type` is the `default` variant (None: `type` is required)."""
    tags = {variant.model_fields["type"].default: variant for variant in variants}

    def short_form(value: Any) -> Any:
        if isinstance(value, str):
            value = {"type": value}
        if not isinstance(value, dict):
            return value
        tag = value.get("type", default)
        if tag is None:
            raise ValueError(f"{section}.type is required: one of {sorted(tags)}")
        chosen = tags.get(tag)
        if chosen is None:
            raise ValueError(f"{section}.type must be one of {sorted(tags)}, got {tag!r}")
        for key in sorted(set(value) - set(chosen.model_fields)):
            owners = sorted(t for t, v in tags.items() if key in v.model_fields)
            if owners:
                raise ValueError(f"{section}.{key} applies to {section} type {' or '.join(owners)}, not {tag}; "
                                 f"remove it or set {section}.type: {owners[0]}")
        return {**value, "type": tag}

    return Annotated[Union[tuple(tags.values())], Field(discriminator="type"), BeforeValidator(short_form)]
