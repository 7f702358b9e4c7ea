"""One behaviour suite for every training backend (plain torch, Megatron-Core), on CPU.

Same tiny Qwen2 model (GQA, qkv biases, tied embeddings), same batches: what the trainer relies on
must hold for each backend — log-probs equal to the Hugging Face model's, a step that lowers the
loss of a repeated batch, masked (tool/environment) tokens that contribute no gradient, published
weights that reload in transformers, checkpoints that restore model and optimizer exactly, the
elastic gradient hook's arithmetic (`gradient_hook.train_step`): a hybrid's gradient added
gives the update of one larger batch, a hybrid that misses the deadline that of what arrived —
and packing (`trainer.micro_batch_tokens`: sequences concatenated with no padding, micro-batches
by a token budget) changes none of it: log-probs, loss, metrics, gradients and the update equal
the padded ones, with and without a hybrid.

The new model kinds run the same suite: a mixture-of-experts model (a tiny Qwen3-MoE, on both
backends; its routers' load-balancing loss is off here, because it depends on how tokens are
grouped into micro-batches — tests/unit/test_moe.py covers it) and LoRA (`trainer.lora`: adapters
only trained, checkpointed and published merged; tests/unit/test_lora.py has what is LoRA's own).
"""

from __future__ import annotations

import os

import pytest
import torch

from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.gradient_hook import GradientHook, HybridGradients, HybridShare
from tests.unit.conftest import TINY_VOCAB

VOCAB = TINY_VOCAB  # the model of tests/unit/conftest.py
LORA = {"rank": 4, "alpha": 8.0}
# kind: (backend, model, settings every config of the kind has)
KINDS = {
    "torch": ("torch", "qwen2", {}),
    "megatron": ("megatron", "qwen2", {}),
    "torch-moe": ("torch", "qwen3_moe", {}),
    "megatron-moe": ("megatron", "qwen3_moe", {"backend": {"type": "megatron", "router_aux_loss_coef": 0.0}}),
    "torch-lora": ("torch", "qwen2", {"lora": LORA}),
    "megatron-lora": ("megatron", "qwen2", {"lora": LORA}),
}
BACKENDS = list(KINDS)
# Adam's first step is lr · g / (|g| + eps): an element whose gradient is within ~100 eps of zero
# turns float noise of ~1e-9 in g (another summation order) into ~1e-5 in its update. Measured on
# the new kinds with packed core + hybrid against one padded process: a LoRA B element with
# g = 2.5e-9 and a MoE qkv weight with g = 1.1e-7 (gradients equal to 2e-9), updates 2e-5 apart;
# then in CI (12-05) on plain megatron, a qkv weight element 1.5e-5 apart. Such elements (|g| < 1e-6)
# are exempt from the update comparison on every kind (their gradients are compared, to 1e-7).


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from tests.unit.test_moe import hf_moe_model

    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    hf_moe_model("qwen3_moe").save_pretrained(path)
    return path


@pytest.fixture
def model_dir(request, tiny_qwen2_dir) -> str:
    """The model of the test's kind: the tiny Qwen2 of tests/unit/conftest.py, or a tiny Qwen3-MoE."""
    model = KINDS[request.node.callspec.params["kind"]][1]
    return tiny_qwen2_dir if model == "qwen2" else request.getfixturevalue("moe_dir")


def _config(kind: str = "torch", **overrides) -> TrainerConfig:
    backend, _, settings = KINDS[kind]
    return TrainerConfig(**{"lr": 1e-2, "micro_batch_size": 2, "torch_threads": 1, "backend": backend,
                            **settings, **overrides})


def _backend(kind: str, model_dir: str, **overrides):
    config = _config(kind, **overrides)
    if KINDS[kind][0] == "torch":
        from libra.services.trainer.torch_backend import TorchBackend

        backend = TorchBackend(config, seed=0)
    else:
        from libra.services.trainer.megatron.backend import MegatronBackend

        backend = MegatronBackend(config, seed=0)
    backend.load(model_dir)
    return backend


