"""Mixture-of-experts models on the Megatron backend, on tiny random Qwen3-MoE / Qwen2-MoE models (CPU).

Covers: HF ↔ Megatron conversion with equal log-probs (top-k renormalised or not, a gated shared
expert), the published weights reloading in transformers and in the transformers rollout engine
(fused experts in memory), the routers' load-balancing loss — its reported value equal to
Megatron's formula applied to the HF model's router logits, and its gradient equal to the HF
model's gradient of that loss at the weight the step gives it — expert parallelism over two gloo
ranks and pipeline parallelism over two stages equal to one rank, the configs it refuses (naming
the field) and the GPU path (bf16, DDP, checkpoint; where CUDA is). The planner's cost of an MoE
model (active parameters for compute, total for memory) is in test_planner_cost.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from libra.redis_server import free_port
from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.megatron import convert as convert
from tests.ranks import spawn_ranks

VOCAB = 64
COMMON = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
              num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
KINDS = ("qwen3_moe", "qwen3_moe_raw", "qwen2_moe")


def hf_moe_model(kind: str):
    """A tiny random MoE model: Qwen3-MoE with renormalised top-k (as Qwen3-30B-A3B) or raw top-k
    probabilities, or Qwen2-MoE (gated shared expert, qkv biases); non-trivial norms and biases."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=48,
                                                   use_sliding_window=False, tie_word_embeddings=False))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, head_dim=16, norm_topk_prob=kind == "qwen3_moe",
                                                   tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
            if name.endswith("gate.weight"):  # a sharper router: routing decisions far from ties
                p.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for kind in KINDS:
        path = str(tmp_path_factory.mktemp(kind))
        hf_moe_model(kind).save_pretrained(path)
        out[kind] = path
    return out


def _batch(shapes=((3, 9, 1.0), (5, 2, -1.0), (2, 6, 0.5))) -> TrainBatch:
    generator = torch.Generator().manual_seed(5)
    sequences = []
    for prompt, response, advantage in shapes:
        tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
        sequences.append(TrainSequence(tokens, prompt, [1] * response, [-4.0] * response, advantage))
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


def _megatron(model_dir: str, ranks: int = 1, **backend):
    from libra.services.trainer.megatron.backend import MegatronBackend

    config = TrainerConfig(lr=1e-2, micro_batch_size=1, max_grad_norm=1e6, ranks=ranks,
                           backend={"type": "megatron", **backend})
    instance = MegatronBackend(config, seed=0)
    instance.load(model_dir)
    return instance


