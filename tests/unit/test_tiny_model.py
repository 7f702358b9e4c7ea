"""The tiny policy model: tokenizer round trip, single-token markup, HF loading, and the SFT warm start."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from libra.model_config import ModelConfig  # noqa: E402
from libra.services.trainer.config import WarmupConfig  # noqa: E402
from libra.services.trainer.warmup import IGNORE, collate, encode_segments, warm_start  # noqa: E402
from libra.tiny_model import create_tiny_model, load_tokenizer, stop_token_ids  # noqa: E402
from libra.workloads.base import build_workload  # noqa: E402
from libra.workloads.config import CalculatorConfig  # noqa: E402

SMALL = ModelConfig(hidden_size=32, layers=1, heads=2, kv_heads=2, intermediate_size=64, vocab_size=320,
                    max_position=128)


@pytest.fixture(scope="module")
def calc():
    return build_workload(CalculatorConfig())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, calc):
    return create_tiny_model(SMALL, calc, tmp_path_factory.mktemp("tiny"), seed=0)


def test_directory_is_a_standard_hf_model(model_dir):
    names = {path.name for path in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == SMALL.hidden_size


def test_tokenizer_round_trips_and_concatenates(model_dir, calc):
    tokenizer = load_tokenizer(model_dir)
    for demo in calc.demonstrations(20, seed=3):
        ids = []
        for text, _ in demo:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            assert tokenizer.decode(piece) == text
            assert tokenizer.decode(piece, skip_special_tokens=True) == text  # markup survives
            ids += piece
        assert tokenizer.decode(ids) == "".join(text for text, _ in demo)
    with_bos = tokenizer("Compute 1+2.").input_ids
    assert with_bos[0] == tokenizer.bos_token_id
    assert with_bos[1:] == tokenizer("Compute 1+2.", add_special_tokens=False).input_ids


def test_markup_and_stop_strings_are_single_tokens(model_dir, calc):
    tokenizer = load_tokenizer(model_dir)
    for text in calc.markup_tokens:
        assert len(tokenizer(text, add_special_tokens=False).input_ids) == 1
    stops = stop_token_ids(tokenizer, calc)
    assert len(set(stops)) == len(calc.stop_strings)
    assert tokenizer.unk_token_id not in stops
    assert tokenizer.decode(stops) == "".join(calc.stop_strings)


def test_model_loads_and_runs_forward(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer = load_tokenizer(model_dir)
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer("Compute 3*4.<calc>3*4</calc>").input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_encode_masks_prompt_and_tool_output(model_dir, calc):
    tokenizer = load_tokenizer(model_dir)
    demo = calc.demonstrations(1, seed=0)[0]
    ids, mask = encode_segments(tokenizer, demo)
    assert ids[0] == tokenizer.bos_token_id and not mask[0]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "".join(text for text, on in demo if on)
    batch = collate([(ids, mask), (ids[:5], mask[:5])], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids))
    assert (batch["labels"][1, 5:] == IGNORE).all() and batch["attention_mask"][1, 5:].sum() == 0


def test_warm_start_lowers_the_loss(model_dir, calc, tmp_path):
    work = shutil.copytree(model_dir, tmp_path / "model")
    before = (work / "model.safetensors").read_bytes()
    steps = []
    metrics = warm_start(work, calc, WarmupConfig(steps=20, batch_size=8, lr=3e-3), seed=0, torch_threads=2,
                         progress=lambda step, loss: steps.append(step))
    assert steps == list(range(1, 21))
    assert metrics["final_loss"] < metrics["first_loss"] - 1.0
    assert 0 < metrics["trained_tokens"] < metrics["tokens"]
    assert (work / "model.safetensors").read_bytes() != before
