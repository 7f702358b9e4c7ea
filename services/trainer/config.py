"""Typed config of the trainer service (asynchronous GRPO).

The training backend is a union on its `type`: ``backend: torch`` (or ``{type: torch}``) or
``backend: {type: megatron, tensor_parallel: 2, ...}``; the Megatron-Core settings exist only in
the megatron variant, so writing one for the torch backend is an error that names the fix.
`lora` (absent: full fine-tuning) trains low-rank adapters instead of the weights, in either backend.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from libra.configbase import Section, tagged_union


class WarmupConfig(Section):
    """Supervised warm start on the workload's demonstrations before RL."""

    steps: int = Field(250, ge=0, le=1_000_000, description="SFT optimizer steps (0: skip)")
    batch_size: int = Field(32, ge=1, le=65536, description="demonstrations per SFT step")
    lr: float = Field(1.5e-3, gt=0, le=1.0, description="SFT peak learning rate (linear ramp, cosine decay)")


class TorchBackendConfig(Section):
    """The plain PyTorch backend: one process, CPU or one GPU."""

    type: Literal["torch"] = Field("torch", description="backend type")
    forward: Literal["auto", "transformers"] = Field(
        "auto",
        description="auto: a plain Llama-architecture model trained in float32 on a machine without CUDA, with "
                    "no LoRA and no packed micro-batches, runs the rollout engine's own forward pass "
                    "(libra/llama_forward.py: torch alone, transformers never imported: "
                    "~3 CPU-s less start-up); any other model or setting transformers' own; transformers: "
                    "always transformers' model")


class MegatronBackendConfig(Section):
    """The Megatron-Core backend: TP x PP x DP over `trainer.ranks` processes."""

    type: Literal["megatron"] = Field("megatron", description="backend type")
    tensor_parallel: int = Field(1, ge=1, le=64, description="tensor-parallel size (must divide attention and KV heads)")
    pipeline_parallel: int = Field(
        1, ge=1, le=64, description="pipeline-parallel stages (must divide num_hidden_layers; 1F1B schedule)")
    layer_spec: Literal["sdpa", "local"] = Field(
        "sdpa", description="layer spec: sdpa (torch fused attention) or local (Megatron's unfused attention)")
    bf16: bool = Field(True, description="bf16 parameters and activations on GPUs (CPU always runs fp32)")
    fused_kernels: bool = Field(
        True, description="on GPUs, Megatron's torch.compile-fused SwiGLU and cross entropy (off: plain kernels)")
    distributed_optimizer: bool = Field(
        True, description="shard Adam states over data parallelism on GPUs (false for elastic hybrid replicas)")
    expert_parallel: int = Field(1, ge=1, le=1024, description=(
        "expert-parallel size of a mixture-of-experts model: each rank holds num_experts / expert_parallel "
        "experts and tokens travel to them (all-to-all); must divide num_experts and trainer.ranks / "
        "pipeline_parallel (1 for dense models)"))
    router_aux_loss_coef: float | None = Field(None, ge=0, le=10, description=(
        "weight of the routers' load-balancing loss of a mixture-of-experts model (unset: config.json's "
        "router_aux_loss_coef; 0: off); reported as router_aux_loss in the step metrics"))


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Megatron fuses q/k/v into linear_qkv and gate/up into linear_fc1: one adapter each, so they go together.
MEGATRON_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LoraConfig(Section):
    """Low-rank adapters (LoRA): the model's weights stay frozen, W + (alpha / rank) · B·A is trained."""

    rank: int = Field(8, le=4096, description="adapter rank r (>= 1)")
    alpha: float = Field(16.0, gt=0, le=100_000, description="scale numerator: the adapter adds (alpha / rank) · B·A")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapters' input during the gradient pass (log-prob passes never drop)"))
    target_modules: tuple[str, ...] = Field(LORA_MODULES, min_length=1, description=(
        f"projections that get adapters, in Hugging Face names ({', '.join(LORA_MODULES)}); the megatron "
        "backend adapts its fused projections, so q/k/v and gate/up come together there"))

    @field_validator("rank")
    @classmethod
    def _rank(cls, rank: int) -> int:
        if rank < 1:
            raise ValueError(f"trainer.lora.rank must be >= 1, got {rank} (a rank-0 adapter trains nothing); "
                             "remove trainer.lora to train every weight")
        return rank

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(targets) - set(LORA_MODULES))
        if unknown:
            raise ValueError(f"trainer.lora.target_modules: unknown {unknown}; choose from {list(LORA_MODULES)}")
        return tuple(dict.fromkeys(targets))


