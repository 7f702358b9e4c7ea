"""Weight loads of the transformers engine (`hf_engine.HFEngine`): a new policy version into the model.

The counterpart of `vllm_ext.LibraWorkerExtension` for the hf engine, and mixed in the same way:
`HFEngine` takes these methods from `HFWeightLoads`, and `hf_server` reaches them through the same
`/collective_rpc` method names. Three sources: a safetensors directory on disk (every name and shape
checked before the model is touched, so a bad directory leaves the weights alone), the weights
group (libra/weights/group.py: broadcast straight into the parameters; hf_server joins and leaves its
generations), and the trainer's export buffers on this GPU (weights: colocated, libra/weights/ipc.py:
the parameters become views of the buffer — share — or take one device copy of it — copy). A load
that fails half-way marks the engine `dirty` (its /health then answers 503) instead of serving
mixed weights.

The loads run in the engine's decode thread between two steps (hf_server hands them over as
control jobs); joining the group does not touch the model and runs outside it. A load that changed
the weights has the engine recompute its running requests' KV cache (`refresh_kv`) before the next
step, so no token is sampled attending to KV of another version.

Runs in: the hf engine process. This module must not know about HTTP, batching or sampling.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from libra import log as liblog
from libra.weights.flat import FlatWeights

_log = liblog.get("libra.rollout.hf_weights")


class HFWeightLoads:
    """Weight loads, mixed into `HFEngine`; it provides `model`, `device`, `version`, `dirty`,
    `weights_group` and `refresh_kv`."""

    model: Any
    device: Any
    version: int
    dirty: str | None
    weights_group: Any
    flat_weights: FlatWeights | None = None  # the parameters, once laid out as the weights group's stream
    flat_refused: bool = False  # laying them out ran out of memory once: not tried again
    shared_weights: bool = False  # the parameters are views of the trainer's buffer (weights: colocated, share)
    _colocated_streams: dict[tuple[str, int, int], Any]  # the trainer's buffers this engine opened (_buffer_key)
    refresh_kv: Callable[[], None]  # HFEngine's: recompute the running requests' KV cache under these weights

    def _swapped(self, route: str, version: int, started: float, **extra: Any) -> dict[str, Any]:
        """After new weights are in: the running rows' KV recomputed; the answer, with where the time
        went (the weights themselves, then the KV refresh), also logged once per version."""
        loaded = time.perf_counter()
        self.refresh_kv()
        done = time.perf_counter()
        timing = {"seconds": done - started, "load_s": loaded - started, "refresh_s": done - loaded}
        _log.info("weights swapped", route=route, version=version, **{k: round(v, 4) for k, v in timing.items()})
        return {"version": version, **timing, **extra}

    def label_weights(self, version: int | str) -> dict[str, Any]:
        """Label the weights `version` without loading any (vLLM's /update_weight_version): the
        tokens sampled from now on carry it."""
        self.version = _check_version(version)
        return {"version": self.version}

    def load_from_disk(self, path: str, version: int) -> dict[str, Any]:
        """Load the safetensors directory `path` as `version`; {"error"} leaves the weights alone."""
        import torch
        from safetensors import SafetensorError, safe_open

        from libra.services.rollout.engines.vllm_ext import safetensors_files
        from libra.weights.experts import target  # a MoE checkpoint's per-expert tensors: slices of fused ones

        started = time.perf_counter()
        try:
            version = _check_version(version)
            files = safetensors_files(path)
            state = self.model.state_dict()
            for file in files:  # check every name and shape before the model is touched
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():
                        shape = tuple(handle.get_slice(name).get_shape())
                        into = target(state, name)
                        if into is None or tuple(into.shape) != shape:
                            raise ValueError(f"{file.name}: tensor {name} {list(shape)} does not fit this model")
        except (OSError, ValueError, SafetensorError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        self.own_weights()  # never write a disk version into the trainer's shared buffer
        count = 0
        with torch.no_grad():
            for file in files:
                with safe_open(str(file), framework="pt", device=str(self.device)) as handle:
                    for name in handle.keys():
                        target(state, name).copy_(handle.get_tensor(name))
                        count += 1
        self.version = version
        self.dirty = None  # a complete weight set: consistent again after a half-received version
        return self._swapped("disk", version, started, tensors=count)

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
        layout = self.weights_group.last_layout
        in_place = flat is not None and flat.fits(layout)
        answer = self._swapped("group", version, started, tensors=count, in_place=in_place)
        if not in_place and not self.flat_refused:
            # Lay the parameters out as the trainer's byte stream: later versions then land in them
            # with no unpack copy (libra/weights/flat.py). Same parameter objects; one copy, once.
            try:
                self.flat_weights = FlatWeights.adopt(params, layout)
            except torch.OutOfMemoryError as error:  # nothing moved (the buffer comes first): stay as is
                self.flat_weights, self.flat_refused = None, True
                _log.warning("parameters stay unflattened: no memory for a second copy", error=str(error)[:200])
        return answer

    # ---- weights: colocated (the trainer's export buffers on this GPU) ------------------------------
    def receive_colocated(self, descriptor: str, version: int) -> dict[str, Any]:
        """Take `version` from the trainer's export buffer that `descriptor` (libra/weights/ipc.py)
        names: share — every parameter becomes a view of it (no copy; the engine's own copy is
        freed); copy — one device copy into the parameters (laid out as the buffer once). Every name,
        shape and dtype is checked first: {"error"} leaves the weights alone."""
        import torch

        from libra.weights import ipc

        started = time.perf_counter()
        try:
            version = _check_version(version)
            sent, mode, slot, layout, handles = ipc.parse(descriptor)
            if sent != version:
                raise ValueError(f"the descriptor is of version {sent}, not {version}")
            if self.device.type != "cuda":
                raise ValueError(f"{ipc.NEEDS}; this engine runs on {self.device}")
            params = dict(self.model.named_parameters())
            expected = {s.name: (tuple(s.shape), s.dtype) for s in layout.slots}
            held = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params.items()}
            if expected != held:
                wrong = sorted(set(expected.items()) ^ set(held.items()))[:5]
                raise ValueError(f"the trainer's tensors do not fit this model (name, shape, dtype): {wrong}")
            stream = self._colocated_stream(handles[slot])
        except (ValueError, RuntimeError) as error:  # RuntimeError: the CUDA IPC handle did not open
            # Still serving the previous version: never from a buffer the trainer writes the next one into.
            self.own_weights()
            return {"error": f"{type(error).__name__}: {error}"}
        with torch.no_grad():
            if mode == "share":
                for name, view in ipc.views(stream, layout).items():
                    params[name].data = view
                self.shared_weights = True
            else:
                self.own_weights()
                if (self.flat_weights is None or not self.flat_weights.fits(layout)) and not self.flat_refused:
                    try:  # laid out as the buffer once: every later version is one memcpy
                        self.flat_weights = FlatWeights.adopt(params, layout)
                    except torch.OutOfMemoryError:  # nothing moved: tensor by tensor from now on
                        self.flat_weights, self.flat_refused = None, True
                if self.flat_weights is not None and self.flat_weights.fits(layout):
                    self.flat_weights.stream.copy_(stream)
                else:  # not laid out as the buffer (it could not be): tensor by tensor
                    for name, view in ipc.views(stream, layout).items():
                        params[name].copy_(view)
        torch.cuda.synchronize(self.device)  # done with the buffer before the trainer hears back
        keys = {_buffer_key(h) for h in handles}  # forgets (closes) a restarted trainer's buffers
        self._colocated_streams = {k: s for k, s in self._colocated_streams.items() if k in keys}
        self.version, self.dirty = version, None
        return self._swapped("colocated", version, started, tensors=len(params), mode=mode)

    def _colocated_stream(self, handle: dict[str, Any]) -> Any:
        """The trainer's buffer behind `handle`, opened once and kept (each open maps it again)."""
        from libra.weights import ipc

        streams = self.__dict__.setdefault("_colocated_streams", {})
        key = _buffer_key(handle)
        if key not in streams:
            streams[key] = ipc.open_handle(handle)
        return streams[key]


    def own_weights(self) -> None:
        """Parameters that are views of the trainer's buffer (share) get memory of their own again."""
        if not getattr(self, "shared_weights", False):
            return
        import torch

        with torch.no_grad():
            for param in self.model.parameters():
                param.data = param.data.clone()
        self.shared_weights = False


def _check_version(version: int | str) -> int:
    value = int(version)
    if value < 0:
        raise ValueError(f"policy version must be >= 0, got {value}")
    return value


def _buffer_key(handle: dict[str, Any]) -> tuple[str, int, int]:
    """What tells two export buffers apart: the CUDA IPC handle names the allocator's whole segment,
    and the caching allocator may put both buffers in one segment (seen on an H200: the second
    version's buffer opened as the first's), so the offsets into it belong to the key."""
    return handle["handle"], handle["storage_offset"], handle["offset"]
