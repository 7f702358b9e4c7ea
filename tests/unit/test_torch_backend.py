"""Unit tests of the plain-torch training backend on a tiny random Llama (CPU, seconds)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from libra.redis_server import free_port
from libra.services.trainer.backend import TrainBatch, TrainSequence, pack
from libra.services.trainer.config import TrainerConfig
from libra.services.trainer.torch_backend import TorchBackend
from tests.ranks import spawn_ranks

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "micro_batch_size": 16, "torch_threads": 1, **overrides})


def _backend(model_dir: str, **overrides) -> TorchBackend:
    backend = TorchBackend(_config(**overrides), seed=0)
    backend.load(model_dir)
    return backend


def _sequence(seed: int, prompt: int, response: int, advantage: float, tool_at=()) -> TrainSequence:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
    mask = [0 if i in tool_at else 1 for i in range(response)]
    behaviour = (-torch.rand(response, generator=generator) - 3.5).tolist()
    return TrainSequence(tokens, prompt, mask, behaviour, advantage)


def _mixed_batch() -> TrainBatch:
    # Different lengths and masks, so a per-micro-batch mean would weigh tokens differently.
    return TrainBatch([
        _sequence(1, 3, 9, 1.0, tool_at=(3, 4)),
        _sequence(2, 5, 2, -1.0),
        _sequence(3, 2, 6, 0.5, tool_at=(0,)),
        _sequence(4, 4, 4, -0.5),
    ])


def _logits(backend: TorchBackend, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one unpadded row batch, on whichever model the backend loaded."""
    with torch.no_grad():
        if backend.own_forward:
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return backend.model(ids, torch.ones_like(ids), positions, None, last_only=False)[0]
        return backend.model(input_ids=ids).logits


def _parameters(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in backend.model.named_parameters()}


def _with_behaviour(backend: TorchBackend, batch: TrainBatch, shift: float = 0.0) -> TrainBatch:
    """The batch with behaviour log-probs set to the model's own (as if sampled by these weights)."""
    logprobs = backend.compute_logprobs(batch)
    return TrainBatch([TrainSequence(s.token_ids, s.prompt_length, s.loss_mask, (lp + shift).tolist(), s.advantage)
                       for s, lp in zip(batch.sequences, logprobs)])


