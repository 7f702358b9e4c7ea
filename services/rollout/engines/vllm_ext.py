"""Libra's extension of the vLLM worker: in-place weight reload from a safetensors directory or
from the weights group (NCCL on GPUs, gloo on CPU; see libra/weights/group.py).

vLLM mixes this class into its worker class when the server is started with
`--worker-extension-cls libra.services.rollout.engines.vllm_ext.LibraWorkerExtension` (see
`vllm/v1/worker/worker_base.py`: the class is appended to the worker's bases, and a name that
clashes with a worker attribute is an assertion error, hence the `libra_` prefix). Its methods
run in the worker process and are reached from outside through the engine's `collective_rpc`,
which the OpenAI server exposes as `POST /collective_rpc` when `VLLM_SERVER_DEV_MODE=1`:

    gateway ──HTTP──▶ api server ──zmq──▶ engine core ──mq──▶ worker.libra_load_weights(path, v)
                                          (between two scheduler steps)

The engine core runs a utility call between two scheduler steps, and `EngineClient` calls these
methods with the scheduler paused by vLLM's own RL pause (`/pause?mode=keep&clear_cache=true`):
the running requests are kept but preempted, every KV block is freed and the prefix cache emptied,
so after `/resume` they recompute their KV under the new weights. No request is drained, and no
token is sampled attending to KV of another version; the engine core labels each token with the
version (`/update_weight_version`, set by the client once every rank holds it).

Why not `model.load_weights` alone: on CPU, vLLM repacks linear weights for oneDNN after loading
(`dispatch_cpu_unquantized_gemm` with `remove_weight=True` leaves `layer.weight` empty and keeps
the packed copy in a closure). vLLM's layer-wise reload (`Worker.reload_weights` with a weights
iterator) restores the checkpoint layout, calls the model's `load_weights`, and runs the
post-load processing again, so it is right on CPU and GPU alike, but for one layer: a *tied*
`lm_head` (tie_word_embeddings, as the quickstart's model) receives no tensor of its own, so its
post-load processing is not run again, and on CPU its packed copy kept the first weights' embedding
while the embedding itself changed (every version after the first sampled through a stale output
head: behaviour log-probs off by 1e-3 to 1e-2). `_repack_tied_head` runs it again after each reload.

Runs in: the vLLM worker process (each TP rank of a worker). This module must not know about
HTTP, Redis or the gateway; it only imports what the worker has.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any, Iterator

# Env var through which the launcher tells a fresh worker which policy version it starts with.
INITIAL_VERSION_ENV = "LIBRA_POLICY_VERSION"


def safetensors_files(path: str | Path) -> list[Path]:
    """The `*.safetensors` files of a weight directory, checked to be readable, in name order."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"weight directory {directory} does not exist")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    for file in files:  # parse every header before the model is touched
        with safe_open(str(file), framework="pt") as handle:
            if not list(handle.keys()):
                raise ValueError(f"{file} holds no tensors")
    return files


def iterate_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, tensor) from each file, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _repack_tied_head(model: Any) -> bool:
    """Run the post-load processing of an `lm_head` tied to the input embedding again, from the
    reloaded (shared) weight; True when the head is tied. On GPU it is a no-op for unquantized
    heads; on CPU it rebuilds the packed oneDNN copy the logits are computed with."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if method is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    method.process_weights_after_loading(head)
    return True


def _check_version(version: int | str) -> int:
    value = int(version)
    if value < 0:
        raise ValueError(f"policy version must be >= 0, got {value}")
    return value


class LibraWorkerExtension:
    """Methods mixed into vLLM's worker; call them by name through `collective_rpc`."""

    def libra_load_weights(self, path: str, version: int | str) -> dict[str, Any]:
        """Load the weight set in directory `path` into the running model as `version`.

        Returns {"version", "seconds", "tensors"}, or {"error": message} when the weight set is
        unusable (no directory, no or unreadable files, bad version): those are found before any
        layer is touched, so the loaded weights stay as they were, and answering (rather than
        raising) keeps the server from turning a caller's mistake into a 500. A failure during
        the reload itself raises. Arguments may arrive as strings (the dev server passes JSON
        values through as they are).
        """
        from safetensors import SafetensorError

        started = time.perf_counter()
        try:
            version = _check_version(version)
            files = safetensors_files(path)
        except (OSError, ValueError, SafetensorError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        counted: list[str] = []

        def tensors() -> Iterator[tuple[str, Any]]:
            for name, tensor in iterate_tensors(files):
                counted.append(name)
                yield name, tensor

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        _repack_tied_head(self.model_runner.get_model())  # type: ignore[attr-defined]
        self.libra_version = version
        return {"version": version, "seconds": time.perf_counter() - started,
                "tensors": len(counted)}

    def libra_join_weights_group(self, host: str, port: int | str, first_rank: int | str, world_size: int | str,
                                 backend: str, timeout_s: float | str, bucket_mb: int | str,
                                 generation: int | str = 0) -> dict[str, Any]:
        """Join generation `generation` of the weights group as rank `first_rank` + this worker's TP
        rank, closing the generation it was in (libra/weights/group.py).

        Blocks until every rank has joined, so the trainer (rank 0) joins at the same time.
        """
        from libra.weights.group import join_generation

        rank = int(first_rank) + int(getattr(self, "rank", 0))
        previous, self.libra_group = getattr(self, "libra_group", None), None
        self.libra_group = join_generation(previous, host, port, rank, world_size, backend,
                                           str(getattr(self, "device", "cpu")), timeout_s, bucket_mb, generation)
        return {"rank": rank, "world_size": int(world_size), "backend": backend, "generation": int(generation)}

    def libra_leave_weights_group(self) -> dict[str, Any]:
        """Close this worker's generation of the weights group (it is no longer in the roster)."""
        group, self.libra_group = getattr(self, "libra_group", None), None
        if group is not None:
            group.close()
        return {"left": group is not None}

    def libra_receive_weights(self, version: int | str) -> dict[str, Any]:
        """Receive `version` from the weights group and load it like a weight directory.

        Every TP rank receives the whole set (HF names) and vLLM's layer-wise reload picks its
        shard. A version the sender aborted (a rank missing) answers {"error"} with the weights
        untouched; a failure mid-transfer raises (the gateway loads the version from disk instead, and
        marks the worker unhealthy if that fails too).
        """
        from libra.errors import FailedPrecondition
        from libra.weights.group import WeightSyncError

        group = getattr(self, "libra_group", None)
        if group is None:
            return {"error": "FailedPrecondition: this worker has not joined a weights group"}
        started = time.perf_counter()
        version = _check_version(version)
        stream = group.receive(version)
        try:
            first = next(stream)
        except (WeightSyncError, FailedPrecondition) as error:  # aborted or closed before any byte moved
            return {"error": f"{type(error).__name__}: {error}"}
        counted: list[str] = []

        def tensors() -> Iterator[tuple[str, Any]]:
            for name, tensor in itertools.chain([first], stream):
                counted.append(name)
                yield name, tensor

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        _repack_tied_head(self.model_runner.get_model())  # type: ignore[attr-defined]
        self.libra_version = version
        return {"version": version, "seconds": time.perf_counter() - started, "tensors": len(counted)}

    def libra_policy_version(self) -> int:
        """The policy version of the weights this worker holds now."""
        if not hasattr(self, "libra_version"):
            self.libra_version = int(os.environ.get(INITIAL_VERSION_ENV, "0"))
        return self.libra_version
