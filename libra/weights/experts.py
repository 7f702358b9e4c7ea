"""Mixture-of-experts weights in two layouts: one tensor per expert (the checkpoint's), fused (transformers 5's).

Owns: where a tensor named in the checkpoint layout lands in a model whose experts transformers 5
holds fused. Must not know: files, transports, which engine asks.

Runs in: the hf engine process (`engines.hf_weights`), loading a published version from disk.

A MoE checkpoint (what `save_pretrained` writes, what vLLM loads, what the trainers publish) has
one tensor per expert and projection; transformers 5 keeps each layer's experts as two fused
parameters, so a name of the first layout is a slice of one of the second:

    …mlp.experts.{e}.gate_proj.weight [I, H]  ─▶  …mlp.experts.gate_up_proj[e, :I]   ([E, 2I, H])
    …mlp.experts.{e}.up_proj.weight   [I, H]  ─▶  …mlp.experts.gate_up_proj[e, I:]
    …mlp.experts.{e}.down_proj.weight [H, I]  ─▶  …mlp.experts.down_proj[e]          ([E, H, I])
"""

from __future__ import annotations

import re
from typing import Any, Mapping

EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)\.weight$")


def target(state: Mapping[str, Any], name: str) -> Any:
    """The tensor of `state` (a model's state dict) that checkpoint tensor `name` loads into — the
    entry itself, or a view of a fused expert parameter — or None when the model has no place for it."""
    if name in state:
        return state[name]
    match = EXPERT.match(name)
    if match is None:
        return None
    prefix, index, projection = match.group("prefix"), int(match.group("index")), match.group("projection")
    if projection == "down_proj":
        fused = state.get(f"{prefix}.down_proj")
        return fused[index] if fused is not None and index < fused.shape[0] else None
    fused = state.get(f"{prefix}.gate_up_proj")
    if fused is None or index >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[index, :half] if projection == "gate_proj" else fused[index, half:]
