"""Weight loads of the transformers engine (`hf_engine.HFEngine`): a new policy version into the model.

The counterpart of `vllm_ext.LibraWorkerExtension` for the hf engine, and mixed in the same way:
`HFEngine` takes these methods from `HFWeightLoads`, and `hf_server` reaches them through the same
`/collective_rpc` method names. Two sources: a safetensors directory on disk (every name and shape
checked before the model is touched, so a bad directory leaves the weights alone) and the weights
group (libra/weights/group.py: broadcast straight into the parameters; hf_server joins and leaves its
generations). A load that fails half-way marks
the engine `dirty` (its /health then answers 503) instead of serving mixed weights.

The loads run in the engine's decode thread between two steps (hf_server hands them over as
control jobs); joining the group does not touch the model and runs outside it. Runs in: the hf
engine process. This module must not know about HTTP, batching or sampling.
"""

from __future__ import annotations

import time
from typing import Any

from libra import log as liblog
from libra.weights.flat import FlatWeights

_log = liblog.get("libra.rollout.hf_weights")


class HFWeightLoads:
    """Weight loads, mixed into `HFEngine`; it provides `model`, `device`, `version`, `dirty` and
    `weights_group`."""

    model: Any
    device: Any
    version: int
    dirty: str | None
    weights_group: Any
    flat_weights: FlatWeights | None = None  # the parameters, once laid out as the weights group's stream
    flat_refused: bool = False  # laying them out ran out of memory once: not tried again

    def load_from_disk(self, path: str, version: int) -> dict[str, Any]:
        """Load the safetensors directory `path` as `version`; {"error"} leaves the weights alone."""
        import torch
        from safetensors import SafetensorError, safe_open

        from libra.services.rollout.engines.vllm_ext import safetensors_files

        started = time.perf_counter()
        try:
            version = _check_version(version)
            files = safetensors_files(path)
            state = self.model.state_dict()
            for file in files:  # check every name and shape before the model is touched
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        shape = tuple(handle.get_slice(name).get_shape())
                        if name not in state or tuple(state[name].shape) != shape:
                            raise ValueError(f"{file.name}: tensor {name} {list(shape)} does not fit this model")
        except (OSError, ValueError, SafetensorError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        count = 0
        with torch.no_grad():
            for file in files:
                with safe_open(str(file), framework="pt", device=str(self.device)) as handle:
                    for name in handle.keys():
                        state[name].copy_(handle.get_tensor(name))
                        count += 1
        self.version = version
        self.dirty = None  # a complete weight set: consistent again after a half-received version
        return {"version": version, "seconds": time.perf_counter() - started, "tensors": count}

    def receive_weights(self, version: int) -> dict[str, Any]:
        """Receive `version` from the weights group straight into the parameters."""
        import torch

        from libra.errors import FailedPrecondition
        from libra.weights.group import WeightSyncError

        if self.weights_group is None:
            return {"error": "FailedPrecondition: this engine has not joined a weights group"}
        version = _check_version(version)
        started = time.perf_counter()
        params = dict(self.model.named_parameters())
        flat = self.flat_weights
        count, misfits = 0, []
        try:
            with torch.no_grad():
                for name, tensor in self.weights_group.receive(version, targets=flat if flat is not None else params):
                    count += 1
                    if params.get(name) is not tensor:  # unknown name, or another shape/dtype
                        misfits.append(f"{name} {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
        except FailedPrecondition as error:  # a closed or already broken group: refused before any byte moved
            return {"error": f"FailedPrecondition: {error}"}
        except WeightSyncError as error:
            # Aborted by the sender before the transfer: nothing reached the model. A collective that
            # failed (the group is broken now) may have written part of a tensor: refuse to serve.
            if self.weights_group.broken or count:
                self.dirty = f"version {version} arrived partly: {error}"
            return {"error": f"WeightSyncError: {error}"}
        except Exception as error:  # noqa: BLE001 - half-loaded weights: refuse to serve from now on
            self.dirty = f"version {version} arrived partly: {type(error).__name__}: {error}"
            raise
        if misfits:
            self.dirty = f"version {version} does not fit this model: {misfits[:5]}"
            return {"error": f"ValueError: the trainer sent tensors this model cannot hold: {misfits[:5]}"}
        self.version = version
        seconds = time.perf_counter() - started
        layout = self.weights_group.last_layout
        in_place = flat is not None and flat.fits(layout)
        if not in_place and not self.flat_refused:
            # Lay the parameters out as the trainer's byte stream: later versions then land in them
            # with no unpack copy (libra/weights/flat.py). Same parameter objects; one copy, once.
            try:
                self.flat_weights = FlatWeights.adopt(params, layout)
            except torch.OutOfMemoryError as error:  # nothing moved (the buffer comes first): stay as is
                self.flat_weights, self.flat_refused = None, True
                _log.warning("parameters stay unflattened: no memory for a second copy", error=str(error)[:200])
        return {"version": version, "seconds": seconds, "tensors": count, "in_place": in_place}


def _check_version(version: int | str) -> int:
    value = int(version)
    if value < 0:
        raise ValueError(f"policy version must be >= 0, got {value}")
    return value
