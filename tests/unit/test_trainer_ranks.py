"""The trainer on several ranks (services/trainer/ranks.py): rank 0's LeaderBackend announces every
collective call, the other ranks follow.

Real processes (spawn, gloo, torchrun's environment variables): two data-parallel ranks of the
Megatron backend on a tiny random Qwen2 model. Rank 0 makes the calls the service makes (load, log-
probs, two GRPO steps, the HF export, published weights, a checkpoint); rank 1 only follows. What
must hold: rank 0 sees what one process sees (log-probs, metrics, weights after each step — each
rank trained its own shard of whole groups, 1 group and 2), the follower made every call and was
released by `stop`, the files exist once, and each rank leaves its process groups. A torch trainer
launched on two ranks fails at start.
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
GROUP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                         max_position_embeddings=128, tie_word_embeddings=True,
                                         use_sliding_window=False))
    path = str(tmp_path_factory.mktemp("qwen2"))
    model.save_pretrained(path)
    return path


def _batch() -> TrainBatch:
    """Three groups of two: the two data-parallel ranks train one group and two."""
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for index, (prompt, response) in enumerate(((3, 7), (4, 5), (2, 9), (5, 4), (3, 3), (6, 8))):
        tokens = torch.randint(1, VOCAB, (prompt + response,), generator=generator).tolist()
        behaviour = (-torch.rand(response, generator=generator) - 3.0).tolist()
        sequences.append(TrainSequence(tokens, prompt, [1] * response, behaviour, 1.0 if index % 2 else -1.0))
    return TrainBatch(sequences)


def _config() -> TrainerConfig:
    return TrainerConfig(lr=1e-2, micro_batch_size=2, torch_threads=1, group_size=GROUP,
                         backend={"type": "megatron", "distributed_optimizer": False})


def _calls(backend, out_dir: str) -> dict:
    """What the trainer service asks of its backend, in its order."""
    batch, config = _batch(), _config()
    backend.load(os.environ["LIBRA_TEST_MODEL"])
    out = {"logprobs": backend.compute_logprobs(batch), "step1": backend.train_step(batch, config)}
    out["hf_step1"] = backend.hf_state_dict()
    out["step2"] = backend.train_step(batch, config)
    out["hf_step2"] = backend.hf_state_dict()
    backend.save_weights(os.path.join(out_dir, "weights"))
    backend.save_checkpoint(os.path.join(out_dir, "checkpoint"), {"step": 2})
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank), LIBRA_TEST_MODEL=model_dir)
    from libra.services.trainer import ranks
    from libra.services.trainer.megatron.backend import MegatronBackend

    assert ranks.launched() == (rank, world)
    group = ranks.join()
    backend = MegatronBackend(_config(), seed=0)
    if rank == 0:
        leader = ranks.LeaderBackend(backend, group, world)
        result = _calls(leader, out_dir)
        result["refusal"] = leader.hybrid_refusal()
        leader.stop()
        leader.stop()  # idempotent
    else:
        result = {"calls": ranks.follow(backend, group)}
    ranks.leave()  # what `libra serve trainer` does after a clean stop: no gloo thread outlives the interpreter
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    result["left"] = not dist.is_initialized() and not ps.model_parallel_is_initialized()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_ranks_follow_the_leader_and_train_like_one_process(model_dir, tmp_path):
    spawn_ranks(_rank, (2, free_port(), model_dir, str(tmp_path)), 2)
    leader, follower = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert follower == {"calls": 8, "left": True}  # load, log-probs, 2 steps, 2 exports, weights, checkpoint
    assert "2 ranks" in leader["refusal"] and leader["left"]

    from libra.services.trainer.megatron.backend import MegatronBackend

    os.environ["LIBRA_TEST_MODEL"] = model_dir
    single = _calls(MegatronBackend(_config(), seed=0), str(tmp_path / "single"))
    for ours, expected in zip(leader["logprobs"], single["logprobs"], strict=True):
        assert torch.allclose(ours, expected, atol=1e-6)
    for step in ("step1", "step2"):
        for name, value in single[step].items():
            if name != "seconds":
                assert leader[step][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
        for name, value in single[f"hf_{step}"].items():  # DP sums the two shards' gradients: float noise
            assert torch.allclose(leader[f"hf_{step}"][name], value, rtol=1e-5, atol=5e-5), name
    assert (tmp_path / "weights" / "model.safetensors").exists() and (tmp_path / "checkpoint").exists()


def test_rank_counts_that_cannot_work_fail_at_start():
    from pydantic import ValidationError

    from libra.config import RunConfig
    from libra.services.trainer import ranks

    with pytest.raises(ValidationError, match="trainer.ranks=2 needs trainer.backend: megatron"):
        TrainerConfig(ranks=2)
    with pytest.raises(ValidationError, match="trainer.ranks=3 is not a multiple of .* = 2"):
        TrainerConfig(ranks=3, backend={"type": "megatron", "tensor_parallel": 2})
    config = RunConfig(trainer={"ranks": 4, "backend": {"type": "megatron", "tensor_parallel": 2}})
    with pytest.raises(ValueError, match="launched on 2 rank.*trainer.ranks=4"):
        ranks.check(config, 2)
    ranks.check(config, 4)
    with pytest.raises(ValueError, match="launched on 2 rank.*trainer.ranks=1"):
        ranks.check(RunConfig(), 2)
