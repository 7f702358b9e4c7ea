"""The plain-PyTorch training backend: HF causal LM in float32, AdamW, optional data parallelism.

Owns: one model replica and its optimizer on this process, the micro-batched GRPO step, and the
files it writes (published weights, checkpoints). Must not know: Redis, gRPC, how batches are
assembled or where weights go next.

Data parallelism: when `torch.distributed` is initialised (gloo on CPU), each rank calls every
method with its own shard of the step's batch. There is no DDP wrapper: after all micro-batches
have accumulated, one all-reduce sums the flattened gradients. The step's arithmetic (loss scaled
by W / N, the sum ÷ W, elastic hybrids' gradients injected first) is `gradient_hook.train_step`,
shared with the Megatron backend; this backend supplies its flat gradient, its sums over the
default group and the write-back.

The model stays in eval mode (no dropout): the policy ratio compares two forward passes of the
same function, and rollout workers sample without dropout too.

The model is transformers' `AutoModelForCausalLM`, or (`trainer.backend.forward: auto`, the
default) for a plain float32 Llama on a machine without CUDA, with no LoRA and no packed
micro-batches, the rollout engine's own pass (libra/llama_forward.py, the same
parameters under the same names, held to transformers' logits by its tests): the trainer then never
imports transformers (~2.7 CPU-seconds of start-up on a small machine), and it trains the same
network code the CPU engines sample with. Published weights are the same safetensors either way.

LoRA (`trainer.lora`, services/trainer/lora.py): peft adapters on the targeted linears, every other
weight frozen — so gradients, the optimizer, the elastic hook's flat gradient and the checkpoint hold
only the adapters; published weights are the merged ones under the HF model's names
(`hf_named_tensors`, `save_weights`), so every engine and transport loads plain HF weights.

Micro-batches (`TrainBatch.plan`): `micro_batch_size` right-padded sequences, or with
`micro_batch_tokens` a token budget of sequences concatenated into one row with no padding; the
model is then loaded with the `libra_packed` attention implementation (packed_attention.py), so
each sequence attends only to itself and positions restart per sequence. Log-probs come back in
the batch's order whichever micro-batch computed them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from libra.errors import FailedPrecondition
from libra.services.trainer.backend import (TrainBackend, TrainBatch, as_trained_means, atomic_torch_save,
                                            gradient_batch, micro_batch_cost, pack, token_logprobs, unpack,
                                            write_safetensors_dir, write_weights_dir)
from libra.services.trainer.gradient_hook import train_step as shared_train_step
from libra.services.trainer.grpo import policy_loss
from libra.services.trainer.world import barrier, distributed, rank

if TYPE_CHECKING:
    import torch

    from libra.services.trainer.config import TrainerConfig

CHECKPOINT_FORMAT = 1


class TorchBackend(TrainBackend):
    """`TrainBackend` on plain PyTorch (CPU; data parallel over gloo when a process group exists)."""

    def __init__(self, config: TrainerConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self.model_dir: str | None = None
        self.transformers_because = ""  # why the loaded model is transformers' ("": the engine's own pass)
        self._model: Any = None
        self._optimizer: Any = None
        self._optimizer_lock = threading.Lock()

    # ---- loading -------------------------------------------------------------------------
    def load(self, model_dir: str) -> None:
        import torch

        if not os.path.isdir(model_dir):
            raise ValueError(f"TorchBackend.load: {model_dir!r} is not a model directory")
        torch.set_num_threads(self.config.torch_threads)
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        self.transformers_because = self._own_forward_reason(model_dir) or ""
        if not self.transformers_because:
            from libra.llama_forward import LlamaForward

            model = LlamaForward.load(model_dir)
        else:
            model = self._transformers_model(model_dir)
        if self.config.lora is not None:
            from libra.services.trainer import lora

            model = lora.wrap(model, self.config.lora)
        model.eval()
        with self._optimizer_lock:
            self._model, self.model_dir = model, model_dir
            self._optimizer = None  # made on first use (`optimizer`), or ahead of it by prepare_optimizer

    def prepare_optimizer(self) -> None:
        """Make the optimizer now, if not yet. torch.optim's first optimizer imports torch._dynamo
        (~1.4 CPU-seconds): the trainer calls this in a thread while the first batch is rolled out,
        so the weights can be published without waiting for it. Thread-safe; a no-op before `load`."""
        import torch

        with self._optimizer_lock:
            if self._optimizer is None and self._model is not None:
                self._optimizer = torch.optim.AdamW(
                    [p for p in self._model.parameters() if p.requires_grad],
                    lr=self.config.lr, weight_decay=self.config.weight_decay,
                )

    def _transformers_model(self, model_dir: str) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        extra = {}
        if self.config.micro_batch_tokens:  # packed micro-batches: attention kept inside each sequence
            from libra.services.trainer.packed_attention import register_hf

            extra["attn_implementation"] = register_hf(self.config.packed_attention)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra)
        model.config.use_cache = False
        return model

    def _own_forward_reason(self, model_dir: str) -> str | None:
        """Why this model must load as transformers' (None: it runs the engine's own pass)."""
        import torch

        from libra.llama_forward import unsupported_dir

        settings = self.config.backend
        if getattr(settings, "forward", "transformers") != "auto":
            return "trainer.backend.forward is transformers"
        if self.config.lora is not None:
            return "LoRA adapters (peft wraps transformers' model)"
        if self.config.micro_batch_tokens:
            return "packed micro-batches (transformers' attention interface)"
        if torch.cuda.is_available():
            return "CUDA is available (a GPU trainer runs transformers' kernels)"
        return unsupported_dir(model_dir, "cpu", "float32")

    @property
    def own_forward(self) -> bool:
        """Whether the loaded model is the engine's own pass instead of transformers' (False before load)."""
        return self._model is not None and not self.transformers_because

    @property
    def model(self) -> Any:
        if self._model is None:
            raise FailedPrecondition("TorchBackend: call load(model_dir) first")
        return self._model

    def to(self, device: str) -> None:
        """Move the model to `device` (cpu, cuda:N) before the first step; batches follow it."""
        self.model.to(device)

    def num_parameters(self) -> int:
        """Parameters of the model (LoRA adapters not counted: the model's size, what a step computes with)."""
        from libra.services.trainer.lora import is_adapter

        return sum(p.numel() for name, p in self.model.named_parameters() if not is_adapter(name))

    def hf_named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the weights as published: the parameters, or with LoRA the merged weights."""
        if self.config.lora is None:
            return list(self.model.named_parameters())
        from libra.services.trainer import lora

        return lora.merged_named_tensors(self.model)

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, sequences: list, concatenate: bool = False) -> tuple[Any, torch.Tensor]:
        """Log-probs of one micro-batch on the target grid: right-padded rows, or `concatenate`d."""
        import torch

        if concatenate and not self.config.micro_batch_tokens:
            raise ValueError("packed micro-batches need the model loaded for them: set trainer.micro_batch_tokens "
                             "in the config the backend is built with, not only in a step's config")
        packed = pack(sequences, concatenate=concatenate)
        device = next(self.model.parameters()).device
        if device.type != "cpu":
            packed = dataclasses.replace(packed, **{f.name: getattr(packed, f.name).to(device)
                                                    for f in dataclasses.fields(packed)
                                                    if isinstance(getattr(packed, f.name), torch.Tensor)})
        if concatenate:
            from libra.services.trainer.packed_attention import hf_packed_inputs

            logits = self.model(**hf_packed_inputs(packed, device)).logits
        elif self.own_forward:  # right-padded rows: positions count from each row's first token
            positions = torch.arange(packed.input_ids.shape[1], device=device).expand_as(packed.input_ids)
            logits = self.model(packed.input_ids, packed.attention_mask, positions, None, last_only=False)[0]
        else:
            logits = self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        return packed, token_logprobs(logits, packed.input_ids)

    def _plan(self, batch: TrainBatch, config: TrainerConfig) -> list[list[int]]:
        device = next(self.model.parameters()).device
        return batch.plan(config.micro_batch_size, config.micro_batch_tokens,
                          micro_batch_cost(device, config.micro_batch_cost_tokens))

    def compute_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        return self._logprobs(batch, self.config)

    def _logprobs(self, batch: TrainBatch, config: TrainerConfig) -> list[torch.Tensor]:
        import torch

        out: list[Any] = [None] * len(batch)
        with torch.no_grad():
            for indices in self._plan(batch, config):
                packed, logprobs = self._forward([batch.sequences[i] for i in indices], bool(config.micro_batch_tokens))
                for index, values in zip(indices, unpack(logprobs, packed)):
                    out[index] = values
        return out

    # ---- the GRPO step ---------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, config: TrainerConfig) -> dict[str, float]:
        return shared_train_step(self, batch, config, self.gradient_hook)

    def accumulate_gradients(self, batch: TrainBatch, config: TrainerConfig, token_count: float) -> dict[str, float]:
        """Zeroed .grad, then every micro-batch's gradient of Σ token loss / token_count; metric sums.

        Public for hybrid replicas, which compute their slice exactly as a core rank does.
        """
        trained = gradient_batch(batch, config)  # the sequences with a gradient (TrainBatch.with_gradient)
        old = self._logprobs(trained, config) if config.recompute_logprobs else None
        self._set_hyper_parameters(config)
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.lora is None or not self.config.lora.dropout:
            sums = self._accumulate(trained, config, old, token_count=token_count)
        else:
            from libra.services.trainer import lora

            lora.set_dropout(self.model, True)  # the adapters' dropout in the gradient pass only
            try:
                sums = self._accumulate(trained, config, old, token_count=token_count)
            finally:
                lora.set_dropout(self.model, False)
        return as_trained_means(sums, batch, trained)

    def flat_gradients(self) -> torch.Tensor:
        """The trainable parameters' gradients as one flat float tensor (zeros where none)."""
        import torch

        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])

    def set_flat_gradients(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in (p for p in self.model.parameters() if p.requires_grad):
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the default group, in place (a no-op in one process)."""
        import torch.distributed as dist

        if distributed():
            # NCCL reduces device tensors only: the counts travel on the model's device and come back
            device = next(self.model.parameters()).device
            moved = values.to(device)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            if moved is not values:
                values.copy_(moved)
        return values

    def dp_sum_gradients(self, flat: torch.Tensor) -> torch.Tensor:
        return self.dp_sum(flat)

    def step_optimizer(self, config: TrainerConfig) -> torch.Tensor:
        """Clip the gradients in .grad and take one optimizer step; returns the pre-clip norm."""
        import torch

        self._set_hyper_parameters(config)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        self.optimizer.step()
        return grad_norm

    @property
    def optimizer(self) -> Any:
        if self._model is None:
            raise FailedPrecondition("TorchBackend: call load(model_dir) first")
        if self._optimizer is None:
            self.prepare_optimizer()
        return self._optimizer

    def _accumulate(
        self, batch: TrainBatch, config: TrainerConfig, old: list | None, token_count: float
    ) -> dict[str, float]:
        """Forward/backward every micro-batch, gradients summing in .grad; returns metric sums."""
        import torch

        sums: dict[str, float] = defaultdict(float)
        for indices in self._plan(batch, config):
            packed, new = self._forward([batch.sequences[i] for i in indices], bool(config.micro_batch_tokens))
            old_grid = packed.behaviour_logprobs  # no recompute: old = behaviour, so w = 1
            if old is not None:
                old_grid = torch.zeros_like(new)
                old_grid[packed.response_mask] = torch.cat([old[i] for i in indices]).to(new.device)
            loss, metrics = policy_loss(
                new, old_grid, packed.behaviour_logprobs, packed.advantages, packed.loss_mask,
                config.clip_low, config.clip_high, config.tis_cap, config.kl_coef, token_count=token_count,
            )
            loss.backward()
            sums["loss"] += float(loss.detach())
            for name, value in metrics.items():
                sums[name] += float(value)
        return sums

    def _set_hyper_parameters(self, config: TrainerConfig) -> None:
        # Per step, so a schedule (or a changed config on resume) takes effect without a rebuild.
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = config.lr, config.weight_decay

    # ---- files -----------------------------------------------------------------------------
    def save_weights(self, out_dir: str) -> None:
        if rank() == 0:  # safetensors: the default (4.x) and only (5.x) format of save_pretrained
            if self.own_forward:  # the engine's own pass: its parameters under transformers' names
                write_safetensors_dir(out_dir, self.model_dir, self._published_state())
            elif self.config.lora is None:
                write_weights_dir(out_dir, self.model_dir, self.model.save_pretrained)
            else:  # the merged weights, saved by the underlying HF model (config and all)
                merged = dict(self.hf_named_tensors())
                base = self.model.get_base_model()
                write_weights_dir(out_dir, self.model_dir, lambda staging: base.save_pretrained(
                    staging, state_dict=merged))
        barrier()

    def _published_state(self) -> dict[str, Any]:
        """The own pass's weights as transformers saves them: a tied lm_head left out (config.json and
        the rest are the model directory's, copied beside them)."""
        model = self.model
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        return {name: tensor.detach() for name, tensor in model.state_dict().items()
                if not (tied and name == "lm_head.weight")}

    def save_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        import torch

        if rank() == 0:
            state = {
                "format": CHECKPOINT_FORMAT,
                "model": self._checkpointed_state(),
                "adapters_only": self.config.lora is not None,
                "optimizer": self.optimizer.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "extra": dict(extra),
            }
            atomic_torch_save(state, path)
        barrier()

    def _checkpointed_state(self) -> dict[str, Any]:
        """The whole model, or with LoRA only the adapters (the trainable parameters)."""
        return self.model.state_dict() if self.config.lora is None else _trainable_state(self.model)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        import torch

        # weights_only: a checkpoint is data, never code; `extra` must be plain Python values.
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, expected {CHECKPOINT_FORMAT}")
        adapters_only = bool(state.get("adapters_only", False))
        if adapters_only != (self.config.lora is not None):
            raise ValueError(f"{path}: a checkpoint of {'LoRA adapters' if adapters_only else 'full weights'}, but "
                             f"trainer.lora is {'unset' if adapters_only else 'set'}; resume with the trainer.lora "
                             "the run was started with")
        if adapters_only:  # the frozen weights are the model directory's, already loaded
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
            frozen = set(self.model.state_dict()) - set(_trainable_state(self.model))  # tied copies too
            if unexpected or set(missing) - frozen:
                raise ValueError(f"{path}: the adapters do not fit this model (trainer.lora.rank or target_modules "
                                 f"changed?): missing {sorted(set(missing) - frozen)[:5]}, unexpected {unexpected[:5]}")
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_random_state(state["rng"]["python"]))
        return state["extra"]


def _trainable_state(model: Any) -> dict[str, Any]:
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def _as_random_state(state: Any) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)

