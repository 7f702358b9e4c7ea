"""Packed micro-batches on one GPU: the attention kernels against an exact reference, and both
training backends packed against padded on a long-tailed batch (bf16 Megatron, fp32 torch).

On CPU the same equalities hold exactly (tests/unit/test_backend_contract.py); here the kernels are
the GPU's (FlashAttention's varlen kernel where torch has it, SDPA's flash kernel per sequence), so
bf16 runs compare to bf16 tolerances and the gradients by direction and size.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LENGTHS = [900, 37, 260, 12, 511, 64, 1500, 8, 130, 45, 333, 20]  # long-tailed, in no order
BUDGET = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                         tie_word_embeddings=True, use_sliding_window=False)
    path = str(tmp_path_factory.mktemp("qwen2-packing"))
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _batch():
    from libra.services.trainer.backend import TrainBatch, TrainSequence

    generator = torch.Generator().manual_seed(7)
    sequences = []
    for i, length in enumerate(LENGTHS):
        prompt = max(1, length // 4)
        response = length - prompt
        tokens = torch.randint(3, 512, (length,), generator=generator).tolist()
        mask = [0 if 3 <= j < 6 else 1 for j in range(response)]  # a few tool tokens
        behaviour = (-torch.rand(response, generator=generator) - 5.5).tolist()
        sequences.append(TrainSequence(tokens, prompt, mask, behaviour, 1.0 if i % 2 else -0.5))
    return TrainBatch(sequences)


def _reference(q, k, v, bounds):
    out = []
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (ks, vs))
        scores = (qs @ ks.transpose(1, 2)) / qs.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("kernel", ["sdpa", "varlen", "auto"])
def test_packed_attention_kernels_match_an_exact_reference(kernel):
    from libra.services.trainer.packed_attention import packed_causal_attention

    if kernel == "varlen":
        pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen attention")
    generator = torch.Generator(device="cuda").manual_seed(0)
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    q = torch.randn(bounds[-1], 8, 64, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=True)
    k, v = (torch.randn(bounds[-1], 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator,
                        requires_grad=True) for _ in range(2))
    got = packed_causal_attention(q, k, v, torch.tensor(bounds, device="cuda"), max(LENGTHS), kernel=kernel)
    expected = _reference(q.detach(), k.detach(), v.detach(), bounds)
    assert (got.float() - expected).abs().max() < 2e-2
    got.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def _flat(backend) -> torch.Tensor:
    return backend.flat_gradients().float().clone()


def _run(kind: str, model_dir: str, tokens: int, kernel: str = "auto"):
    from libra.services.trainer.config import TrainerConfig

    options = dict(lr=1e-4, max_grad_norm=1e6, micro_batch_size=2, micro_batch_tokens=tokens,
                   recompute_logprobs=True, kl_coef=0.1)
    if tokens:
        options["packed_attention"] = kernel
    if kind == "megatron":
        from libra.services.trainer.megatron.backend import MegatronBackend

        config = TrainerConfig(backend={"type": "megatron", "layer_spec": "sdpa"}, **options)
        backend = MegatronBackend(config, seed=0)
        backend.load(model_dir)
    else:
        from libra.services.trainer.torch_backend import TorchBackend

        config = TrainerConfig(**options)
        backend = TorchBackend(config, seed=0)
        backend.load(model_dir)
        backend.to("cuda")
    batch = _batch()
    logprobs = backend.compute_logprobs(batch)
    metrics = backend.train_step(batch, config)
    return logprobs, metrics, _flat(backend)


@pytest.mark.parametrize("kind,kernel", [("megatron", "auto"), ("megatron", "sdpa"), ("torch", "auto")])
def test_packed_training_equals_padded_on_the_gpu(kind, kernel, model_dir):
    """bf16 Megatron (fp32 torch): the same log-probs, loss and gradient, packed or padded."""
    padded = _run(kind, model_dir, 0)
    packed = _run(kind, model_dir, BUDGET, kernel)
    tolerance = 5e-2 if kind == "megatron" else 1e-4  # bf16 activations vs fp32 ones
    for a, b in zip(padded[0], packed[0]):
        assert a.shape == b.shape and (a.float() - b.float()).abs().mean() < tolerance / 5, (a - b).abs().max()
    assert packed[1]["tokens"] == padded[1]["tokens"]
    assert packed[1]["loss"] == pytest.approx(padded[1]["loss"], rel=tolerance, abs=tolerance / 10)
    cosine = torch.nn.functional.cosine_similarity(padded[2], packed[2], dim=0)
    ratio = float(packed[2].norm() / padded[2].norm())
    assert cosine > (0.99 if kind == "megatron" else 0.99999) and abs(ratio - 1) < tolerance, (cosine, ratio)
