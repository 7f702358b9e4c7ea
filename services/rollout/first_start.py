"""How the gateway's first workers come up, and on which weights.

```
 a version on disk already (a restarted gateway) ─▶ the plan's workers start on the newest one
 none yet ─▶ wait for version 1; meanwhile, once the trainer names the run's base model (Redis
            `base_model`, a directory inside the run's), the plan's workers start on it
         ─▶ version 1 on disk ─▶ they load it (the usual disk route) ─▶ only then they join routing
```
The trainer names the base model before it loads it into its backend, so the workers' start-up
(a transformers import on CPU, a vLLM start on a GPU) overlaps the trainer's. A directory outside
the run's is never started on (Redis is not trusted with paths): the workers then wait for
version 1, as before. Knows the pool and the store, not routing or trajectories.
"""

from __future__ import annotations

import asyncio
import pathlib

from libra import log as liblog
from libra.errors import Unavailable
from libra.plans import Plan
from libra.rpc import retry_until

_log = liblog.get("libra.rollout")


class FirstStart:
    def __init__(self, store, pool, run_path: pathlib.Path):
        self.store, self.pool, self.run_path = store, pool, run_path
        self._refused: set[str] = set()  # base models named in Redis outside the run directory

    async def wait(self, plan: Plan) -> tuple[int, str, asyncio.Task | None]:
        """The newest version on disk: (version, path, the early start's task or None). While there
        is none, the plan's workers start on the base model as soon as the trainer names it."""
        found: dict[str, tuple[int, str]] = {}
        early: list[asyncio.Task] = []

        async def published() -> bool:
            latest = await self.store.latest_on_disk()
            if latest is not None:
                found["v"] = (latest.version, latest.path)
                return True
            if early and early[0].done() and not early[0].cancelled() and early[0].exception():
                return True  # the early start failed: stop waiting, the caller raises its error
            if not early and (base := await self.store.base_model()) and self._inside_run(base):
                _log.info("starting workers on the base model while the trainer prepares its first version",
                          model=base)
                early.append(asyncio.get_running_loop().create_task(self.pool.start(plan, base, 0)))
            return False

        _log.info("waiting for the first published policy version")
        try:
            await retry_until(published, "the trainer's first weights", max_backoff_s=0.5)
        except BaseException:
            for task in early:
                task.cancel()
            raise
        if "v" not in found:
            await early[0]  # raises why the workers could not start
        return (*found["v"], early[0] if early else None)

    async def load(self, early: asyncio.Task, path: str, version: int) -> list:
        """The workers started on the base model, each holding `version` (loaded from `path`)."""
        workers = await early
        results = await asyncio.gather(*(w.client.load_weights(path, version) for w in workers),
                                       return_exceptions=True)
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException):
                raise Unavailable(f"worker {worker.worker_id} started on the base model could not load "
                                  f"v{version} from {path}: {result}")
            worker.version = version
        return workers

    def _inside_run(self, path: str) -> bool:
        """A model directory inside the run's (one that is not there yet, or was removed: not now)."""
        if pathlib.Path(path).resolve().is_relative_to(self.run_path.resolve()):
            return (pathlib.Path(path) / "config.json").is_file()
        if path not in self._refused:
            self._refused.add(path)
            _log.warning("the base model named in Redis is outside the run directory; the workers wait "
                         "for version 1 instead", model=path, run_dir=str(self.run_path))
        return False
