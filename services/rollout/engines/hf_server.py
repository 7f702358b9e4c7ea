"""The hf engine process: its command line (`main`) and its HTTP face, vLLM's OpenAI-compatible
endpoints that Libra uses plus the weight-update endpoints, as an aiohttp application serving one
`hf_engine.HFEngine`.

Runs in: the hf engine process (one per worker of rollout.worker.engine hf), started by the
rollout gateway (workers.py) as `python -m libra.services.rollout.engines.hf_server --model DIR
--port P --device cuda|cpu`. Kept apart from the engine so that the batching/decoding loop
(engines/hf_engine.py) reads on its own and never imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from typing import Any, Callable

from libra import event_loop
from libra.security.http import bearer_middleware
from libra.services.rollout.engines.engine_auth import OPEN_PATHS, SERVED_MODEL_NAME, key_from_environment
from libra.services.rollout.engines.hf_engine import (LOGPROBS_MODES, PREFILL_RATIO, PREFILL_WAIT_STEPS,
                                                      PREFIX_CACHE_MIB, HFEngine, Request, version_spans)
from libra.services.rollout.engines.hf_forward import FORWARDS
from libra.services.rollout.engines.vllm_ext import INITIAL_VERSION_ENV


def build_app(engine: HFEngine, tokenizer: Any = None, key: str | None = None) -> Any:
    """The aiohttp application serving `engine` with vLLM's endpoints (the subset Libra uses);
    `key`: the engine key every path but /health requires (engines/engine_auth.py)."""
    import torch
    from aiohttp import web

    settler = Settler()

    async def run_in_engine(job: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, result, error)

        engine.control(job, done)
        return await future

    async def generate(prompt: list[int], body: dict[str, Any]) -> Request:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        temperature, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
        max_tokens = int(body.get("max_tokens") or 16)
        if temperature < 0 or not 0 < top_p <= 1 or max_tokens < 1:
            raise ValueError("temperature must be >= 0, top_p in (0, 1] and max_tokens >= 1")
        seed = body.get("seed")
        generator = None
        if seed is not None and temperature > 0:
            generator = torch.Generator(device=engine.device)
            generator.manual_seed(int(seed))
        request = Request(list(prompt), max_tokens, temperature, top_p,
                          frozenset(int(t) for t in body.get("stop_token_ids") or []), generator,
                          lambda r: settler.settle(loop, future, r))
        engine.submit(request)
        return await future

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""

    async def completions(http: web.Request) -> web.Response:
        body = await http.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if tokenizer is None:
                return _error(400, "this engine has no tokenizer; send the prompt as token ids")
            prompt = tokenizer(prompt).input_ids
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(400, "prompt must be a non-empty list of token ids (or a string)")
        try:
            done = await generate(prompt, body)
        except ValueError as error:
            return _error(400, str(error))
        if done.error:
            return _error(500, done.error)
        choice = {"index": 0, "text": decode(done.generated), "token_ids": done.generated,
                  "logprobs": {"token_logprobs": done.logprobs, "tokens": [str(t) for t in done.generated]},
                  "finish_reason": done.finish_reason, "stop_reason": done.stop_reason,
                  "weight_versions": version_spans(done.token_versions),
                  "decode_batch": round(done.decode_batch, 3)}
        return web.json_response({"object": "text_completion", "model": SERVED_MODEL_NAME, "choices": [choice],
                                  "usage": _usage(done)})

    async def generate_tokens(http: web.Request) -> web.Response:
        """vLLM's token-in/token-out endpoint (its "tokens" output mode): what EngineClient.generate calls."""
        body = await http.json()
        prompt, sampling = body.get("token_ids"), body.get("sampling_params")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(400, "token_ids must be a non-empty list of token ids")
        if not isinstance(sampling, dict):
            return _error(400, "sampling_params must be an object (max_tokens, temperature, top_p, seed, ...)")
        try:
            done = await generate(prompt, sampling)
        except ValueError as error:
            return _error(400, str(error))
        if done.error:
            return _error(500, done.error)
        content = [{"token_id": t, "logprob": lp} for t, lp in zip(done.generated, done.logprobs)]
        choice = {"index": 0, "token_ids": done.generated, "logprobs": {"content": content},
                  "finish_reason": done.finish_reason, "stop_reason": done.stop_reason,
                  "weight_versions": version_spans(done.token_versions),
                  "decode_batch": round(done.decode_batch, 3)}
        return web.json_response({"model": SERVED_MODEL_NAME, "choices": [choice], "usage": _usage(done)})

    async def chat(http: web.Request) -> web.Response:
        body = await http.json()
        if tokenizer is None:
            return _error(400, "this engine has no tokenizer; chat needs one")
        if not hasattr(tokenizer, "apply_chat_template"):
            return _error(400, "this engine's tokenizer has no chat template; send the prompt as token ids or text")
        try:
            prompt = tokenizer.apply_chat_template(body.get("messages") or [], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            done = await generate(list(prompt), body)
        except ValueError as error:
            return _error(400, str(error))
        if done.error:
            return _error(500, done.error)
        content = [{"token": decode([t]), "logprob": lp} for t, lp in zip(done.generated, done.logprobs)]
        choice = {"index": 0, "message": {"role": "assistant", "content": decode(done.generated)},
                  "logprobs": {"content": content}, "token_ids": done.generated,
                  "finish_reason": done.finish_reason, "stop_reason": done.stop_reason,
                  "weight_versions": version_spans(done.token_versions),
                  "decode_batch": round(done.decode_batch, 3)}
        return web.json_response({"object": "chat.completion", "model": SERVED_MODEL_NAME, "choices": [choice],
                                  "usage": _usage(done)})

    methods: dict[str, Callable[..., Any]] = {
        "libra_load_weights": lambda path, version: run_in_engine(lambda: engine.load_from_disk(path, version)),
        "libra_receive_weights": lambda version: run_in_engine(lambda: engine.receive_weights(version)),
        "libra_receive_colocated": lambda descriptor, version: run_in_engine(
            lambda: engine.receive_colocated(descriptor, version)),
        "libra_policy_version": lambda: _value(engine.version),
        # joining blocks until every rank is there; it does not touch the model, so not in the decode thread
        "libra_join_weights_group": lambda *args: asyncio.to_thread(_join_group, engine, *args),
        "libra_leave_weights_group": lambda: asyncio.to_thread(_leave_group, engine),
    }

    async def collective_rpc(http: web.Request) -> web.Response:
        body = await http.json()
        method = methods.get(body.get("method"))
        if method is None:
            return _error(400, f"unknown method {body.get('method')!r}; known: {sorted(methods)}")
        try:
            result = await method(*(body.get("args") or []))
        except (TypeError, ValueError) as error:
            return _error(400, f"{type(error).__name__}: {error}")
        return web.json_response({"results": [result]})

    async def health(_: web.Request) -> web.Response:
        if not engine.alive:
            return _error(503, "the decode thread died")
        if engine.dirty:
            return _error(503, f"weights are inconsistent: {engine.dirty}; restart this worker")
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SERVED_MODEL_NAME, "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"libra:num_requests_running {engine.running}\n"
                                 f"libra:num_requests_waiting {engine.waiting}\n"
                                 f"libra:policy_version {engine.version}\n"
                                 + "".join(f'libra:forward_passes_total{{kind="{kind}"}} {count}\n'
                                           f'libra:forward_rows_total{{kind="{kind}"}} {engine.rows_passed[kind]}\n'
                                           for kind, count in engine.passes.items())
                                 + "".join(f'libra:forward_cpu_seconds_total{{kind="{kind}"}} {seconds:.6f}\n'
                                           for kind, seconds in engine.cpu_s.items())
                                 + f"libra:prefill_tokens_total {engine.prefill_tokens}\n"
                                 f"libra:prefix_cache_lookups_total {engine.prefix.lookups}\n"
                                 f"libra:prefix_cache_hits_total {engine.prefix.hits}\n"
                                 f"libra:prefix_cache_hit_tokens_total {engine.prefix.hit_tokens}\n"
                                 f"libra:prefix_cache_tokens {engine.prefix.tokens}\n")

    async def pause(http: web.Request) -> web.Response:
        # vLLM's mode=keep&clear_cache=true, always: requests stay, and a weight load recomputes their KV
        engine.pause(True)
        return web.json_response({"paused": True})

    async def update_weight_version(http: web.Request) -> web.Response:
        body = await http.json()
        try:
            labelled = await run_in_engine(lambda: engine.label_weights(body.get("new_version")))
        except (TypeError, ValueError) as error:
            return _error(400, f"new_version must be a policy version (an integer >= 0): {error}")
        return web.json_response({"success": True, "new_version": str(labelled["version"])})

    async def resume(_: web.Request) -> web.Response:
        engine.pause(False)
        return web.json_response({"paused": False})

    guard = [bearer_middleware(key, open_paths=OPEN_PATHS)] if key else []
    app = web.Application(client_max_size=64 * 2**20, middlewares=guard)
    app.add_routes([web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat),
                    web.post("/inference/v1/generate", generate_tokens),
                    web.post("/update_weight_version", update_weight_version),
                    web.post("/collective_rpc", collective_rpc), web.get("/health", health),
                    web.get("/v1/models", models), web.get("/metrics", metrics),
                    web.post("/pause", pause), web.post("/resume", resume)])
    return app


