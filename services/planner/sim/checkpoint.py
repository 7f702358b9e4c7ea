"""A long simulation's progress on disk: a run killed or stopped goes on from its last checkpoint.

A 4,096-GPU online run takes an hour or more of CPU (its replanner replays the recent steps after
each step), longer than a shared machine's session or a batch job's slot. `Simulator.run(checkpoint=
Checkpoint(path))` writes the whole simulator (event heap, engines, turns in flight, the routing
policy's prefix forest, the replanner's calibration and history, the random generators) to `path`
at a step's end, at most every `every_s` seconds of wall time, by writing a file beside it and
renaming it over (a kill while writing leaves the previous checkpoint whole). `resume(path, key)`
loads it; the run then continues exactly as if it had never stopped (the same events in the same
order: tests/unit/test_sim_checkpoint.py), and its CPU and wall figures add up every part.

With `stop_on_signals()` SIGTERM and SIGINT (a batch system's notice before its time limit, or
Ctrl-C) do not kill the run: it saves at the next step's end and raises `Stopped`, whose message
says how to go on.

`key` names the run's inputs (the command line, say): a checkpoint of other inputs is refused with
both named, never continued as if it were this run's. So is one saved by other code: the file's
header holds the sha256 of the source of every `libra` module the saving process had loaded, and
a module whose source differs now is named (a run half on one version and half on another is
neither's). The header is read first, so a refusal never unpickles the simulator. A checkpoint is
a pickle: load only files you wrote (it runs code it names, like any pickle).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pathlib
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

from libra.errors import InvalidArgument

FORMAT = "libra-sim-checkpoint/2"  # a header dict (format, key, step, code), then the simulator


class Stopped(Exception):
    """The run was asked to stop (a signal) and saved itself: running it again goes on."""


@dataclass
class Checkpoint:
    """Where and how often a run saves itself: `every_s` wall seconds at most (0: after every step)."""

    path: pathlib.Path
    key: str = ""
    every_s: float = 300.0
    saved: int = 0  # checkpoints written by this process
    last_s: float = field(default_factory=time.perf_counter)
    stop: bool = False  # save at the next step's end and raise Stopped

    def __post_init__(self) -> None:
        self.path = pathlib.Path(self.path)
        if self.every_s < 0:
            raise InvalidArgument(f"checkpoint every_s must be >= 0 seconds, got {self.every_s}")

    def due(self) -> bool:
        return self.stop or time.perf_counter() - self.last_s >= self.every_s

    @contextlib.contextmanager
    def stop_on_signals(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator["Checkpoint"]:
        """While inside, these signals ask the run to save and stop instead of killing it (a second
        one while it finishes its step is ignored); the previous handlers come back after."""
        def ask(signum, _frame) -> None:
            self.stop = True

        previous = {signum: signal.signal(signum, ask) for signum in signals}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def save(self, simulator: object, step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "wb") as out:
            pickle.dump({"format": FORMAT, "key": self.key, "step": step, "code": code_fingerprint()}, out,
                        protocol=pickle.HIGHEST_PROTOCOL)
            pickle.dump(simulator, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)
        self.saved += 1
        self.last_s = time.perf_counter()


def header(path: str | os.PathLike[str]) -> dict:
    """A checkpoint's header (format, key, step, code) without its simulator."""
    return _open(pathlib.Path(path), header_only=True)[0]


def resume(path: str | os.PathLike[str], key: str = "") -> object:
    """The simulator saved at `path` (`Simulator.run` continues it); a file of another format, run or
    code is refused."""
    path = pathlib.Path(path)
    return _open(path, key=key)[1]


def _open(path: pathlib.Path, key: str = "", header_only: bool = False) -> tuple[dict, object]:
    try:
        with open(path, "rb") as source:
            saved = pickle.load(source)
            if not isinstance(saved, dict) or saved.get("format") != FORMAT:
                raise InvalidArgument(f"{path} is not a simulation checkpoint of this version ({FORMAT}); remove it "
                                      f"to start the run afresh")
            if header_only:
                return saved, None
            if saved["key"] != key:
                raise InvalidArgument(f"{path} holds another run's checkpoint (saved for {saved['key']!r}, this run "
                                      f"is {key!r}); name another file, or remove it to start afresh")
            changed = code_changes(saved.get("code", {}))
            if changed:
                shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
                raise InvalidArgument(f"{path} was saved by other code: {shown} changed since (going on would mix "
                                      f"two versions in one run); finish it with the code that saved it, or remove "
                                      f"it to start afresh")
            return saved, pickle.load(source)
    except InvalidArgument:  # (a ValueError: not to be taken for an unreadable file below)
        raise
    except FileNotFoundError:
        raise InvalidArgument(f"no checkpoint at {path}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError, KeyError) as error:
        raise InvalidArgument(f"{path} is not a readable simulation checkpoint ({type(error).__name__}: {error}); "
                              f"remove it to start the run afresh") from None


_SEEN: dict[str, str | None] = {}  # module -> its source's sha256 when this process first fingerprinted it


def code_fingerprint() -> dict[str, str]:
    """{module: sha256 of its source} for every `libra` module loaded in this process, each read
    the first time it is seen here (a source edited while the run goes on does not pass for its code)."""
    for name, module in list(sys.modules.items()):
        if (name == "libra" or name.startswith("libra.")) and name not in _SEEN:
            _SEEN[name] = _digest(getattr(module, "__file__", None))
    return {name: digest for name, digest in _SEEN.items() if digest is not None}


def code_changes(saved: dict[str, str]) -> list[str]:
    """The modules of a fingerprint whose source differs here (or that are gone), sorted."""
    changed = []
    for name, digest in sorted(saved.items()):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) if module is not None else None
        if path is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            path = spec.origin if spec is not None else None
        if _digest(path) != digest:
            changed.append(name)
    return changed


def _digest(path: str | None) -> str | None:
    if not path or not path.endswith(".py"):
        return None
    try:
        return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