def _sequence(seed: int, prompt: int, response: int, advantage: float, tool_at=()) -> TrainSequence:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
    mask = [0 if i in tool_at else 1 for i in range(response)]
    behaviour = (-torch.rand(response, generator=generator) - 3.5).tolist()
    return TrainSequence(tokens, prompt, mask, behaviour, advantage)


def _batch() -> TrainBatch:
    return TrainBatch([_sequence(1, 3, 9, 1.0, tool_at=(3, 4)), _sequence(2, 5, 2, -1.0),
                       _sequence(3, 2, 6, 0.5, tool_at=(0,))])


PACKED_TOKENS = 24  # the budget that puts several of the batches' sequences in one row


def _long_tailed_batch() -> TrainBatch:
    """Lengths 4..40 in no order (a long tail, as agentic trajectories), tool tokens masked out."""
    shapes = [(3, 37, 1.0, (5, 6, 7)), (2, 2, -1.0, ()), (4, 9, 0.5, (1,)), (5, 14, -0.5, ()),
              (2, 3, 1.5, ()), (3, 5, -1.5, (0, 4)), (6, 6, 0.25, ())]
    return TrainBatch([_sequence(10 + i, p, r, a, tool_at=t) for i, (p, r, a, t) in enumerate(shapes)])


def _parameters(backend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters()}


def _reference_logprobs(model_dir: str, batch: TrainBatch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for seq in batch.sequences:
        ids = torch.tensor([seq.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][seq.prompt_length - 1:])
    return out


@pytest.mark.parametrize("kind", BACKENDS)
def test_logprobs_equal_the_hugging_face_model(kind, model_dir):
    backend = _backend(kind, model_dir)
    batch = _batch()
    got = backend.compute_logprobs(batch)
    for seq, logprobs, expected in zip(batch.sequences, got, _reference_logprobs(model_dir, batch)):
        assert logprobs.shape == (seq.response_length,) and torch.isfinite(logprobs).all()
        assert torch.allclose(logprobs, expected, atol=1e-5), (kind, (logprobs - expected).abs().max())
    assert backend.num_parameters() == sum(p.numel() for p in _reference_model_parameters(model_dir))


def _reference_model_parameters(model_dir: str):
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir).parameters())


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_step_lowers_the_loss_of_a_repeated_batch(kind, model_dir):
    backend = _backend(kind, model_dir, lr=3e-3)
    batch = _batch()
    first = backend.train_step(batch, _config(kind, lr=3e-3))
    second = backend.train_step(batch, _config(kind, lr=3e-3))
    assert all(torch.isfinite(torch.tensor(v)) for v in first.values())
    assert first["tokens"] == batch.loss_tokens and first["grad_norm"] > 0
    assert second["loss"] < first["loss"] - 1e-3


@pytest.mark.parametrize("kind", BACKENDS)
def test_masked_tokens_contribute_no_gradient(kind, model_dir):
    """Behaviour log-probs enter the loss per token (KL and importance weight): changing them only
    where loss_mask = 0 must leave the update unchanged; changing a trained token's must not."""
    batch = _batch()
    config = dict(kl_coef=0.5, recompute_logprobs=True)

    def changed(position_masked: bool) -> TrainBatch:
        seq = batch.sequences[0]
        index = 3 if position_masked else 5  # tool_at=(3, 4) in the first sequence
        assert seq.loss_mask[index] == (0 if position_masked else 1)
        behaviour = list(seq.behaviour_logprobs)
        behaviour[index] -= 2.0
        return TrainBatch([TrainSequence(seq.token_ids, seq.prompt_length, seq.loss_mask, behaviour, seq.advantage),
                           *batch.sequences[1:]])

    updates = []
    for variant in (batch, changed(True), changed(False)):
        backend = _backend(kind, model_dir, **config)
        backend.train_step(variant, _config(kind, **config))
        updates.append(_parameters(backend))
    base, masked, trained = updates
    assert all(torch.allclose(base[n], masked[n], rtol=0, atol=1e-7) for n in base)
    assert not all(torch.allclose(base[n], trained[n], rtol=0, atol=1e-7) for n in base)


