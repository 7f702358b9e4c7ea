"""The transformers engine's batched sampler on a GPU: logits and per-request generators on CUDA, as
the HTTP layer makes them for `rollout.worker.engine: {type: hf, device: cuda}`."""

from __future__ import annotations

import math

import pytest
import torch

from libra.services.rollout.engines.hf_engine import Request, sample_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LOGITS = [2.0, 1.0, 0.0, -1.0, -3.0]


def _row(temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> Request:
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cuda")
        generator.manual_seed(seed)
    return Request([1], 8, temperature, top_p, frozenset(), generator, lambda r: None)


def test_cuda_rows_sample_the_tempered_distribution_and_seeds_repeat():
    torch.manual_seed(0)
    rows = 20_000
    logits = torch.tensor([LOGITS] * rows, device="cuda")
    tokens, logprobs = sample_rows(logits, [_row(0.7)] * rows, "processed_logprobs")
    weights = [math.exp(x / 0.7) for x in LOGITS]
    for token, weight in enumerate(weights):
        assert tokens.count(token) / rows == pytest.approx(weight / sum(weights), abs=0.012)
    seeded = [sample_rows(logits[:3], [_row(), _row(seed=11), _row(0.0)], "processed_logprobs")[0] for _ in range(3)]
    assert seeded[0][1] == seeded[1][1] == seeded[2][1] and seeded[0][2] == 0
    assert all(isinstance(t, int) for t in tokens[:5]) and all(isinstance(lp, float) for lp in logprobs[:5])
