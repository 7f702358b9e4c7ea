"""A hybrid replica: a whole data-parallel replica that trains beside the core over a side channel.

Owns: one model replica and its optimizer on a borrowed (rollout) device, the join (snapshot
load, catch-up replay) and the lockstep step loop. Must not know: Redis, membership rules, how
batches are assembled. Start it as documented in `libra.services.trainer.elastic`.

    connect + hello{device} ─▶ [channel{backend, port}: join the pair group the core opened]
        ─▶ prepare{backend, model_dir, config, layout}: build the core's backend kind (torch, or
           Megatron TP=PP=1 in a one-process world of its own), check the gradient layout, run
           throwaway steps (kernel compilation) ─▶ prepared
        ─▶ snapshot{path} (taken at the next boundary) ─▶ load shards ─▶ loaded{step}
        ─▶ catch_up{step}+gradient × n (replay: same gradient, clip, Adam step as the core did)
        ─▶ active ─▶ per step: step{slice, N/W} ─▶ backward ─▶ grad ─▶ reduced ─▶ clip + step
        ─▶ bye (exit 0) | error (exit 3 while joining, 4 once active) | connection lost (exit 4)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from libra import log as liblog

_log = liblog.get("libra.trainer.hybrid")
EXIT_RELEASED, EXIT_USAGE, EXIT_JOIN_FAILED, EXIT_LOST = 0, 2, 3, 4


class HybridReplica:
    """The replica's loop over frames; `on_step(step, backend)` lets tests observe lockstep."""

    def __init__(self, link: Any, replica_id: str, threads: int = 1, device: str = "cpu",
                 on_step: Callable[[int, Any], None] | None = None,
                 die_at_step: int | None = None):
        self.link, self.replica_id = link, replica_id
        self.threads, self.device = threads, device
        self.on_step, self.die_at_step = on_step, die_at_step
        self.backend: Any = None
        self.step = -1  # committed steps in this replica's state
        self.active = False

    def run(self) -> int:
        try:
            while True:
                frame = self.link.recv()
                code = self._handle(frame)
                if code is not None:
                    return code
        except (ConnectionError, OSError) as error:
            _log.warning("lost the core", replica=self.replica_id, step=self.step, error=str(error))
            return EXIT_LOST
        finally:
            self.link.close()

    def _handle(self, frame: Any) -> int | None:
        if frame.kind == "channel":
            return self._open_channel(frame.header)
        if frame.kind == "prepare":
            return self._prepare(frame.header)
        if frame.kind == "snapshot":
            return self._load(frame.header["path"])
        if frame.kind == "catch_up":
            self._apply(frame.tensor(), frame.header["config"], frame.header["step"], catch_up=True)
            return None
        if frame.kind == "active":
            self.active = True
            _log.info("active", replica=self.replica_id, from_step=frame.header["from_step"])
            return None
        if frame.kind == "step":
            self._train(frame)
            return None
        if frame.kind == "bye":
            _log.info("released", replica=self.replica_id, step=self.step)
            return EXIT_RELEASED
        if frame.kind == "error":
            _log.warning("removed by the core", replica=self.replica_id, reason=frame.header.get("reason"))
            return EXIT_LOST if self.active else EXIT_JOIN_FAILED
        raise ConnectionError(f"unexpected frame {frame.kind!r} from the core")

    def _open_channel(self, channel: dict[str, Any]) -> int | None:
        """Join the pair group the core opened for this link: gradients then go device to device."""
        from libra.services.trainer.elastic.device_channel import ChannelError

        started = time.perf_counter()
        try:
            self.link.open_group(channel)
        except ChannelError as error:
            return self._join_failed(f"cannot open the device channel: {error}")
        _log.info("device channel open", replica=self.replica_id, channel=self.link.channel,
                  seconds=round(time.perf_counter() - started, 3))
        return None

    def _build(self, meta: dict[str, Any]) -> Any:
        """The core's backend kind with the core's config (`backends.build`), its flat gradient laid
        out exactly as the core rank's; a layout that differs fails the join, naming the difference."""
        from libra.services.trainer.elastic import backends

        backend = backends.build(meta, self.threads, self.device)
        mismatch = backends.layout_mismatch(backends.gradient_layout(backend), meta.get("layout"))
        if mismatch:
            raise ValueError(mismatch)
        return backend

    def _prepare(self, meta: dict[str, Any]) -> int | None:
        """Build model and optimizer (architecture only) while the core writes the snapshot."""
        started = time.perf_counter()
        try:
            self._built = self._build(meta)
        except Exception as error:  # noqa: BLE001 - reported; the join rolls back
            return self._join_failed(f"cannot build the model from {meta.get('model_dir')!r}: "
                                     f"{type(error).__name__}: {error}")
        _log.info("model built", replica=self.replica_id, seconds=round(time.perf_counter() - started, 3))
        try:
            self._warm_up(self._built, meta)
        except Exception as error:  # noqa: BLE001 - a replica that cannot run a step must not join
            return self._join_failed(f"a warm-up step failed: {type(error).__name__}: {error}")
        self.link.send("prepared", {})
        return None

    def _warm_up(self, backend: Any, meta: dict[str, Any]) -> None:
        """Throwaway forward/backward passes (several shapes) before `prepared`: the first real step
        must not carry one-time costs the core then waits for — kernel compilation (Megatron's fused
        kernels are torch.compile'd: 10.1 s of the first active step on an H200 before this,
        docs/benchmarks.md), library handles, allocator growth. The core keeps training meanwhile and retains nothing yet (the
        snapshot boundary comes after `prepared`). The gradients are discarded: every step zeroes
        them first, and the catch-up sets them."""
        from libra.services.trainer.backend import TrainBatch, TrainSequence

        started = time.perf_counter()
        config = self._config(meta["config"])
        rows = max(1, config.micro_batch_size)
        # Full micro-batches at two widths, then fewer rows: torch.compile then compiles for dynamic
        # widths and row counts, as real slices vary in both (one shape would be recompiled at once).
        for count, length in ((rows, 24), (rows, 56), (max(2, rows // 2) if rows > 2 else rows, 40)):
            ids = [1 + i % 7 for i in range(length)]
            response = length - 8
            batch = TrainBatch([TrainSequence(ids, 8, [1] * response, [0.0] * response, 1.0)] * count)
            backend.accumulate_gradients(batch, config, token_count=float(response * count))
        _log.info("kernels warmed", replica=self.replica_id, seconds=round(time.perf_counter() - started, 3))

    def _join_failed(self, reason: str) -> int:
        _log.warning("join failed", replica=self.replica_id, reason=reason)
        self.link.send("join_failed", {"reason": reason})
        return EXIT_JOIN_FAILED

    def _load(self, path: str) -> int | None:
        from libra.services.trainer.elastic import snapshot as snap

        started = time.perf_counter()
        try:
            backend = getattr(self, "_built", None) or self._build(snap.read_meta(path))
            self.step = snap.load(path, backend)
        except Exception as error:  # noqa: BLE001 - any fetch failure rolls the join back
            return self._join_failed(f"snapshot fetch failed: {type(error).__name__}: {error}")
        self.backend = backend
        self.link.send("loaded", {"step": self.step})
        _log.info("snapshot loaded", replica=self.replica_id, step=self.step,
                  seconds=round(time.perf_counter() - started, 3))
        return None

    def _config(self, raw: dict[str, Any]) -> Any:
        from libra.services.trainer.config import TrainerConfig

        return TrainerConfig(**{**raw, "torch_threads": self.threads})

    def _apply(self, flat: Any, raw_config: dict[str, Any], step: int, catch_up: bool = False) -> None:
        self.backend.set_flat_gradients(flat.to(self.device))
        self.backend.step_optimizer(self._config(raw_config))
        if self.on_step is not None:
            self.on_step(step, self.backend)
        if catch_up:
            self.link.send("caught_up", {"step": step})
        self.step = step

    def _train(self, frame: Any) -> None:
        from libra.services.trainer.backend import TrainBatch
        from libra.services.trainer.elastic.work import slice_from_wire

        header = frame.header
        if self.die_at_step is not None and header["step"] >= self.die_at_step:
            raise ConnectionError(f"simulated death in step {header['step']}")
        config = self._config(header["config"])
        batch = TrainBatch(slice_from_wire(header["slice"]))
        grad_header = {"step": header["step"], "epoch": header["epoch"]}  # acknowledges the step's manifest
        if header.get("verify_lockstep"):
            from libra.services.trainer.elastic.checks import param_digest

            grad_header["param_digest"] = param_digest(self.backend.model)
        sums = self.backend.accumulate_gradients(batch, config, token_count=header["token_count"])
        self.link.send("grad", {**grad_header, "metrics": dict(sums)}, self.backend.flat_gradients())
        reduced = self.link.recv()
        if reduced.kind != "reduced" or reduced.header.get("step") != header["step"]:
            code = self._handle(reduced) if reduced.kind in ("bye", "error") else None
            raise ConnectionError(f"expected the reduced gradient of step {header['step']}, got {reduced.kind}"
                                  + (f" (exit {code})" if code is not None else ""))
        self._apply(reduced.tensor(), header["config"], header["step"])


def _endpoint_from_trainer(trainer: str, run_id: str, replica_id: str, wait_s: float) -> str:
    """Look the replica's lane endpoint up in GetStepManifest(step=0), retrying until it appears."""
    import grpc

    from libra.rpc import sync_channel
    from libra.security import from_environment
    from libra.v1 import trainer_pb2, trainer_pb2_grpc

    deadline = time.monotonic() + wait_s
    with sync_channel(trainer, from_environment()) as channel:  # the coordinator's token and TLS
        stub = trainer_pb2_grpc.TrainerStub(channel)
        while True:
            try:
                manifest = stub.GetStepManifest(trainer_pb2.StepManifestRequest(run_id=run_id, step=0), timeout=10)
                for hybrid in manifest.hybrids:
                    if hybrid.replica_id == replica_id and hybrid.endpoint:
                        return hybrid.endpoint
            except grpc.RpcError as error:
                _log.info("waiting for the trainer", trainer=trainer, error=error.code().name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica_id!r} has no lane endpoint in the trainer's manifest "
                                   f"after {wait_s} s: call AdmitHybrid first")
            time.sleep(0.5)


def _preload_model_code() -> Any:
    """Import the model code before connecting: seconds that must not sit inside the join (Megatron's
    too where it is installed: the core may run either backend)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("megatron") is not None:
        importlib.import_module("megatron.core.models.gpt")

    return AutoModelForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra.services.trainer.elastic.hybrid",
                                     description="Run one hybrid training replica beside the core group.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--trainer", help="trainer gRPC address HOST:PORT (looks up the lane endpoint)")
    where.add_argument("--endpoint", help="lane endpoint HOST:PORT of the core rank (skips the lookup)")
    parser.add_argument("--run-id", default="", help="run id (with --trainer)")
    parser.add_argument("--replica-id", required=True, help="the id given to AdmitHybrid")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--lookup-timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    import torch

    from libra.services.trainer.elastic.side_channel import HybridLink

    torch.set_num_threads(args.threads)
    _preload_model_code()
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    try:
        endpoint = args.endpoint or _endpoint_from_trainer(args.trainer, args.run_id, args.replica_id,
                                                           args.lookup_timeout_s)
        link = HybridLink(endpoint, args.replica_id, device=args.device)
    except (TimeoutError, OSError, ValueError) as error:
        print(f"hybrid {args.replica_id}: {error}", file=sys.stderr)
        return EXIT_JOIN_FAILED
    return HybridReplica(link, args.replica_id, args.threads, args.device).run()


if __name__ == "__main__":
    sys.exit(main())