TrainBackendConfig = tagged_union("trainer.backend", TorchBackendConfig, MegatronBackendConfig)
"""The `trainer.backend` section: torch or megatron (a bare name is short for `{type: NAME}`)."""


class TrainerElasticConfig(Section):
    """The core rank's side of the elastic hybrid pool."""

    channel: Literal["auto", "tcp", "group"] = Field(
        "auto", description="how gradients travel between a core rank and its hybrids: group (a private two-rank "
                            "NCCL group per hybrid on GPUs, gloo on CPU), tcp (the CPU-staged side channel), "
                            "auto (group when both are on GPUs, else tcp); control frames always use TCP")
    grad_deadline_s: float = Field(
        60.0, gt=0, le=3600, description="seconds a step waits for a hybrid's gradient before dropping the hybrid")
    join_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="seconds an admitted hybrid has to connect, build its model and run its warm-up steps")
    max_catch_up_steps: int = Field(
        64, ge=1, le=100_000, description="steps the core keeps gradients for a joining hybrid before failing the "
                                          "join (each kept step is one full gradient on the core's device: raise it "
                                          "for fast steps, mind the memory)")
    catch_up_patience: int = Field(
        8, ge=1, le=100_000, description="boundaries a caught-up hybrid may stay one step behind before it is "
                                         "activated anyway (the core then waits once)")
    snapshot_shards: int = Field(4, ge=1, le=1024, description="files a join snapshot is written as")


