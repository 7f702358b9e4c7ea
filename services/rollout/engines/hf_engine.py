"""A transformers-based rollout engine for machines without vLLM, behind vLLM's HTTP surface.

    HTTP (aiohttp, event loop)                       decode thread (owns the model)
    ──────────────────────────                       ──────────────────────────────
    POST /inference/v1/generate ──▶ queue ───────▶   between two steps: run control jobs
    POST /v1/completions, /v1/chat/completions         (weight loads: disk or weights group,
                                                        then the running rows' KV recomputed)
    POST /collective_rpc ──▶ control job ─────────▶  admit waiting requests: batched prefill,
    GET  /health /v1/models /metrics                   left-padded, merged into the running batch
         ◀── future resolved per request ──────────   one batched decode step; finished rows leave

Continuous batching, lite: the running batch keeps one KV cache per layer ([B, heads, L, dim],
left-padded, with a [B, L] mask and explicit positions); new requests are prefilled together and
padded into it between steps, finished rows are dropped, and columns no row needs are trimmed.
A prefill is a forward pass in which the running rows do not advance, and for a small model its
cost is mostly per pass: while rows run, new requests wait until they number `prefill_ratio` times
the running rows or have waited `prefill_wait_steps` decode steps, then are prefilled together
(rollout.worker.engine's fields; docs/benchmarks.md, "Time to first learning"). Sampling is one
batch of tensor operations for all rows (`hf_sampling.sample_rows`), each row with its own
temperature, top-p and seed.
Weight loads (engines/hf_weights.py) run in the decode thread between two steps, and no request is
dropped: a load recomputes the running rows' KV cache under the new weights (`refresh_kv`) before the
next step, so every token is sampled from one version's weights attending to KV of that version
only, and each token is stamped with the version that sampled it (`Request.token_versions`, answered
as vLLM's `weight_versions` spans). A sequence's log-probs are then exactly what a trainer holding
each token's version computes over the whole sequence.
A prefix cache (engines/hf_prefix.py, `prefix_cache_mib`) keeps the KV of prompts and finished
sequences: a prompt that continues one (an agent's next turn) prefills only its new tokens, on the
cached KV as the past, and the samples of one group sharing a prompt in one prefill compute it once.
The cache is emptied whenever the weights change, so a prefix is only ever reused under the weights
that computed it.

The HTTP surface is the subset of vLLM's that `EngineClient` uses: token ids in and out (vLLM's
`/inference/v1/generate`, with its per-token `weight_versions`), per-token log-probs ("processed":
of the distribution sampled from, as vLLM's default), stop on token ids or EOS (the stop id is the
last id returned), `seed`, `/pause` `/resume` `/update_weight_version`, and `/collective_rpc` with
the same method names as `LibraWorkerExtension` (plus the weights-group ones), so the gateway
cannot tell the engines apart. Tensor parallelism is not supported (TP 1 only).
The model is transformers' own, except a plain Llama-architecture model in float32 on CPU (the
quickstart's tiny model), which runs the engine's own forward pass (libra/llama_forward.py, the
same logits on torch alone: a worker then never imports transformers), unless
`rollout.worker.engine.forward: transformers`.

The batch's KV layout (padding, a cached past, right-aligning) is engines/hf_kv.py; which model and
forward pass run, engines/hf_forward.py.

Runs in: the hf engine process (`python -m libra.services.rollout.engines.hf_server`, whose `main`
builds this engine and serves it over HTTP); this module never imports the HTTP layer.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from libra.services.rollout.engines import hf_forward, hf_kv
from libra.services.rollout.engines.hf_prefix import PrefixCache
from libra.services.rollout.engines.hf_sampling import sample_rows
from libra.services.rollout.engines.hf_weights import HFWeightLoads

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
PREFILL_RATIO, PREFILL_WAIT_STEPS = 0.5, 8  # admission batching's defaults (rollout.worker.engine's are the same)
PREFIX_CACHE_MIB = 256.0  # the prefix cache's default size (rollout.worker.engine's is the same)


@dataclass
class Request:
    """One completion request as the decode thread sees it."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop_ids: frozenset[int]
    generator: Any  # torch.Generator or None
    done: Callable[["Request"], None]
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    token_versions: list[int] = field(default_factory=list)  # the policy version that sampled each generated id
    error: str | None = None  # set when the engine failed the request (the HTTP answer is a 500)
    batch_sum: int = 0  # over its sampled ids, the rows of the pass that sampled each (decode_batch)

    @property
    def decode_batch(self) -> float:
        """The mean rows of the forward passes that sampled its ids: the batch its tokens were decoded
        in, as the engine ran it (requests held for admission or on their way back not counted)."""
        return self.batch_sum / len(self.generated) if self.generated else 0.0


