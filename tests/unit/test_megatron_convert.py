"""HF ↔ Megatron-Core conversion and the Megatron backend's model, on tiny random models (CPU).

Covers the three architectures the backend maps (Llama with GQA, Qwen2 with qkv biases and tied
embeddings, Qwen3 with qk-norm and a head_dim that is not hidden/heads), both layer specs, the
tensor-parallel split and merge, TP=2 across two processes, and the errors for configs Megatron
cannot express. The GPU test runs only where CUDA is present.
"""

from __future__ import annotations

import os

import pytest
import torch

from libra.redis_server import free_port
from libra.services.trainer.megatron import convert as convert
from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from tests.ranks import spawn_ranks

VOCAB = 64
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)


def _hf_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False))
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping of either shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        path = str(tmp_path_factory.mktemp(kind))
        _hf_model(kind).save_pretrained(path)
        out[kind] = path
    return out


def _batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(5)
    sequences = []
    for prompt, response in ((3, 9), (5, 2), (2, 6)):
        tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
        sequences.append(TrainSequence(tokens, prompt, [1] * response, [-4.0] * response, 1.0))
    return TrainBatch(sequences)


def _reference(model_dir: str, batch: TrainBatch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for seq in batch.sequences:
        ids = torch.tensor([seq.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][seq.prompt_length - 1:])
    return out


def _megatron(model_dir: str, spec: str = "sdpa", tp: int = 1, **overrides):
    from libra.services.trainer.megatron.backend import MegatronBackend

    config = TrainerConfig(lr=1e-2, micro_batch_size=2, backend={"type": "megatron", "tensor_parallel": tp,
                                                                 "layer_spec": spec}, **overrides)
    backend = MegatronBackend(config, seed=0)
    backend.load(model_dir)
    return backend


@pytest.mark.parametrize("kind,spec", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("qwen2", "local")])
def test_megatron_logits_equal_hf_and_weights_convert_back(kind, spec, model_dirs):
    from safetensors.torch import load_file

    backend = _megatron(model_dirs[kind], spec)
    batch = _batch()
    for ours, expected in zip(backend.compute_logprobs(batch), _reference(model_dirs[kind], batch)):
        assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()
    source = load_file(os.path.join(model_dirs[kind], "model.safetensors"))
    back = backend.hf_state_dict()
    assert set(back) == set(source)
    assert all(torch.equal(back[name], source[name]) for name in source)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tensor_parallel_split_and_merge_round_trip(kind):
    model = _hf_model(kind)
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    shape = convert.model_shape(model.config)
    shards = [convert.hf_to_megatron(hf, shape, tp=2, rank=r) for r in range(2)]
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    # one KV group per rank: its 2 query heads, then k, then v (head_dim rows each)
    head = shape.head_dim
    assert qkv.shape == ((shape.heads // shape.groups + 2) * head, shape.hidden)
    assert torch.equal(qkv[:head], hf["model.layers.0.self_attn.q_proj.weight"][:head])
    assert torch.equal(qkv[2 * head:3 * head], hf["model.layers.0.self_attn.k_proj.weight"][:head])
    back = convert.megatron_to_hf(shards, shape)
    expected = {k: v for k, v in hf.items() if not (shape.tied and k == "lm_head.weight")}
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_configs_megatron_cannot_express_are_refused_by_field():
    from transformers import LlamaConfig, Qwen2Config

    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide config.json num_attention_heads=4"):
        convert.check_parallel(convert.model_shape(LlamaConfig(**COMMON)), tp=3, pp=1)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        convert.check_parallel(convert.model_shape(LlamaConfig(**{**COMMON, "num_attention_heads": 8})), tp=4, pp=1)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        from transformers import GPT2Config

        convert.model_shape(GPT2Config())
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        convert.model_shape(LlamaConfig(**COMMON, hidden_act="gelu"))
    with pytest.raises(ValueError, match="use_sliding_window"):
        convert.model_shape(Qwen2Config(**COMMON, use_sliding_window=True))
    with pytest.raises(ValueError, match="rope_scaling type 'llama3'"):
        convert.model_shape(LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="pipeline_parallel=3 does not divide config.json num_hidden_layers=2"):
        convert.check_parallel(convert.model_shape(LlamaConfig(**COMMON)), tp=1, pp=3)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        TrainerConfig(backend={"type": "megatron", "pipeline_parallel": 0})
    with pytest.raises(ValueError, match="layer_spec"):
        TrainerConfig(backend={"type": "megatron", "layer_spec": "te"})


def _hf_gradients(backend) -> dict[str, torch.Tensor] | None:
    """The step's final (reduced, clipped) gradient in HF layout: each .grad read through the converter.

    Gradients, not updated weights, are compared: Adam's first step moves every weight by about
    ±lr whatever its gradient's size, so float noise in a near-zero gradient can flip a weight's
    update while the gradients still agree to float precision.
    """
    params = list(backend.model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return backend.hf_state_dict()
    finally:
        for p, w in zip(params, weights):
            p.data = w


def _tp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        backend = _megatron(model_dir, tp=2)
        batch = _batch()
        logprobs = backend.compute_logprobs(batch)
        metrics = backend.train_step(batch, backend.config)
        gradients = _hf_gradients(backend)
        if rank == 0:
            torch.save({"logprobs": logprobs, "metrics": metrics, "gradients": gradients}, out)
        dist.barrier()  # both ranks done before either tears its gloo groups down
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_two_ranks_equal_one_rank(model_dirs, tmp_path):
    """TP=2 over gloo: same log-probs as HF, and the same gradient (clipping sees the whole norm)."""
    port = free_port()
    out = str(tmp_path / "tp2.pt")
    spawn_ranks(_tp_rank, (port, model_dirs["qwen3"], out), 2)
    result = torch.load(out, weights_only=True)
    batch = _batch()
    for ours, expected in zip(result["logprobs"], _reference(model_dirs["qwen3"], batch)):
        assert torch.allclose(ours, expected, atol=1e-5)
    single = _megatron(model_dirs["qwen3"], tp=1)
    metrics = single.train_step(batch, single.config)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)  # fp32 sums split over TP
    one = _hf_gradients(single)
    assert set(one) == set(result["gradients"])
    assert all(torch.allclose(result["gradients"][k], one[k], rtol=1e-4, atol=1e-7) for k in one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 Megatron path, DDP + distributed optimizer)")
def test_gpu_bf16_step_and_checkpoint(model_dirs, tmp_path):
    backend = _megatron(model_dirs["qwen2"])
    batch = _batch()
    for ours, expected in zip(backend.compute_logprobs(batch), _reference(model_dirs["qwen2"], batch)):
        assert torch.allclose(ours, expected, atol=5e-2)  # bf16 weights and activations
    first = backend.train_step(batch, backend.config)
    path = str(tmp_path / "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    saved = {k: v.clone() for k, v in backend.model.state_dict().items() if not k.endswith("_extra_state")}
    second = backend.train_step(batch, backend.config)
    assert second["loss"] < first["loss"]
    assert backend.load_checkpoint(path) == {"step": 1}
    now = backend.model.state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in saved)
