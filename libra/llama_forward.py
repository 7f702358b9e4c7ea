"""The own forward pass for plain Llama-architecture models in float32 on CPU, shared by the hf
engine (services/rollout/engines/hf_engine.py), which samples with it, and the torch training
backend (services/trainer/torch_backend.py, `trainer.backend.forward: auto`), which trains it: here
in libra/ because no service imports another.

The transformers engine (`hf_engine.py`) calls a model with left-padded rows, a 2-D attention mask,
explicit positions and the KV cache as one (keys, values) pair per layer. For a small model on CPU
most of what such a pass costs is not arithmetic but the library around it: importing transformers
takes ~3 CPU-seconds in every worker (`hf engine serving`'s start-up phases), and its model builds a
cache object, a 4-D mask and the rotary table through several layers of dispatch at every decode
step. `LlamaForward` is the same network (the parameter names of transformers' `LlamaForCausalLM`,
so weight loads, the weights group and the trainer's checkpoints fit it unchanged) written as the
handful of tensor operations the engine needs, on torch alone:

    ids, mask, positions, cache ──▶ embed ──▶ per layer: RMSNorm ─▶ q, k, v ─▶ rotary ─▶ cache ⧺ k, v
                                                         ─▶ attention under (mask ∧ causal) ─▶ o + residual
                                                         ─▶ RMSNorm ─▶ SiLU-gated MLP + residual
                                ──▶ final RMSNorm of the last position ──▶ logits, cache

`unsupported(config, device, dtype)` says why a model must go through transformers instead (another
architecture, rotary scaling, biases, another activation, a GPU or a half dtype, where transformers'
kernels and its mixed-precision casts are what the trainer reproduces); the engine and the trainer
then do so. For training, `last_only=False` gives every position's logits of right-padded rows.
tests/unit/test_llama_forward.py holds it to transformers' logits and cache,
tests/unit/test_torch_backend.py its training step to transformers' model's.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def unsupported(config: dict[str, Any], device: str, dtype: str) -> str | None:
    """Why `config` (a model directory's config.json) cannot run here, or None when it can."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    checks = [
        (device == "cpu", f"device {device} (the engine's own pass is for CPU)"),
        (dtype == "float32", f"dtype {dtype} (the engine's own pass is float32 only)"),
        (config.get("model_type") == "llama" and "LlamaForCausalLM" in (config.get("architectures") or []),
         f"architecture {config.get('architectures')} ({config.get('model_type')})"),
        (config.get("hidden_act", "silu") == "silu", f"activation {config.get('hidden_act')}"),
        (not config.get("attention_bias") and not config.get("mlp_bias"), "attention or MLP biases"),
        (rope.get("rope_type", "default") == "default" and not rope.get("factor"), f"rotary scaling {rope}"),
        (config.get("pretraining_tp", 1) == 1, "pretraining_tp != 1"),
        (config.get("partial_rotary_factor", 1.0) == 1.0, "partial rotary embeddings"),
    ]
    failed = [why for ok, why in checks if not ok]
    return "; ".join(failed) or None


def unsupported_dir(model_dir: str | pathlib.Path, device: str, dtype: str) -> str | None:
    """Why the model directory `model_dir` cannot run on this pass (its config.json unreadable, no
    safetensors weights, or `unsupported`), or None when it can: what the engine and the trainer
    both ask before loading it."""
    directory = pathlib.Path(model_dir)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"config.json unreadable here ({type(error).__name__})"
    if not any(directory.glob("*.safetensors")):
        return "no safetensors weights (the own pass loads safetensors only)"
    return unsupported(config, device, dtype)


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class _Norm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one kernel for transformers' five ops


class _Layer(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int):
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.self_attn = _Attention(hidden, config["num_attention_heads"],
                                    config.get("num_key_value_heads") or config["num_attention_heads"], head_dim)
        self.mlp = _MLP(hidden, config["intermediate_size"])
        self.input_layernorm = _Norm(hidden, eps)
        self.post_attention_layernorm = _Norm(hidden, eps)


