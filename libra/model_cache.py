"""A content-addressed cache of created model directories (the warm-started tiny model).

```
 $LIBRA_CACHE (default ~/.cache/libra; "off": no cache)
   models/<key>/                  a complete model directory + libra-cache.json (what the key hashed)
   models/<key>.partial-<pid>-…   one being built; renamed to <key> in one step when done
```
`key` is the SHA-256 of a JSON document of everything that shapes the directory's contents (the
caller's recipe: configs, seed, the code's own hash, library versions, the data it was trained on).
Entries are never changed in place: a run copies an entry into its own run directory, so nothing a
run writes reaches the cache. Concurrent runs are safe: each builds under its own name and renames;
the first rename wins, a later builder finds the entry there and drops its own copy.

Must not know: how a model is created or trained (the caller's `build` does that), torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import uuid
from typing import Any, Callable, Mapping

ENV = "LIBRA_CACHE"
OFF = ("off", "none", "0", "false")
META = "libra-cache.json"
FORMAT = 1


def cache_root(env: Mapping[str, str] | None = None) -> pathlib.Path | None:
    """The cache directory: $LIBRA_CACHE, else ~/.cache/libra; None when $LIBRA_CACHE says off."""
    env = os.environ if env is None else env
    value = env.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        path = pathlib.Path(value).expanduser()
        if not path.is_absolute():
            raise ValueError(f"{ENV}={value!r} must be an absolute path (or 'off' to disable the model cache)")
        return path
    return pathlib.Path.home() / ".cache" / "libra"


def digest_texts(texts: Any) -> str:
    """SHA-256 of a sequence of texts (length-prefixed, so boundaries count)."""
    hasher = hashlib.sha256()
    for text in texts:
        data = text.encode() if isinstance(text, str) else json.dumps(text, sort_keys=True).encode()
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()


def digest_files(paths: Any) -> str:
    """SHA-256 of the contents of `paths` (source files whose code shapes an entry)."""
    return digest_texts(pathlib.Path(p).read_text() for p in paths)


def model_key(recipe: Mapping[str, Any]) -> str:
    """The entry name of `recipe` (a JSON-serialisable mapping)."""
    document = json.dumps({"format": FORMAT, **recipe}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(document.encode()).hexdigest()[:32]


def copy_model(source: pathlib.Path, dest: pathlib.Path) -> None:
    """Copy an entry's files into `dest` (made here; it must not exist), without the cache's own file."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(META))


def cached_model(root: pathlib.Path | None, recipe: Mapping[str, Any], dest: pathlib.Path,
                 build: Callable[[pathlib.Path], None]) -> bool:
    """Put the model directory of `recipe` at `dest` (which must not exist yet): copied from the
    cache when the entry is there (returns True), else built by `build(directory)` and stored
    (returns False). With `root` None the model is built straight into `dest`.
    """
    dest = pathlib.Path(dest)
    if root is None:
        build(dest)
        return False
    key = model_key(recipe)
    models = root / "models"
    entry = models / key
    if (entry / META).is_file():
        copy_model(entry, dest)
        return True
    models.mkdir(parents=True, exist_ok=True)
    staging = models / f"{key}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build(staging)
        (staging / META).write_text(json.dumps({"format": FORMAT, "key": key, **recipe}, indent=2, sort_keys=True))
        try:
            staging.rename(entry)  # atomic; fails when another run stored the entry first
        except OSError:
            if not (entry / META).is_file():  # something else is in the way: use ours, store nothing
                copy_model(staging, dest)
                return False
        copy_model(entry, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return False
