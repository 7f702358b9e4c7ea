"""The rollout gateway's tokenizer without transformers (tiny_model.LightTokenizer) gives the same
ids and texts as transformers' tokenizer of the same directory, and is used only where it can."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from libra.model_config import ModelConfig  # noqa: E402
from libra.tiny_model import LightTokenizer, create_tiny_model, load_tokenizer, stop_token_ids  # noqa: E402
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


def test_light_and_transformers_tokenizers_agree(model_dir, calc):
    light, full = load_tokenizer(model_dir, light=True), load_tokenizer(model_dir)
    assert isinstance(light, LightTokenizer) and not isinstance(full, LightTokenizer)
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == \
        (full.bos_token_id, full.eos_token_id, full.pad_token_id)
    assert len(light) == len(full)
    assert stop_token_ids(light, calc) == stop_token_ids(full, calc)
    texts = [text for demo in calc.demonstrations(50, seed=5) for text, _ in demo]
    texts += [calc.prompt(i).text for i in range(50)] + ["", "  odd   spacing\n", "<calc>1+</answer>ünïcode"]
    for text in texts:
        for special in (True, False):
            ids = light(text, add_special_tokens=special).input_ids
            assert ids == full(text, add_special_tokens=special).input_ids, text
            for skip in (True, False):
                assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    every = list(range(len(full)))
    assert light.convert_ids_to_tokens(every) == full.convert_ids_to_tokens(every)
    assert light.convert_ids_to_tokens(5) == full.convert_ids_to_tokens(5)
    assert light.convert_tokens_to_ids(["<eos>", "<calc>"]) == full.convert_tokens_to_ids(["<eos>", "<calc>"])


def test_other_tokenizers_are_loaded_by_transformers(model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for path in model_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    assert LightTokenizer.load(other) is None  # a chat template: transformers renders it
    assert not isinstance(load_tokenizer(other, light=True), LightTokenizer)
    assert LightTokenizer.load(tmp_path / "absent") is None


def test_the_light_tokenizer_imports_neither_transformers_nor_torch(model_dir):
    code = ("import sys; from libra.tiny_model import load_tokenizer; "
            f"t = load_tokenizer({str(model_dir)!r}, light=True); t('Compute 1+2.'); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() \
        == ["False", "False"]