class _Body(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(_Layer(config, head_dim) for _ in range(config["num_hidden_layers"]))
        self.norm = _Norm(config["hidden_size"], config["rms_norm_eps"])


KV_ROOM = 64
"""Positions a layer's KV buffer keeps free after its rows' positions (`_extend`)."""


def _extend(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`cached` [rows, heads, past, dim] followed by `new` [rows, heads, n, dim] along the positions.

    A decode step adds one position to every row; concatenating would copy the whole cache at every
    step (most of a small model's decode pass on CPU). So the result is a view of the front of a
    buffer with KV_ROOM positions to spare, and when `cached` is such a view, ending where its
    buffer's written positions end, `new` is written after it in place: no copy. Any other tensor
    (a fresh prefill's, one the engine trimmed or merged, a view some other call already extended)
    is copied into a new buffer, so an extension never writes where another view reads."""
    past, n = cached.shape[2], new.shape[2]
    buffer = getattr(cached, "kv_buffer", None)
    if (buffer is None or buffer.kv_written != past or buffer.shape[2] < past + n
            or buffer.shape[:2] != cached.shape[:2] or cached.data_ptr() != buffer.data_ptr()):
        buffer = cached.new_empty((cached.shape[0], cached.shape[1], past + n + KV_ROOM, cached.shape[3]))
        buffer[:, :, :past] = cached
    buffer[:, :, past:past + n] = new
    buffer.kv_written = past + n
    extended = buffer[:, :, :past + n]
    extended.kv_buffer = buffer
    return extended


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaForward(nn.Module):
    """`LlamaForCausalLM`'s parameters and its forward pass as the hf engine calls it."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.eos_token_id = config.get("eos_token_id")
        self.vocab_size = config["vocab_size"]
        self.model = _Body(config, self.head_dim)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        if config.get("tie_word_embeddings", False):  # (transformers' LlamaConfig default)
            self.lm_head.weight = self.model.embed_tokens.weight
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.register_buffer("inv_freq", 1.0 / (_rope_theta(config) ** steps), persistent=False)

    @classmethod
    def load(cls, model_dir: str | pathlib.Path) -> "LlamaForward":
        """The model of a HF directory (config.json and *.safetensors), every tensor accounted for."""
        from safetensors.torch import load_file

        directory = pathlib.Path(model_dir)
        model = cls(json.loads((directory / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            state.update(load_file(str(file)))
        expected = set(model.state_dict())
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        missing = expected - set(state) - ({"lm_head.weight"} if tied else set())
        unexpected = set(state) - expected
        if missing or unexpected or not state:
            raise ValueError(f"{directory}: the checkpoint does not match a Llama model "
                             f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        model.load_state_dict(state, strict=False)
        return model.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None, last_only: bool = True
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits [rows, vocab] of each row's last position (every position's, [rows, new, vocab],
        with `last_only=False`) and the cache extended by the new positions. `attention_mask`
        [rows, past + new] covers the cache and the new ids (1: attend); `cache` holds one
        ([rows, kv_heads, past, head_dim] keys, values) per layer."""
        rows, new = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        angles = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        past = cache[0][0].shape[2] if cache else 0
        allowed = attention_mask[:, None, None, :].bool()
        if new > 1:  # (one new position, a decode step, sees every column the mask lets it)
            allowed = allowed & torch.ones(new, past + new, dtype=torch.bool, device=x.device).tril(past)
        extended = []
        for index, layer in enumerate(self.model.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            q = attention.q_proj(h).view(rows, new, self.heads, self.head_dim).transpose(1, 2)
            k = attention.k_proj(h).view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attention.v_proj(h).view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if cache:
                k, v = _extend(cache[index][0], k), _extend(cache[index][1], v)
            extended.append((k, v))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=self.kv_heads != self.heads)
            x = x + attention.o_proj(o.transpose(1, 2).reshape(rows, new, -1))
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        if last_only:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x)), extended
