"""Packed micro-batches on CPU: the concatenated layout, the token-budget plan, the attention that
keeps to each sequence, and the config rules around them. (That packing changes no loss, log-prob
or gradient in either backend is in test_backend_contract.py; the GPU kernels in tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

from libra.config import build_run_config
from libra.errors import ConfigError
from libra.services.trainer.backend import (MICRO_BATCH_COST_TOKENS, TrainBatch, TrainSequence, micro_batch_cost, pack,
                                            padded_chunks, unpack)
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.packed_attention import (LONG_SEQUENCE_TOKENS, packed_causal_attention, prefers_sdpa,
                                                     register_hf)


def _seq(length: int, prompt: int = 1) -> TrainSequence:
    response = length - prompt
    return TrainSequence(list(range(1, length + 1)), prompt, [1] * response, [-1.0] * response, 0.5)


def test_concatenated_pack_keeps_every_value_in_its_grid_cell():
    a = TrainSequence([5, 6, 7, 8, 9], 3, [1, 0], [-1.0, -2.0], 0.5)
    b = TrainSequence([1, 2, 3], 1, [1, 1], [-3.0, -4.0], -1.0)
    packed = pack([a, b], concatenate=True)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert packed.attention_mask is None and packed.cu_seqlens == (0, 5, 8) and packed.max_seqlen == 5
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    # column 4 would score b's first token from a's last: never a response column
    assert packed.response_mask.tolist() == [[False, False, True, True, False, True, True]]
    assert packed.loss_mask.tolist() == [[0, 0, 1, 0, 0, 1, 1]]
    assert packed.behaviour_logprobs.tolist() == [[0, 0, -1, -2, 0, -3, -4]]
    assert packed.advantages.tolist() == [[0, 0, 0.5, 0.5, 0, -1, -1]]
    assert [t.tolist() for t in unpack(torch.arange(7.0)[None], packed)] == [[2.0, 3.0], [5.0, 6.0]]
    padded = pack([a, b])
    assert [t.tolist() for t in unpack(padded.behaviour_logprobs, padded)] == [[-1.0, -2.0], [-3.0, -4.0]]


def test_token_budget_plan_is_first_fit_decreasing_and_covers_every_sequence_once():
    lengths = [30, 5, 12, 90, 7, 40, 3, 61, 22, 9]
    batch = TrainBatch([_seq(n) for n in lengths])
    plan = batch.plan(4, tokens=64)
    assert sorted(i for micro in plan for i in micro) == list(range(len(lengths)))
    for micro in plan:
        total = sum(lengths[i] for i in micro)
        assert total <= 64 or len(micro) == 1  # only a sequence longer than the budget stands alone
    assert plan[0] == [3]  # 90 > 64: its own micro-batch, placed first (longest first)
    assert plan == batch.plan(4, tokens=64)  # deterministic: every rank computes the same plan
    assert plan == [[3], [7, 6], [5, 8], [0, 2, 9, 4, 1]]  # 90 | 61+3 | 40+22 | 30+12+9+7+5 = 63
    assert batch.plan(4) == [[6, 1, 4, 9], [2, 8, 0, 5], [7, 3]]  # no budget: chunks of like length, shortest first
    with pytest.raises(ValueError, match="budget"):
        batch.plan(4, tokens=-1)


def _chunk_cost(lengths: list[int], chunks: list[tuple[int, int]]) -> int:
    return sum(MICRO_BATCH_COST_TOKENS + (b - a) * lengths[b - 1] for a, b in chunks)


def _compositions(n: int, size: int):
    """Every cut of range(n) into consecutive chunks of at most `size` (brute force)."""
    if n == 0:
        yield []
        return
    for first in range(1, min(size, n) + 1):
        for rest in _compositions(n - first, size):
            yield [(0, first)] + [(a + first, b + first) for a, b in rest]


def test_padded_chunks_is_the_cheapest_cut():
    import random

    rng = random.Random(7)
    for _ in range(200):
        n, size = rng.randint(1, 9), rng.randint(1, 5)
        lengths = sorted(rng.choice((rng.randint(5, 40), rng.randint(100, 400))) for _ in range(n))
        chunks = padded_chunks(lengths, size)
        assert [a for a, _ in chunks] == [0] + [b for _, b in chunks[:-1]] and chunks[-1][1] == n  # contiguous, all
        assert all(0 < b - a <= size for a, b in chunks)
        assert _chunk_cost(lengths, chunks) == min(_chunk_cost(lengths, c) for c in _compositions(n, size))


def test_without_a_chunk_cost_the_cut_keeps_the_fewest_chunks_and_pads_least_among_them():
    """chunk_cost None (a GPU, where the fixed cost of a pass is not measured): as many chunks as the
    plain chunks of `size`, and of those cuts the one with the fewest padded slots (brute force)."""
    import random

    rng = random.Random(11)
    for _ in range(200):
        n, size = rng.randint(1, 9), rng.randint(1, 5)
        lengths = sorted(rng.choice((rng.randint(5, 40), rng.randint(100, 400))) for _ in range(n))
        chunks = padded_chunks(lengths, size, None)
        fewest = -(-n // size)
        assert len(chunks) == fewest and all(0 < b - a <= size for a, b in chunks)
        slots = lambda cut: sum((b - a) * lengths[b - 1] for a, b in cut)  # noqa: E731
        assert slots(chunks) == min(slots(c) for c in _compositions(n, size) if len(c) == fewest)
    lengths = [36 + i % 5 for i in range(63)] + [384]
    plan = TrainBatch([_seq(n) for n in lengths]).plan(16, chunk_cost=None)
    assert len(plan) == 4 and len(plan[-1]) == 16  # 64 rows in chunks of 16: no room to set the long one apart


def test_the_chunk_cost_is_measured_on_cpu_and_the_fewest_chunks_elsewhere():
    assert micro_batch_cost("cpu") == micro_batch_cost(torch.device("cpu")) == MICRO_BATCH_COST_TOKENS
    assert micro_batch_cost("cuda:0") is None and micro_batch_cost(torch.device("cuda", 1)) is None
    assert micro_batch_cost("cuda:0", 500) == 500 and micro_batch_cost("cpu", 0) == 0  # configured wins
    lengths = [36 + i % 5 for i in range(63)] + [384]
    batch = TrainBatch([_seq(n) for n in lengths])
    assert batch.plan(16, chunk_cost=0) != batch.plan(16) != batch.plan(16, chunk_cost=None)


def test_padded_plan_puts_a_long_sequence_alone_and_keeps_like_lengths_together():
    lengths = [36 + i % 5 for i in range(63)] + [384]  # one trajectory that ran to its token limit
    batch = TrainBatch([_seq(n) for n in lengths])
    plan = batch.plan(16)
    assert plan[-1] == [63]  # alone: it no longer pads 15 short rows to 384 tokens
    assert sorted(i for micro in plan for i in micro) == list(range(64)) and all(len(m) <= 16 for m in plan)
    padded = sum(len(m) * max(lengths[i] for i in m) for m in plan)
    assert padded < 0.4 * (48 * 40 + 16 * 384)  # the fixed chunks of 16: three of <= 40 tokens and one of 384
    assert TrainBatch([_seq(40) for _ in range(64)]).plan(16) == [list(range(i, i + 16)) for i in range(0, 64, 16)]
    assert plan == batch.plan(16)  # deterministic: every rank computes the same plan


def _dense_reference(q, k, v, bounds, scale=None):
    """Attention over the whole row with a block-diagonal causal mask (exact, quadratic in the row)."""
    total = q.shape[0]
    owner = torch.zeros(total, dtype=torch.long)
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        owner[start:end] = index
    allowed = (owner[:, None] == owner[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_packed_attention_equals_a_block_diagonal_causal_mask(heads, kv_heads):
    generator = torch.Generator().manual_seed(0)
    bounds = [0, 7, 8, 30, 41]
    q = torch.randn(41, heads, 16, generator=generator)
    k, v = (torch.randn(41, kv_heads, 16, generator=generator) for _ in range(2))
    got = packed_causal_attention(q, k, v, torch.tensor(bounds), 22, scale=0.3, kernel="auto")  # CPU: sdpa
    assert torch.allclose(got, _dense_reference(q, k, v, bounds, 0.3), atol=1e-6)
    with pytest.raises(ValueError, match="kernel"):
        packed_causal_attention(q, k, v, torch.tensor(bounds), 22, kernel="flash")


def test_padded_forward_through_libra_packed_equals_sdpa(tiny_qwen2_dir):
    """Registering the packed implementation leaves a padded forward exactly as transformers' SDPA."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, attn_implementation=register_hf()).eval()
    with torch.no_grad():
        expected = sdpa(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(expected, ours(input_ids=ids, attention_mask=mask).logits)


def test_packing_settings_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="packed_attention=sdpa applies to packed micro-batches"):
        TrainerConfig(packed_attention="sdpa")
    with pytest.raises(ValueError, match="layer_spec: sdpa"):
        TrainerConfig(micro_batch_tokens=4096, backend={"type": "megatron", "layer_spec": "local"})
    with pytest.raises(ConfigError, match="micro_batch_tokens=300 cannot hold"):
        build_run_config({"trainer": {"micro_batch_tokens": 300}, "rollout": {"max_total_tokens": 384}}, env={})
    config = build_run_config({"trainer": {"micro_batch_tokens": 4096}, "rollout": {"max_total_tokens": 384}}, env={})
    assert config.trainer.micro_batch_tokens == 4096


def test_auto_sends_rows_of_long_sequences_to_sdpa_on_hopper_only():
    long_row = (4 * LONG_SEQUENCE_TOKENS, 4)  # tokens, sequences: the mean at the threshold
    short_row = (4 * LONG_SEQUENCE_TOKENS - 1, 4)
    assert prefers_sdpa((9, 0), *long_row) and prefers_sdpa((10, 0), *long_row)
    assert not prefers_sdpa((9, 0), *short_row)  # many short sequences: one varlen launch for the row
    assert not prefers_sdpa((8, 0), *long_row)  # before Hopper: varlen (not measured otherwise)
    assert not prefers_sdpa((9, 0), 0, 0)
