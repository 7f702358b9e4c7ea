"""One structlog setup for every Libra process: JSON in deployment, readable on a terminal.

Context fields (run, service, step, policy_version, trajectory_id) are bound by callers with
`log.bind(...)` or `structlog.contextvars.bind_contextvars(...)`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, run_id: str = "", json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog and stdlib logging for this process (idempotent)."""
    if json is None:
        json = os.environ.get("LIBRA_LOG_FORMAT", "json" if not sys.stderr.isatty() else "console") == "json"
    level_name = (level or os.environ.get("LIBRA_LOG_LEVEL", "INFO")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **({"run": run_id} if run_id else {}))


def get(name: str = "libra") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