class HFEngine(HFWeightLoads):
    """A causal LM from a HF directory, batched decoding in one thread, weight loads (`HFWeightLoads`)
    between steps."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "float32", max_model_len: int = 2048,
                 max_num_seqs: int = 64, logprobs_mode: str = "processed_logprobs", policy_version: int = 0,
                 tensor_parallel_size: int = 1, prefill_ratio: float = PREFILL_RATIO,
                 prefill_wait_steps: int = PREFILL_WAIT_STEPS, forward: str = "auto",
                 prefix_cache_mib: float = PREFIX_CACHE_MIB):
        import torch

        if tensor_parallel_size != 1:
            raise ValueError(f"the hf engine runs tensor parallel size 1 only, got {tensor_parallel_size}; "
                             f"use engine: vllm for TP > 1 (rollout.worker.engine)")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if prefill_ratio < 0 or prefill_wait_steps < 0 or prefix_cache_mib < 0:
            raise ValueError(f"prefill_ratio, prefill_wait_steps and prefix_cache_mib must be >= 0, got "
                             f"{prefill_ratio}, {prefill_wait_steps}, {prefix_cache_mib}")
        if forward not in hf_forward.FORWARDS:
            raise ValueError(f"forward must be one of {hf_forward.FORWARDS}, got {forward!r}")
        self.device = torch.device(device)
        self.forward, self.forward_why = hf_forward.choose(model_dir, device, dtype, forward)
        self.model, self._pass = hf_forward.load(self.forward, model_dir, self.device, dtype)
        self.eos_id, self.vocab_size = hf_forward.eos_and_vocab(self.model)
        self.max_model_len, self.max_num_seqs, self.logprobs_mode = max_model_len, max_num_seqs, logprobs_mode
        self.prefill_ratio, self.prefill_wait_steps = prefill_ratio, prefill_wait_steps
        self._waiting: list[Request] = []  # taken off the queue, not yet prefilled (admission batching)
        self._waited = 0  # decode steps the oldest of them has waited
        self.version = policy_version
        self.dirty: str | None = None  # a load that failed half-way: weights are neither old nor new
        self.weights_group: Any = None
        self._incoming: queue.Queue[Request] = queue.Queue()
        self._control: queue.Queue[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._paused = threading.Event()
        self.running = 0
        self.passes = {"prefill": 0, "decode": 0}  # forward passes by kind (the /metrics counters)
        self.rows_passed = {"prefill": 0, "decode": 0}  # rows those passes carried
        self.prefill_tokens = 0  # prompt positions computed (what the prefix cache saved is not)
        self.cpu_s = {"prefill": 0.0, "decode": 0.0, "refresh": 0.0}  # the decode thread's CPU, by what it ran
        self.prefix = PrefixCache(int(prefix_cache_mib * 2**20 // hf_kv.kv_bytes_per_token(model_dir, dtype)))
        self._rows: list[Request] = []
        self._kv: list[tuple[Any, Any]] = []
        self._mask: Any = None
        self._thread = threading.Thread(target=self._loop, name="hf-engine-decode", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread) --------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        """Requests accepted and not yet prefilled (queued, or held back by the admission batching)."""
        return self._incoming.qsize() + len(self._waiting)

    def submit(self, request: Request) -> None:
        if len(request.prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens; this engine's context is "
                             f"{self.max_model_len} (max_model_len)")
        if any(not 0 <= t < self.vocab_size for t in request.prompt):
            raise ValueError(f"prompt token ids must be in 0..{self.vocab_size - 1}")
        self._incoming.put(request)
        self._wake.set()

    def control(self, job: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run `job` in the decode thread between two steps; `done(result, error)` is called there."""
        self._control.put((job, done))
        self._wake.set()

    def pause(self, paused: bool) -> None:
        """Freeze decoding (requests and their KV cache stay); control jobs still run."""
        (self._paused.set if paused else self._paused.clear)()
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the decode thread ---------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread's kernels and NCCL calls go to the engine's GPU
        with torch.inference_mode():
            while not self._stopping.is_set():
                self._run_control()
                if self._paused.is_set():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                fresh = self._admit()
                started = time.thread_time()
                try:
                    if fresh:
                        self._prefill(fresh)
                        self.cpu_s["prefill"] += time.thread_time() - started
                    elif self._rows:
                        self._decode()
                        self.cpu_s["decode"] += time.thread_time() - started
                    else:
                        self._wake.wait(0.05)
                        self._wake.clear()
                except Exception as error:  # noqa: BLE001 - fail this batch's requests, keep serving
                    self._fail(fresh, error)
                self.running = len(self._rows)

    def _fail(self, fresh: list[Request], error: Exception) -> None:
        """A step raised (e.g. out of memory): every request in it answers with the error."""
        _log().error("decode step failed; its requests are failed", error=f"{type(error).__name__}: {error}")
        failed = {id(r): r for r in [*self._rows, *fresh]}
        self._rows, self._kv, self._mask = [], [], None
        for request in failed.values():
            request.error = f"{type(error).__name__}: {error}"
            request.done(request)

    def _run_control(self) -> None:
        while True:
            try:
                job, done = self._control.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = job(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who answers with it
                result, error = None, exc
            done(result, error)

    def _admit(self) -> list[Request]:
        """The requests to prefill now, or none (decode instead).

        Prefilling is a forward pass of its own, in which the running rows do not advance, and for a
        small model its cost is mostly per pass, not per row. So while rows are running, arrivals
        wait until they are at least `prefill_ratio` times the running rows, or the oldest has
        waited `prefill_wait_steps` decode steps, and are then prefilled together (0 and 0: every
        arrival at the next step)."""
        fresh = self._waiting
        while len(self._rows) + len(fresh) < self.max_num_seqs:
            try:
                fresh.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        if not fresh:
            return fresh
        if (self._rows and len(fresh) < self.prefill_ratio * len(self._rows)
                and self._waited < self.prefill_wait_steps and len(self._rows) + len(fresh) < self.max_num_seqs):
            self._waited += 1
            return []
        self._waiting, self._waited = [], 0
        return fresh

    def _prefill(self, fresh: list[Request]) -> None:
        """One pass over the new requests' prompts (each distinct prompt once), on the KV the prefix
        cache holds for their beginnings; each prompt the cache knew nothing of is cached."""
        import torch

        self.passes["prefill"] += 1
        self.rows_passed["prefill"] += len(fresh)
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in fresh]
        prompts = [list(p) for p in distinct]
        hits = [self.prefix.lookup(p) for p in prompts] if self.prefix.capacity_tokens else [(0, None)] * len(prompts)
        self.prefill_tokens += sum(len(p) - n for p, (n, _) in zip(prompts, hits))
        logits, kv, mask = self._forward_prompts(prompts, hits)
        for row, (prompt, (n, _)) in enumerate(zip(prompts, hits)):
            if self.prefix.capacity_tokens and n == 0:  # a new beginning (a first turn), not a continuation
                self.prefix.insert(prompt, hf_kv.row_kv(kv, mask, row))
        if len(prompts) < len(fresh):
            at = torch.tensor(index, dtype=torch.long, device=self.device)
            logits, mask = logits.index_select(0, at), mask.index_select(0, at)
            kv = [(k.index_select(0, at), v.index_select(0, at)) for k, v in kv]
        self._merge(fresh, kv, mask)
        self._sample(logits, offset=len(self._rows) - len(fresh))

    def _forward_prompts(self, prompts: list[list[int]], hits: list[tuple[int, Any]] | None = None
                         ) -> tuple[Any, list[tuple[Any, Any]], Any]:
        """One batched forward of `prompts`: (each row's last logits, KV cache, mask). With `hits`
        (per prompt: how many of its first positions the prefix cache holds, and their KV), only the
        rest of each prompt is computed, on that KV as the past, and each row's KV is right-aligned."""
        hits = hits or [(0, None)] * len(prompts)
        ids, mask, past = hf_kv.prompt_batch(prompts, hits)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, past:]
        if not past:
            return (*self._pass(ids, mask, positions), mask)
        logits, kv = self._pass(ids, mask, positions, hf_kv.left_padded_past(hits, past))
        return (logits, *hf_kv.right_aligned(kv, mask))

    def refresh_kv(self) -> None:
        """Recompute the running rows' KV cache under the weights now loaded (a weight load calls it, in
        the decode thread): each row's context but its last sampled id, which the next step feeds.

        Without it a row's later tokens would attend to KV of the previous version, a forward pass no
        trainer can reproduce. If the recompute itself fails (out of memory) the running requests are
        failed (the gateway retries their turns elsewhere) rather than continued on stale KV.
        """
        self.prefix.clear()  # KV computed under other weights
        if not self._rows:
            return
        started = time.thread_time()
        try:
            _, self._kv, self._mask = self._forward_prompts([r.prompt + r.generated[:-1] for r in self._rows])
        except Exception as error:  # noqa: BLE001 - fail those requests, keep serving
            self._fail([], error)
        self.cpu_s["refresh"] += time.thread_time() - started

    def _merge(self, fresh: list[Request], kv: list[tuple[Any, Any]], mask: Any) -> None:
        import torch

        if not self._rows:
            self._rows, self._kv, self._mask = list(fresh), kv, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._kv = [(torch.cat([hf_kv.pad_left(k0, width, 2), hf_kv.pad_left(k1, width, 2)]),
                     torch.cat([hf_kv.pad_left(v0, width, 2), hf_kv.pad_left(v1, width, 2)]))
                    for (k0, v0), (k1, v1) in zip(self._kv, kv)]
        self._mask = torch.cat([hf_kv.pad_left(self._mask, width, 1), hf_kv.pad_left(mask, width, 1)])
        self._rows.extend(fresh)

    def _decode(self) -> None:
        import torch

        self.passes["decode"] += 1
        self.rows_passed["decode"] += len(self._rows)
        last = torch.tensor([[r.generated[-1]] for r in self._rows], device=self.device)
        positions = self._mask.sum(1, keepdim=True)
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        logits, self._kv = self._pass(last, mask, positions, self._kv)
        self._mask = mask
        self._sample(logits, offset=0)

    def _sample(self, logits: Any, offset: int) -> None:
        """Sample one token for rows offset.. (the rows these logits belong to); retire finished rows."""
        import torch

        rows = self._rows[offset:offset + logits.shape[0]]
        tokens, logprobs = sample_rows(logits, rows, self.logprobs_mode)
        width = len(rows)
        for request, token, logprob in zip(rows, tokens, logprobs):
            request.batch_sum += width
            request.generated.append(token)
            request.logprobs.append(logprob)
            request.token_versions.append(self.version)
            if token in request.stop_ids or token == self.eos_id:
                request.finish_reason, request.stop_reason = "stop", (token if token in request.stop_ids else None)
            elif (len(request.generated) >= request.max_tokens
                  or len(request.prompt) + len(request.generated) >= self.max_model_len):
                request.finish_reason = "length"
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        finished = [r for r in self._rows if r.finish_reason is not None]
        if finished and self.prefix.capacity_tokens:  # what the next turn of each will begin with
            for i, request in enumerate(self._rows):
                if request.finish_reason is not None:
                    kv = hf_kv.row_kv(self._kv, self._mask, i)
                    sequence = request.prompt + request.generated[:-1]  # the last id was never fed
                    if kv[0][0].shape[1] == len(sequence):
                        self.prefix.insert(sequence, kv)
        if finished:
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self._rows = [self._rows[i] for i in keep]
            self._kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self._kv]
            self._mask = self._mask.index_select(0, index)
            if self._rows:  # drop the left columns no remaining row attends to
                first = int((self._mask.sum(0) > 0).nonzero()[0])
                self._kv = [(k[:, :, first:], v[:, :, first:]) for k, v in self._kv]
                self._mask = self._mask[:, first:]
            for request in finished:
                request.done(request)


def version_spans(token_versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions as vLLM's `weight_versions`: contiguous spans {version (a string), start, end}."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": str(version), "start": index, "end": index + 1})
    return spans


def _log() -> Any:
    from libra import log as liblog

    return liblog.get("libra.rollout.hf_engine")
