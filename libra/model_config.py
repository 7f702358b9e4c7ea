"""The policy model a run trains and serves: a tiny locally created one, or a Hugging Face directory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from libra.configbase import Section


class ModelConfig(Section):
    """Architecture of a tiny model created by Libra (`source: tiny`), or the path of an existing one."""

    source: Literal["tiny", "path"] = Field("tiny", description="tiny: create a small Llama-architecture model; path: load `path`")
    path: str = Field("", description="Hugging Face model directory when source is path")
    hidden_size: int = Field(128, ge=8, le=65536, description="hidden size of the tiny model")
    layers: int = Field(2, ge=1, le=256, description="decoder layers of the tiny model")
    heads: int = Field(4, ge=1, le=512, description="attention heads of the tiny model")
    kv_heads: int = Field(4, ge=1, le=512, description="key/value heads of the tiny model")
    intermediate_size: int = Field(384, ge=8, le=262144, description="MLP width of the tiny model")
    vocab_size: int = Field(512, ge=300, le=262144, description="target vocabulary of the locally trained tokenizer")
    max_position: int = Field(512, ge=16, le=1_000_000, description="max positions of the tiny model")

    @model_validator(mode="after")
    def _shape(self) -> "ModelConfig":
        if self.source == "path" and not self.path:
            raise ValueError("model.path is required when model.source is 'path'")
        if self.hidden_size % self.heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by model.heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model.heads ({self.heads}) must be divisible by model.kv_heads ({self.kv_heads})")
        return self
