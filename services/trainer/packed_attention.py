"""Causal attention that stays inside each sequence of a packed row, for both training backends.

Owns: the attention of a packed micro-batch (backend.pack(concatenate=True): sequences back to
back in one row, `cu_seqlens` marking where each starts), its two kernels and the choice between
them, and the Hugging Face attention implementation that the torch backend loads its model with.
Must not know: the GRPO loss, optimizers, Megatron (its core attention calls `packed_causal_attention`
from megatron/specs.py).

    q, k, v  [T, heads, head_dim]  (T = Σ sequence lengths, no padding)
       │
       ├─ varlen: torch.nn.attention.varlen.varlen_attn (FlashAttention's variable-length kernel:
       │          one launch for the whole row; CUDA, bf16/fp16)
       └─ sdpa:   one torch SDPA call (is_causal) per sequence, outputs concatenated: exact on any
                  device, one kernel launch per sequence and layer
       ▼
    out      [T, heads, head_dim]

`auto` uses varlen where it runs: the first packed call on a device and dtype tries it on a small
row against the per-sequence path and keeps it only when both agree (torch's varlen API changed
between releases — `is_causal` in 2.10, `window_size` after — and is CUDA-only); otherwise sdpa,
with a log line saying why. One exception, by measurement: on Hopper and later (compute capability
≥ 9.0) a row whose sequences average ≥ `LONG_SEQUENCE_TOKENS` goes to sdpa, whose per-sequence calls
reach cuDNN's Hopper flash-attention kernels; torch's varlen kernel is FlashAttention-2's, and on an
H200 its attention took 3.05 s of GPU time against cuDNN's 1.83 s for the same R2E-like batch (32
sequences of 300–30,000 tokens, benchmarks/gpu_packing.py --profile, docs/benchmarks.md). Rows of
many short sequences stay on varlen, one launch for the whole row. Either way no token attends
across a sequence boundary, and no FLOP is spent on padding: the quadratic part is Σ Lᵢ², not
(max L)² per row.

The torch backend's model is loaded with attention implementation `libra_packed` (registered here
with transformers' AttentionInterface): a packed forward passes `cu_seq_lens_q` (transformers'
own name for it) and gets this attention; any other forward (a padded micro-batch) gets
transformers' own SDPA attention and mask, exactly as with `attn_implementation="sdpa"`.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from libra import log as liblog

if TYPE_CHECKING:
    from torch import Tensor

KERNELS = ("auto", "varlen", "sdpa")
HF_IMPLEMENTATION = "libra_packed"
_log = liblog.get("libra.trainer.packed_attention")
_chosen: dict[tuple[str, str], str] = {}  # (device, dtype) -> the kernel `auto` settled on
_long_rows: set[tuple[str, str]] = set()  # (device, dtype) where `auto` sent rows of long sequences to sdpa
LONG_SEQUENCE_TOKENS = 1024  # mean sequence length of a row from which sdpa beats varlen on compute capability >= 9


def packed_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                            scale: float | None = None, kernel: str = "auto") -> Tensor:
    """Causal attention of each sequence of a packed row with itself only.

    query [T, Hq, D], key/value [T, Hkv, D] (Hq a multiple of Hkv: grouped-query attention), and
    `cu_seqlens` (N + 1 int32/int64 offsets on any device: 0, L₀, L₀+L₁, …, T); returns [T, Hq, D].
    """
    if kernel not in KERNELS:
        raise ValueError(f"packed attention kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        kernel = _auto(query) if _varlen_takes(scale, query) else "sdpa"
        if kernel == "varlen" and prefers_sdpa(_capability(query.device), query.shape[0], cu_seqlens.shape[0] - 1):
            _long_rows.add((str(query.device), str(query.dtype)))
            kernel = "sdpa"
    if kernel == "varlen":
        return _varlen(query, key, value, cu_seqlens, max_seqlen, scale)
    return _per_sequence(query, key, value, cu_seqlens, scale)


def kernels_in_use() -> dict[str, str]:
    """What `auto` settled on in this process, per "device dtype" (for reports)."""
    return {f"{device} {dtype}": kernel + ("; sdpa for rows of long sequences" if (device, dtype) in _long_rows else "")
            for (device, dtype), kernel in _chosen.items()}


def prefers_sdpa(capability: tuple[int, int], tokens: int, sequences: int) -> bool:
    """Whether `auto` sends a row of `sequences` sequences and `tokens` tokens to per-sequence SDPA
    although varlen runs: on compute capability >= 9.0, when they average >= LONG_SEQUENCE_TOKENS."""
    return capability >= (9, 0) and sequences > 0 and tokens >= LONG_SEQUENCE_TOKENS * sequences


@functools.lru_cache(maxsize=None)
def _capability(device: Any) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else (0, 0)


def _per_sequence(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float | None) -> Tensor:
    import torch
    import torch.nn.functional as F

    bounds = cu_seqlens.tolist()
    grouped = query.shape[1] != key.shape[1]
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        # [L, heads, D] -> [1, heads, L, D]: SDPA's layout, so CUDA takes its FlashAttention kernel.
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


@functools.lru_cache(maxsize=1)
def _varlen_parameters() -> Any:
    from torch.nn.attention.varlen import varlen_attn

    return inspect.signature(varlen_attn).parameters


def _varlen_takes(scale: float | None, query: Tensor) -> bool:
    """False when this torch's varlen kernel has no `scale` and `scale` is not its default 1/√d."""
    try:
        parameters = _varlen_parameters()
    except ImportError:
        return False
    return scale is None or "scale" in parameters or abs(scale * query.shape[-1] ** 0.5 - 1) < 1e-6


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int,
            scale: float | None) -> Tensor:
    import torch
    from torch.nn.attention.varlen import varlen_attn

    parameters = _varlen_parameters()
    options: dict[str, Any] = {}
    if "scale" in parameters:
        options["scale"] = scale
    elif not _varlen_takes(scale, query):
        raise ValueError(f"this torch's varlen attention has no scale argument; scale {scale} is not 1/sqrt(d): use "
                         "trainer.packed_attention: sdpa")
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal (torch > 2.10)
    else:
        options["is_causal"] = True  # torch 2.10
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:  # a kernel without grouped-query support: repeat the KV heads (a copy)
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    query, key, value = (t.contiguous() for t in (query, key, value))  # views of a fused QKV projection
    return varlen_attn(query, key, value, cu, cu, int(max_seqlen), int(max_seqlen), **options)


