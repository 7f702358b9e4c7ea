"""The sandbox's fallback where namespaces are not available: what an unisolated run still gets.

A run without the `namespaces` isolation (not root, or no working `unshare`) is refused unless the
workload allows it (`allow_unisolated_sandbox: true`); then it gets, in the child before exec:

```
 root:     fork ─▶ [unshare(CLONE_NEWNET): an empty network namespace] ─▶ rlimits
                ─▶ setgroups([]), setgid/setuid to an unused uid (never root) ─▶ exec the program
 not root: fork ─▶ rlimits ─▶ exec [unshare --user --map-current-user --net --] the program
           (a new user namespace that maps only our own uid, and an empty network namespace)
```
(the bracketed steps where the kernel allows them here; probed once).
plus a `sitecustomize` that makes `socket` unusable for Python programs (the only network block
where no namespace can be made). Still weaker than namespaces: the program sees the host's
processes and file system, and can write to world-writable directories (/tmp, /dev/shm).
Dropping root needs an interpreter that other users can reach (not one under a private /root).
Must not know workloads.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Callable

from libra.errors import FailedPrecondition

# The `guard` isolation's network block, for Python programs (PYTHONPATH points at it).
GUARD_SITECUSTOMIZE = '''
import socket as _socket
def _blocked(*args, **kwargs):
    raise OSError(101, "network access is disabled in the Libra sandbox")
class _Socket(_socket.socket):
    def __init__(self, *args, **kwargs):
        _blocked()
_socket.socket = _Socket
_socket.create_connection = _blocked
_socket.getaddrinfo = _blocked
'''

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


class SandboxUnavailable(FailedPrecondition):
    """The sandbox cannot run a program with the isolation it was allowed to use."""


HINT = ("run Libra as root where `unshare` works (namespaces: no network, private /tmp, own pids), or set "
        "workload.allow_unisolated_sandbox: true to run model-written code with rlimits only, as an "
        "unprivileged user (see libra/workloads/sandbox_guard.py)")


UNSHARE_NET = ("unshare", "--user", "--map-current-user", "--net", "--")
"""A non-root run's prefix: an empty network namespace in a user namespace of our own uid. A new
user namespace needs a single-threaded caller, which a freshly exec'd `unshare` is (a forked child
of a gRPC process may not be)."""


def enter_empty_network() -> None:
    """As root, in a child before exec: move it into a new, empty network namespace (raises
    OSError if the kernel refuses)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")


@functools.lru_cache(maxsize=2)
def network_namespace_available(root: bool) -> bool:
    """True when a run (as root or not) can get an empty network namespace here (probed once)."""
    try:
        if root:
            probe = subprocess.run(["true"], preexec_fn=enter_empty_network, capture_output=True, timeout=10)
        elif shutil.which("unshare"):
            probe = subprocess.run([*UNSHARE_NET, "true"], capture_output=True, timeout=10)
        else:
            return False
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def unreachable_dirs(program: str) -> list[str]:
    """Directories on the way to `program` (and, for this interpreter, to its standard library)
    that other users cannot traverse (e.g. /root)."""
    targets = {pathlib.Path(os.path.realpath(program)).parent}
    if os.path.realpath(program) == os.path.realpath(sys.executable):
        targets.add(pathlib.Path(sys.base_prefix).resolve())
    found = set()
    for target in targets:
        for depth in range(1, len(target.parts)):
            directory = pathlib.Path(*target.parts[:depth + 1])
            if not os.stat(directory).st_mode & 0o001:
                found.add(str(directory))
                break
    return sorted(found)


def check_unisolated(program: str) -> None:
    """Raise SandboxUnavailable when an unisolated run could not start `program` here."""
    if os.geteuid() == 0 and (blocked := unreachable_dirs(program)):
        raise SandboxUnavailable(f"an unisolated sandbox run drops root to an unused uid, which cannot reach "
                                 f"{program} under {', '.join(blocked)}; install it where other users can read "
                                 f"it, or run where `unshare` works (namespaces)")


def give_to(path: pathlib.Path, uid: int) -> None:
    """Make `path` (a run's scratch tree) the unprivileged uid's."""
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, uid, uid)


def preexec(rlimits: dict[str, list[int]], uid: int | None, network: bool) -> Callable[[], None]:
    """The child's set-up before exec (the module docstring's picture); `uid`: drop root to it;
    `network`: enter an empty network namespace first (root only)."""

    def set_up() -> None:
        import resource

        if network:
            enter_empty_network()
        for name, (soft, hard) in rlimits.items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return set_up
