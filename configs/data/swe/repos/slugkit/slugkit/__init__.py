"""Turn titles into URL slugs."""

from slugkit.core import slugify

__all__ = ["slugify"]