def _auto(query: Tensor) -> str:
    """varlen where it runs and agrees with the per-sequence path on this device and dtype, else sdpa."""
    import torch

    if query.device.type != "cuda" or query.dtype not in (torch.bfloat16, torch.float16):
        return "sdpa"
    where = (str(query.device), str(query.dtype))
    if where not in _chosen:
        _chosen[where] = _probe(query.device, query.dtype)
    return _chosen[where]


def _probe(device: Any, dtype: Any) -> str:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(80, 4, 64, device=device, dtype=dtype, generator=generator, requires_grad=True)
    k, v = (torch.randn(80, 2, 64, device=device, dtype=dtype, generator=generator, requires_grad=True)
            for _ in range(2))
    cu = torch.tensor([0, 17, 50, 80], device=device, dtype=torch.int32)
    try:
        with torch.enable_grad():  # the first packed call may come from a no-grad forward (log-probs)
            got = _varlen(q, k, v, cu, 33, None)
            got.float().sum().backward()  # the backward must exist too: training uses it
    except Exception as error:  # noqa: BLE001 - a capability probe: any failure means "not here"
        _log.warning("packed attention: varlen kernel unavailable, using one SDPA call per sequence",
                     device=str(device), dtype=str(dtype), error=f"{type(error).__name__}: {error}"[:300])
        return "sdpa"
    with torch.no_grad():
        expected = _per_sequence(q, k, v, cu, None)
        error = float((got - expected).abs().max())
    if error > 3e-2:  # bf16: two roundings of a value below 2 differ by at most ~0.008
        _log.warning("packed attention: varlen kernel disagrees with per-sequence SDPA, using SDPA",
                     device=str(device), dtype=str(dtype), max_abs_error=error)
        return "sdpa"
    _log.info("packed attention: varlen kernel", device=str(device), dtype=str(dtype), probe_max_abs_error=error)
    return "varlen"


# ---- the torch backend's Hugging Face attention implementation ----------------------------------

def register_hf(kernel: str = "auto") -> str:
    """Register `libra_packed` with transformers (attention and mask); returns its name for
    `from_pretrained(attn_implementation=...)`. `kernel`: what packed forwards use."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if kernel not in KERNELS:
        raise ValueError(f"packed attention kernel must be one of {KERNELS}, got {kernel!r}")

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:  # a padded micro-batch (or one sequence): transformers' SDPA as usual
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        if query.shape[0] != 1 or dropout:
            raise ValueError("libra_packed attention: a packed forward is one row, without dropout")
        # transformers hands [1, heads, T, D] and wants [1, T, heads, D] back
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = packed_causal_attention(q, k, v, cu_seqlens, int(kwargs.get("max_length_q") or q.shape[0]),
                                      scaling, kernel)
        return out.unsqueeze(0), None

    def mask(*args: Any, **kwargs: Any) -> Any:
        # A packed forward passes no attention mask: the attention above keeps to each sequence, so
        # no (T × T) block-diagonal mask is built. Padded rows get SDPA's mask, as with "sdpa".
        if kwargs.get("attention_mask") is None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(HF_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(HF_IMPLEMENTATION, mask)
    return HF_IMPLEMENTATION


def hf_packed_inputs(packed: Any, device: Any) -> dict[str, Any]:
    """The keyword arguments of a packed forward of a `libra_packed` HF model (one row, no mask)."""
    import torch

    cu = torch.tensor(packed.cu_seqlens, dtype=torch.int32, device=device)
    return {"input_ids": packed.input_ids.to(device), "position_ids": packed.position_ids.to(device),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": packed.max_seqlen,
            "max_length_k": packed.max_seqlen}
