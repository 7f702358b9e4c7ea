"""A random, tiny Llama checkpoint for tests that need a real engine (vLLM, transformers).

Built on the spot from a byte-level BPE trained on a few lines of text, so nothing is downloaded
(works with HF_HUB_OFFLINE=1). It is a test fixture only: the project's tiny model factory is
`libra.tiny_model`. The model is random, so what it says is noise, but its token ids, log-probs
and weight files are real, which is what engine tests need.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
# vLLM's CPU attention kernels take head sizes 32, 64, 80, ... only (16 fails at the first step).
HEAD_DIM = 32
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the agent calls a tool and reads the result before the next turn",
    "rollout workers sample tokens while the trainer updates the policy",
    "def add(a, b): return a + b  # 0123456789 + - * / = ( ) [ ] { }",
    "user: what is 12 times 7? assistant: 12 * 7 = 84",
    "<|user|> <|assistant|> <|system|> <|tool|> json {\"name\": \"calc\", \"args\": [1, 2]}",
] * 20


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE with BOS/EOS/PAD, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_random_llama(path: str | Path, seed: int = 0, hidden_size: int = 64,
                      num_layers: int = 2, lm_head_scale: float = 1.0, tied: bool = False) -> Path:
    """Write a random Llama (safetensors, HF names) and its tokenizer to `path`; return the path.

    The same `seed` gives the same weights; `lm_head_scale` multiplies the output head, which
    sharpens or flattens the distribution without changing the architecture (for weight-update
    tests). Untied embeddings by default, so `lm_head.weight` is its own tensor in the files;
    `tied`: the output head is the input embedding (as the quickstart's tiny model), no lm_head
    tensor in the files, and `lm_head_scale` scales the embedding.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    heads = hidden_size // HEAD_DIM
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(VOCAB_SIZE)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=2048, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32", initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def two_weight_sets(root: Path) -> dict[str, Path]:
    """Two weight sets of one architecture under `root`: "base" and "sharp" (its output head 3x),
    so a test can tell which one an engine serves from its log-probs."""
    return {"base": make_random_llama(root / "base", seed=0),
            "sharp": make_random_llama(root / "sharp", seed=0, lm_head_scale=3.0)}
