"""What a run directory holds, and how a new `libra up` treats it.

```
 RUN_DIR/checkpoints/step{N}.pt   the trainer's latest checkpoint: N committed steps
 RUN_DIR/model/base/              the warm-started model (the trainer skips the warm start)
 RUN_DIR/logs/                    this start's logs; earlier starts' in logs.1 (latest) … logs.5
```

A new `libra up` over an existing directory:
- nothing to resume (no checkpoint, no warm-started model): start, as on an empty directory;
- a checkpoint below trainer.steps, or only the warm-started model: resume, and say from where;
- a checkpoint at trainer.steps or beyond (the trainer checkpoints its last step): the run is
  finished and there is nothing to train: refused, naming the two ways on (`--fresh`, or a larger
  `--set trainer.steps=N`).
`--fresh` moves the directory aside to RUN_DIR.prev-<time> (never deletes) and, on a Redis that
outlives `libra up` (redis.url given), deletes the run's keys there; `--resume` insists on resuming.

Must not know: how the trainer saves a checkpoint (only its name, from model_state).
"""

from __future__ import annotations

import pathlib
import shutil
import time
from dataclasses import dataclass

from libra.errors import ConfigError, FailedPrecondition

KEEP_LOGS = 5  # earlier starts' log directories kept beside the current one


@dataclass(frozen=True)
class RunDirState:
    """What an earlier start left in a run directory."""

    path: pathlib.Path
    checkpoint: pathlib.Path | None  # the latest trainer checkpoint
    step: int  # the steps that checkpoint committed (0: none)
    warm_started: bool  # model/base is there

    @property
    def resumable(self) -> bool:
        return self.checkpoint is not None or self.warm_started


def inspect(path: pathlib.Path) -> RunDirState:
    from libra.services.trainer.model_state import CHECKPOINT_RE

    found = [(int(m.group(1)), p) for p in (path / "checkpoints").glob("step*")
             if (m := CHECKPOINT_RE.match(p.name))]
    step, checkpoint = max(found) if found else (0, None)
    return RunDirState(path, checkpoint, step, (path / "model" / "base" / "config.json").exists())


def decide(state: RunDirState, run_id: str, steps: int, fresh: bool, resume: bool) -> str | None:
    """The line to print about this start (None: a new run, nothing to say); raises
    FailedPrecondition for a finished run or a `--resume` with nothing to resume."""
    if fresh and resume:
        raise ConfigError("--fresh starts over and --resume insists on continuing: pass one of them")
    if fresh:
        return None
    if not state.resumable:
        if resume:
            raise FailedPrecondition(f"--resume: run {run_id} has nothing to resume in {state.path} (no checkpoint, "
                                     f"no warm-started model); leave out --resume to start it")
        return None
    if state.step >= steps:
        raise FailedPrecondition(
            f"run {run_id} in {state.path} is finished: its checkpoint {state.checkpoint} is at step {state.step} and "
            f"trainer.steps is {steps}, so there is nothing to train. Pass --fresh to start over (moves {state.path} "
            f"aside to {state.path}.prev-<time>), or train on with more steps, e.g. --set trainer.steps="
            f"{max(2 * state.step, state.step + 1)}")
    if state.checkpoint is None:
        return (f"run {run_id}: reusing the warm-started model in {state.path / 'model' / 'base'} (no checkpoint "
                f"yet), training from step 0/{steps}; pass --fresh to start over")
    return (f"resuming run {run_id} from step {state.step}/{steps} (checkpoint {state.checkpoint}); "
            f"pass --fresh to start over")


def move_aside(path: pathlib.Path) -> pathlib.Path | None:
    """Rename `path` to a free `<name>.prev-<YYYYmmdd-HHMMSS>[-k]` beside it; None if it is absent."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.prev-{stamp}")
    k = 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}.prev-{stamp}-{k}")
    path.rename(target)
    return target


def rotate_logs(logs: pathlib.Path, keep: int = KEEP_LOGS) -> pathlib.Path | None:
    """Move `logs` to logs.1 (logs.1 to logs.2, …; beyond `keep` dropped), so a new start writes
    fresh files; where the previous start's logs went (None: there were none)."""
    if not logs.is_dir() or not any(logs.iterdir()):
        return None
    shutil.rmtree(logs.with_name(f"{logs.name}.{keep}"), ignore_errors=True)
    for index in range(keep - 1, 0, -1):
        older = logs.with_name(f"{logs.name}.{index}")
        if older.exists():
            older.rename(logs.with_name(f"{logs.name}.{index + 1}"))
    target = logs.with_name(f"{logs.name}.1")
    logs.rename(target)
    return target


def clear_redis_run(url: str, run_id: str) -> int:
    """Delete every key of `run_id` from the Redis at `url` (for `--fresh` on a Redis that
    outlives `libra up`); the number deleted."""
    import redis

    from libra.state.keys import Keys

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=Keys(run_id).prefix + "*", count=1000))
        for start in range(0, len(keys), 1000):
            client.unlink(*keys[start:start + 1000])
        return len(keys)
    finally:
        client.close()
