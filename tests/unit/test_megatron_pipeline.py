"""Pipeline parallelism of the Megatron backend on CPU: PP=2 (and TP=2 × PP=2) against PP=1.

Real processes (torch.multiprocessing spawn, gloo): each rank loads its stage of a tiny random
model, and the step runs through Megatron's 1F1B schedule with micro-batches of different widths
and sizes. What must hold: the same log-probs on every rank, the same loss and metrics on every
rank, the same updated weights after one and after two steps (the second recomputing old
log-probs and with a KL term), the same gathered HF state dict, the same parameter count — with
tied embeddings (Qwen2: the copy on the last stage) and untied ones (Llama). Published weights
hold the whole model, and a distributed checkpoint saved at PP=2 restores model and optimizer
exactly. The errors for layouts that cannot work are checked in-process.

How close "the same" is (measured, qwen2 at PP=2 against PP=1): after step 1 every gradient and
weight is bitwise equal except the tied embedding's gradient, whose two halves (input embedding,
LM head) PP=2 adds with an all-reduce across stages and PP=1 with autograd: 1 ulp apart. From
step 2 on that ulp is in the weights, so every gradient differs by float noise (≤ 2e-7 of its
tensor's largest element). Adam divides each element's gradient by √v̂ + ε, so an element whose
own gradient nearly cancels takes that noise amplified: Qwen2's k_proj biases have such elements
(RoPE rotates keys after the bias, so their gradient is not zero, but on the slow rotary
frequencies q·R(j−i)·b barely depends on j and softmax cancels it). Weights are therefore
compared within a bound derived from Adam's state (`_noise_bound`), not with one loose tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from libra.redis_server import free_port
from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from tests.ranks import spawn_ranks

VOCAB = 64
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
SECOND_STEP = dict(recompute_logprobs=True, kl_coef=0.1)
# Float32 noise of a gradient from another summation order, relative to its tensor's largest
# gradient (≈ max √v̂). Measured: ≤ 2e-7 at PP=2; up to 7e-6 at TP=2 × PP=2, on a k_proj bias,
# whose gradient is the small difference of much larger terms. Allowed: 3e-5.
GRADIENT_NOISE = 3e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = {}
    for kind in ("qwen2", "llama"):
        torch.manual_seed(0)
        if kind == "qwen2":  # qkv biases, tied embeddings
            model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False))
        else:
            model = LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False))
        with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping of either shows
            for name, p in model.named_parameters():
                if "norm" in name or "bias" in name:
                    p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        path = str(tmp_path_factory.mktemp(kind))
        model.save_pretrained(path)
        out[kind] = path
    return out


def _batch() -> TrainBatch:
    """Five sequences in micro-batches of 2: three micro-batches of different widths and sizes."""
    generator = torch.Generator().manual_seed(7)
    sequences = []
    for index, (prompt, response) in enumerate(((3, 9), (5, 2), (2, 6), (4, 11), (6, 3))):
        tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
        mask = [0 if i == 1 else 1 for i in range(response)]  # a tool token in each
        behaviour = (-torch.rand(response, generator=generator) - 3.5).tolist()
        sequences.append(TrainSequence(tokens, prompt, mask, behaviour, 1.0 if index % 2 else -0.5))
    return TrainBatch(sequences)


def _config(tp: int = 1, pp: int = 1, spec: str = "sdpa", **overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-2, "micro_batch_size": 2, "torch_threads": 1,
                            "backend": {"type": "megatron", "tensor_parallel": tp, "pipeline_parallel": pp,
                                        "layer_spec": spec},
                            **overrides})


def _backend(model_dir: str, tp: int = 1, pp: int = 1, spec: str = "sdpa"):
    from libra.services.trainer.megatron.backend import MegatronBackend

    backend = MegatronBackend(_config(tp, pp, spec), seed=0)
    backend.load(model_dir)
    return backend


def _adam_v_hat(backend) -> dict[str, torch.Tensor]:
    """Adam's bias-corrected second moment v̂ of every parameter, in HF names (one process: the CPU
    path's torch AdamW over the whole model)."""
    from libra.services.trainer.megatron import convert

    optimizer = backend.optimizer
    beta2 = optimizer.param_groups[0]["betas"][1]
    v_hat = {name: optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** float(optimizer.state[p]["step"]))
             for name, p in backend.model.named_parameters()}
    return convert.megatron_to_hf([v_hat], backend.shape)


