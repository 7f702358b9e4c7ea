"""The device-to-device path of the side channel: a private two-rank group per hybrid replica.

Owns: choosing a hybrid's channel (TCP only, or a pair group over NCCL or gloo), building that
group, moving one tensor at a time over it with a deadline, and tearing it down. Must not know:
frames, models, membership, Redis.

The pair group is built like the weights group (libra/weights/group.py), by the same helper
(libra/process_group.py): its own TCPStore (hosted by the core rank on a free port) and a
standalone `ProcessGroupNCCL` (GPUs) or `ProcessGroupGloo` (CPU), never `init_process_group`, so
the core's own process group is never created, rebuilt or used for a hybrid. It lives exactly as
long as the hybrid's connection: built when the hybrid says hello, aborted when it leaves, fails
or dies (ARCHITECTURE.md §7: membership changes never rebuild a group anyone else is in).

    hybrid (rank 1)                                 core rank r: the link's reader thread (rank 0)
    hello{device, device_uuid, channels}   ──▶      choose_backend(): None → TCP only (nothing sent)
                                                    "nccl" | "gloo" → TCPStore on a free port
      ◀── channel{backend, port, timeout_s}         (the first frame the hybrid receives)
    PairGroup(rank 1) ◀── rendezvous, warm-up broadcast (NCCL: communicator init) ──▶ PairGroup(rank 0)

    then every tensor frame: its header on TCP (via "group", dtype, shape) and its bytes as one
    broadcast rooted at the sender. Both ends issue these in frame order: one writer at a time
    per end, and the directions alternate (catch_up… → active → step → grad → reduced → step …),
    so the two ranks' collectives always match.

Deadlines: an operation is polled (`Work.is_completed`) against a deadline on the host, and the
caller's CUDA stream never waits for the peer (the broadcast runs behind a side stream), so a dead
or stalled peer costs the caller at most the deadline. Then the group is broken for good and
aborted in a background thread; the caller fails the hybrid (a later join builds a new group).
NCCL groups are built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, never tear
the process down): a hybrid's death must not kill the core.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from typing import Any, Callable

from libra import log as liblog
from libra import process_group

_log = liblog.get("libra.trainer.elastic")
MODES = ("auto", "tcp", "group")
_ENV_LOCK = threading.Lock()


class ChannelError(ConnectionError):
    """The pair group failed or is broken: the hybrid is lost (callers treat it as a closed link)."""


class ChannelTimeout(ChannelError):
    """An operation on the pair group did not finish before its deadline."""


def device_info(device: Any) -> dict[str, str]:
    """What a hybrid says about its device in its hello (the core picks the backend from it)."""
    import torch

    device = torch.device(device)
    info = {"device": device.type, "device_uuid": ""}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        info["device_uuid"] = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return info


def choose_backend(mode: str, core: dict[str, str], hello: dict[str, Any]) -> str | None:
    """The pair group's backend for a hybrid, or None for TCP only (pure).

    auto: NCCL when both ends are on (different) GPUs, else TCP. group: NCCL when both are on
    different GPUs, else gloo (CUDA tensors staged through host memory). tcp: always TCP. A hybrid
    that does not offer "group" (an older build) gets TCP whatever the mode. `core`: the core
    rank's `device_info`; `hello`: the hybrid's hello header.
    """
    if mode not in MODES:
        raise ValueError(f"side channel mode must be one of {MODES}, got {mode!r}")
    if mode == "tcp" or "group" not in hello.get("channels", ()):
        return None
    gpus = core["device"] == "cuda" and hello.get("device") == "cuda"
    same_gpu = gpus and bool(core["device_uuid"]) and core["device_uuid"] == hello.get("device_uuid")
    if gpus and not same_gpu:  # NCCL refuses two ranks on one GPU
        return "nccl"
    return "gloo" if mode == "group" else None


def host_store(host: str, timeout_s: float) -> Any:
    """The core's end of a pair's rendezvous: a TCPStore on a free port (`.port` says which)."""
    return process_group.open_store(host, 0, True, timeout_s, world_size=2)


def join_store(host: str, port: int, timeout_s: float) -> Any:
    return process_group.open_store(host, port, False, timeout_s, world_size=2)


def open_core_end(mode: str, core_device: Any, hello: dict[str, Any], host: str, timeout_s: float,
                  send: Callable[[str, dict[str, Any]], bool]) -> "PairGroup | None":
    """The core rank's end: pick the channel; for a group, host its store, tell the hybrid with
    `send("channel", …)` (its first frame) and build rank 0. None: TCP only (nothing is sent)."""
    backend = None if mode == "tcp" else choose_backend(mode, device_info(core_device), hello)
    if backend is None:
        return None
    try:
        store = host_store(host, timeout_s)
        if not send("channel", {"backend": backend, "port": store.port, "timeout_s": timeout_s}):
            raise ChannelError("the hybrid's connection closed before its pair group was set up")
        group = PairGroup(store, 0, backend, core_device, timeout_s)
    except RuntimeError as error:  # the store or the rendezvous timed out, NCCL init failed
        raise ChannelError(f"pair group ({backend}) setup failed: {error}") from error
    _log.info("pair group open", replica=hello.get("replica_id"), backend=backend, device=str(core_device))
    return group


def open_hybrid_end(channel: dict[str, Any], core_host: str, device: Any) -> "PairGroup":
    """The hybrid's end, from the core's `channel` frame (the store is on the core's host)."""
    try:
        store = join_store(core_host, channel["port"], channel["timeout_s"])
        return PairGroup(store, 1, channel["backend"], device, channel["timeout_s"])
    except RuntimeError as error:
        raise ChannelError(f"pair group ({channel.get('backend')}) setup failed: {error}") from error


def model_device(model: Any) -> Any:
    """Where a model's parameters live (the core's end of a pair group goes there)."""
    import torch

    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


@contextlib.contextmanager
def _cleanup_only_on_error():
    """ProcessGroupNCCL reads its error-handling mode from the environment when it is built."""
    with _ENV_LOCK:
        saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # CleanUpOnly: abort the comm, keep the process
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved


class Pending:
    """A receive in flight: the tensor it fills and its Work."""

    def __init__(self, group: "PairGroup", work: Any, tensor: Any):
        self.group, self.work, self.tensor = group, work, tensor

    def result(self, deadline: float) -> Any:
        """The received tensor once complete; ChannelTimeout after `deadline` (time.monotonic)."""
        self.group._finish(self.work, deadline, "receive")
        if self.tensor.device.type == "cuda":
            import torch

            # Written behind the side stream, read on the caller's: the allocator must not hand the
            # memory out again before the caller's stream is done with it.
            self.tensor.record_stream(torch.cuda.current_stream(self.tensor.device))
        return self.tensor


class PairGroup:
    """One end of a hybrid's pair group (rank 0: the core rank, rank 1: the hybrid)."""

    def __init__(self, store: Any, rank: int, backend: str, device: Any, timeout_s: float):
        import torch

        if backend not in ("nccl", "gloo") or rank not in (0, 1):
            raise ValueError(f"pair group: backend nccl|gloo and rank 0|1, got {backend!r}, {rank}")
        self.rank, self.backend, self.timeout_s = rank, backend, float(timeout_s)
        self.device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        self.store = store  # kept as long as the group: NCCL may use it until the group is gone
        self.broken: str | None = None
        self._aborting: threading.Thread | None = None
        self._close_lock = threading.Lock()
        # Backstop only: every operation is waited for against its own deadline, and aborted first.
        with _cleanup_only_on_error() if backend == "nccl" else contextlib.nullcontext():
            self.group = process_group.build_group(store, "libra-lane/pg", rank, 2, backend, self.device,
                                                   2 * self.timeout_s + 60)
        self.stream = torch.cuda.Stream(self.device) if backend == "nccl" else None
        with self._side():
            work = self._broadcast(torch.zeros(1, device=self.device), root=0)
        self._finish(work, time.monotonic() + self.timeout_s, "warm-up")

    @property
    def description(self) -> str:
        return f"group/{self.backend}"

    # -- one tensor each way ---------------------------------------------------------------------
    def send(self, tensor: Any, ready: Any = None) -> None:
        """Send `tensor` to the peer; returns once the peer has it (ChannelError otherwise).

        `ready`: a CUDA event recorded after `tensor` was produced (the broadcast waits for it on
        a side stream, never the caller's stream on the peer).
        """
        deadline = time.monotonic() + self.timeout_s
        self._check()
        if self.backend == "nccl":
            with self._side():
                if ready is not None:
                    self.stream.wait_event(ready)
                work = self._broadcast(tensor, root=self.rank)
        else:
            if ready is not None:
                ready.synchronize()
            work = self._broadcast(tensor.to("cpu").contiguous(), root=self.rank)
        self._finish(work, deadline, "send")

    def start_recv(self, shape: list[int], dtype: str) -> Pending:
        """Post the receive of the peer's next tensor (on this group's device); `Pending.result` waits."""
        import torch

        self._check()
        with self._side():
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            return Pending(self, self._broadcast(tensor, root=1 - self.rank), tensor)

    def recv(self, shape: list[int], dtype: str) -> Any:
        return self.start_recv(shape, dtype).result(time.monotonic() + self.timeout_s)

    # -- plumbing ----------------------------------------------------------------------------------
    def _side(self) -> Any:
        """On NCCL: this group's device and side stream (the broadcast waits on it, not on the
        caller's stream); a no-op on gloo."""
        if self.stream is None:
            return contextlib.nullcontext()
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def _broadcast(self, tensor: Any, root: int) -> Any:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        group = self.group
        if group is None:
            raise ChannelError(f"pair group ({self.backend}) is closed")
        try:
            return group.broadcast([tensor], options)
        except RuntimeError as error:  # a broken transport fails at issue on gloo
            self._break(f"broadcast failed: {error}")
            raise ChannelError(f"pair group ({self.backend}): {error}") from error

    def _finish(self, work: Any, deadline: float, what: str) -> None:
        pause = 1e-5
        try:
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise ChannelTimeout(f"pair group ({self.backend}): {what} did not finish within "
                                         f"{self.timeout_s:g} s")
                time.sleep(pause)  # short at first: a transfer over NVLink takes milliseconds
                pause = min(2 * pause, 1e-3)
            work.wait()  # complete: raises the failure, if any, and blocks nothing
        except ChannelTimeout as error:
            self._break(str(error))
            raise
        except RuntimeError as error:  # DistBackendError, gloo's "connection closed", an aborted comm
            self._break(f"{what} failed: {error}")
            raise ChannelError(f"pair group ({self.backend}): {what} failed: {error}") from error

    def _check(self) -> None:
        if self.broken:
            raise ChannelError(f"pair group ({self.backend}) is broken: {self.broken}")

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            _log.warning("pair group broken", backend=self.backend, rank=self.rank, reason=reason)
        self.close()

    def close(self, wait_s: float = 0.0) -> None:
        """Abort the group in a background thread, waiting for it at most `wait_s` (the core: 0, its
        step never waits; a hybrid about to exit: a few seconds, so it does not exit mid-abort)."""
        with self._close_lock:
            if self._aborting is None:
                self.broken = self.broken or "closed"
                # The last reference goes with the thread: gloo's connections close when the group
                # is destroyed, and the peer's operations fail at once.
                group, self.group = self.group, None
                self._aborting = threading.Thread(target=lambda: _abort(group, self.backend),
                                                  name=f"pair-abort-{self.backend}", daemon=True)
                self._aborting.start()
        self._aborting.join(wait_s)


def _abort(group: Any, backend: str) -> None:
    try:
        getattr(group, "abort", lambda: None)()
    except RuntimeError as error:  # already aborted by its watchdog
        _log.info("pair group abort", backend=backend, error=str(error))
