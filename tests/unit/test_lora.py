"""LoRA (`trainer.lora`) on both training backends, on CPU: what is LoRA's own.

The shared behaviour (log-probs, a step, masked tokens, publication, checkpoints, the gradient
hook, packing) runs in tests/unit/test_backend_contract.py with LoRA on. Here: only the adapters
train (every other weight bitwise unchanged, the flat gradient and the optimizer hold the
adapters alone), the published weights are the merged ones under the HF names, the checkpoint
holds the adapters only, dropout acts in the gradient pass only, the Megatron adapters under
tensor parallelism equal one rank's, and bad settings fail at start naming the field.
"""

from __future__ import annotations

import os

import pytest
import torch

from libra.errors import ConfigError
from libra.redis_server import free_port
from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from tests.ranks import spawn_ranks
from tests.unit.conftest import TINY_VOCAB

KINDS = ["torch", "megatron"]
LORA = {"rank": 4, "alpha": 8.0}


def _config(kind: str, lora: dict | None = None, **overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-2, "micro_batch_size": 2, "max_grad_norm": 1e6, "backend": kind,
                            "lora": LORA if lora is None else lora, **overrides})


def _backend(kind: str, model_dir: str, lora: dict | None = None, **overrides):
    config = _config(kind, lora, **overrides)
    if kind == "torch":
        from libra.services.trainer.torch_backend import TorchBackend

        backend = TorchBackend(config, seed=0)
    else:
        from libra.services.trainer.megatron.backend import MegatronBackend

        backend = MegatronBackend(config, seed=0)
    backend.load(model_dir)
    return backend


def _batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for prompt, response, advantage in ((3, 9, 1.0), (5, 4, -1.0), (2, 6, 0.5)):
        tokens = torch.randint(1, TINY_VOCAB, (prompt + response,), generator=generator).tolist()
        behaviour = (-torch.rand(response, generator=generator) - 3.5).tolist()
        sequences.append(TrainSequence(tokens, prompt, [1] * response, behaviour, advantage))
    return TrainBatch(sequences)


def _is_adapter(name: str) -> bool:
    return "lora" in name


def _expected_adapter_parameters(kind: str, model_dir: str, rank: int) -> int:
    """r·(in + out) per adapted linear: HF's seven projections (peft), Megatron's four fused ones."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, i, d = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    if kind == "torch":
        shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    else:
        shapes = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    return c.num_hidden_layers * sum(rank * (a + b) for a, b in shapes)


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_adapters_train_and_the_published_weights_are_merged(kind, tiny_qwen2_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    backend = _backend(kind, tiny_qwen2_dir)
    named = dict(backend.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(_is_adapter(n) for n in trainable)
    adapters = sum(named[n].numel() for n in trainable)
    assert adapters == _expected_adapter_parameters(kind, tiny_qwen2_dir, LORA["rank"])
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    batch = _batch()
    for _ in range(2):
        backend.train_step(batch, _config(kind))
    assert backend.flat_gradients().numel() == adapters
    assert all(torch.equal(frozen[n], p) for n, p in backend.model.named_parameters() if n in frozen)
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in backend.model.named_parameters()
               if "lora_b" in n or "lora_B" in n)  # B left zero: the adapters moved

    out = str(tmp_path / "v1")
    backend.save_weights(out)
    published, source = load_file(os.path.join(out, "model.safetensors")), load_file(
        os.path.join(tiny_qwen2_dir, "model.safetensors"))
    assert set(published) == set(source)  # plain HF weights, no adapter tensors
    assert not torch.equal(published["model.layers.0.self_attn.o_proj.weight"],
                           source["model.layers.0.self_attn.o_proj.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for seq, ours in zip(batch.sequences, backend.compute_logprobs(batch)):
        ids = torch.tensor([seq.token_ids])
        with torch.no_grad():
            logits = reloaded(input_ids=ids).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][seq.prompt_length - 1:]
        assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()
    names = {name for name, _ in backend.hf_named_tensors()}  # what the weights group and CUDA IPC send
    assert names == {name for name, _ in reloaded.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_the_checkpoint_holds_only_the_adapters(kind, tiny_qwen2_dir, tmp_path):
    backend = _backend(kind, tiny_qwen2_dir)
    batch = _batch()
    backend.train_step(batch, _config(kind))
    path = str(tmp_path / "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    if kind == "torch":
        stored = set(torch.load(path, weights_only=True)["model"])
    else:
        from libra.services.trainer.megatron import checkpoint

        state = checkpoint.sharded_state(backend.model, backend.optimizer, loading=True)
        stored = {k[len("model."):] for k in state if k.startswith("model.")}
    assert stored == trainable
    resumed = _backend(kind, tiny_qwen2_dir)
    assert resumed.load_checkpoint(path) == {"step": 1}
    assert all(torch.equal(p, dict(backend.model.named_parameters())[n]) for n, p in resumed.model.named_parameters())


def test_a_torch_checkpoint_of_adapters_does_not_resume_full_fine_tuning(tiny_qwen2_dir, tmp_path):
    from libra.services.trainer.torch_backend import TorchBackend

    backend = _backend("torch", tiny_qwen2_dir)
    path = str(tmp_path / "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    full = TorchBackend(TrainerConfig(backend="torch"), seed=0)
    full.load(tiny_qwen2_dir)
    with pytest.raises(ValueError, match="a checkpoint of LoRA adapters, but trainer.lora is unset"):
        full.load_checkpoint(path)


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_acts_in_the_gradient_pass_only(kind, tiny_qwen2_dir):
    batch = _batch()
    dropped = _backend(kind, tiny_qwen2_dir, lora={**LORA, "dropout": 0.5})
    dropped.train_step(batch, _config(kind))
    dropped.train_step(batch, _config(kind))  # B ≠ 0 now: dropout would show in a log-prob pass
    first, again = dropped.compute_logprobs(batch), dropped.compute_logprobs(batch)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    plain = _backend(kind, tiny_qwen2_dir)
    plain.train_step(batch, _config(kind))
    plain.train_step(batch, _config(kind))
    assert not torch.allclose(plain.flat_gradients(), dropped.flat_gradients())


def test_bad_lora_settings_fail_at_start_naming_the_field(tmp_path):
    from libra.config import build_run_config

    with pytest.raises(ConfigError, match=r"trainer.lora.rank must be >= 1, got 0"):
        build_run_config({"trainer": {"lora": {"rank": 0}}})
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules: unknown \['qkv'\]"):
        build_run_config({"trainer": {"lora": {"target_modules": ["qkv"]}}})
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules has \['gate_proj'\] but not all of"):
        build_run_config({"trainer": {"backend": "megatron", "lora": {"target_modules": ["gate_proj", "down_proj"]}}})
    with pytest.raises(ConfigError, match="alpha"):
        build_run_config({"trainer": {"lora": {"alpha": 0}}})
    with pytest.raises(ConfigError, match="dropout"):
        build_run_config({"trainer": {"lora": {"dropout": 1.0}}})
    assert build_run_config({"trainer": {"lora": {"rank": 16}}}).trainer.lora.rank == 16


# ---- Megatron adapters under tensor parallelism -------------------------------------------------

def _adapter_gradients(backend) -> dict[str, torch.Tensor] | None:
    """Every adapter's gradient as one rank holds it at TP=1 (TP shards gathered), on TP rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, module in backend.model.named_modules():
        if not getattr(module, "lora_rank", 0):
            continue
        column = module.lora_parallel == "column"
        for key in ("lora_a", "lora_b"):
            grad = getattr(module, key).grad.contiguous()
            if (key == "lora_b") == column and tp > 1:  # the sharded one: gather
                parts = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(parts, grad, group=ps.get_tensor_model_parallel_group())
                if column and name.endswith("linear_fc1"):  # each rank holds [gate shard; up shard]
                    halves = [p.chunk(2) for p in parts]
                    grad = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    grad = torch.cat(parts, dim=0 if column else 1)
            out[f"{name}.{key}"] = grad
    return out if ps.get_tensor_model_parallel_rank() == 0 else None


