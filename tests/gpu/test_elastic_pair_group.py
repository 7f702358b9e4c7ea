"""The side channel's pair group over NCCL on two GPUs (what `channel: auto` picks for a hybrid on GPUs).

Two spawned processes, the core's end on cuda:0 and the hybrid's on cuda:1: a gradient each way
device to device; then the hybrid freezes (never answers a receive), and the core's receive ends
at its deadline, the group is aborted and the core process (and its GPU) carries on; then a new
pair group between the same two processes works (a re-admitted hybrid builds a new one).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a pair group over NCCL)"),
]
TIMEOUT_S = 5.0


def _core_end(ports, frozen, released, results) -> None:
    from libra.services.trainer.elastic import device_channel as dc

    torch.cuda.set_device(0)
    out = {}
    try:
        store = dc.host_store("127.0.0.1", 60.0)
        ports.put(store.port)
        group = dc.PairGroup(store, 0, "nccl", "cuda:0", TIMEOUT_S)
        gradient = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        got = group.start_recv([1 << 20], "float32").result(time.monotonic() + TIMEOUT_S)
        out["received"] = bool(torch.equal(got, gradient * 2))
        group.send(gradient)
        frozen.wait(60)  # the hybrid no longer answers
        started = time.monotonic()
        pending = group.start_recv([1 << 20], "float32")
        try:
            pending.result(started + TIMEOUT_S)
            out["frozen"] = "completed?!"
        except dc.ChannelTimeout:
            out["frozen"] = "timeout"
        out["frozen_s"] = time.monotonic() - started
        out["broken"] = bool(group.broken)
        group.close(wait_s=30.0)
        released.set()
        out["gpu_alive"] = float(torch.ones(4, device="cuda:0").sum()) == 4.0
        store = dc.host_store("127.0.0.1", 60.0)  # a new pair group, as for a re-admitted hybrid
        ports.put(store.port)
        again = dc.PairGroup(store, 0, "nccl", "cuda:0", TIMEOUT_S)
        again.send(torch.full((16,), 3.0, device="cuda:0"))
        again.close(wait_s=30.0)
        out["again"] = True
    except Exception as error:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(error).__name__}: {error}"
        released.set()
    results.put(("core", out))


def _hybrid_end(ports, frozen, released, results) -> None:
    from libra.services.trainer.elastic import device_channel as dc

    torch.cuda.set_device(1)
    out = {}
    try:
        group = dc.PairGroup(dc.join_store("127.0.0.1", ports.get(timeout=60), 60.0), 1, "nccl", "cuda:1", TIMEOUT_S)
        group.send(torch.arange(1 << 20, dtype=torch.float32, device="cuda:1") * 2)
        got = group.recv([1 << 20], "float32")
        out["received"] = bool(torch.equal(got, torch.arange(1 << 20, dtype=torch.float32, device="cuda:1")))
        frozen.set()  # and never posts the matching send, until the core has given up on it
        released.wait(60)
        group.close(wait_s=30.0)
        again = dc.PairGroup(dc.join_store("127.0.0.1", ports.get(timeout=60), 60.0), 1, "nccl", "cuda:1",
                             TIMEOUT_S)
        out["again"] = bool(torch.equal(again.recv([16], "float32"), torch.full((16,), 3.0, device="cuda:1")))
        again.close(wait_s=30.0)
    except Exception as error:  # noqa: BLE001
        out["error"] = f"{type(error).__name__}: {error}"
    results.put(("hybrid", out))


def test_a_pair_group_over_nccl_moves_gradients_and_a_frozen_peer_only_costs_the_deadline():
    spawn = multiprocessing.get_context("spawn")
    ports, frozen, released, results = spawn.Queue(), spawn.Event(), spawn.Event(), spawn.Queue()
    processes = [spawn.Process(target=f, args=(ports, frozen, released, results)) for f in (_core_end, _hybrid_end)]
    for process in processes:
        process.start()
    try:
        reports = dict(results.get(timeout=240) for _ in processes)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    core, hybrid = reports["core"], reports["hybrid"]
    assert "error" not in core and "error" not in hybrid, (core, hybrid)
    assert core["received"] and hybrid["received"]
    assert core["frozen"] == "timeout" and TIMEOUT_S <= core["frozen_s"] < TIMEOUT_S + 10 and core["broken"]
    assert core["gpu_alive"] and core["again"] and hybrid["again"]
    assert processes[0].exitcode == 0  # the core process survived the abort
