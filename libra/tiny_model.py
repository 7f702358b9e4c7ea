"""Creation of the tiny policy model: a locally trained tokenizer and a random Llama, saved for HF and vLLM.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on the workload's corpus; digits
are split one per token, and the workload's markup (``<calc>``, ``</answer>`` …) are added tokens,
so each is exactly one id, and stay in decoded text (they are not "special", so engines that skip
special tokens when detokenizing keep them). ``<bos>`` is prepended when special tokens are added;
``<eos>`` and ``<pad>`` exist for the engines. The model is a `LlamaForCausalLM` (Llama, because
`AutoTokenizer` would swap in Qwen2's own pre-tokenizer for a Qwen2 model) saved as safetensors
with its tokenizer in one standard Hugging Face directory, loadable offline by transformers and
vLLM.

This module knows the workload only through its corpus and markup tokens.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from libra.model_config import ModelConfig
from libra.workloads.base import Workload

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
CORPUS_DOCUMENTS = 4000
"""Documents of workload text the tokenizer is trained on (training takes well under a second)."""


def train_tokenizer(workload: Workload, vocab_size: int, seed: int) -> Any:
    """A `tokenizers.Tokenizer`: byte-level BPE over single digits, markup as added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # Single digits keep every number's tokens uniform, which is what arithmetic needs.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(workload.corpus(CORPUS_DOCUMENTS, seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(text, normalized=False, special=False) for text in workload.markup_tokens])
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def wrap_tokenizer(tokenizer: Any, model_max_length: int) -> Any:
    """The transformers view of a trained tokenizer (generic fast tokenizer, no model-specific rules)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )


def llama_config(model_cfg: ModelConfig, tokenizer: Any) -> Any:
    """The `LlamaConfig` of the tiny model; its vocabulary is the tokenizer's."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.layers, num_attention_heads=model_cfg.heads,
        num_key_value_heads=model_cfg.kv_heads, intermediate_size=model_cfg.intermediate_size,
        max_position_embeddings=model_cfg.max_position, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )


def create_tiny_model(model_cfg: ModelConfig, workload: Workload, out_dir: pathlib.Path, seed: int) -> pathlib.Path:
    """Train the tokenizer, build a randomly initialised Llama, and save both into `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = wrap_tokenizer(train_tokenizer(workload, model_cfg.vocab_size, seed), model_cfg.max_position)
    _check_markup(tokenizer, workload)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(model_cfg, tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _pin_tokenizer_class(out_dir)
    return out_dir


def _check_markup(tokenizer: Any, workload: Workload) -> None:
    for text in workload.markup_tokens:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"markup {text!r} is not one token: {ids}"


def _pin_tokenizer_class(out_dir: pathlib.Path) -> None:
    # Loaders must use the generic fast tokenizer: a model-specific class (LlamaTokenizer…)
    # would rebuild its own normalizer/pre-tokenizer and change the ids.
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: str | pathlib.Path, light: bool = False) -> Any:
    """The tokenizer of a model directory, offline (the same ids rollout and trainer use).

    `light`: where the directory holds a generic fast tokenizer (what `create_tiny_model` saves:
    tokenizer.json, class PreTrainedTokenizerFast), a `LightTokenizer` on the `tokenizers` library
    alone, without importing transformers (and so torch): the rollout gateway's choice, which only
    encodes and decodes (~300 MB and seconds of start-up less). Any other tokenizer: transformers'.
    """
    path = pathlib.Path(path)
    if light:
        found = LightTokenizer.load(path)
        if found is not None:
            return found
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class LightTokenizer:
    """The part of a transformers fast tokenizer that the agent runner and the OpenAI gateway use
    (encode with or without special tokens, decode, token <-> id), on a `tokenizers.Tokenizer`.

    Only for directories whose tokenizer is the generic PreTrainedTokenizerFast: that class adds
    no rules of its own to tokenizer.json (its post-processor puts ``<bos>`` first), so the ids and
    texts are the same as transformers' (tests/unit/test_tiny_model.py compares them).
    """

    def __init__(self, tokenizer: Any, special: dict[str, str]):
        self._tokenizer = tokenizer
        for role in ("bos", "eos", "pad", "unk"):
            token = special.get(f"{role}_token")
            setattr(self, f"{role}_token", token)
            setattr(self, f"{role}_token_id", tokenizer.token_to_id(token) if token else None)

    @classmethod
    def load(cls, path: pathlib.Path) -> "LightTokenizer | None":
        """The directory's tokenizer, or None where it is not a generic fast tokenizer."""
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if config.get("tokenizer_class") != "PreTrainedTokenizerFast" or not (path / "tokenizer.json").is_file() \
                or config.get("clean_up_tokenization_spaces") or config.get("chat_template"):
            return None
        from tokenizers import Tokenizer

        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), special)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids]


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def stop_token_ids(tokenizer: Any, workload: Workload) -> list[int]:
    """The token id of each of the workload's stop strings (each is a single token)."""
    return [tokenizer.convert_tokens_to_ids(text) for text in workload.stop_strings]
