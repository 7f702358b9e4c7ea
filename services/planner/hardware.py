"""What the planner's cost model knows about GPUs and models: typed specs and their YAML loaders.

Owns `GpuSpec` (one accelerator and its node) and `ModelSpec` (a decoder's architecture, from which
total and active parameter counts are derived). It must not know about plans, traces or search.
Files live in `configs/hardware/*.yaml` and `configs/models/*.yaml`; each cites its `source`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Type, TypeVar

import yaml
from pydantic import Field, ValidationError, model_validator

from libra.configbase import Section
from libra.errors import ConfigError

GIB = 1024 ** 3
GB = 1e9
CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"


class GpuSpec(Section):
    """One GPU model and the node it sits in; bandwidths are the datasheet figures."""

    name: str = Field(..., min_length=1, max_length=64, description="short name, e.g. h200-141g")
    source: str = Field("", max_length=400, description="where the numbers come from")
    memory_gib: float = Field(..., gt=0, le=4096, description="device memory in GiB")
    hbm_gbps: float = Field(..., gt=0, le=100_000, description="HBM bandwidth, GB/s")
    bf16_tflops: float = Field(..., gt=0, le=100_000, description="dense BF16 peak, TFLOP/s")
    nvlink_gbps: float = Field(..., ge=0, le=100_000,
                               description="intra-node NVLink per GPU, GB/s, bidirectional total")
    internode_gbps: float = Field(..., gt=0, le=10_000, description="inter-node network per GPU, GB/s")
    gpus_per_node: int = Field(8, ge=1, le=256, description="GPUs that share one NVLink domain")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def link_bytes_per_s(self, span_gpus: int) -> float:
        """One-direction bandwidth of a collective spanning `span_gpus` GPUs packed from node starts."""
        if span_gpus <= self.gpus_per_node and self.nvlink_gbps > 0:
            return self.nvlink_gbps / 2 * GB  # the datasheet counts both directions
        return self.internode_gbps * GB


class ModelSpec(Section):
    """A decoder-only transformer (dense, or MoE when `experts` > 0) with grouped-query attention."""

    name: str = Field(..., min_length=1, max_length=64, description="short name, e.g. qwen3-14b")
    source: str = Field("", max_length=400, description="where the numbers come from")
    hidden_size: int = Field(..., ge=8, le=65536, description="model width")
    layers: int = Field(..., ge=1, le=512, description="decoder layers")
    heads: int = Field(..., ge=1, le=1024, description="query heads")
    kv_heads: int = Field(..., ge=1, le=1024, description="key/value heads (GQA groups)")
    head_dim: int = Field(..., ge=8, le=1024, description="width of one attention head")
    intermediate_size: int = Field(..., ge=8, le=1_000_000,
                                   description="MLP width (of one expert for MoE models)")
    vocab_size: int = Field(..., ge=2, le=1_000_000, description="vocabulary size")
    tie_embeddings: bool = Field(False, description="input and output embeddings share weights")
    experts: int = Field(0, ge=0, le=4096, description="routed experts per layer (0: dense)")
    active_experts: int = Field(0, ge=0, le=4096, description="experts routed per token (MoE only)")
    bytes_per_param: float = Field(2.0, gt=0, le=8, description="weight bytes per parameter (bf16: 2)")
    kv_bytes_per_value: float = Field(2.0, gt=0, le=8, description="KV-cache bytes per element (bf16: 2)")

    @model_validator(mode="after")
    def _shape(self) -> "ModelSpec":
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.experts and not 1 <= self.active_experts <= self.experts:
            raise ValueError(f"active_experts must be in 1..experts ({self.experts}), got {self.active_experts}")
        if not self.experts and self.active_experts:
            raise ValueError("active_experts is set but experts is 0 (a dense model)")
        return self

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer (biases and norms are negligible)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    @property
    def mlp_params(self) -> int:
        """Gated MLP of one layer: all experts plus the router for MoE."""
        one = 3 * self.hidden_size * self.intermediate_size
        return one * self.experts + self.hidden_size * self.experts if self.experts else one

    @property
    def active_mlp_params(self) -> int:
        one = 3 * self.hidden_size * self.intermediate_size
        return one * self.active_experts + self.hidden_size * self.experts if self.experts else one

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def total_params(self) -> int:
        return self.layers * (self.attention_params + self.mlp_params) + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters touched per token (the FLOP count's N)."""
        return self.layers * (self.attention_params + self.active_mlp_params) + self.embedding_params

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param


S = TypeVar("S", bound=Section)


def _load(kind: Type[S], path: Path) -> S:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read {kind.__name__} file {path}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ConfigError(f"{path}: field {where}: {first['msg']}") from error


def load_gpu(path: str | Path) -> GpuSpec:
    """A `GpuSpec` from YAML; `ConfigError` names the offending field."""
    return _load(GpuSpec, Path(path))


def load_model(path: str | Path) -> ModelSpec:
    """A `ModelSpec` from YAML; `ConfigError` names the offending field."""
    return _load(ModelSpec, Path(path))


def gpu_named(name: str, root: Path = CONFIG_ROOT) -> GpuSpec:
    """`configs/hardware/NAME.yaml`."""
    return load_gpu(root / "hardware" / f"{name}.yaml")


def model_named(name: str, root: Path = CONFIG_ROOT) -> ModelSpec:
    """`configs/models/NAME.yaml`."""
    return load_model(root / "models" / f"{name}.yaml")