def _hf_gradients(backend) -> dict[str, torch.Tensor] | None:
    """The step's gradient in HF layout (each .grad read through the converter)."""
    params = list(backend.model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return backend.hf_state_dict()
    finally:
        for p, w in zip(params, weights):
            p.data = w


@pytest.mark.parametrize("kind", KINDS)
def test_moe_logits_equal_hf_and_weights_convert_back(kind, moe_dirs):
    from safetensors.torch import load_file

    backend = _megatron(moe_dirs[kind])
    batch = _batch()
    for ours, expected in zip(backend.compute_logprobs(batch), _reference(moe_dirs[kind], batch)):
        assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()
    source = load_file(os.path.join(moe_dirs[kind], "model.safetensors"))
    assert any(".mlp.experts.3.down_proj." in name for name in source)  # per-expert tensors on disk
    back = backend.hf_state_dict()
    assert set(back) == set(source)
    assert all(torch.equal(back[name], source[name]) for name in source)
    assert backend.num_parameters() == sum(t.numel() for t in source.values())


def test_a_trained_moe_publishes_weights_transformers_reloads(moe_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _megatron(moe_dirs["qwen3_moe"])
    batch = _batch()
    first = backend.train_step(batch, backend.config)
    second = backend.train_step(batch, backend.config)
    assert second["loss"] < first["loss"]
    out = str(tmp_path / "v1")
    backend.save_weights(out)
    AutoModelForCausalLM.from_pretrained(out)
    for ours, reloaded in zip(backend.compute_logprobs(batch), _reference(out, batch)):
        assert torch.allclose(ours, reloaded, atol=1e-5)


def test_the_transformers_engine_loads_a_published_moe_version(moe_dirs, tmp_path):
    """The hf rollout engine holds transformers 5's fused experts; the published version has one
    tensor per expert (libra/weights/experts.py maps them): after the load it samples from exactly
    the trainer's weights."""
    from libra.services.rollout.engines.hf_engine import HFEngine

    backend = _megatron(moe_dirs["qwen3_moe"])
    batch = _batch()
    backend.train_step(batch, backend.config)
    out = str(tmp_path / "v1")
    backend.save_weights(out)
    engine = HFEngine(moe_dirs["qwen3_moe"], device="cpu")
    try:
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        reply = engine.load_from_disk(out, 1)
        assert reply.get("version") == 1, reply
        after = engine.model.state_dict()
        assert all(not torch.equal(before[k], after[k]) for k in after if k.endswith("experts.gate_up_proj"))
        for seq, ours in zip(batch.sequences, backend.compute_logprobs(batch)):
            ids = torch.tensor([seq.token_ids])
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0, :-1]
            served = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][seq.prompt_length - 1:]
            assert torch.allclose(ours, served, atol=1e-5)
        bad = tmp_path / "bad"
        bad.mkdir()
        from safetensors.torch import load_file, save_file

        tensors = load_file(os.path.join(out, "model.safetensors"))
        tensors["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(16, 32)  # there are 4 experts
        save_file(tensors, str(bad / "model.safetensors"))
        assert "experts.9.up_proj" in engine.load_from_disk(str(bad), 2)["error"]
    finally:
        engine.stop()


def _switch_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Megatron's load-balancing loss of one layer and micro-batch from its router logits [T, E]:
    E / (k·T²) · Σ_e (Σ_t softmax(logits)_te) · (tokens routed to e)."""
    tokens, experts = router_logits.shape
    scores = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=-1).indices, 1.0)
    return experts / (topk * tokens * tokens) * (scores.sum(0) * chosen.sum(0)).sum()


def test_router_load_balancing_loss_is_reported_and_trained_with_its_weight(moe_dirs):
    """One micro-batch per sequence (no padding). Reported: the mean over layers and micro-batches
    of Megatron's loss, computed here from the HF model's router logits. Trained: the gradient with
    coefficient c minus the one with 0 is c/N · ∇ Σ_m T_m Σ_layers loss_m,l (N the step's loss
    tokens, T_m a micro-batch's tokens), the HF model's autograd of that sum."""
    from transformers import AutoModelForCausalLM

    model_dir, coef, batch = moe_dirs["qwen3_moe"], 0.05, _batch()
    with_loss = _megatron(model_dir, router_aux_loss_coef=coef)
    metrics = with_loss.train_step(batch, with_loss.config)
    without = _megatron(model_dir, router_aux_loss_coef=0.0)
    plain = without.train_step(batch, without.config)
    assert "router_aux_loss" not in plain and plain["loss"] == pytest.approx(metrics["loss"], rel=1e-6)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weighted, reported = 0.0, []
    for seq in batch.sequences:
        logits = hf(input_ids=torch.tensor([seq.token_ids]), output_router_logits=True).router_logits
        losses = [_switch_loss(layer, hf.config.num_experts_per_tok) for layer in logits]
        reported.extend(float(x) for x in losses)
        weighted = weighted + len(seq.token_ids) * sum(losses)
    assert metrics["router_aux_loss"] == pytest.approx(sum(reported) / len(reported), rel=1e-5)
    (coef / batch.loss_tokens * weighted).backward()
    expected = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}

    ours, base = _hf_gradients(with_loss), _hf_gradients(without)
    router = "model.layers.0.mlp.gate.weight"
    assert expected[router].abs().max() > 1e-4  # the loss moves the routers
    from safetensors.torch import load_file

    for name in load_file(os.path.join(model_dir, "model.safetensors")):
        want = _hf_layout(expected, name, ours[name].shape)
        assert torch.allclose(ours[name] - base[name], want, atol=1e-6, rtol=1e-3), \
            (name, (ours[name] - base[name] - want).abs().max())


def _hf_layout(grads: dict[str, torch.Tensor], name: str, shape: torch.Size) -> torch.Tensor:
    """A gradient by its on-disk name (transformers 5 holds the experts fused in memory); zeros
    where the loss does not reach (the last layer's experts)."""
    import re

    match = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if match is None:
        return grads.get(name, torch.zeros(shape))
    prefix, index, which = match.group(1), int(match.group(2)), match.group(3)
    if f"{prefix}.down_proj" not in grads:
        return torch.zeros(shape)
    if which == "down_proj":
        return grads[f"{prefix}.down_proj"][index]
    gate, up = grads[f"{prefix}.gate_up_proj"][index].chunk(2)
    return gate if which == "gate_proj" else up


EP_SHAPES = ((3, 9, 1.0), (5, 2, -1.0), (2, 6, 0.5), (4, 5, -0.5))  # two micro-batches per rank


def _ep_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        backend = _megatron(model_dir, ranks=2, expert_parallel=2)
        batch = _batch(EP_SHAPES)
        shard = TrainBatch(batch.sequences[:2] if rank == 0 else batch.sequences[2:])  # each DP rank its own
        logprobs = backend.compute_logprobs(shard)
        weights = backend.hf_state_dict()  # every expert, gathered from both ranks
        metrics = backend.train_step(shard, backend.config)
        gradients = _hf_gradients(backend)
        local_experts = len(backend.model.decoder.layers[0].mlp.experts.local_experts)
        gathered = [None, None]
        dist.all_gather_object(gathered, [lp.tolist() for lp in logprobs])
        if rank == 0:
            torch.save({"logprobs": gathered, "metrics": metrics, "gradients": gradients, "weights": weights,
                        "local_experts": local_experts, "parameters": backend.num_parameters()}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_two_ranks_equal_one_rank(moe_dirs, tmp_path):
    """EP=2 over gloo (each rank 2 of the 4 experts, tokens exchanged all-to-all, each rank its own
    data shard): the same log-probs, loss and gradient (experts summed over the ranks holding them)
    as one rank over the whole batch, and the published weights gather every expert. (The reported router loss is each rank's
    mean over its micro-batches, averaged over ranks: equal here, two micro-batches each.)"""
    port, out = free_port(), str(tmp_path / "ep2.pt")
    model_dir = moe_dirs["qwen3_moe"]
    spawn_ranks(_ep_rank, (port, model_dir, out), 2)
    result = torch.load(out, weights_only=True)
    assert result["local_experts"] == 2
    batch = _batch(EP_SHAPES)
    single = _megatron(model_dir)
    expected = [lp.tolist() for lp in single.compute_logprobs(batch)]
    got = result["logprobs"][0] + result["logprobs"][1]
    for a, b in zip(got, expected):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    metrics = single.train_step(batch, single.config)
    for name in ("loss", "kl", "ratio_mean", "router_aux_loss", "grad_norm", "tokens"):
        assert result["metrics"][name] == pytest.approx(metrics[name], rel=1e-4), name
    one = _hf_gradients(single)
    assert set(one) == set(result["gradients"])
    assert all(torch.allclose(result["gradients"][k], one[k], rtol=1e-4, atol=1e-7) for k in one)
    from safetensors.torch import load_file

    source = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(source) == set(result["weights"]) and result["parameters"] == single.num_parameters()
    assert all(torch.equal(result["weights"][k], source[k]) for k in source)


def _pp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        backend = _megatron(model_dir, ranks=2, pipeline_parallel=2)
        batch = _batch()
        logprobs = backend.compute_logprobs(batch)
        metrics = backend.train_step(batch, backend.config)
        weights = backend.hf_state_dict()
        if rank == 0:
            torch.save({"logprobs": logprobs, "metrics": metrics, "weights": weights,
                        "parameters": backend.num_parameters()}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_pipeline_parallel_two_stages_equal_one_stage(moe_dirs, tmp_path):
    """PP=2 (one MoE layer per stage, micro-batches of different widths through the 1F1B schedule
    with the all-to-all dispatcher): the same log-probs, loss, router loss (each stage's layers
    summed over the pipeline) and gradient norm as one stage, and the whole model published."""
    port, out, model_dir = free_port(), str(tmp_path / "pp2.pt"), moe_dirs["qwen3_moe"]
    spawn_ranks(_pp_rank, (port, model_dir, out), 2)
    result = torch.load(out, weights_only=True)
    single, batch = _megatron(model_dir), _batch()
    for a, b in zip(result["logprobs"], single.compute_logprobs(batch)):
        assert torch.allclose(a, b, atol=1e-6)
    metrics = single.train_step(batch, single.config)
    for name in ("loss", "router_aux_loss", "grad_norm", "kl", "tokens"):
        assert result["metrics"][name] == pytest.approx(metrics[name], rel=1e-5), name
    from safetensors.torch import load_file

    source = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(result["weights"]) == set(source) and result["parameters"] == single.num_parameters()


def test_moe_configs_the_backend_cannot_run_are_refused_by_field(moe_dirs):
    from transformers import AutoConfig, LlamaConfig, Qwen3MoeConfig

    shape = convert.model_shape(AutoConfig.from_pretrained(moe_dirs["qwen3_moe"]))
    assert shape.moe and shape.experts == 4 and shape.topk == 2 and shape.normalise_topk
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide config.json num_experts=4"):
        convert.check_parallel(shape, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match="tensor_parallel=2 with a mixture-of-experts model"):
        convert.check_parallel(shape, tp=2, pp=1)
    dense = convert.model_shape(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="expert_parallel=2 needs a mixture-of-experts model"):
        convert.check_parallel(dense, tp=1, pp=1, ep=2)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        convert.model_shape(Qwen3MoeConfig(**COMMON, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        convert.model_shape(Qwen3MoeConfig(**COMMON, decoder_sparse_step=2))
    with pytest.raises(ValueError, match="expert_parallel=2 does not divide the data-parallel size 1"):
        TrainerConfig(backend={"type": "megatron", "expert_parallel": 2})
    with pytest.raises(ValueError, match="expert_parallel"):
        TrainerConfig(backend={"type": "megatron", "expert_parallel": 0})
    with pytest.raises(ValueError, match="expert_parallel applies to trainer.backend type megatron"):
        TrainerConfig(backend={"type": "torch", "expert_parallel": 2})
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide config.json num_experts=4"):
        _megatron(moe_dirs["qwen3_moe"], ranks=3, expert_parallel=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 Megatron path, DDP + distributed optimizer)")
def test_gpu_bf16_moe_step_and_checkpoint(moe_dirs, tmp_path):
    """The GPU path of a MoE model: bf16 log-probs near HF's, two steps that lower the loss with the
    router loss reported, and a distributed checkpoint that restores the weights exactly."""
    backend = _megatron(moe_dirs["qwen3_moe"])
    batch = _batch()
    for ours, expected in zip(backend.compute_logprobs(batch), _reference(moe_dirs["qwen3_moe"], batch)):
        assert torch.allclose(ours, expected, atol=5e-2)  # bf16 weights and activations
    first = backend.train_step(batch, backend.config)
    path = str(tmp_path / "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    saved = {k: v.clone() for k, v in backend.model.state_dict().items() if not k.endswith("_extra_state")}
    second = backend.train_step(batch, backend.config)
    assert second["loss"] < first["loss"] and first["router_aux_loss"] > 0
    assert backend.load_checkpoint(path) == {"step": 1}
    now = backend.model.state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in saved)


def test_a_router_loss_weight_for_a_dense_model_is_refused(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 applies to mixture-of-experts models"):
        _megatron(tiny_qwen2_dir, router_aux_loss_coef=0.01)