def _noise_bound(v_hats: list[dict[str, torch.Tensor]], name: str, lr: float, eps: float) -> torch.Tensor:
    """How far float noise in the gradients may move each element of weight `name`, over the steps
    taken (one v̂ per step).

    Adam moves an element by lr·m̂/(√v̂ + ε), so a change δg of its gradient moves it by about
    lr·δg/(√v̂ + ε). Another summation order changes a gradient by a few ulps of the sums that make
    it, i.e. of the tensor's large gradients (≈ max √v̂), not of the element's own: δg ≈
    GRADIENT_NOISE · max √v̂. Where an element's gradient is of the tensor's size this is lr·3e-5 =
    3e-7, below the base tolerance; only elements whose gradient nearly cancels get more (an element
    with √v̂ at 1e-3 of its tensor's largest: 3e-4 = 3% of lr), and their update is float noise in any
    correct implementation. A wrong gradient moves the typical element by ~lr, a flipped sign by
    2·lr: still caught (a PP=2 whose tied embedding misses the LM head's gradient fails on the
    embedding; one whose last stage scales its gradient by 1.5 fails on every weight after step 2).
    """
    bound = torch.zeros_like(v_hats[0][name])
    for v_hat in v_hats:
        root = v_hat[name].sqrt()
        bound += lr * GRADIENT_NOISE * root.max() / (root + eps)
    return bound


def _run(model_dir: str, tp: int = 1, pp: int = 1, spec: str = "sdpa", checkpoint: str | None = None,
         weights: str | None = None, adam: bool = False) -> dict:
    """Load, log-probs, two steps, the HF state after each; optionally published weights, a
    checkpoint round trip and (`adam`, one process only) Adam's v̂ after each step."""
    backend = _backend(model_dir, tp, pp, spec)
    batch = _batch()
    out = {"parameters": backend.num_parameters(), "hf_loaded": backend.hf_state_dict(),
           "logprobs": backend.compute_logprobs(batch)}
    out["step1"] = backend.train_step(batch, _config(tp, pp))
    out["hf_step1"] = backend.hf_state_dict()
    out["v_hat_step1"] = _adam_v_hat(backend) if adam else None
    out["step2"] = backend.train_step(batch, _config(tp, pp, **SECOND_STEP))
    out["hf_step2"] = backend.hf_state_dict()
    out["v_hat_step2"] = _adam_v_hat(backend) if adam else None
    out["adam_eps"] = backend.optimizer.param_groups[0]["eps"]
    if weights is not None:
        backend.save_weights(weights)
    if checkpoint is not None:
        out["checkpoint"] = _checkpoint_round_trip(backend, batch, tp, pp, spec, checkpoint)
    return out


def _checkpoint_round_trip(first, batch: TrainBatch, tp: int, pp: int, spec: str, path: str) -> dict[str, bool]:
    """Save, step; a fresh backend loads the save and steps: the same weights (model + Adam state)."""
    first.save_checkpoint(path, {"step": 2})
    saved = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    first.train_step(batch, _config(tp, pp))
    second = _backend(first.model_dir, tp, pp, spec)
    extra = second.load_checkpoint(path)
    restored = all(torch.equal(saved[n], p) for n, p in second.model.named_parameters())
    second.train_step(batch, _config(tp, pp))
    after = {n: p.detach() for n, p in first.model.named_parameters()}
    stepped = all(torch.equal(after[n], p) for n, p in second.model.named_parameters())
    return {"extra": extra == {"step": 2}, "restored": restored, "stepped_equal": stepped}


def _rank(rank: int, world: int, port: int, model_dir: str, tp: int, pp: int, spec: str, out_dir: str,
          checkpoint: str | None) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result = _run(model_dir, tp, pp, spec, checkpoint, weights=os.path.join(out_dir, "weights"))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank done before any tears its gloo groups down
    finally:
        dist.destroy_process_group()


