"""The side channel's device-to-device path: a private two-rank group per hybrid (gloo here, NCCL on GPUs).

The channel choice is a pure function; the pair group is exercised for real (two ranks in two
threads over loopback TCP); the joins run the real core and hybrid replicas of
tests/unit/test_elastic_math.py with `channel="group"`. Multi-process runs (a hybrid killed in
the middle of its gradient transfer) live in tests/service/test_elastic_join.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from libra.services.trainer.elastic import device_channel as dc
from libra.services.trainer.elastic.frames import encode
from libra.services.trainer.elastic.hybrid import EXIT_LOST, EXIT_RELEASED, HybridReplica
from libra.services.trainer.elastic.manifest import HybridState
from tests.unit import test_elastic_math
from tests.unit.test_elastic_math import Run, _join

model_dir = test_elastic_math.model_dir  # the same tiny Llama (a fixture)

CPU = {"device": "cpu", "device_uuid": ""}
GPU0 = {"device": "cuda", "device_uuid": "GPU-0"}
GPU1 = {"device": "cuda", "device_uuid": "GPU-1"}


def _hello(info: dict, channels=("tcp", "group")) -> dict:
    return {"replica_id": "h", "channels": list(channels), **info}


def test_the_channel_is_nccl_between_two_gpus_tcp_or_gloo_otherwise():
    assert dc.choose_backend("auto", GPU0, _hello(GPU1)) == "nccl"
    assert dc.choose_backend("group", GPU0, _hello(GPU1)) == "nccl"
    assert dc.choose_backend("auto", CPU, _hello(CPU)) is None  # CPU: TCP unless asked for
    assert dc.choose_backend("group", CPU, _hello(CPU)) == "gloo"
    assert dc.choose_backend("auto", GPU0, _hello(CPU)) is None
    assert dc.choose_backend("group", GPU0, _hello(CPU)) == "gloo"
    assert dc.choose_backend("auto", GPU0, _hello(GPU0)) is None  # one GPU: NCCL refuses two ranks on it
    assert dc.choose_backend("tcp", GPU0, _hello(GPU1)) is None
    assert dc.choose_backend("group", CPU, _hello(CPU, channels=("tcp",))) is None  # an older hybrid
    with pytest.raises(ValueError, match="auto"):
        dc.choose_backend("shm", CPU, _hello(CPU))


def _pair(timeout_s: float) -> tuple[dc.PairGroup, dc.PairGroup]:
    store = dc.host_store("127.0.0.1", timeout_s)
    ends: dict[int, dc.PairGroup] = {}

    def build(rank: int, handle) -> None:
        ends[rank] = dc.PairGroup(handle, rank, "gloo", "cpu", timeout_s)

    hybrid = threading.Thread(target=build, args=(1, dc.join_store("127.0.0.1", store.port, timeout_s)))
    hybrid.start()
    build(0, store)
    hybrid.join(30)
    return ends[0], ends[1]


def test_a_pair_group_moves_tensors_both_ways_and_a_silent_peer_costs_only_the_deadline():
    core, hybrid = _pair(timeout_s=2.0)
    gradient = torch.randn(1000)
    got: dict[str, torch.Tensor] = {}
    receiver = threading.Thread(target=lambda: got.__setitem__("g", hybrid.recv([1000], "float32")))
    receiver.start()
    core.send(gradient)  # returns once the peer has it
    receiver.join(10)
    assert torch.equal(got["g"], gradient)
    pending = core.start_recv([4, 3], "bfloat16")
    hybrid.send(torch.full((4, 3), 1.5, dtype=torch.bfloat16))
    assert torch.equal(pending.result(time.monotonic() + 10), torch.full((4, 3), 1.5, dtype=torch.bfloat16))

    pending = core.start_recv([8], "float32")  # the hybrid never sends: a stalled or frozen peer
    started = time.monotonic()
    with pytest.raises(dc.ChannelTimeout):
        pending.result(started + 1.0)
    assert 1.0 <= time.monotonic() - started < 5.0
    assert core.broken and "did not finish" in core.broken
    with pytest.raises(dc.ChannelError, match="broken"):  # broken for good: the hybrid is failed
        core.send(gradient)
    core.close(wait_s=10)  # already aborting (in the background); closing again is harmless
    hybrid.close(wait_s=10)


class _FrozenInTransfer(HybridReplica):
    """From step 4 on, sends its gradient's header and never its bytes (a peer frozen mid-transfer:
    what a hung GPU or a stopped process looks like to NCCL), until the test lets it go."""

    unblock = threading.Event()

    def _train(self, frame):
        if frame.header["step"] < 4:
            return super()._train(frame)
        size = self.backend.flat_gradients().numel()
        head = encode("grad", {"step": frame.header["step"], "epoch": frame.header["epoch"]}, torch.zeros(size),
                      via_group=True).head
        self.link.sock.sendall(head)
        self.unblock.wait(60)
        raise ConnectionError("frozen replica gives up")


def test_a_hybrid_frozen_in_the_middle_of_its_gradient_transfer_is_dropped_at_the_deadline(model_dir, tmp_path):
    run = Run(model_dir, tmp_path, grad_deadline_s=3.0, channel="group")
    frozen = _join(run, "h-frozen", replica_class=_FrozenInTransfer)  # active from step 3
    link = run.core.endpoint.link("h-frozen")
    run.run(1)
    assert link.channel == "group/gloo" and not run.core.failures
    started = time.monotonic()
    run.run(1, reference_drop=("h-frozen",))  # step 4: its receive never completes; the deadline ends it
    assert 3.0 <= time.monotonic() - started < 3.0 + 10.0
    assert [(s, r) for s, r, _ in run.core.failures] == [(4, "h-frozen")] and "deadline" in run.core.failures[0][2]
    assert link.group.broken and run.core.endpoint.link("h-frozen") is None  # aborted and dropped
    run.assert_equal_to_reference()
    run.run(2)  # the core carries on without it
    assert run.manifests[6].hybrids == () and run.core.membership.hybrid("h-frozen").state == HybridState.FAILED
    run.assert_equal_to_reference()
    _FrozenInTransfer.unblock.set()
    frozen.thread.join(10)
    assert frozen.code == EXIT_LOST
    run.core.close()


def _join_and_leave(model_dir: str, tmp_path, channel: str) -> tuple[Run, dict, list[str]]:
    run = Run(model_dir, tmp_path / channel, max_grad_norm=0.5, channel=channel)
    hybrid = _join(run, "h-1")
    link = run.core.endpoint.link("h-1")
    run.run(4)
    run.core.release("h-1")
    run.run(2)
    hybrid.thread.join(10)
    assert hybrid.code == EXIT_RELEASED
    run.core.close()
    return run, hybrid.params, [link.channel, str(link.group.broken if link.group else "")]


def test_the_group_channel_gives_bitwise_the_updates_of_the_tcp_channel_and_is_torn_down_on_release(
        model_dir, tmp_path):
    tcp, tcp_hybrid, tcp_link = _join_and_leave(model_dir, tmp_path, "tcp")
    group, group_hybrid, group_link = _join_and_leave(model_dir, tmp_path, "group")
    assert tcp_link == ["tcp", ""] and group_link == ["group/gloo", "closed"]  # the pair group went with it
    assert [m.hybrids for m in group.manifests.values()] == [m.hybrids for m in tcp.manifests.values()]
    assert sorted(group_hybrid) == sorted(tcp_hybrid) == [2, 3, 4, 5, 6]  # step 2 replayed in the catch-up
    for step in group.core_params:
        assert all(torch.equal(a, b) for a, b in zip(group.core_params[step], tcp.core_params[step])), step
    for step in group_hybrid:
        assert all(torch.equal(a, b) for a, b in zip(group_hybrid[step], tcp_hybrid[step])), step
    group.assert_equal_to_reference()
