"""Flat weights (libra/weights/flat.py) on the weights group, over gloo with real processes.

- Adopting: the same tensor objects, their values, now at the stream's offsets; a layout cut
  otherwise, a tensor moved out of the buffer, a misfit dtype or a direct tensor are noticed.
- Mixed sides: a flat sender with packing receivers and the other way round, versions 1-3, every
  tensor equal to the source and, on the flat receiver, landing in its own tensors.
- An engine without memory for the flat copy keeps receiving by unpacking, and does not retry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.redis_server import free_port
from libra.weights.group import WeightsGroup, plan_layout
from tests.service.test_weight_sync import _tensors

pytestmark = pytest.mark.slow

def _flat_main(rank: int, port: int, out_dir: str, scenario: str) -> None:
    """Versions 1-3 with packing and flat sides mixed: v1 all packing (rank 1 adopts its targets after
    it), v2 a flat sender, v3 a packing sender again; rank 1 flat from v2 on, rank 2 never."""
    import torch

    from libra.weights.flat import FlatWeights

    group = WeightsGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=5, bucket_bytes=4096)
    outcome: dict = {}
    targets: dict | FlatWeights | None = ({k: torch.zeros_like(t) for k, t in _tensors(1).items()}
                                          if rank == 1 else None)
    try:
        for version in (1, 2, 3):
            source = _tensors(version)
            if rank == 0:
                named = source.items()
                if version == 2:
                    named = FlatWeights.adopt(source, plan_layout(source.items(), 2, 4096))
                    outcome["sender_flat"] = named is not None and all(named[k] is source[k] for k in source)
                report = group.send(named, version)
                outcome[version] = {"buckets": report.buckets, "receivers": sorted(report.receivers)}
                continue
            was_flat = isinstance(targets, FlatWeights) and targets.fits(group.last_layout)
            received = dict(group.receive(version, targets))
            outcome[version] = {"equal": all(torch.equal(received[k], t) for k, t in source.items()),
                                "in_place": targets is not None and all(received[k] is targets[k] for k in source),
                                "flat": was_flat}
            if rank == 1 and version == 1:
                originals = dict(targets)
                targets = FlatWeights.adopt(targets, group.last_layout)
                outcome["adopted_same_objects"] = all(targets[k] is originals[k] for k in originals)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_flat_sides_skip_the_copies_and_mix_with_packing_sides(tmp_path):
    import torch.multiprocessing as mp

    context = mp.start_processes(_flat_main, args=(free_port(), str(tmp_path), "flat"), nprocs=3,
                                 join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert outcomes[0]["sender_flat"] and outcomes[1]["adopted_same_objects"]
    for version in ("1", "2", "3"):
        assert outcomes[0][version]["receivers"] == [1, 2]
        assert outcomes[1][version] == {"equal": True, "in_place": True, "flat": version != "1"}
        assert outcomes[2][version] == {"equal": True, "in_place": False, "flat": False}


def test_flat_weights_adopt_tensors_in_place_and_notice_a_moved_one():
    import torch

    from libra.weights.flat import FlatWeights

    tensors = _tensors(1)
    values = {k: t.clone() for k, t in tensors.items()}
    layout = plan_layout(tensors.items(), 1, 4096)
    flat = FlatWeights.adopt(tensors, layout)
    assert flat is not None and flat.fits(layout) and list(flat) == list(tensors)
    for slot in layout.slots:  # the same objects, same values, now at the stream's offsets
        assert flat[slot.name] is tensors[slot.name] and torch.equal(tensors[slot.name], values[slot.name])
        assert tensors[slot.name].data_ptr() == flat.stream.data_ptr() + slot.offset
    sizes = [flat.bucket(layout, b).numel() for b in range(layout.num_buckets)]
    assert sizes[:-1] == [4096] * (len(sizes) - 1) and 0 < sizes[-1] <= 4096 and sum(sizes) == layout.stream_bytes
    assert not flat.fits(plan_layout(_tensors(1).items(), 1, 4096, direct_bytes=10000))  # another cut
    tensors["layer0.weight"].data = torch.zeros(300, 7)  # moved out of the buffer: no longer in place
    assert not flat.fits(layout)
    assert FlatWeights.adopt(_tensors(1), plan_layout(_tensors(1).items(), 1, 4096, direct_bytes=10000)) is None
    other = _tensors(1)
    other["layer1.weight"] = other["layer1.weight"].float()  # another dtype than the layout says
    assert FlatWeights.adopt(other, layout) is None and FlatWeights.adopt({}, layout) is None


def test_an_engine_without_room_for_the_flat_copy_keeps_unpacking(monkeypatch):
    """Laying the parameters out flat needs a second copy of them for a moment; a GPU without the
    memory (simulated: OutOfMemoryError cannot be provoked on this CPU machine) keeps serving from
    its parameters as they are, receives every version by unpacking, and does not try again."""
    import threading

    import torch

    from libra.services.rollout.engines.hf_weights import HFWeightLoads
    from libra.weights.flat import FlatWeights

    class Engine(HFWeightLoads):
        def __init__(self) -> None:
            self.model, self.device, self.version, self.dirty = torch.nn.Linear(8, 4), "cpu", 0, None
            self.refreshes = 0

        def refresh_kv(self) -> None:  # HFEngine's; no request is running here
            self.refreshes += 1

    torch.manual_seed(0)
    engine, trainer_model = Engine(), torch.nn.Linear(8, 4)
    port, sent = free_port(), {}

    def trainer() -> None:
        group = WeightsGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, bucket_bytes=64)
        for version in (1, 2):
            with torch.no_grad():
                trainer_model.weight.add_(1.0)
            sent[version] = group.send(trainer_model.named_parameters(), version)

    attempts = []

    def no_room(tensors, layout):
        attempts.append(layout.version)
        raise torch.OutOfMemoryError("simulated: no room for a second copy of the weights")

    monkeypatch.setattr(FlatWeights, "adopt", staticmethod(no_room))
    thread = threading.Thread(target=trainer)
    thread.start()
    engine.weights_group = WeightsGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=30, bucket_bytes=64)
    first = engine.receive_weights(1)
    second = engine.receive_weights(2)
    thread.join(30)
    assert first["version"] == 1 and second == {**second, "version": 2, "in_place": False}
    assert engine.refreshes == 2  # every version that arrived refreshed the running requests' KV
    assert attempts == [1] and engine.flat_refused and engine.flat_weights is None and engine.dirty is None
    assert torch.equal(engine.model.weight, trainer_model.weight) and sorted(sent) == [1, 2]
