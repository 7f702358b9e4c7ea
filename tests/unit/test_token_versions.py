"""Per-token policy versions on their way from an engine to Redis: vLLM's `weight_versions` spans read
by the client, the hf engine's spans, and the store's check that a completed trajectory has one
version (and log-prob and mask bit) per response token."""

from __future__ import annotations

import pytest

from libra.errors import InvalidArgument
from libra.services.rollout.engines.client import EngineError, token_versions
from libra.services.rollout.engines.hf_engine import version_spans
from libra.state.trajectories import check_response
from libra.v1 import common_pb2


def test_spans_become_one_version_per_token_and_back():
    spans = [{"version": "5", "start": 0, "end": 3}, {"version": "6", "start": 3, "end": 5}]
    assert token_versions(spans, 5) == [5, 5, 5, 6, 6]
    assert version_spans([5, 5, 5, 6, 6]) == spans  # the hf engine answers what vLLM answers
    assert version_spans([]) == [] and token_versions([], 0) == []


@pytest.mark.parametrize("spans, count, says", [
    ([{"version": "default", "start": 0, "end": 2}], 2, "not with a policy version"),  # never labelled
    (None, 2, "versions for 0 of 2 tokens"),  # /v1/completions, or a server without --enable-scale-out
    ([{"version": "5", "start": 0, "end": 1}], 2, "versions for 1 of 2 tokens"),
    ([{"version": "5", "start": 1, "end": 2}], 2, "not contiguous"),
    ([{"version": "5", "end": 2}], 2, "not with a policy version"),
])
def test_spans_that_do_not_cover_the_output_with_versions_are_engine_errors(spans, count, says):
    with pytest.raises(EngineError, match=says):
        token_versions(spans, count)


def test_a_completed_trajectory_needs_one_version_per_response_token():
    traj = common_pb2.Trajectory(trajectory_id="t", prompt_length=2, token_ids=[1, 2, 3, 4], loss_mask=[1, 0],
                                 logprobs=[-1.0, 0.0], versions=[3, 3])
    check_response(traj)
    del traj.versions[1:]
    with pytest.raises(InvalidArgument, match="versions has 1 entries for 2 response tokens"):
        check_response(traj)
