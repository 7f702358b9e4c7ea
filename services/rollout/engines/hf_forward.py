"""The model an hf engine samples from and the forward pass it calls: the engine's own pass
(libra/llama_forward.py, a plain Llama in float32 on CPU: transformers never imported) or
transformers' model, each called as `LlamaForward` is: (ids, mask, positions, cache) -> (each row's
last logits, the cache extended), the cache as one (keys, values) pair per layer. Which one runs, and
why, changes with the models and devices supported, not with the engine's batching (hf_engine.py).

Must not know: requests, batching, HTTP.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

FORWARDS = ("auto", "transformers")


def load(forward: str, model_dir: str, device: Any, dtype: str) -> tuple[Any, Callable[..., Any]]:
    """(the model, its pass) for `forward` ("own" or "transformers", from `choose`)."""
    if forward == "own":
        from libra.llama_forward import LlamaForward

        model = LlamaForward.load(model_dir)
        return model, model
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    return model, functools.partial(transformers_pass, model)


def eos_and_vocab(model: Any) -> tuple[Any, int]:
    """The model's end-of-sequence id and vocabulary size, either kind of model."""
    config = getattr(model, "config", None)
    if config is None:  # LlamaForward
        return model.eos_token_id, model.vocab_size
    return config.eos_token_id, config.vocab_size


def choose(model_dir: str, device: str, dtype: str, forward: str) -> tuple[str, str]:
    """Which forward pass runs the model, and why: "own" (llama_forward.py: a plain Llama in float32
    on CPU, transformers never imported) under "auto" where it can, else "transformers"."""
    if forward == "transformers":
        return "transformers", "asked for (rollout.worker.engine.forward)"
    from libra.llama_forward import unsupported_dir

    why = unsupported_dir(model_dir, str(device), dtype)
    return ("transformers", why) if why else ("own", "a plain Llama in float32 on CPU")


def transformers_pass(model: Any, ids: Any, mask: Any, positions: Any,
                       kv: list[tuple[Any, Any]] | None = None) -> tuple[Any, list[tuple[Any, Any]]]:
    """A transformers model called as `LlamaForward` is: (the last position's logits, the cache
    extended by the new positions), the cache as one (keys, values) pair per layer."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=_new_cache(kv),
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], _cache_tensors(out.past_key_values)


def _new_cache(kv: list[tuple[Any, Any]] | None = None) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()


def _cache_tensors(cache: Any) -> list[tuple[Any, Any]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))