@pytest.mark.parametrize("kind", BACKENDS)
def test_sequences_with_advantage_zero_are_left_out_with_the_same_update(kind, model_dir):
    """`trainer.skip_zero_advantage` (the default): a group whose rewards were all equal (advantage
    0 on each sequence) is not computed, the token mean still counts its tokens, and the update and
    the loss are those of the whole batch; with every sequence at 0 the step still runs (the
    Megatron backend keeps one, so that each rank runs a micro-batch) and changes no gradient."""
    batch = TrainBatch([*_batch().sequences, _sequence(7, 4, 5, 0.0), _sequence(8, 2, 7, 0.0, tool_at=(1,)),
                        _sequence(9, 3, 4, 0.0)])
    results = []
    for skip in (True, False):
        backend = _backend(kind, model_dir, skip_zero_advantage=skip)
        metrics = backend.train_step(batch, _config(kind, skip_zero_advantage=skip))
        results.append((metrics, _parameters(backend)))
    (m_skip, p_skip), (m_all, p_all) = results
    assert m_skip["tokens"] == m_all["tokens"] == batch.loss_tokens
    assert m_skip["loss"] == pytest.approx(m_all["loss"], rel=1e-5, abs=1e-9)
    assert m_skip["grad_norm"] == pytest.approx(m_all["grad_norm"], rel=1e-4)
    for name in p_skip:
        assert torch.allclose(p_skip[name], p_all[name], rtol=0, atol=2e-6), name
    nothing = TrainBatch(batch.sequences[3:])
    backend = _backend(kind, model_dir)
    metrics = backend.train_step(nothing, _config(kind))
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("kind", BACKENDS)
def test_published_weights_reload_in_transformers(kind, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _backend(kind, model_dir)
    batch = _batch()
    backend.train_step(batch, _config(kind))
    out = str(tmp_path / "v1")
    backend.save_weights(out)
    assert os.path.exists(os.path.join(out, "model.safetensors")) and os.path.exists(os.path.join(out, "config.json"))
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    AutoModelForCausalLM.from_pretrained(out)
    for ours, reloaded in zip(backend.compute_logprobs(batch), _reference_logprobs(out, batch)):
        assert torch.allclose(ours, reloaded, atol=1e-5)


@pytest.mark.parametrize("kind", BACKENDS)
def test_checkpoint_round_trip_restores_model_and_optimizer(kind, model_dir, tmp_path):
    batch = _batch()
    first = _backend(kind, model_dir)
    first.train_step(batch, _config(kind))
    path = str(tmp_path / "checkpoints" / "step1.pt")
    first.save_checkpoint(path, {"step": 1, "stream": {"offset": "1-0"}})
    saved = _parameters(first)
    first.train_step(batch, _config(kind))

    second = _backend(kind, model_dir)
    assert second.load_checkpoint(path) == {"step": 1, "stream": {"offset": "1-0"}}
    assert all(torch.equal(saved[n], p) for n, p in second.model.named_parameters())
    second.train_step(batch, _config(kind))  # equal only if Adam's moments and step came back too
    after = _parameters(second)
    assert all(torch.equal(after[n], p) for n, p in first.model.named_parameters())


class _OneHybrid(GradientHook):
    """A hook with one in-process hybrid replica (another backend) training on `slice_`; with
    `arrives=False` the hybrid misses the deadline: its tokens were counted, its gradient never comes."""

    def __init__(self, hybrid, slice_: TrainBatch, config: TrainerConfig, arrives: bool = True):
        self.hybrid, self.slice, self.config, self.arrives = hybrid, slice_, config, arrives
        self.token_count: float | None = None
        self.delivered: torch.Tensor | None = None

    def share(self) -> HybridShare:
        return HybridShare(loss_tokens=float(self.slice.loss_tokens), sequences=len(self.slice), replicas=1)

    def start(self, token_count: float, replicas: int, config: TrainerConfig) -> None:
        assert replicas == 2
        self.token_count = token_count

    def inject(self, flat_grad: torch.Tensor) -> HybridGradients:
        if not self.arrives:
            return HybridGradients(missing_tokens=float(self.slice.loss_tokens))
        sums = self.hybrid.accumulate_gradients(self.slice, self.config, token_count=self.token_count)
        flat_grad += self.hybrid.flat_gradients()
        return HybridGradients(metric_sums=dict(sums))

    def deliver(self, reduced_grad: torch.Tensor, config: TrainerConfig) -> None:
        self.delivered = reduced_grad.clone()


@pytest.mark.parametrize("kind", BACKENDS)
def test_gradient_hook_update_equals_one_process_over_both_slices(kind, model_dir):
    """A hybrid replica's gradient added before the DP reduce gives the update of the whole batch."""
    config = _config(kind, max_grad_norm=1e6)  # unclipped: the gradients are compared too
    # shortest first, so that the whole batch's micro-batches (like lengths together) are the slices'
    # own and the sums run in the same order: Adam's first step magnifies rounding in near-zero gradients
    batch = TrainBatch(sorted(_batch().sequences, key=lambda s: len(s.token_ids)))
    core_slice, hybrid_slice = TrainBatch(batch.sequences[:2]), TrainBatch(batch.sequences[2:])
    core = _backend(kind, model_dir)
    core.gradient_hook = hook = _OneHybrid(_backend(kind, model_dir), hybrid_slice, config)
    metrics = core.train_step(core_slice, config)
    single = _backend(kind, model_dir)
    expected = single.train_step(batch, config)
    assert metrics["tokens"] == expected["tokens"] and metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert torch.allclose(hook.delivered, single.flat_gradients(), rtol=1e-4, atol=1e-7)
    assert torch.equal(core.flat_gradients(), hook.delivered)  # what the core stepped with
    reference = _parameters(single)
    assert all(torch.allclose(reference[n], p, atol=1e-6) for n, p in core.model.named_parameters())


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_hybrid_that_misses_the_deadline_leaves_the_token_mean_of_what_arrived(kind, model_dir):
    """Its loss tokens are in N but its gradient is absent: the rescale N / (N − missed) makes the
    update, and the gradient itself (Adam would hide a wrong scale), the core slice's alone."""
    batch, config = _batch(), _config(kind, max_grad_norm=1e6)
    core_slice, hybrid_slice = TrainBatch(batch.sequences[:2]), TrainBatch(batch.sequences[2:])
    core = _backend(kind, model_dir)
    core.gradient_hook = hook = _OneHybrid(None, hybrid_slice, config, arrives=False)
    metrics = core.train_step(core_slice, config)
    single = _backend(kind, model_dir)
    single.train_step(core_slice, config)
    assert metrics["tokens"] == batch.loss_tokens
    assert torch.allclose(hook.delivered, single.flat_gradients(), rtol=1e-4, atol=1e-7)
    assert torch.equal(core.flat_gradients(), hook.delivered)  # what the core stepped with
    # Adam's first step is about lr · sign(g): where |g| is near its eps the rounding of the
    # rescale shows, so the parameters are compared to a hundredth of a step.
    reference = _parameters(single)
    assert all(torch.allclose(reference[n], p, atol=1e-4) for n, p in core.model.named_parameters())


@pytest.mark.parametrize("kind", BACKENDS)
def test_packed_micro_batches_change_no_arithmetic(kind, model_dir):
    """Concatenated rows in token-budget micro-batches against right-padded ones of two sequences:
    the same log-probs, loss, metrics, gradient and update (recompute and KL on, so the old
    log-probs and the behaviour ones both enter per token)."""
    batch = _long_tailed_batch()
    plan = batch.plan(2, PACKED_TOKENS)
    assert any(len(micro) > 1 for micro in plan) and len(plan) < len(batch)  # really packed
    assert max(sum(len(batch.sequences[i].token_ids) for i in micro) for micro in plan if len(micro) > 1) \
        <= PACKED_TOKENS
    options = dict(max_grad_norm=1e6, kl_coef=0.3, recompute_logprobs=True)
    results = []
    for tokens in (0, PACKED_TOKENS):
        backend = _backend(kind, model_dir, micro_batch_tokens=tokens, **options)
        config = _config(kind, micro_batch_tokens=tokens, **options)
        logprobs = backend.compute_logprobs(batch)
        metrics = backend.train_step(batch, config)
        grads = {n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        results.append((logprobs, metrics, backend.flat_gradients().clone(), _parameters(backend), grads))
    (padded_lp, padded, padded_grad, padded_params, grads), (packed_lp, packed, packed_grad, packed_params, _) = results
    for seq, a, b in zip(batch.sequences, padded_lp, packed_lp):
        assert a.shape == b.shape == (seq.response_length,)
        assert torch.allclose(a, b, atol=2e-6), (kind, (a - b).abs().max())
    for name in ("loss", "clip_fraction", "kl", "ratio_mean", "tis_mean", "tokens", "sequences"):
        assert packed[name] == pytest.approx(padded[name], rel=1e-5, abs=1e-7), name
    assert torch.allclose(packed_grad, padded_grad, rtol=1e-4, atol=1e-7), (packed_grad - padded_grad).abs().max()
    # Adam's first step is about lr · sign(g): where |g| is near its eps, float rounding of the
    # gradient shows in the step, so the parameters are compared to a thousandth of a step, but for
    # the near-zero gradients (on an AVX2-only CPU: one MoE expert element with
    # g = 1.6e-9 both ways, its updates 1.6e-5 apart; its gradient is compared above).
    for n in padded_params:
        close = torch.isclose(padded_params[n], packed_params[n], atol=1e-5)
        if n in grads:
            close |= grads[n].abs() < 1e-6
        assert close.all(), (n, (padded_params[n] - packed_params[n]).abs().max())


@pytest.mark.parametrize("kind", BACKENDS)
def test_packed_attention_keeps_to_each_sequence(kind, model_dir):
    """A sequence's log-probs do not depend on what it is packed with (nor where in the row): a
    row whose attention leaked across sequences would fail this."""
    batch = _long_tailed_batch()
    backend = _backend(kind, model_dir, micro_batch_tokens=200)  # the whole batch in one row
    together = backend.compute_logprobs(batch)
    alone = [backend.compute_logprobs(TrainBatch([seq]))[0] for seq in batch.sequences]
    for a, b in zip(together, alone):
        assert torch.allclose(a, b, atol=2e-6), (kind, (a - b).abs().max())
    for got, expected in zip(together, _reference_logprobs(model_dir, batch)):
        assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("kind", BACKENDS)
def test_gradient_hook_arithmetic_is_unchanged_by_packing(kind, model_dir):
    """Core and hybrid both packed: the update is that of one padded process over both slices."""
    batch, options = _long_tailed_batch(), dict(max_grad_norm=1e6)
    core_slice, hybrid_slice = TrainBatch(batch.sequences[:4]), TrainBatch(batch.sequences[4:])
    packed_config = _config(kind, micro_batch_tokens=PACKED_TOKENS, **options)
    core = _backend(kind, model_dir, micro_batch_tokens=PACKED_TOKENS, **options)
    hybrid = _backend(kind, model_dir, micro_batch_tokens=PACKED_TOKENS, **options)
    core.gradient_hook = hook = _OneHybrid(hybrid, hybrid_slice, packed_config)
    metrics = core.train_step(core_slice, packed_config)
    single = _backend(kind, model_dir, **options)
    expected = single.train_step(batch, _config(kind, **options))
    assert metrics["tokens"] == expected["tokens"] and metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert torch.allclose(hook.delivered, single.flat_gradients(), rtol=1e-4, atol=1e-7)
    reference = _parameters(single)
    assert all(p.grad is not None for p in single.model.parameters() if p.requires_grad)  # what the exemption reads
    for n, p in core.model.named_parameters():
        close = torch.isclose(reference[n], p, atol=1e-5)
        if p.grad is not None:
            close |= single.model.get_parameter(n).grad.abs() < 1e-6
        assert close.all(), (n, (reference[n] - p).abs().max())
