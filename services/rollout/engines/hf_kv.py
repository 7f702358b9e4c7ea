"""The hf engine's KV cache layout: rows of one batch share a [rows, kv_heads, positions, head_dim]
tensor per layer (keys and values) and a [rows, positions] mask, each row left-padded. What lays
rows out (padding, a cached past, right-aligning, one row's positions) changes with the cache's
shape, not with how the engine admits, samples or loads weights (hf_engine.py).

Must not know: the engine's requests, its model, or HTTP.
"""

from __future__ import annotations

from typing import Any


def prompt_batch(prompts: list[list[int]], hits: list[tuple[int, Any]]) -> tuple[Any, Any, int]:
    """(ids, mask, past) of a prefill: each row's uncached positions left-padded to one width in `ids`,
    and the mask over [left padding, its cached past | left padding, its new positions], the past
    `past` positions wide (0 when nothing is cached: every row's last token is at -1)."""
    import torch

    past = max(n for n, _ in hits)
    news = [p[n:] for p, (n, _) in zip(prompts, hits)]
    width = max(len(n) for n in news)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), past + width), dtype=torch.long)
    for row, (new, (n, _)) in enumerate(zip(news, hits)):
        ids[row, width - len(new):] = torch.tensor(new)
        mask[row, past - n:past] = 1
        mask[row, past + width - len(new):] = 1
    return ids, mask, past


def left_padded_past(hits: list[tuple[int, Any]], past: int) -> list[tuple[Any, Any]]:
    """The cached KV of each row's beginning as one past of `past` positions, left-padded with zeros
    (`hits`: per row (n, its n positions' KV per layer, or None when n is 0))."""
    reference = next(kv for n, kv in hits if n)
    cache = []
    for layer, (k0, v0) in enumerate(reference):
        keys = k0.new_zeros((len(hits), k0.shape[0], past, k0.shape[2]))
        values = v0.new_zeros((len(hits), v0.shape[0], past, v0.shape[2]))
        for row, (n, kv) in enumerate(hits):
            if n:
                keys[row, :, past - n:], values[row, :, past - n:] = kv[layer]
        cache.append((keys, values))
    return cache


def right_aligned(kv: list[tuple[Any, Any]], mask: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """The KV cache and mask with each row's positions moved to the right end, in order, and the
    columns no row then needs dropped: a cached prefill's rows are [padding, past, padding, new], as
    wide as the longest past plus the longest new part, which every later decode step would carry.
    (The order of a row's positions does not matter to attention: each key holds its position.)"""
    import torch

    width = int(mask.sum(1).max())
    order = torch.sort(mask, dim=1, stable=True).indices[:, -width:]  # padding first, then the positions in order
    gather = order[:, None, :, None]
    return ([(k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[3])),
              v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[3]))) for k, v in kv], mask.gather(1, order))


def row_kv(kv: list[tuple[Any, Any]], mask: Any, row: int) -> list[tuple[Any, Any]]:
    """Row `row`'s KV without its padding: per layer (keys, values) [kv_heads, its positions, head_dim]."""
    columns = mask[row].nonzero()[:, 0]
    return [(k[row].index_select(1, columns), v[row].index_select(1, columns)) for k, v in kv]


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """Bytes of KV cache one token takes (every layer's keys and values), from the model's config."""
    import json
    import pathlib

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    width = {"float32": 4, "float64": 8}.get(dtype, 2)
    return 2 * config["num_hidden_layers"] * (config.get("num_key_value_heads") or heads) * head_dim * width


def pad_left(tensor: Any, width: int, dim: int) -> Any:
    import torch

    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=tensor.dtype, device=tensor.device), tensor], dim=dim)
