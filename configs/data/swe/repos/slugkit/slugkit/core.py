import re

_UNSAFE = re.compile(r"[^a-z0-9]+")


def slugify(title, separator="-"):
    """Lower-case `title`, replace every run of other characters by `separator`, trim the ends."""
    slug = _UNSAFE.sub(separator, title)
    return slug.strip(separator)
