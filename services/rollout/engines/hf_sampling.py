"""The hf engine's sampler: one token and its log-prob per running row, for all rows in one batch of
tensor operations (each row with its own temperature, top-p and seed). Kept apart from the engine's
batching (hf_engine.py): how a token is drawn changes for its own reasons (a sampling option, a
log-prob mode), not when admission or the KV cache do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.services.rollout.engines.hf_engine import Request


def sample_rows(logits: Any, rows: list["Request"], mode: str) -> tuple[list[int], list[float]]:
    """One (token, log-prob) per row of `logits` [rows, vocab], in one batch of tensor operations:
    greedy rows (temperature 0) take the argmax with its raw log-prob; the others sample from
    softmax(logits / temperature), cut to the smallest set of tokens whose probability reaches top_p
    (the most likely token always kept), by inverting the cumulative distribution at one uniform draw
    per row. A row with a seed draws from its own generator, so its sample does not depend on which
    other rows share the batch; the others draw from torch's global generator. The log-prob is of
    the distribution sampled from ("processed_logprobs", vLLM's default) or of the raw logits."""
    import torch

    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    chosen = raw.gather(1, tokens[:, None])[:, 0]
    sampled = [index for index, request in enumerate(rows) if request.temperature != 0.0]
    if sampled:
        at = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        temperature = torch.tensor([rows[i].temperature for i in sampled], device=logits.device)
        scaled = logits.index_select(0, at) / temperature[:, None]
        top_p = [rows[i].top_p for i in sampled]
        if min(top_p) < 1.0:
            ordered, order = torch.sort(scaled, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            cut = probs.cumsum(-1) - probs >= torch.tensor(top_p, device=logits.device)[:, None]
            scaled = scaled.scatter(1, order, ordered.masked_fill(cut, float("-inf")))
        processed = torch.log_softmax(scaled, dim=-1)
        cdf = processed.exp().cumsum(-1)
        draws = _uniform([rows[i].generator for i in sampled], logits.device)
        picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
        picked = picked.clamp(max=logits.shape[1] - 1)
        unlikely = torch.isinf(processed.gather(1, picked[:, None])[:, 0])  # rounding at the top of the cdf
        picked = torch.where(unlikely, torch.argmax(processed, dim=-1), picked)
        source = processed if mode == "processed_logprobs" else raw.index_select(0, at)
        tokens = tokens.index_copy(0, at, picked)
        chosen = chosen.index_copy(0, at, source.gather(1, picked[:, None])[:, 0])
    return tokens.tolist(), chosen.tolist()


def _uniform(generators: list[Any], device: Any) -> Any:
    """One U[0, 1) draw per row: from the row's own generator where it has one (on the engine's device,
    as the HTTP layer makes it), else torch's global one."""
    import torch

    draws = torch.rand(len(generators), device=device)
    for index, generator in enumerate(generators):
        if generator is not None:
            draws[index] = torch.rand((), generator=generator, device=device)
    return draws
