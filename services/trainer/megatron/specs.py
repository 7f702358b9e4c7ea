"""Megatron-Core layer specs for the trainer: the stock local spec, with fused (SDPA) core attention.

Owns: which Megatron-Core modules make up one transformer layer of the policy model.
Must not know: Hugging Face, weights on disk, the GRPO loss.

Runs in: every trainer rank process and a hybrid replica's process (the layers of the model each
of them builds).

Megatron's local spec (`get_gpt_layer_local_spec`) computes attention unfused: it materialises the
(b·heads, s, s) score matrix, softmaxes it in a separate kernel and multiplies again — on an H200
that held a ~0.94B model at ~25% MFU. Transformer Engine (Megatron's fused path) is not installed
on our GPU machines, so `SDPAttention` replaces only the spec's `core_attention` submodule with
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)`, which PyTorch dispatches to
its FlashAttention kernel on CUDA for bf16/fp16 (and to its math kernel on CPU). Everything else —
QKV/projection linears, tensor parallelism, norms, MLP — stays Megatron's own.

The mask is the causal one and nothing else: the trainer right-pads sequences, so a real token
never attends to a pad (pads come after it) and positions are 0..T−1 for every row; what the pads
themselves compute is masked out of the loss.

Packed micro-batches (THD: Megatron passes `packed_seq_params` with cu_seqlens and hands q/k/v as
[tokens, heads, dim], RoPE already applied per sequence): attention is causal within each sequence
and never across one, through `packed_attention.packed_causal_attention` (FlashAttention's varlen
kernel where it runs, else one SDPA call per sequence) — Transformer Engine, Megatron's own THD
path, is not on our GPU machines.
"""

from __future__ import annotations

from typing import Any

SPECS = ("sdpa", "local")


def layer_spec(name: str, qk_layernorm: bool, packed_kernel: str = "auto", num_experts: int | None = None) -> Any:
    """The `ModuleSpec` of one GPT layer: "local" (Megatron's, unfused attention) or "sdpa";
    `packed_kernel`: the sdpa spec's attention kernel for packed rows (trainer.packed_attention);
    `num_experts`: a mixture-of-experts MLP (Megatron's MoE layer: router, token dispatcher, the
    experts as a sequence of MLPs — grouped GEMMs need Transformer Engine or the grouped_gemm
    package, neither of which our GPU machines have) instead of the dense one."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if name not in SPECS:
        raise ValueError(f"trainer.backend.layer_spec must be one of {SPECS}, got {name!r}")
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    if name == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=_sdpa_class(), params={"packed_kernel": packed_kernel})
    return spec


_SDPA_CLASS: Any = None


def _sdpa_class() -> Any:
    """`SDPAttention`, built on first use so that importing this module does not import megatron."""
    global _SDPA_CLASS
    if _SDPA_CLASS is not None:
        return _SDPA_CLASS
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from libra.services.trainer.packed_attention import packed_causal_attention

    class SDPAttention(DotProductAttention):
        """Megatron's core-attention interface over torch SDPA (causal, GQA without copying K/V), and
        over packed rows (THD) with attention kept inside each sequence."""

        def __init__(self, *args, packed_kernel: str = "auto", **kwargs):  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.packed_kernel = packed_kernel  # trainer.packed_attention

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **unused):  # noqa: ANN001 - Megatron's signature
            if attention_bias is not None:
                raise ValueError("SDPAttention: attention biases are not supported")
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd" or self.training and self.attention_dropout.p:
                    raise ValueError("SDPAttention: packed sequences come as THD, without attention dropout")
                # [tokens, heads, head_dim] in and out; Megatron reshapes to [tokens, 1, hidden]
                return packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                               packed_seq_params.max_seqlen_q, self.softmax_scale, self.packed_kernel)
            # Megatron hands [s, b, heads, head_dim]; SDPA wants [b, heads, s, head_dim].
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
            dropout = self.attention_dropout.p if self.training else 0.0
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale, enable_gqa=grouped)
            # [b, heads, s, d] -> [s, b, heads·d]
            context = context.permute(2, 0, 1, 3).contiguous()
            return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)

    _SDPA_CLASS = SDPAttention
    return SDPAttention
