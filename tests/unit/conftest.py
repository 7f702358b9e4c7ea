"""Fixtures shared by the unit tests of the training backends and the elastic data plane."""

from __future__ import annotations

import pytest
import torch

TINY_VOCAB = 64


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 checkpoint (GQA, qkv biases, tied embeddings, vocabulary of TINY_VOCAB) with
    non-trivial norms and biases, so a wrong mapping of either shows. Read-only for the tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=True, use_sliding_window=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    model.save_pretrained(path)
    return path