def _tp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        backend = _backend("megatron", model_dir, ranks=2, backend={"type": "megatron", "tensor_parallel": 2})
        batch = _batch()
        backend.train_step(batch, backend.config)  # B moves off zero: the second step's A gradient is not zero
        metrics = backend.train_step(batch, backend.config)
        gradients = _adapter_gradients(backend)
        logprobs = backend.compute_logprobs(batch)
        weights = backend.hf_state_dict()
        if rank == 0:
            torch.save({"metrics": metrics, "gradients": gradients, "logprobs": logprobs, "weights": weights}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_adapters_under_tensor_parallelism_equal_one_rank(tiny_qwen2_dir, tmp_path):
    """TP=2 over gloo: A and B start as one rank's (seeded by global names), and after two steps the
    adapter gradients, log-probs and merged published weights equal TP=1's."""
    port, out = free_port(), str(tmp_path / "tp2.pt")
    spawn_ranks(_tp_rank, (port, tiny_qwen2_dir, out), 2)
    result = torch.load(out, weights_only=True)
    single = _backend("megatron", tiny_qwen2_dir)
    batch = _batch()
    single.train_step(batch, single.config)
    metrics = single.train_step(batch, single.config)
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    one = _adapter_gradients(single)
    assert set(one) == set(result["gradients"])
    for name, grad in one.items():
        assert torch.allclose(result["gradients"][name], grad, rtol=1e-4, atol=1e-7), name
    for a, b in zip(result["logprobs"], single.compute_logprobs(batch)):
        assert torch.allclose(a, b, atol=1e-5)
    weights = single.hf_state_dict()
    assert all(torch.allclose(result["weights"][k], weights[k], atol=1e-5) for k in weights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 Megatron path, DDP + distributed optimizer)")
def test_gpu_bf16_megatron_lora_step_and_checkpoint(tiny_qwen2_dir, tmp_path):
    """The GPU path with adapters: Megatron DDP and the distributed optimizer over the adapters only,
    the base weights untouched, and an adapters-only checkpoint that restores them exactly."""
    backend = _backend("megatron", tiny_qwen2_dir)
    frozen = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad}
    batch = _batch()
    backend.train_step(batch, _config("megatron"))
    path = str(tmp_path / "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    saved = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    backend.train_step(batch, _config("megatron"))
    assert all(torch.equal(frozen[n], p) for n, p in backend.model.named_parameters() if n in frozen)
    assert backend.load_checkpoint(path) == {"step": 1}
    assert all(torch.equal(saved[n], p) for n, p in backend.model.named_parameters() if p.requires_grad)
