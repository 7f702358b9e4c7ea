"""The trainer's model on disk: creation and warm start, resume, checkpoints.

Layout under run_dir:
    model/base/          the created (tiny) model after the supervised warm start (a copy of the
                         model cache's entry for its recipe, libra/model_cache.py: built once per
                         recipe on a machine, reused by every later run)
    weights/v{N}/        weight sets of policy versions (HF format, what workers load): publisher.py
    checkpoints/step{N}.pt   model + optimizer + RNG + trainer position (atomic writes)

A checkpoint also lists the completed-stream entries that its steps used (and those of the groups
it discarded as stale or failed); they are acked only after the checkpoint is on disk, so a
trainer that dies between two checkpoints gets exactly those entries again, judges them again and
counts its discards again (a restart acks the ones a checkpoint covers).
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from libra import log as liblog
from libra import model_cache
from libra.config import RunConfig
from libra.services.trainer.backend import TrainBackend
from libra.workloads.base import build_workload

_log = liblog.get("libra.trainer")
CHECKPOINT_RE = re.compile(r"^step(\d+)\.pt$")


def make_backend(config: RunConfig) -> TrainBackend:
    """The training backend that `trainer.backend` names (torch: plain PyTorch; megatron: Megatron-Core)."""
    if config.trainer.backend.type == "megatron":
        from libra.services.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(config.trainer, seed=config.seed)
    from libra.services.trainer.torch_backend import TorchBackend

    return TorchBackend(config.trainer, seed=config.seed)


def warm_model_recipe(config: RunConfig, workload: Any) -> dict[str, Any]:
    """Everything that shapes the warm-started tiny model: its key in the model cache.

    The workload enters through what the model is built from (the tokenizer's corpus, its markup
    and the warm start's demonstrations, hashed), so a data file or workload code that changes
    them changes the key, and a field that does not (num_prompts) leaves it alone. A synthetic
    workload (`Workload.warm_start_inputs`: the texts are its code on its config) enters through
    that code and config instead, which is cheaper than making the texts at every start. Thread counts
    are not in it: they change float rounding, not what the model is, and configs that differ only
    there (the quickstart and configs/sync-colocated.yaml) share one entry, hence the same weights.
    """
    import importlib.metadata

    from libra import tiny_model
    from libra.services.trainer import warmup

    warm = config.trainer.warmup
    inputs = workload.warm_start_inputs()
    if inputs is not None:  # texts made from code and config alone: those, not the texts (~0.7 CPU-s)
        texts: dict[str, Any] = {"texts_from": inputs}
    else:
        demonstrations = workload.demonstrations(warm.steps * warm.batch_size, config.seed) if warm.steps else []
        texts = {"corpus": model_cache.digest_texts(workload.corpus(tiny_model.CORPUS_DOCUMENTS, config.seed)),
                 "demonstrations": model_cache.digest_texts(demonstrations)}
    return {
        "kind": "warm-started tiny model",
        "model": config.model.model_dump(mode="json"),
        "seed": config.seed,
        "warmup": warm.model_dump(mode="json"),
        "workload": config.workload.name,
        **texts,
        "markup": list(workload.markup_tokens),
        "code": model_cache.digest_files([tiny_model.__file__, warmup.__file__]),
        "libraries": {name: importlib.metadata.version(name) for name in ("torch", "transformers", "tokenizers")},
    }


def build_warm_model(config: RunConfig, workload: Any, directory: pathlib.Path,
                     progress: Callable[[int, float], None] | None = None) -> dict:
    """Create the tiny model in `directory` and warm-start it there; the warm start's metrics."""
    from libra.services.trainer.warmup import warm_start
    from libra.tiny_model import create_tiny_model

    create_tiny_model(config.model, workload, directory, config.seed)
    return warm_start(directory, workload, config.trainer.warmup, config.seed, config.trainer.torch_threads, progress)


def base_model(config: RunConfig, dest: pathlib.Path) -> bool:
    """The warm-started tiny model of `config` at `dest` (which must not exist), from the model cache
    when it holds it (True) or built (False): what `libra up` starts from, for tools beside it."""
    workload = build_workload(config.workload)
    root = model_cache.cache_root()
    recipe = warm_model_recipe(config, workload) if root is not None else {}
    return model_cache.cached_model(root, recipe, dest, lambda d: build_warm_model(config, workload, d))


@dataclass
class Position:
    """Where the trainer is: committed steps, its policy version, the next prompt position."""

    step: int = 0
    version: int = 0
    data_position: int = 0
    discarded_groups: int = 0  # rejected (stale) or failed groups, replaced by new submissions
    used_entries: list[str] = field(default_factory=list)  # stream entries used since the last checkpoint


class ModelState:
    def __init__(self, config: RunConfig, backend: TrainBackend | None, store: Any):
        self.config, self.backend, self.store = config, backend, store
        self.root = config.run_path
        self.base_dir = self.root / "model" / "base"
        self.checkpoints = self.root / "checkpoints"
        self.stopping = threading.Event()  # set on SIGTERM: the warm start stops at its next step

    def latest_checkpoint(self) -> pathlib.Path | None:
        found = [(int(m.group(1)), p) for p in self.checkpoints.glob("step*.pt") if (m := CHECKPOINT_RE.match(p.name))]
        return max(found)[1] if found else None

    async def prepare_base(self, on_warmup: Callable[[str], Any]) -> None:
        """Create and warm-start the base model if needed (the model cache's copy when it holds it), and
        name it in Redis: rollout workers may start on it while the backend is made and loads it."""
        if not (self.base_dir / "config.json").exists():
            await self._create(on_warmup)
        await self.store.set_base_model(str(self.base_dir))

    async def load(self) -> Position:
        """After `prepare_base`: the backend (`self.backend`, set by now) loads the base model, and
        resumes from the latest checkpoint when there is one."""
        if self.backend is None or not (self.base_dir / "config.json").exists():
            raise RuntimeError("ModelState.load: set the backend and call prepare_base first")
        await asyncio.to_thread(self.backend.load, str(self.base_dir))
        if hasattr(self.backend, "own_forward"):  # the torch backend: which model it trains
            _log.info("model loaded", forward="the engine's own pass" if self.backend.own_forward else
                      f"transformers ({self.backend.transformers_because})")
        position = Position()
        checkpoint = self.latest_checkpoint()
        if checkpoint is not None:
            extra = await asyncio.to_thread(self.backend.load_checkpoint, str(checkpoint))
            position = Position(step=extra["step"], version=extra["version"], data_position=extra["data_position"],
                                discarded_groups=extra.get("discarded_groups", 0))
            acked = await self.store.ack_completed(list(extra.get("used_entries", [])))
            _log.info("resumed", checkpoint=str(checkpoint), step=position.step, acked_entries=acked)
        return position

    async def _create(self, on_warmup: Callable[[str], Any]) -> None:
        if self.config.model.source == "path":
            await asyncio.to_thread(shutil.copytree, self.config.model.path, self.base_dir, dirs_exist_ok=True)
            return
        workload = build_workload(self.config.workload)
        staging = self.base_dir.with_name("base.partial")
        shutil.rmtree(staging, ignore_errors=True)
        root = model_cache.cache_root()
        recipe = await asyncio.to_thread(warm_model_recipe, self.config, workload) if root is not None else {}
        warm = self.config.trainer.warmup
        loop = asyncio.get_running_loop()

        def progress(step: int, loss: float) -> None:
            if self.stopping.is_set():
                raise InterruptedError("warm start interrupted by shutdown; it restarts from scratch next time")
            if step % 20 == 0 or step == warm.steps:
                asyncio.run_coroutine_threadsafe(on_warmup(f"{step}/{warm.steps} loss {loss:.3f}"), loop)

        def build(directory: pathlib.Path) -> None:
            asyncio.run_coroutine_threadsafe(on_warmup("creating the tiny model and its tokenizer"), loop)
            metrics = build_warm_model(self.config, workload, directory, progress)
            _log.info("warm start done", **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})

        reused = await asyncio.to_thread(model_cache.cached_model, root, recipe, staging, build)
        if reused:
            _log.info("warm-started model reused", cache=str(root / "models" / model_cache.model_key(recipe)))
            await on_warmup("reused the warm-started model from the cache")
        staging.rename(self.base_dir)

    async def checkpoint(self, position: Position) -> pathlib.Path:
        """Save, then ack the stream entries the saved steps used, then forget older checkpoints."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        path = self.checkpoints / f"step{position.step}.pt"
        extra = {"step": position.step, "version": position.version, "data_position": position.data_position,
                 "discarded_groups": position.discarded_groups, "used_entries": list(position.used_entries)}
        await asyncio.to_thread(self.backend.save_checkpoint, str(path), extra)
        await self.store.ack_completed(list(position.used_entries))
        position.used_entries.clear()
        await self.store.set_trainer_progress({"step": position.step, "version": position.version,
                                               "data_position": position.data_position, "checkpoint_path": str(path)})
        for old in self.checkpoints.glob("step*.pt"):
            match = CHECKPOINT_RE.match(old.name)
            if match and int(match.group(1)) < position.step:
                old.unlink(missing_ok=True)
        return path
