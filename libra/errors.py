"""Libra's exception hierarchy and the one table that maps it to gRPC status codes.

Domain code raises these; servicers never build status codes themselves (see `libra.rpc`).
"""

from __future__ import annotations

import grpc


class LibraError(Exception):
    """Base class of every error Libra raises on purpose."""

    code = grpc.StatusCode.INTERNAL


class ConfigError(LibraError, ValueError):
    """A config file or flag is invalid; the message names the field and the fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidArgument(LibraError, ValueError):
    """A request field is missing or out of range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LibraError, KeyError):
    """An unknown run, trajectory, worker or member."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else "not found"


class FailedPrecondition(LibraError):
    """The request is well formed but the system is not in a state to accept it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Conflict(LibraError):
    """A compare-and-set lost: someone else wrote a newer generation first."""

    code = grpc.StatusCode.ABORTED


class ResourceExhausted(LibraError):
    """A bounded resource is in use (e.g. the one Preflight search a planner runs at a time); retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(LibraError):
    """Work ran past its own time limit (not the caller's deadline) and was stopped."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(LibraError):
    """A peer (service, worker or Redis) cannot be reached right now; retry later."""

    code = grpc.StatusCode.UNAVAILABLE


def status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised while serving a request."""
    if isinstance(error, LibraError):
        return error.code
    if isinstance(error, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
