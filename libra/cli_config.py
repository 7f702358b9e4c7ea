"""How the `libra` command turns its flags into a run config: `--config FILE`, `--set KEY=VALUE`
and the flags that name the run (`--redis-url`, `--run-id`, `--run-dir`); for the commands that
talk to running services, with the run's token and TLS installed."""

from __future__ import annotations

import argparse
from typing import Any

from libra.errors import ConfigError


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if getattr(args, "redis_url", None):
        found["redis.url"] = args.redis_url
    if getattr(args, "run_id", None):
        found["run_id"] = args.run_id
    if getattr(args, "run_dir", None):
        found["run_dir"] = args.run_dir
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        import yaml

        found[key] = yaml.safe_load(value)
    return found


def load(args: argparse.Namespace):
    from libra.config import load_run_config

    return load_run_config(args.config, overrides(args))


def client(args: argparse.Namespace):
    """The config, with its token and TLS installed for this process's channels (status, explain)."""
    from libra import security

    config = load(args)
    security.install(security.load(config))
    return config
