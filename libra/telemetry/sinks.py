"""Where a service's records go: the run record (JSON lines), TensorBoard, Weights & Biases.

Each sink takes the same call, `write(Entry)`. The run record keeps everything (it is what
`libra report` reads); TensorBoard gets scalars, histograms and text through TensorBoard's own
writer (its event-file writer and its plugins' summary builders, the ones torch's SummaryWriter
uses, without importing torch: the planner and scheduler stay light); W&B gets scalars and
histograms through `wandb.log`. A sink that fails to write (a full disk) logs it once and stops;
the service goes on.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from libra import log as liblog

_log = liblog.get("libra.telemetry")


@dataclass
class Entry:
    """One record: a kind, when, the step it belongs to, and what to log."""

    kind: str
    t: float
    step: int
    scalars: dict[str, float] = field(default_factory=dict)  # TensorBoard tag -> value (all sinks)
    histograms: dict[str, list[float]] = field(default_factory=dict)  # tag -> values (TensorBoard, W&B)
    text: dict[str, str] = field(default_factory=dict)  # tag -> markdown (TensorBoard)
    fields: dict[str, Any] = field(default_factory=dict)  # anything else the report needs (run record only)

    def line(self) -> dict[str, Any]:
        row: dict[str, Any] = {"kind": self.kind, "t": round(self.t, 3), "step": self.step}
        if self.scalars:
            row["scalars"] = {tag: _finite(value) for tag, value in self.scalars.items()}
        return {**row, **self.fields}


def _finite(value: float) -> float | None:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None  # JSON has no NaN


class Sink:
    name = "sink"

    def __init__(self) -> None:
        self.broken = False

    def write(self, entry: Entry) -> None:
        if self.broken:
            return
        try:
            self._write(entry)
        except OSError as error:  # the run goes on without this sink; say so once
            self.broken = True
            _log.warning("telemetry sink stopped writing", sink=self.name, error=str(error))

    def _write(self, entry: Entry) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RunRecordSink(Sink):
    """RUN_DIR/telemetry/<service>.jsonl: one JSON object a line, flushed at every line."""

    name = "run record"

    def __init__(self, path: pathlib.Path):
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def _write(self, entry: Entry) -> None:
        self._file.write(json.dumps(entry.line(), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink(Sink):
    """Event files in RUN_DIR/tensorboard/<service>/ (TensorBoard's EventFileWriter, flushed every 5 s)."""

    name = "tensorboard"

    def __init__(self, logdir: pathlib.Path):
        super().__init__()
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir), max_queue_size=100, flush_secs=5)

    def _write(self, entry: Entry) -> None:
        import numpy as np
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.histogram.summary_v2 import histogram_pb
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        summaries = [scalar_pb(tag, float(value)) for tag, value in entry.scalars.items()]
        summaries += [histogram_pb(tag, np.asarray(values, dtype=np.float64), buckets=30)
                      for tag, values in entry.histograms.items() if values]
        summaries += [text_pb(tag, text) for tag, text in entry.text.items()]
        for summary in summaries:
            self._writer.add_event(Event(wall_time=entry.t, step=entry.step, summary=summary))

    def close(self) -> None:
        self._writer.close()


class WandbSink(Sink):
    """One W&B run per service: name RUN/SERVICE, group RUN, resumed by a later start of the same run."""

    name = "wandb"

    def __init__(self, wandb: Any, run: Any):
        super().__init__()
        self._wandb, self._run = wandb, run

    @classmethod
    def open(cls, settings: Any, run_path: pathlib.Path, run_id: str, service: str, started_at: float,
             config: dict[str, Any]) -> "WandbSink | None":
        try:
            import wandb
        except ImportError:
            _log.warning("telemetry.wandb is set but the wandb package is not installed; logging to TensorBoard "
                         "and the run record only (pip install wandb, or remove telemetry.wandb)")
            return None
        directory = run_path / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(project=settings.project, entity=settings.entity or None, mode=settings.mode,
                             dir=str(directory), name=f"{run_id}/{service}", group=run_id, job_type=service,
                             id=f"{run_id}-{int(started_at)}-{service}", resume="allow", config=config)
        except wandb.errors.Error as error:  # not logged in, no network (online mode): the run goes on without
            _log.warning("cannot start a W&B run; logging to TensorBoard and the run record only (wandb login, "
                         "or telemetry.wandb.mode: offline)", error=str(error))
            return None
        return cls(wandb, run)

    def _write(self, entry: Entry) -> None:
        values: dict[str, Any] = dict(entry.scalars)
        values.update({tag: self._wandb.Histogram(data) for tag, data in entry.histograms.items() if data})
        if values:
            self._run.log(values, step=entry.step)

    def close(self) -> None:
        self._run.finish()

