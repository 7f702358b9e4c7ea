"""A service's recorder: one call writes a record to every sink (run record, TensorBoard, W&B).

```
 service hook ─▶ probe (services/<name>/telemetry.py: what the service knows, as tags)
                   └▶ Recorder.write(kind, step, scalars, histograms, text, fields)
                        ├▶ RUN_DIR/telemetry/<service>.jsonl   (always: `libra report` reads it)
                        ├▶ RUN_DIR/tensorboard/<service>/      (telemetry.tensorboard)
                        └▶ W&B run RUN/<service>               (telemetry.wandb, when installed)
```
Steps: the trainer's records carry the training step; every other service's carry the run's
elapsed seconds (since RUN_DIR/telemetry/clock.json, written once by the first service of the
run), so all services share one time axis in TensorBoard and a restarted service continues it.
One recorder per service and run directory in a process (`recorder`), opened on first use and
closed at exit, like the process-wide Prometheus registry the same hooks feed.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from libra import log as liblog
from libra.telemetry.config import TelemetryConfig
from libra.telemetry.sinks import Entry, RunRecordSink, Sink, TensorBoardSink, WandbSink

if TYPE_CHECKING:
    from libra.config import RunConfig

_log = liblog.get("libra.telemetry")
P = TypeVar("P")
CLOCK_FILE = "clock.json"


def run_clock(directory: pathlib.Path, now: float) -> float:
    """The run's start time: RUN_DIR/telemetry/clock.json, written by whichever service comes first."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CLOCK_FILE
    if not path.exists():
        draft = directory / f".{CLOCK_FILE}.{os.getpid()}"
        draft.write_text(json.dumps({"started_at": now}))
        try:
            os.link(draft, path)  # atomic: exactly one service's draft becomes the clock
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return float(json.loads(path.read_text())["started_at"])


class Recorder:
    """Writes one service's records to its sinks."""

    def __init__(self, run_path: pathlib.Path, service: str, run_id: str, settings: TelemetryConfig,
                 clock: Callable[[], float] = time.time, run_config: dict[str, Any] | None = None):
        self.service, self.clock = service, clock
        directory = run_path / "telemetry"
        self.sinks: list[Sink] = []
        self.started_at = clock()
        try:
            self.started_at = run_clock(directory, self.started_at)
            self.sinks.append(RunRecordSink(directory / f"{service}.jsonl"))
            if settings.tensorboard:
                self._tensorboard(run_path / "tensorboard" / service)
        except OSError as error:  # an unwritable run directory: the service runs on, unrecorded
            _log.warning("cannot write the run record; this service records nothing", service=service,
                         error=str(error))
        if settings.wandb is not None:
            sink = WandbSink.open(settings.wandb, run_path, run_id, service, self.started_at, run_config or {})
            if sink is not None:
                self.sinks.append(sink)

    def _tensorboard(self, logdir: pathlib.Path) -> None:
        try:
            self.sinks.append(TensorBoardSink(logdir))
        except ImportError:
            _log.warning("telemetry.tensorboard is on but the tensorboard package is not installed; the run "
                         "record is still written (pip install tensorboard, or telemetry.tensorboard: false)")

    def elapsed(self, t: float | None = None) -> int:
        """Whole seconds since the run started: the step of a record that has no training step."""
        return max(0, int((self.clock() if t is None else t) - self.started_at))

    def write(self, kind: str, *, step: int | None = None, t: float | None = None,
              scalars: dict[str, float] | None = None, histograms: dict[str, list[float]] | None = None,
              text: dict[str, str] | None = None, **fields: Any) -> Entry:
        when = self.clock() if t is None else t
        entry = Entry(kind, when, self.elapsed(when) if step is None else int(step), dict(scalars or {}),
                      dict(histograms or {}), dict(text or {}), fields)
        for sink in self.sinks:
            sink.write(entry)
        return entry

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


_recorders: dict[tuple[str, str], Recorder] = {}
_probes: dict[tuple[str, str], Any] = {}
_resolved: dict[tuple[str, str], str] = {}


def _run_key(config: "RunConfig") -> str:
    """`config`'s run directory, resolved once per (as written, working directory): probes are looked
    up on every turn and every route, and resolving walks the path with a system call per part."""
    written = (str(config.run_dir), os.getcwd())
    if written not in _resolved:
        _resolved[written] = str(config.run_path)
    return _resolved[written]


def recorder(config: "RunConfig", service: str) -> Recorder:
    """This process's recorder for `service` of `config`'s run (opened on first use)."""
    key = (_run_key(config), service)
    if key not in _recorders:
        _recorders[key] = Recorder(config.run_path, service, config.run_id, config.telemetry,
                                   run_config=config.model_dump(mode="json", exclude={"redis", "security"}))
    return _recorders[key]


def probe(config: "RunConfig", service: str, make: Callable[[Recorder, "RunConfig"], P]) -> P:
    """This process's probe for `service` (what turns the service's state into records), made once."""
    key = (_run_key(config), service)
    if key not in _probes:
        _probes[key] = make(recorder(config, service), config)
    return _probes[key]


@atexit.register
def close_all() -> None:
    """Flush and close every recorder of this process (at exit; tests call it to read what was written)."""
    for key in list(_recorders):
        _recorders.pop(key).close()
    _probes.clear()