def _join_group(engine: HFEngine, host: str, port: int, rank: int, world_size: int, backend: str,
                timeout_s: float, bucket_mb: int, generation: int = 0) -> dict[str, Any]:
    """Make the engine rank `rank` of weights-group generation `generation`, closing its old one."""
    from libra.weights.group import join_generation

    previous, engine.weights_group = engine.weights_group, None
    engine.weights_group = join_generation(previous, host, port, rank, world_size, backend, str(engine.device),
                                           timeout_s, bucket_mb, generation)
    return {"rank": int(rank), "world_size": int(world_size), "backend": backend, "generation": int(generation)}


def _leave_group(engine: HFEngine) -> dict[str, Any]:
    group, engine.weights_group = engine.weights_group, None
    if group is not None:
        group.close()
    return {"left": group is not None}


class Settler:
    """Hands finished requests from the decode thread to the event loop, one wake-up per batch: the
    rows that finish in one step are settled together (each `call_soon_threadsafe` writes to the
    loop's self-pipe: 12% of an engine's samples in one profile when made once per request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future, Any]] = []

    def settle(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any) -> None:
        with self._lock:
            self._pending.append((future, result))
            if len(self._pending) > 1:
                return  # a drain is already scheduled and has not run yet: it takes this one too
        loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future, result in pending:
            _settle(future, result, None)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def _value(value: Any) -> Any:
    return value


def _usage(done: Request) -> dict[str, int]:
    return {"prompt_tokens": len(done.prompt), "completion_tokens": len(done.generated),
            "total_tokens": len(done.prompt) + len(done.generated)}


def _error(status: int, message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


# ---- command line: build the engine, serve build_app -----------------------------------------
class StartPhases:
    """Wall and CPU seconds of each start-up phase, and CPU seconds since the interpreter started
    (its own start and the imports before main: `cpu_total_s`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._wall, self._cpu = time.monotonic(), time.process_time()
        self.seconds["cpu_before_main_s"] = round(self._cpu, 2)

    def done(self, phase: str) -> None:
        wall, cpu = time.monotonic(), time.process_time()
        self.seconds[f"{phase}_s"] = round(wall - self._wall, 2)
        self.seconds[f"{phase}_cpu_s"] = round(cpu - self._cpu, 2)
        self.seconds["cpu_total_s"] = round(cpu, 2)
        self._wall, self._cpu = wall, cpu


def load_tokenizer(model_dir: str) -> Any:
    """The directory's tokenizer: on `tokenizers` alone where that is exact (libra.tiny_model's
    LightTokenizer: a generic fast tokenizer, no chat template), so that a worker running the engine's
    own forward pass never imports transformers; else transformers' AutoTokenizer; None without one
    (token ids in and out still work; text and chat do not)."""
    import pathlib

    from libra.tiny_model import LightTokenizer

    directory = pathlib.Path(model_dir)
    chat = any(directory.glob("chat_template*"))  # transformers 5 keeps a chat template beside the config
    light = None if chat else LightTokenizer.load(directory)
    if light is not None:
        return light
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a transformers-based rollout engine behind vLLM's HTTP "
                                                 "surface.")
    parser.add_argument("--model", required=True, help="HF model directory (config, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--logprobs-mode", default="processed_logprobs", choices=LOGPROBS_MODES)
    parser.add_argument("--policy-version", type=int, default=int(os.environ.get(INITIAL_VERSION_ENV, "0")))
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--prefill-ratio", type=float, default=PREFILL_RATIO,
                        help="prefill new requests together once they are this many times the running ones "
                             "(0: at once)")
    parser.add_argument("--prefill-wait-steps", type=int, default=PREFILL_WAIT_STEPS,
                        help="decode steps a new request waits at most before it is prefilled")
    parser.add_argument("--prefix-cache-mib", type=float, default=PREFIX_CACHE_MIB,
                        help="MiB of KV the prefix cache may hold (engines/hf_prefix.py); 0: none")
    parser.add_argument("--event-loop", default="auto", choices=event_loop.CHOICES,
                        help="the HTTP server's asyncio loop (the run's event_loop; libra/event_loop.py)")
    parser.add_argument("--forward", default="auto", choices=FORWARDS,
                        help="auto: a plain Llama in float32 on CPU runs the engine's own forward pass "
                             "(libra/llama_forward.py), anything else transformers' model; transformers: always")
    args = parser.parse_args(argv)
    key = key_from_environment()
    phases = StartPhases()  # start-up, phase by phase, in the "hf engine serving" line
    import torch
    from aiohttp import web

    from libra import log as liblog

    liblog.configure("rollout-hf-engine")
    phases.done("import_torch")

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    phases.done("tokenizer")
    engine = HFEngine(args.model, args.device, args.dtype, args.max_model_len, args.max_num_seqs,
                      args.logprobs_mode, args.policy_version, args.tensor_parallel_size, args.prefill_ratio,
                      args.prefill_wait_steps, args.forward, args.prefix_cache_mib)
    phases.done("model")
    liblog.get("libra.rollout.hf_engine").info("hf engine serving", model=args.model, device=args.device,
                                               port=args.port, version=args.policy_version, forward=engine.forward,
                                               forward_why=engine.forward_why,
                                               transformers="transformers" in sys.modules,
                                               event_loop=event_loop.chosen(args.event_loop), **phases.seconds)
    try:
        web.run_app(build_app(engine, tokenizer, key), host=args.host, port=args.port, print=None,
                    access_log=None, handle_signals=True, loop=event_loop.new_loop(args.event_loop))
    finally:
        engine.stop()
        liblog.get("libra.rollout.hf_engine").info(
            "hf engine stopped", passes=engine.passes, rows=engine.rows_passed, prefill_tokens=engine.prefill_tokens,
            pass_cpu_s={kind: round(seconds, 3) for kind, seconds in engine.cpu_s.items()},
            prefix_hits=engine.prefix.hits, prefix_lookups=engine.prefix.lookups,
            prefix_hit_tokens=engine.prefix.hit_tokens, cpu_s=round(time.process_time(), 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
