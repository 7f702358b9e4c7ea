"""The hf engine's prefix cache: the KV of sequences it has already computed, so that a prompt which
continues one prefills only what is new. An agent's next turn is the previous turn's prompt, the
reply sampled for it and the tool's return: without the cache every turn prefills the whole
conversation again; and the samples of one GRPO group share their prompt.

```
 prefill of a prompt ──▶ lookup: the longest entry whose tokens begin the prompt ──▶ its KV as the
                         past, the rest of the prompt as new positions, one batched pass
 prompt prefilled ──────▶ entry (prompt)            request finished ─▶ entry (prompt + reply but its
                                                                        last token, which was never fed)
 weights loaded ────────▶ every entry dropped (KV of other weights is not what this version computes)
```

vLLM caches by blocks of tokens; this engine keeps whole sequences, one entry each, keyed by
(length, a polynomial hash of the tokens), evicted least recently used beyond `capacity_tokens`. A
lookup hashes the prompt's prefixes in one pass and tries the lengths entries have, longest first,
confirming a hit token by token; at least one position of the prompt is always left to compute (the
logits to sample from come from it).

Must not know: how the engine batches, samples or loads weights.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

_BASE, _MODULUS = 1_000_003, (1 << 61) - 1


def _prefix_hashes(tokens: list[int], upto: int) -> list[int]:
    """hashes[n]: the hash of tokens[:n], for n = 0..upto."""
    hashes, value = [0], 0
    for token in tokens[:upto]:
        value = (value * _BASE + token + 1) % _MODULUS
        hashes.append(value)
    return hashes


@dataclass
class Entry:
    tokens: list[int]
    kv: list[tuple[Any, Any]]  # per layer (keys, values), each [kv_heads, len(tokens), head_dim]


class PrefixCache:
    """Sequences' KV by their tokens; `capacity_tokens` 0 keeps nothing."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()
        self._lengths: Counter[int] = Counter()
        self.tokens = 0  # held now
        self.lookups = self.hits = self.hit_tokens = 0  # counters, for /metrics

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[Any, Any]] | None]:
        """(n, the KV of prompt[:n]) for the longest cached sequence that begins `prompt`, n at most
        len(prompt) - 1; (0, None) when none does."""
        self.lookups += 1
        lengths = sorted((n for n in self._lengths if n <= len(prompt)), reverse=True)
        if not lengths:
            return 0, None
        hashes = _prefix_hashes(prompt, lengths[0])
        for length in lengths:
            key = (length, hashes[length])
            entry = self._entries.get(key)
            if entry is None or entry.tokens != prompt[:length]:
                continue
            self._entries.move_to_end(key)
            used = min(length, len(prompt) - 1)
            if used <= 0:
                return 0, None
            self.hits += 1
            self.hit_tokens += used
            kv = entry.kv if used == length else [(k[:, :used], v[:, :used]) for k, v in entry.kv]
            return used, kv
        return 0, None

    def insert(self, tokens: list[int], kv: list[tuple[Any, Any]]) -> None:
        """Keep `kv` (per layer [kv_heads, len(tokens), head_dim]) as the KV of `tokens`."""
        if not tokens or len(tokens) > self.capacity_tokens:
            return
        key = (len(tokens), _prefix_hashes(tokens, len(tokens))[-1])
        if key in self._entries and self._entries[key].tokens == tokens:
            self._entries.move_to_end(key)
            return
        if key in self._entries:  # a hash collision: the newer sequence takes the slot
            self._drop(key)
        self._entries[key] = Entry(list(tokens), kv)
        self._lengths[len(tokens)] += 1
        self.tokens += len(tokens)
        while self.tokens > self.capacity_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, int]) -> None:
        entry = self._entries.pop(key)
        self._lengths[len(entry.tokens)] -= 1
        if not self._lengths[len(entry.tokens)]:
            del self._lengths[len(entry.tokens)]
        self.tokens -= len(entry.tokens)