class TrainerConfig(Section):
    """GRPO hyper-parameters, staleness bound, checkpoints."""

    backend: TrainBackendConfig = Field(
        default_factory=TorchBackendConfig,
        description="training backend (torch: plain PyTorch, CPU or DDP; megatron: Megatron-Core, TP x PP x DP)")
    ranks: int = Field(1, ge=1, le=4096, description=(
        "processes the trainer runs on: 1, or the TP x PP x DP ranks of the megatron backend (libra up launches "
        "them with torchrun on this node; under torchrun/srun the launcher's WORLD_SIZE must equal it); rank 0 "
        "serves, the others follow its calls"))
    steps: int = Field(30, ge=1, le=10_000_000, description="GRPO steps to run")
    groups_per_step: int = Field(8, ge=1, le=1_000_000, description="prompt groups per training batch")
    group_size: int = Field(8, ge=2, le=4096, description="samples per prompt (GRPO group)")
    lr: float = Field(1e-4, gt=0, le=1.0, description="learning rate")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    clip_low: float = Field(0.2, gt=0, lt=1.0, description="lower clip of the policy ratio (1 - clip_low)")
    clip_high: float = Field(0.28, gt=0, le=10.0, description="upper clip of the policy ratio (1 + clip_high)")
    kl_coef: float = Field(0.0, ge=0, le=100.0, description="KL penalty against the behaviour policy (0: off)")
    tis_cap: float = Field(2.0, ge=1.0, le=1000.0, description="cap of the truncated importance weight behaviour vs old policy")
    recompute_logprobs: bool = Field(False, description="recompute old log-probs with the current weights before the update")
    skip_zero_advantage: bool = Field(True, description=(
        "leave out of the forward and backward passes the sequences whose advantage is 0 (a group whose rewards "
        "are all equal) when they carry no gradient (kl_coef 0, no MoE router loss): the update is the same, "
        "the denominator of the token mean still counts their tokens; kl, ratio_mean and tis_mean are then "
        "means over the tokens with a gradient (0 in a step with none)"))
    logprob_check_sequences: int = Field(8, ge=0, le=1_000_000, description=(
        "fresh sequences per step whose log-probs the trainer recomputes to check the weight sync "
        "(behaviour_logprob_gap), spread over the batch: a forward pass of that many sequences (0: no check)"))
    max_staleness: int = Field(1, ge=0, le=1000, description="largest policy-version lag of a trajectory admitted to a batch")
    micro_batch_size: int = Field(16, ge=1, le=65536, description="sequences per forward/backward (when "
                                                                  "micro_batch_tokens is 0; each right-padded)")
    micro_batch_tokens: int = Field(0, ge=0, le=100_000_000, description=(
        "token budget of a packed micro-batch: its sequences concatenated into one row with no padding, attention "
        "kept inside each sequence, sequences placed longest first into the first micro-batch with room "
        "(0: micro_batch_size right-padded sequences per micro-batch); must hold rollout.max_total_tokens"))
    micro_batch_cost_tokens: int | None = Field(None, ge=0, le=100_000_000, description=(
        "with right-padded micro-batches (micro_batch_tokens 0): what one more micro-batch costs, in padded tokens; "
        "sequences sorted by length are cut where the padding saved is worth more (default: 48 on a CPU, measured "
        "there; on a GPU the fewest micro-batches, cut where they pad least)"))
    packed_attention: Literal["auto", "varlen", "sdpa"] = Field("auto", description=(
        "attention of packed micro-batches: varlen (FlashAttention's variable-length kernel: CUDA, bf16/fp16), "
        "sdpa (one torch SDPA call per sequence: any device), auto (varlen where it runs, else sdpa; on compute "
        "capability >= 9.0, rows of long sequences (mean >= 1,024 tokens) go to sdpa, whose cuDNN kernels are faster)"))
    checkpoint_every: int = Field(5, ge=1, le=1_000_000, description="steps between checkpoints (stream entries are acked at checkpoints)")
    torch_threads: int = Field(1, ge=1, le=512, description="intra-op threads of the CPU backend")
    lora: LoraConfig | None = Field(None, description="train low-rank adapters only (absent: full fine-tuning)")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="supervised warm start")
    elastic: TrainerElasticConfig = Field(default_factory=TrainerElasticConfig,
                                          description="elastic hybrid replicas: the side channel")

    @model_validator(mode="before")
    @classmethod
    def _megatron_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "megatron" in data:
            raise ValueError("trainer.megatron moved into the backend: write trainer.backend: {type: megatron, "
                             "tensor_parallel: ..., ...} (docs/configuration.md, trainer.backend)")
        return data

    @model_validator(mode="after")
    def _clip(self) -> "TrainerConfig":
        if self.clip_high < self.clip_low * 0.5:
            raise ValueError("trainer.clip_high is far below clip_low; asymmetric clipping expects clip_high >= clip_low")
        backend = self.backend
        if self.packed_attention != "auto" and not self.micro_batch_tokens:
            raise ValueError(f"trainer.packed_attention={self.packed_attention} applies to packed micro-batches only; "
                             "set trainer.micro_batch_tokens (a token budget) or leave packed_attention at auto")
        if self.micro_batch_tokens and backend.type == "megatron" and backend.layer_spec == "local":
            raise ValueError("trainer.micro_batch_tokens (packed micro-batches) needs trainer.backend.layer_spec: sdpa "
                             "(Megatron's local spec has no attention that keeps to each packed sequence)")
        if self.ranks > 1 and backend.type != "megatron":
            raise ValueError(f"trainer.ranks={self.ranks} needs trainer.backend: megatron (the torch backend trains in "
                             "one process); set trainer.ranks=1 or trainer.backend=megatron")
        if self.ranks > 1 and self.ranks % (backend.tensor_parallel * backend.pipeline_parallel):
            model_parallel = backend.tensor_parallel * backend.pipeline_parallel
            raise ValueError(f"trainer.ranks={self.ranks} is not a multiple of trainer.backend.tensor_parallel x "
                             f"pipeline_parallel = {model_parallel}; the data-parallel size is ranks / {model_parallel}")
        if backend.type == "megatron" and backend.expert_parallel > 1:
            data_parallel = self.ranks // (backend.tensor_parallel * backend.pipeline_parallel)
            if data_parallel % backend.expert_parallel:
                raise ValueError(f"trainer.backend.expert_parallel={backend.expert_parallel} does not divide the "
                                 f"data-parallel size {data_parallel} (trainer.ranks={self.ranks} / tensor_parallel x "
                                 "pipeline_parallel): experts are spread over data-parallel ranks; raise trainer.ranks "
                                 "or lower expert_parallel")
        if self.lora is not None and backend.type == "megatron":
            for fused in MEGATRON_FUSED:
                chosen = [name for name in fused if name in self.lora.target_modules]
                if chosen and len(chosen) < len(fused):
                    raise ValueError(f"trainer.lora.target_modules has {chosen} but not all of {list(fused)}: the "
                                     "megatron backend fuses them into one projection with one adapter; list all or none")
        return self