def test_pack_puts_response_on_the_target_grid():
    packed = pack([TrainSequence([5, 6, 7, 8, 9], 3, [1, 0], [-1.0, -2.0], 0.5), TrainSequence([1, 2], 1, [1], [-3.0], -1.0)])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert packed.response_mask.tolist() == [[False, False, True, True], [True, False, False, False]]
    assert packed.loss_mask.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
    assert packed.advantages.tolist() == [[0, 0, 0.5, 0.5], [-1, 0, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask"):
        TrainSequence([1, 2, 3], 1, [1], [-1.0], 0.0)


def test_compute_logprobs_matches_manual_log_softmax(model_dir):
    backend = _backend(model_dir, micro_batch_size=3)
    batch = _mixed_batch()
    got = backend.compute_logprobs(batch)
    for seq, logprobs in zip(batch.sequences, got):
        ids = torch.tensor([seq.token_ids])
        logits = _logits(backend, ids)[0]
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0][seq.prompt_length - 1 :]
        assert logprobs.shape == (seq.response_length,)
        assert torch.allclose(logprobs, expected, atol=1e-5)


def test_positive_advantage_raises_the_sequence_logprob(model_dir):
    backend = _backend(model_dir, lr=1e-2)
    batch = _with_behaviour(backend, TrainBatch([_sequence(7, 4, 6, 1.0, tool_at=(2,))]))
    mask = torch.tensor(batch.sequences[0].loss_mask, dtype=torch.bool)
    before = backend.compute_logprobs(batch)[0][mask].sum()
    metrics = backend.train_step(batch, _config(lr=1e-2))
    after = backend.compute_logprobs(batch)[0][mask].sum()
    assert after > before + 0.1
    assert metrics["tokens"] == 5 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grad_norm"] > 0 and metrics["seconds"] > 0


def test_micro_batching_gives_the_whole_batch_update(model_dir):
    batch = _mixed_batch()
    whole, single = _backend(model_dir), _backend(model_dir)
    m_whole = whole.train_step(batch, _config(micro_batch_size=4))
    m_single = single.train_step(batch, _config(micro_batch_size=1))
    assert m_whole["loss"] == pytest.approx(m_single["loss"], rel=1e-5)
    assert m_whole["clip_fraction"] == pytest.approx(m_single["clip_fraction"], abs=1e-6)
    for (name, p), q in zip(whole.model.named_parameters(), single.model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name
        assert torch.allclose(p, q, atol=1e-6), name


def _with_equal_groups(backend: TorchBackend) -> TrainBatch:
    """Three groups of two: one whose rewards differ (advantages +-1) and two whose rewards are all
    equal (advantage 0 on every sequence), behaviour log-probs a little off the model's own."""
    batch = TrainBatch([_sequence(11, 3, 7, 1.0, tool_at=(2,)), _sequence(12, 4, 5, -1.0),
                        _sequence(13, 2, 9, 0.0), _sequence(14, 5, 3, 0.0),
                        _sequence(15, 3, 6, 0.0, tool_at=(0, 1)), _sequence(16, 2, 8, 0.0)])
    return _with_behaviour(backend, batch, shift=-0.05)


@pytest.mark.parametrize("recompute", [False, True])
def test_sequences_without_a_gradient_are_left_out_and_the_update_is_the_same(model_dir, recompute):
    skipping, whole = _backend(model_dir), _backend(model_dir, skip_zero_advantage=False)
    batch = _with_equal_groups(whole)
    assert len(batch.with_gradient()) == 2 and batch.with_gradient(keep_one=True) is not batch
    forwarded: list[int] = []
    forward = skipping._forward
    skipping._forward = lambda sequences, packed: forwarded.append(len(sequences)) or forward(sequences, packed)
    config = dict(recompute_logprobs=recompute, micro_batch_size=4)
    m_skip = skipping.train_step(batch, _config(**config))
    m_whole = whole.train_step(batch, _config(skip_zero_advantage=False, **config))
    assert sum(forwarded) == 2 * (2 if recompute else 1)  # only the group whose rewards differ
    assert m_skip["tokens"] == m_whole["tokens"] == batch.loss_tokens  # the same denominator
    assert m_skip["loss"] == pytest.approx(m_whole["loss"], rel=1e-5)
    assert m_skip["clip_fraction"] == pytest.approx(m_whole["clip_fraction"], abs=1e-7)
    assert m_skip["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    for (name, p), q in zip(skipping.model.named_parameters(), whole.model.parameters()):
        assert torch.allclose(p, q, atol=1e-7), name
    # the per-token means are over the tokens with a gradient: here the ratio's, as the whole
    # batch's would be with those tokens alone
    alone = _backend(model_dir).train_step(batch.with_gradient(), _config(**config))
    for name in ("kl", "ratio_mean", "tis_mean"):
        assert m_skip[name] == pytest.approx(alone[name], rel=1e-5), name


def test_nothing_is_left_out_when_every_token_has_a_gradient(model_dir):
    backend = _backend(model_dir)
    batch = _with_equal_groups(backend)
    forwarded: list[int] = []
    forward = backend._forward
    backend._forward = lambda sequences, packed: forwarded.append(len(sequences)) or forward(sequences, packed)
    backend.train_step(batch, _config(kl_coef=0.1))  # the KL term pulls on every token
    assert sum(forwarded) == len(batch)
    forwarded.clear()
    only_equal = TrainBatch(batch.sequences[2:])
    before = _parameters(backend)
    metrics = backend.train_step(only_equal, _config())  # nothing to learn: no pass at all
    assert forwarded == [] and metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert metrics["tokens"] == only_equal.loss_tokens
    assert not all(torch.equal(before[name], p) for name, p in backend.model.named_parameters())  # Adam's momentum
    assert only_equal.with_gradient().sequences == [] and only_equal.with_gradient(keep_one=True).sequences == \
        [only_equal.sequences[0]]


def test_the_optimizer_is_made_once_ahead_of_or_at_the_first_step(model_dir):
    import threading

    ahead, lazy = _backend(model_dir), _backend(model_dir)
    assert ahead._optimizer is None and lazy._optimizer is None  # load makes none (torch._dynamo waits)
    threads = [threading.Thread(target=ahead.prepare_optimizer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made = ahead._optimizer
    assert made is not None and ahead.optimizer is made  # one, however many threads asked
    for backend in (ahead, lazy):
        backend.train_step(_mixed_batch(), _config())
    assert ahead.optimizer is made and lazy.optimizer is not None
    for a, b in zip(ahead.model.parameters(), lazy.model.parameters()):
        assert torch.equal(a, b)  # the same step, whenever the optimizer was made
    ahead.load(model_dir)
    assert ahead._optimizer is None  # a new model gets a new optimizer


def test_recompute_sets_old_to_current_weights(model_dir):
    backend = _backend(model_dir)
    batch = _with_behaviour(backend, _mixed_batch(), shift=-0.1)  # the sampler was a bit less sure
    metrics = backend.train_step(batch, _config(recompute_logprobs=True, tis_cap=5.0))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["tis_mean"] == pytest.approx(torch.tensor(0.1).exp().item(), rel=1e-4)
    assert metrics["clip_fraction"] == 0.0


def test_save_weights_reloads_with_equal_logits(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    source = str(tmp_path / "source")
    shutil.copytree(model_dir, source)
    with open(os.path.join(source, "tokenizer_config.json"), "w") as handle:
        handle.write("{}")
    backend = _backend(source)
    backend.train_step(_mixed_batch(), _config())
    out = str(tmp_path / "v1")
    backend.save_weights(out)
    backend.save_weights(out)  # republishing the same version replaces it
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([_mixed_batch().sequences[0].token_ids])
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, _logits(backend, ids), atol=1e-6)
    _backend(model_dir).save_weights(str(tmp_path / "no-tokenizer"))  # absent tokenizer files are fine


def test_checkpoint_restores_model_optimizer_and_extra(model_dir, tmp_path):
    batch, config = _mixed_batch(), _config()
    first = _backend(model_dir)
    first.train_step(batch, config)
    path = str(tmp_path / "ckpt" / "step-1.pt")
    first.save_checkpoint(path, {"step": 1, "version": 3, "stream": {"offset": "1-0"}})
    saved = _parameters(first)
    first.train_step(batch, config)

    second = _backend(model_dir)
    extra = second.load_checkpoint(path)
    assert extra == {"step": 1, "version": 3, "stream": {"offset": "1-0"}}
    assert all(torch.equal(saved[n], p) for n, p in second.model.named_parameters())
    state_a, state_b = first._optimizer.state_dict()["state"], second._optimizer.state_dict()["state"]
    assert state_b[0]["step"] == 1 and set(state_a) == set(state_b)
    second.train_step(batch, config)
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(p, q), name
    assert os.listdir(tmp_path / "ckpt") == ["step-1.pt"]


TRANSFORMERS = {"backend": {"type": "torch", "forward": "transformers"}}


def test_a_plain_llama_on_cpu_trains_on_the_engines_own_pass(model_dir):
    from libra.llama_forward import LlamaForward

    own = _backend(model_dir)
    assert own.own_forward and isinstance(own.model, LlamaForward) and not own.transformers_because
    asked = _backend(model_dir, **TRANSFORMERS)
    assert not asked.own_forward and "trainer.backend.forward" in asked.transformers_because
    packed = _backend(model_dir, micro_batch_tokens=64)
    assert not packed.own_forward and "packed" in packed.transformers_because


def test_both_models_take_the_same_step(model_dir):
    own, theirs = _backend(model_dir), _backend(model_dir, **TRANSFORMERS)
    batch = _with_behaviour(theirs, _mixed_batch(), shift=-0.05)
    for a, b in zip(own.compute_logprobs(batch), theirs.compute_logprobs(batch)):
        assert torch.allclose(a, b, atol=1e-5)
    m_own = own.train_step(batch, _config(micro_batch_size=2))
    m_theirs = theirs.train_step(batch, _config(micro_batch_size=2))
    assert m_own["loss"] == pytest.approx(m_theirs["loss"], rel=1e-4, abs=1e-6)
    assert m_own["grad_norm"] == pytest.approx(m_theirs["grad_norm"], rel=1e-4)
    for (name, p), q in zip(own.model.named_parameters(), theirs.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_checkpoints_and_weights_move_between_the_two_models(model_dir, tmp_path):
    batch, config = _mixed_batch(), _config()
    theirs = _backend(model_dir, **TRANSFORMERS)
    theirs.train_step(batch, config)
    path = str(tmp_path / "step-1.pt")
    theirs.save_checkpoint(path, {"step": 1})
    own = _backend(model_dir)
    assert own.load_checkpoint(path) == {"step": 1}
    theirs.train_step(batch, config)
    own.train_step(batch, config)  # Adam's moments came across too: the same second step
    for (name, p), q in zip(own.model.named_parameters(), theirs.model.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
    out = str(tmp_path / "published")
    own.save_weights(out)  # what the engine's own pass publishes, transformers loads
    again = _backend(out, **TRANSFORMERS)
    ids = torch.tensor([batch.sequences[0].token_ids])
    assert torch.allclose(_logits(again, ids), _logits(own, ids), atol=1e-6)


def test_the_trainer_never_imports_transformers_on_the_own_pass(model_dir):
    import subprocess
    import sys

    script = ("import sys; from libra.services.trainer.config import TrainerConfig; "
              "from libra.services.trainer.torch_backend import TorchBackend; "
              "b = TorchBackend(TrainerConfig(torch_threads=1)); b.load(sys.argv[1]); "
              "print(b.own_forward, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, model_dir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def _data_parallel_rank(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        backend = _backend(model_dir, micro_batch_size=1)
        shard = TrainBatch(_mixed_batch().sequences[rank::world])
        metrics = backend.train_step(shard, _config(micro_batch_size=1))
        if rank == 0:
            torch.save({"params": _parameters(backend), "metrics": metrics}, out)
        dist.barrier()  # both ranks done before either tears its gloo group down
    finally:
        dist.destroy_process_group()


def test_data_parallel_update_equals_single_process(model_dir, tmp_path):
    port = free_port()
    out = str(tmp_path / "rank0.pt")
    # spawn, not fork: the test process has threads by now (gRPC, executors, transformers' loader
    # pool) and a forked child can deadlock on a lock one of them held.
    spawn_ranks(_data_parallel_rank, (2, model_dir, port, out), 2)
    result = torch.load(out, weights_only=True)
    single = _backend(model_dir)
    metrics = single.train_step(_mixed_batch(), _config())
    assert result["metrics"]["tokens"] == metrics["tokens"]
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    for name, p in single.model.named_parameters():
        assert torch.allclose(result["params"][name], p, atol=1e-6), name
