"""Asynchronous sharded snapshots of a core rank's model and optimizer, for joining hybrids.

Owns: the copy taken at a step boundary, writing it as shards in a background thread while the
core keeps stepping, and loading it into a hybrid's model and optimizer. Must not know: sockets,
membership, Redis, or what a backend's state is made of (`backends.capture_state` / `load_state`:
torch model + AdamW state dicts, or Megatron's model tensors + per-parameter Adam state).

    step s ends ─▶ capture(): clone of parameters + optimizer state (on their device; one copy)
                    └─▶ writer thread: shard-0.pt … shard-{k-1}.pt, then snapshot.json (last =
                        complete) ─▶ on_done(path) / on_error(reason)
    step s+1, s+2 … run meanwhile on the live tensors (the copy is private to the writer)

Layout of a snapshot directory: `shard-{i}.pt` (torch.save of {"model": {name: tensor},
"optimizer": {param index: {state}}}; parameters assigned round-robin by size) and `snapshot.json`
({"step", "shards", "param_groups", "extra", and `backends.prepare_meta`: "backend", "model_dir",
"config", "layout"}). `snapshot.json` is written last and atomically, so a reader never sees half
a snapshot. Loading uses weights_only=True.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Callable

MANIFEST = "snapshot.json"


@dataclass
class Captured:
    step: int
    model: dict[str, Any]  # name -> tensor (a private copy)
    optimizer_state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    extra: dict[str, Any]  # backend-specific (JSON), e.g. Megatron's parameter names and Adam step


def capture(backend: Any, step: int) -> Captured:
    """Copy model and optimizer state at a step boundary (the only part that blocks the core).

    The copy stays on the tensors' device (on a GPU a device-to-device copy, milliseconds); the
    writer thread moves it to the host, off the core's path.
    """
    from libra.services.trainer.elastic.backends import capture_state

    return Captured(step, *capture_state(backend))


def _assign_shards(captured: Captured, shards: int) -> list[dict[str, Any]]:
    """Round-robin by decreasing size so shards are about equal (parameter i ↔ optimizer state i)."""
    out: list[dict[str, Any]] = [{"model": {}, "optimizer": {}} for _ in range(shards)]
    sizes = [0] * shards
    for name in sorted(captured.model, key=lambda n: -captured.model[n].numel()):
        target = min(range(shards), key=lambda i: sizes[i])
        out[target]["model"][name] = captured.model[name]
        sizes[target] += captured.model[name].numel()
    for index in sorted(captured.optimizer_state):
        out[index % shards]["optimizer"][index] = captured.optimizer_state[index]
    return out


def write(captured: Captured, directory: str, shards: int, meta: dict[str, Any],
          after_shard: Callable[[int], None] | None = None) -> str:
    """Write the shards, then the manifest; returns the directory. Blocking (run it in a thread)."""
    import torch

    os.makedirs(directory, exist_ok=True)
    names = []
    for index, shard in enumerate(_assign_shards(captured, max(1, shards))):
        name = f"shard-{index}.pt"
        torch.save(_on_host(shard), os.path.join(directory, name))
        names.append(name)
        if after_shard is not None:
            after_shard(index)
    body = {"step": captured.step, "shards": names, "param_groups": captured.param_groups,
            "extra": captured.extra, **meta}
    staging = os.path.join(directory, MANIFEST + ".tmp")
    with open(staging, "w") as handle:
        json.dump(body, handle)
    os.replace(staging, os.path.join(directory, MANIFEST))
    return directory


def _on_host(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    return value.to("cpu") if hasattr(value, "to") else value


def write_async(captured: Captured, directory: str, shards: int, meta: dict[str, Any],
                on_done: Callable[[str], None], on_error: Callable[[str], None],
                after_shard: Callable[[int], None] | None = None) -> threading.Thread:
    """`write` in a daemon thread; exactly one of on_done(path) / on_error(reason) is called."""

    def run() -> None:
        try:
            path = write(captured, directory, shards, meta, after_shard)
        except Exception as error:  # noqa: BLE001 - reported to the join, which rolls back
            shutil.rmtree(directory, ignore_errors=True)
            on_error(f"snapshot write failed: {type(error).__name__}: {error}")
            return
        on_done(path)

    thread = threading.Thread(target=run, name=f"snapshot-{os.path.basename(directory)}", daemon=True)
    thread.start()
    return thread


def read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"snapshot {directory!r} is incomplete: no {MANIFEST}")
    with open(path) as handle:
        return json.load(handle)


def load(directory: str, backend: Any) -> int:
    """Load a snapshot into `backend`'s model and optimizer (same kind and architecture); its step."""
    import torch

    from libra.services.trainer.elastic.backends import kind_of, load_state

    meta = read_meta(directory)
    if meta.get("backend", "torch") != kind_of(backend):
        raise ValueError(f"snapshot {directory!r} holds a {meta.get('backend', 'torch')} backend's state, "
                         f"not a {kind_of(backend)} one")
    model_state: dict[str, Any] = {}
    optimizer_state: dict[int, Any] = {}
    for name in meta["shards"]:
        shard = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
        model_state.update(shard["model"])
        optimizer_state.update({int(k): v for k, v in shard["optimizer"].items()})
    load_state(backend, model_state, optimizer_state, meta["param_groups"], meta.get("extra", {}))
    return int(meta["step"])