def _spawn(model_dir: str, tp: int, pp: int, out_dir: str, spec: str = "sdpa",
           checkpoint: str | None = None) -> list[dict]:
    port = free_port()
    world = tp * pp
    spawn_ranks(_rank, (world, port, model_dir, tp, pp, spec, out_dir, checkpoint), world)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def _assert_matches_single_process(ranks: list[dict], single: dict) -> None:
    """`single`: a one-process `_run(..., adam=True)`. Updated weights match within rtol 1e-5,
    atol 1e-6, plus the float noise that Adam amplifies (`_noise_bound`)."""
    rank0 = ranks[0]
    assert set(rank0["hf_loaded"]) == set(single["hf_loaded"])
    assert all(torch.equal(rank0["hf_loaded"][k], v) for k, v in single["hf_loaded"].items())
    for result in ranks:  # every rank: log-probs, metrics, parameter count
        assert result["parameters"] == single["parameters"]
        for ours, expected in zip(result["logprobs"], single["logprobs"], strict=True):
            assert torch.allclose(ours, expected, atol=1e-6), (ours - expected).abs().max()
        for step in ("step1", "step2"):
            assert set(result[step]) == set(single[step])
            for name, value in single[step].items():
                if name != "seconds":
                    assert result[step][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
    for result in ranks[1:]:
        assert result["hf_loaded"] is None and result["hf_step2"] is None
    lr = _config().lr
    for steps, step in ((1, "hf_step1"), (2, "hf_step2")):
        assert set(rank0[step]) == set(single[step])
        v_hats = [single[f"v_hat_step{s}"] for s in range(1, steps + 1)]
        for name, value in single[step].items():
            excess = ((rank0[step][name] - value).abs() - 1e-5 * value.abs() - 1e-6
                      - _noise_bound(v_hats, name, lr, single["adam_eps"]))
            assert excess.max() <= 0, (step, name, (rank0[step][name] - value).abs().max(), excess.max())
        moved = max(float((rank0[step][k] - single["hf_loaded"][k]).abs().max()) for k in single[step])
        assert moved > 1e-3  # the step did update the weights


@pytest.mark.slow
@pytest.mark.parametrize("kind,spec", [("qwen2", "sdpa"), ("llama", "local")])
def test_two_stages_equal_one_stage(kind, spec, model_dirs, tmp_path):
    """PP=2 over gloo: log-probs, metrics, weights after 1 and 2 steps, HF state, count = PP=1.
    Qwen2 (tied embeddings) also round-trips a distributed checkpoint at PP=2; Llama runs the local
    spec (the causal mask reaches every stage)."""
    from safetensors.torch import load_file

    checkpoint = str(tmp_path / "checkpoints" / "step2.pt") if kind == "qwen2" else None
    ranks = _spawn(model_dirs[kind], 1, 2, str(tmp_path), spec, checkpoint)
    _assert_matches_single_process(ranks, _run(model_dirs[kind], spec=spec, adam=True))
    published = load_file(str(tmp_path / "weights" / "model.safetensors"))  # save_weights: written by rank 0
    assert set(published) == set(ranks[0]["hf_step2"])
    assert all(torch.equal(published[k], v) for k, v in ranks[0]["hf_step2"].items())
    assert os.path.exists(tmp_path / "weights" / "config.json")
    if checkpoint is not None:
        for result in ranks:
            assert result["checkpoint"] == {"extra": True, "restored": True, "stepped_equal": True}


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_four_ranks_equal_one(model_dirs, tmp_path):
    """TP=2 × PP=2 over gloo (4 processes), tied embeddings: the same as one process. TP splits the
    sums inside each matmul, so every gradient differs in the last bits from step 1 on: the same
    Adam noise bound as PP=2 covers it (the largest noise that GRADIENT_NOISE allows for was measured
    here)."""
    ranks = _spawn(model_dirs["qwen2"], 2, 2, str(tmp_path))
    _assert_matches_single_process(ranks, _run(model_dirs["qwen2"], adam=True))


def test_layouts_that_cannot_work_are_refused(model_dirs):
    from libra.services.trainer.megatron.backend import MegatronBackend

    # One process cannot hold two stages.
    with pytest.raises(ValueError, match="pipeline_parallel=2 = 2 does not divide the world size 1"):
        MegatronBackend(_config(pp=2)).load(model_dirs["llama"])
    with pytest.raises(ValueError, match="pipeline_parallel=3 does not divide config.json num_hidden_layers=4"):
        MegatronBackend(_config(pp=3)).load(model_dirs["llama"])
    # A hybrid replica's gradient is the whole model's; a stage's is not.
    assert "pipeline_parallel=2" in MegatronBackend(_config(pp=2)).hybrid_refusal()
    assert MegatronBackend(_config()).hybrid_refusal() is None  # PP=1 (CPU): hybrids can join
