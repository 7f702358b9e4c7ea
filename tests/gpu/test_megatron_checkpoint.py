"""Megatron backend checkpoints on two GPUs: DP=2 (distributed optimizer) and TP=2 round trips, and a
DP=2 checkpoint loaded at DP=1 (what a joining elastic replica's snapshot does to DP).

Each case runs real processes (spawned, NCCL) on a tiny bf16 Qwen2 model. A round trip: one step,
save, a second step (recording its loss), load, and then the model, the fp32 master weights and
both Adam moments must equal what was saved, bit for bit, and the second step taken again must
give the same loss.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from libra.redis_server import free_port
from tests.ranks import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, DP=2 / TP=2)"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                         tie_word_embeddings=True, use_sliding_window=False)
    path = str(tmp_path_factory.mktemp("tiny-qwen2-gpu"))
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _batch(shard: int):
    from libra.services.trainer.backend import TrainBatch, TrainSequence

    generator = torch.Generator().manual_seed(100 + shard)
    sequences = []
    for i in range(4):
        tokens = torch.randint(3, 256, (48,), generator=generator).tolist()
        sequences.append(TrainSequence(tokens, 8, [1] * 40, [-3.0] * 40, 1.0 if i % 2 else -1.0))
    return TrainBatch(sequences)


def _backend(model_dir: str, tp: int):
    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.megatron.backend import MegatronBackend

    config = TrainerConfig(lr=1e-3, micro_batch_size=2, backend={"type": "megatron", "tensor_parallel": tp})
    backend = MegatronBackend(config, seed=0)
    backend.load(model_dir)
    return backend


def _states(backend) -> tuple[dict, dict]:
    from libra.services.trainer.megatron import optimizer_state

    model = {k: v.detach().float().cpu().clone() for k, v in backend.model.state_dict().items()
             if not k.endswith("_extra_state")}
    return model, optimizer_state.optimizer_state(backend.model, backend.optimizer).get_states()


def _equal(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (nested one level for optimizer states)."""
    bad = []
    for name in a:
        x, y = a[name], b.get(name)
        if isinstance(x, dict):
            bad += [f"{name}.{k}" for k in x if not torch.equal(x[k], y[k])]
        elif y is None or not torch.equal(x, y):
            bad.append(name)
    return bad


def _round_trip(rank: int, port: int, model_dir: str, tp: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    backend = _backend(model_dir, tp)
    from megatron.core import parallel_state as ps

    batch = _batch(ps.get_data_parallel_rank())
    config = backend.config
    backend.train_step(batch, config)
    path = os.path.join(out, "step1.pt")
    backend.save_checkpoint(path, {"step": 1})
    model, optimizer = _states(backend)
    second = backend.train_step(batch, config)["loss"]
    extra = backend.load_checkpoint(path)
    model_after, optimizer_after = _states(backend)
    again = backend.train_step(batch, config)["loss"]
    result = {"extra": extra, "model_differs": _equal(model, model_after),
              "optimizer_differs": _equal(optimizer, optimizer_after), "second": second, "again": again}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0:
        torch.save({"model": model, "optimizer": optimizer}, os.path.join(out, "saved.pt"))


def _load_at_dp1(rank: int, model_dir: str, out: str) -> None:
    torch.cuda.set_device(0)
    backend = _backend(model_dir, 1)
    assert backend.load_checkpoint(os.path.join(out, "step1.pt")) == {"step": 1}
    model, optimizer = _states(backend)
    saved = torch.load(os.path.join(out, "saved.pt"), weights_only=True)
    with open(os.path.join(out, "dp1.json"), "w") as f:
        json.dump({"model_differs": _equal(saved["model"], model),
                   "optimizer_differs": _equal(saved["optimizer"], optimizer)}, f)



def _spawn(fn, nprocs: int, *args) -> None:
    spawn_ranks(fn, args, nprocs)


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_gpu_checkpoint_round_trip(model_dir, tmp_path, tp):
    _spawn(_round_trip, 2, free_port(), model_dir, tp, str(tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["extra"] == {"step": 1}
        assert result["model_differs"] == [] and result["optimizer_differs"] == []
        assert result["again"] == pytest.approx(result["second"], rel=1e-3, abs=1e-4)
    if tp == 1:  # the DP=2 checkpoint loads at DP=1 with the same model and optimizer state
        _spawn(_load_at_dp1, 1, model_dir, str(tmp_path))
        result = json.loads((tmp_path / "dp1.json").read_text())
        assert result["model_differs"] == [] and result["optimizer_differs"] == []
