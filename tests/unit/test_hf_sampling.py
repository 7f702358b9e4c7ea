"""The transformers engine's batched sampler (`hf_sampling.sample_rows`): one batch of tensor operations
for every running row, each row with its own temperature, top-p and seed."""

from __future__ import annotations

import math

import pytest
import torch

from libra.services.rollout.engines.hf_engine import Request
from libra.services.rollout.engines.hf_sampling import sample_rows

LOGITS = [2.0, 1.0, 0.0, -1.0, -3.0]


def _row(temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None) -> Request:
    generator = None
    if seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    return Request([1], 8, temperature, top_p, frozenset(), generator, lambda r: None)


def _probs(logits: list[float], temperature: float) -> list[float]:
    weights = [math.exp(x / temperature) for x in logits]
    return [w / sum(weights) for w in weights]


def test_greedy_rows_take_the_argmax_with_its_raw_logprob():
    logits = torch.tensor([LOGITS, [0.0, 5.0, 1.0, 0.0, 0.0]])
    tokens, logprobs = sample_rows(logits, [_row(0.0), _row(0.0)], "processed_logprobs")
    assert tokens == [0, 1]
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs == pytest.approx([float(raw[0, 0]), float(raw[1, 1])])


def test_samples_follow_the_tempered_distribution():
    torch.manual_seed(0)
    rows, temperature = 20_000, 0.7
    tokens, logprobs = sample_rows(torch.tensor([LOGITS] * rows), [_row(temperature)] * rows, "processed_logprobs")
    expected = _probs(LOGITS, temperature)
    for token, p in enumerate(expected):
        assert tokens.count(token) / rows == pytest.approx(p, abs=0.012)
    for token, logprob in zip(tokens[:200], logprobs[:200]):
        assert logprob == pytest.approx(math.log(expected[token]), abs=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_it_and_always_the_top_token():
    torch.manual_seed(1)
    probs = _probs(LOGITS, 1.0)  # ~0.64, 0.24, 0.09, 0.03, 0.004
    rows = 4_000
    tokens, logprobs = sample_rows(torch.tensor([LOGITS] * rows), [_row(top_p=0.8)] * rows, "processed_logprobs")
    assert set(tokens) == {0, 1}  # 0.64 < 0.8 <= 0.64 + 0.24
    kept = probs[0] + probs[1]
    assert tokens.count(0) / rows == pytest.approx(probs[0] / kept, abs=0.03)
    assert logprobs[tokens.index(1)] == pytest.approx(math.log(probs[1] / kept), abs=1e-5)
    tokens, _ = sample_rows(torch.tensor([LOGITS] * 200), [_row(top_p=0.01)] * 200, "processed_logprobs")
    assert set(tokens) == {0}


def test_raw_logprobs_mode_reports_the_untempered_distribution():
    torch.manual_seed(2)
    tokens, logprobs = sample_rows(torch.tensor([LOGITS] * 50), [_row(0.5, 0.9)] * 50, "raw_logprobs")
    raw = _probs(LOGITS, 1.0)
    assert all(lp == pytest.approx(math.log(raw[t]), abs=1e-5) for t, lp in zip(tokens, logprobs))


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    alone = [sample_rows(torch.tensor([LOGITS]), [_row(seed=7)], "processed_logprobs")[0][0] for _ in range(3)]
    seeded = _row(seed=7)
    batch = [_row(), _row(0.0), seeded, _row(top_p=0.5)]
    shared = sample_rows(torch.tensor([LOGITS] * 4), batch, "processed_logprobs")[0][2]
    assert alone[0] == alone[1] == alone[2] == shared
    # the row's generator moves on: its next draws are the next of its own stream
    follow = _row(seed=7)
    stream = [sample_rows(torch.tensor([LOGITS]), [follow], "processed_logprobs")[0][0] for _ in range(20)]
    again = _row(seed=7)
    assert [sample_rows(torch.tensor([LOGITS] * 2), [_row(), again], "processed_logprobs")[0][1]
            for _ in range(20)] == stream
