"""The Megatron-Core training backend: an HF Llama/Qwen2/Qwen3 (or Qwen3-MoE/Qwen2-MoE) model as a
Megatron GPTModel.

Owns: the process-group layout (TP × PP × DP, and EP over DP for experts), this rank's stage of the GPTModel built from the
HF config (`megatron.convert`), its optimizer, the GRPO step (the same `policy_loss` as the torch
backend, run through Megatron's pipeline schedule by `megatron.pipeline`), HF weight publication,
distributed checkpoints (`megatron.checkpoint`), and its part of the step every backend shares
(`gradient_hook.train_step`: flat gradient, data-parallel sum, write-back).
Must not know: Redis, gRPC, how batches are assembled.

Runs in: every trainer rank process (one instance per rank: global rank 0's is driven by the
trainer service, the others' by `ranks.follow`), and in an elastic hybrid replica's process, which
builds one itself with TP = PP = 1 in a one-process world of its own (`elastic.backends.build`).

Two execution paths, one model:

    CUDA  bf16 params, Megatron DDP (contiguous grad buffers, fp32 grads) + the distributed
          optimizer (Adam states sharded over DP); the DP reduce happens in finish_grad_sync().
    CPU   fp32, no Megatron DDP (its buffers and the distributed optimizer are CUDA-only): one
          flattened all-reduce over the DP group and torch AdamW — the torch backend's scheme.

Each rank is called with its DP replica's shard of the step's batch; the ranks of one
model-parallel group (TP × PP: every rank of the replica) must be handed the same shard. The step's
arithmetic — every rank's loss divided by (global loss tokens N / W), W the replicas of the step,
the DP sum of gradients divided by W, so the update is the token-level mean over the whole batch,
and the elastic hook's calls — is `gradient_hook.train_step`, shared with the torch backend; this
backend supplies its flat gradient (Megatron DDP's grad buffer on CUDA), the DP sum (DDP's
finish_grad_sync, which with calculate_per_token_loss sums without scaling) and the write-back.

Elastic hybrid replicas: delivering the reduced gradient to hybrids needs it whole on each core
rank, which the distributed optimizer (reduce-scatter) does not give, and a hybrid computes the
whole model's gradient, a pipeline stage or tensor-parallel shard only its part: such layouts
train without using the hook and refuse hybrids at admission (`hybrid_refusal`). A hybrid builds
this backend itself (TP = PP = 1, its own one-process world) and loads a snapshot of this rank's
model and Adam state (`elastic.backends`, `elastic.snapshot`). Model and optimizer are built by
`megatron.build`.

Mixture of experts (`megatron.moe`): experts spread over `expert_parallel` ranks, the routers'
load-balancing loss in the gradient and in the step metrics (`router_aux_loss`); expert gradients
are summed over the ranks that hold the same experts. LoRA (`trainer.lora`, `megatron.lora`):
adapters on the targeted linears, every other parameter frozen — gradients, the optimizer, the
elastic hook's flat gradient and the checkpoint hold only the adapters; published weights are the
merged ones (W + (alpha/r)·B·A), so every engine loads plain HF weights.

CPU (tests, tiny runs): Megatron-Core assumes CUDA in a few helpers; `megatron.runtime.
patch_megatron_for_cpu` adapts exactly those, and only when torch has no CUDA.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

from libra.errors import FailedPrecondition
from libra.services.trainer.backend import (TrainBackend, TrainBatch, as_trained_means, gradient_batch,
                                            write_safetensors_dir)
from libra.services.trainer import world
from libra.services.trainer.gradient_hook import train_step as shared_train_step
from libra.services.trainer.megatron import build as build
from libra.services.trainer.megatron import checkpoint as checkpoint
from libra.services.trainer.megatron import lora as lora
from libra.services.trainer.megatron import moe as moe
from libra.services.trainer.megatron import pipeline as pipeline
from libra.services.trainer.megatron import runtime as rt

if TYPE_CHECKING:
    import torch

    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.gradient_hook import GradientHook


class MegatronBackend(TrainBackend):
    """`TrainBackend` on Megatron-Core (GPU by default; CPU for tests and tiny runs)."""

    def __init__(self, config: TrainerConfig, seed: int = 0, layer_spec: str | None = None) -> None:
        if config.backend.type != "megatron":
            raise ValueError(f"MegatronBackend needs trainer.backend type megatron, got {config.backend.type}; "
                             "set trainer.backend: megatron")
        self.config = config
        self.seed = seed
        self.layer_spec = layer_spec or config.backend.layer_spec
        self.model_dir: str | None = None
        self.gradient_hook: GradientHook | None = None  # elastic hybrid replicas' injection point
        self.shape: Any = None
        self._hf_config: Any = None
        self._model: Any = None  # the GPTModel (inside the DDP wrapper on CUDA)
        self._ddp: Any = None
        self._optimizer: Any = None
        self._cuda = False
        self._parameters = 0

    def hybrid_refusal(self) -> str | None:
        """Why this rank cannot take elastic hybrid replicas, or None when it can.

        The trainer installs its elastic core on every run, so a layout that cannot take hybrids
        still trains (the hook is then not used at all); it is the admission of a hybrid that is
        refused with this reason (ElasticCore.admit).
        """
        import torch

        settings = self.config.backend
        if settings.pipeline_parallel > 1:
            return (f"elastic hybrid replicas add whole-model gradients, but trainer.backend.pipeline_parallel="
                    f"{settings.pipeline_parallel} leaves each core rank one stage's: set pipeline_parallel=1 to "
                    "use hybrid replicas")
        if settings.expert_parallel > 1:
            return (f"elastic hybrid replicas are one whole model each, but trainer.backend.expert_parallel="
                    f"{settings.expert_parallel} leaves each core rank a share of the experts: set expert_parallel=1 "
                    "to use hybrid replicas")
        if settings.tensor_parallel > 1:  # mapping a lane to TP coordinates: not built
            return (f"elastic hybrid replicas are one whole model each, but trainer.backend.tensor_parallel="
                    f"{settings.tensor_parallel} leaves each core rank a tensor-parallel shard: set "
                    "tensor_parallel=1 to use hybrid replicas")
        if settings.distributed_optimizer and torch.cuda.is_available():
            return ("elastic hybrid replicas need the full reduced gradient on every core rank: set "
                    "trainer.backend.distributed_optimizer=false")
        return None

    # ---- loading -------------------------------------------------------------------------
    def load(self, model_dir: str) -> None:
        import torch
        from transformers import AutoConfig

        from libra.services.trainer.megatron import convert as convert

        if not os.path.isdir(model_dir):
            raise ValueError(f"MegatronBackend.load: {model_dir!r} is not a model directory")
        settings = self.config.backend
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        shape = convert.model_shape(hf_config)
        convert.check_parallel(shape, settings.tensor_parallel, settings.pipeline_parallel, settings.expert_parallel)
        if settings.router_aux_loss_coef is not None and not shape.moe:
            raise ValueError(f"trainer.backend.router_aux_loss_coef={settings.router_aux_loss_coef} applies to "
                             "mixture-of-experts models; this one is dense (config.json has no num_experts): remove it")
        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            torch.set_num_threads(self.config.torch_threads)
            rt.patch_megatron_for_cpu()
        rt.init_parallel(settings.tensor_parallel, self._cuda, settings.pipeline_parallel, settings.expert_parallel)
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        bf16 = self._cuda and settings.bf16
        self.shape, self._hf_config, self.model_dir = shape, hf_config, model_dir
        model = build.build_model(hf_config, shape, self.config, self.layer_spec, bf16, self._cuda, self.seed)
        build.load_state(model, pipeline.stage_state(model, model_dir, shape, settings.tensor_parallel, rt.tp_rank(),
                                                     ep=settings.expert_parallel, ep_rank=rt.ep_rank()))
        self._model = model
        self._parameters = pipeline.count_parameters(model, settings.tensor_parallel, self._device())
        self._ddp, self._optimizer = build.build_optimizer(model, self.config, bf16, self._cuda)

    @property
    def model(self) -> Any:
        if self._model is None:
            raise FailedPrecondition("MegatronBackend: call load(model_dir) first")
        return self._model

    def num_parameters(self) -> int:
        """Parameters of the whole model (all stages, TP shards summed, replicated norms once, every
        expert; LoRA adapters not counted), counted at load."""
        if self._model is None:
            raise FailedPrecondition("MegatronBackend: call load(model_dir) first")
        return self._parameters

    # ---- forward ---------------------------------------------------------------------------
    def _device(self) -> Any:
        import torch

        return torch.cuda.current_device() if self._cuda else "cpu"

    def _micro_batches(self, batch: TrainBatch, config: TrainerConfig) -> list[pipeline.Micro]:
        # SDPA applies the causal mask itself; the local spec takes it as a tensor.
        if config.micro_batch_tokens and self.layer_spec != "sdpa":
            raise ValueError("packed micro-batches (trainer.micro_batch_tokens) need trainer.backend.layer_spec: sdpa")
        return pipeline.micro_batches(batch, config, self._device(), causal_mask=self.layer_spec == "local")

    def _runner(self) -> Any:
        return self._ddp if self._ddp is not None else self.model

    def compute_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Collective over the model-parallel group; every stage gets the last stage's log-probs."""
        local = pipeline.logprobs(self._runner(), self._micro_batches(batch, self.config))
        return [lp.cpu() for lp in pipeline.share_logprobs(local, batch, self._device())]

    # ---- the GRPO step ---------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, config: TrainerConfig) -> dict[str, float]:
        hook = self.gradient_hook if self.hybrid_refusal() is None else None  # no hybrids can be admitted
        return shared_train_step(self, batch, config, hook)

    # ---- the hybrid-replica surface (the torch backend's names, for backend-neutral callers) ----
    @property
    def optimizer(self) -> Any:
        if self._optimizer is None:
            raise FailedPrecondition("MegatronBackend: call load(model_dir) first")
        return self._optimizer

    def accumulate_gradients(self, batch: TrainBatch, config: TrainerConfig, token_count: float) -> dict[str, float]:
        """Zeroed gradients, then every micro-batch's gradient of Σ token loss / token_count; metric
        sums (equal on every stage). Recomputed old log-probs are needed on the last stage only. The
        sequences with a gradient only (`gradient_batch`; at least one, so that every rank runs a
        micro-batch; all of them when the router's loss is on: every token feeds it)."""
        router_loss = self.shape.moe and self._aux_loss_coef() > 0
        trained = gradient_batch(batch, config, other_loss=router_loss, keep_one=True)
        micros = self._micro_batches(trained, config)
        old = pipeline.logprobs(self._runner(), micros) if config.recompute_logprobs else None
        self._set_hyper_parameters(config)
        self._zero_grad()
        if self.shape.moe:
            moe.clear_aux_loss()
            moe.weigh_aux_loss(self.model, self._aux_loss_coef(), token_count)
        if self.config.lora is not None and self.config.lora.dropout:
            lora.set_dropout(self.model, True)
        try:
            sums = pipeline.accumulate(self._runner(), micros, config, old, token_count=token_count)
        finally:
            if self.config.lora is not None:
                lora.set_dropout(self.model, False)
        if router_loss:
            sums.update(moe.read_aux_loss(self.model, len(micros)))
        pipeline.finish_model_parallel_grads(self.model, main_grad=self._ddp is not None)
        return as_trained_means(sums, batch, trained)

    def _aux_loss_coef(self) -> float:
        coef = self.config.backend.router_aux_loss_coef
        return self.shape.aux_loss_coef if coef is None else coef

    def step_optimizer(self, config: TrainerConfig) -> float:
        """Clip the current gradients and take one optimizer step; returns the pre-clip norm."""
        self._set_hyper_parameters(config)
        if self._ddp is not None:
            ok, grad_norm, _ = self._optimizer.step()
            if not ok:
                raise FloatingPointError("step_optimizer: the optimizer skipped the update (non-finite gradients)")
            return float(grad_norm)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = rt.clip_model_parallel(params, config.max_grad_norm)
        self._optimizer.step()
        return grad_norm

    def flat_gradients(self) -> torch.Tensor:
        """This rank's gradient as one flat tensor: Megatron DDP's grad buffer itself (when there is
        one buffer; several are concatenated), else every parameter's .grad concatenated."""
        import torch

        if self._ddp is not None:
            buffers = self._grad_buffers()
            return buffers[0] if len(buffers) == 1 else torch.cat([b.reshape(-1) for b in buffers])
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])

    def set_flat_gradients(self, flat: torch.Tensor) -> None:
        if self._ddp is not None:
            buffers = self._grad_buffers()
            if len(buffers) > 1 or flat.data_ptr() != buffers[0].data_ptr():
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset: offset + b.numel()].view_as(b))
                    offset += b.numel()
            return
        offset = 0
        for p in (p for p in self.model.parameters() if p.requires_grad):
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _grad_buffers(self) -> list[torch.Tensor]:
        """Megatron DDP's gradient buffers: the dense ones, then the expert-parallel ones (EP > 1)."""
        buffers = list(self._ddp.buffers) + list(getattr(self._ddp, "expert_parallel_buffers", []) or [])
        return [buffer.grad_data for buffer in buffers]

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (on the GPU with NCCL)."""
        return rt.dp_sum_tensor(values.to(self._device()))

    def dp_sum_gradients(self, flat: torch.Tensor) -> torch.Tensor:
        """On CUDA Megatron DDP's own grad sync (all-reduce, or reduce-scatter with the distributed
        optimizer) over its buffers, which `flat` is written into first; on CPU one all-reduce."""
        if self._ddp is None:
            if self.config.backend.expert_parallel > 1:  # expert gradients: over the ranks holding the same experts
                return moe.sum_gradients([p for p in self.model.parameters() if p.requires_grad], flat)
            return rt.dp_sum_tensor(flat)
        self.set_flat_gradients(flat)
        self._ddp.finish_grad_sync()
        return self.flat_gradients()

    def _zero_grad(self) -> None:
        if self._ddp is not None:
            self._ddp.zero_grad_buffer()
            self._optimizer.zero_grad()
            return
        for p in self.model.parameters():
            p.grad = None

    def _set_hyper_parameters(self, config: TrainerConfig) -> None:
        # Per step, so a changed config on resume takes effect; Megatron's groups carry wd_mult
        # (0 for biases and norms), which is kept.
        for group in self._optimizer.param_groups:
            group["lr"], group["weight_decay"] = config.lr, config.weight_decay * group.get("wd_mult", 1.0)

    # ---- files -----------------------------------------------------------------------------
    @property
    def device(self) -> str:
        import torch

        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def hf_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the whole model on this device, for the weights group; collective over
        DP replica 0 (TP and PP), and only global rank 0 (DP 0, TP 0, first stage) gets a non-empty list."""
        hf = self.hf_state_dict(to_cpu=False)
        return sorted(hf.items()) if hf is not None else []

    def hf_state_dict(self, to_cpu: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole model's HF state dict on global rank 0 (None elsewhere); collective over DP replica 0."""
        return pipeline.hf_state_dict(self.model, self.shape, to_cpu, self._device())

    def save_weights(self, out_dir: str) -> None:
        hf = self.hf_state_dict()
        if hf is not None:
            write_safetensors_dir(out_dir, self.model_dir, hf)
        world.barrier()

    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """A Megatron distributed checkpoint (model + optimizer in model space): `megatron.checkpoint`."""
        checkpoint.save(self.model, self.optimizer, path, extra)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return checkpoint.load(self.model, self.optimizer, path)
