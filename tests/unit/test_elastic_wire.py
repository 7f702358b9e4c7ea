"""The elastic data plane's wire and batch division, without a run: a widened batch split into whole
groups per core rank and hybrid, a slice through JSON bit for bit, side-channel frames (and a peer
that stops reading). The math and joins of whole runs are tests/unit/test_elastic_math.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from libra.services.trainer.backend import TrainSequence
from libra.services.trainer.elastic.side_channel import HybridLink
from libra.services.trainer.elastic.work import split, widened_groups
from tests.unit.test_elastic_math import GROUP, _groups, _wait


def test_widened_batches_give_whole_groups_to_hybrids_on_every_core_rank():
    from libra.services.trainer.elastic.manifest import StepManifest
    from libra.services.trainer.elastic.work import group_share

    manifest = StepManifest(5, 2, core_ranks=2, hybrids=(("h0", 0), ("h1", 1), ("h2", 0)))
    assert widened_groups(4, manifest) == 10  # 2 groups per replica × (2 core + 3 hybrids)
    batch = _groups(5, 10)
    slices = split(batch, GROUP, manifest)
    assert list(slices) == ["core-0", "core-1", "h0", "h1", "h2"]
    assert all(len(b) == 2 * GROUP for b in slices.values())
    assert [s for b in slices.values() for s in b.sequences] == batch.sequences  # nothing lost or repeated
    assert manifest.hybrids_of(1) == ["h1"] and manifest.hybrids_of(0) == ["h0", "h2"]
    with pytest.raises(ValueError, match="groups_per_step"):
        group_share(3, 2)
    with pytest.raises(ValueError, match="whole groups"):
        split(_groups(5, 9), GROUP, manifest)


def test_a_slice_crosses_the_wire_bit_for_bit():
    import json
    import math

    from libra.services.trainer.elastic.work import slice_from_wire, slice_to_wire

    sequences = [TrainSequence([151_000, 0, 7, 3], 1, [1, 0, 1], [-1e-300, -math.pi, -0.1 + 1e-17], -2.5),
                 TrainSequence([5] * 9, 4, [0, 1, 1, 1, 0], [-0.0, -1.0, -2.0, -3.0, -4.0], 0.0)]
    back = slice_from_wire(json.loads(json.dumps(slice_to_wire(sequences))))
    assert back == sequences  # dataclass equality: every id, mask, log-prob and advantage
    assert [math.copysign(1.0, lp) for lp in back[1].behaviour_logprobs][:1] == [-1.0]  # even -0.0


def test_side_channel_frames_round_trip_and_a_peer_that_stops_reading_cannot_block_the_core():
    from libra.services.trainer.elastic.side_channel import LaneEndpoint

    endpoint = LaneEndpoint(send_timeout_s=0.5)
    link = HybridLink(endpoint.address, "h-x")
    _wait(lambda: endpoint.link("h-x") is not None)
    for tensor in (torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)):
        assert endpoint.send("h-x", "reduced", {"step": 3}, tensor)
        frame = link.recv()
        assert frame.kind == "reduced" and frame.header["step"] == 3 and torch.equal(frame.tensor(), tensor)
    link.send("grad", {"step": 3}, torch.full((5,), 2.0))
    got = endpoint.wait_grad("h-x", 10)
    assert got.kind == "grad" and got.tensor().tolist() == [2.0] * 5
    started = time.monotonic()
    assert not endpoint.send("h-x", "reduced", {"step": 4}, torch.zeros(64 * 2**20 // 4))  # 64 MB, unread
    assert time.monotonic() - started < 10
    link.close()
    endpoint.close()
