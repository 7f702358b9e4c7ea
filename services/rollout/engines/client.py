"""Async HTTP client of one rollout worker (a vLLM OpenAI-compatible server), token-exact.

`generate` sends the prompt as token ids to vLLM's token-in/token-out `/inference/v1/generate`
(on with `--enable-scale-out`) and reads back exactly the ids the engine sampled with the sampled
token's log-prob (`logprobs: 0`, one per generated token) and the policy version of each token
(`weight_versions`: spans of output tokens sampled by weights of one label, which Libra sets to the
policy version). Nothing is decoded and re-tokenized.

A weight update never drains the worker and never lets KV of one version serve another:

    POST /pause?mode=keep&clear_cache=true   scheduler frozen; running requests preempted (their KV
                                             freed, recomputed on resume), prefix cache emptied
    POST /collective_rpc  libra_load_weights | libra_receive_weights   (every rank)
    POST /update_weight_version  {"new_version": "v"}   tokens sampled from now on carry v
    POST /resume                             the running requests recompute their KV under v

so every token is sampled from one version's weights attending to KV computed by those weights
only, and carries that version: its log-prob is what a trainer holding that version computes over
the whole sequence. A request in flight at the swap keeps going; its tokens say where it changed.
A load that raised (the weights may be half-written) leaves the worker paused: nothing samples
from weights of no version (the gateway marks it unhealthy, and a later version's load resumes it).

How vLLM 0.32 reports a stop: a token in `stop_token_ids`, or EOS, is the last id in
`token_ids` (with its log-prob) and `finish_reason` is "stop"; `stop_reason` is that id for a
stop token id and null for EOS. The *text* leaves the stop token out (unless
`include_stop_str_in_output`), which is one more reason to use the ids.

Errors: a worker that cannot be reached, times out, answers 5xx or answers with something that
is not a finished generation raises `EngineError` (an `Unavailable`: retry the turn on another
worker); a request the worker rejects (4xx: prompt too long, bad parameter) raises
`EngineRequestError` (an `InvalidArgument`: retrying elsewhere will not help).

Runs in: the rollout gateway process. This module knows the HTTP protocol of the workers only;
routing and retries are the gateway's.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from libra.errors import FailedPrecondition, InvalidArgument, Unavailable
from libra.services.rollout.engines.engine_auth import headers

DEFAULT_MODEL = "policy"  # the name VllmWorkerProcess serves the policy under
LOAD_METHOD = "libra_load_weights"  # LibraWorkerExtension methods, called via /collective_rpc
RECEIVE_METHOD = "libra_receive_weights"
COLOCATED_METHOD = "libra_receive_colocated"  # the hf engine's (weights: colocated)
VERSION_METHOD = "libra_policy_version"
GENERATE_PATH = "/inference/v1/generate"  # vLLM's token-in/token-out API; hf_server serves it too
PAUSE_PATH = "/pause?mode=keep&clear_cache=true"  # vLLM's RL pause: keep requests, drop every KV block
FINISH_REASONS = ("stop", "length")


class EngineError(Unavailable):
    """The worker is unreachable, timed out, failed (5xx) or answered malformed; retry elsewhere."""


class EngineRequestError(InvalidArgument):
    """The worker rejected the request itself (4xx); the same request fails on every worker."""


class WeightSetError(FailedPrecondition):
    """The worker found the weight set unusable (missing, unreadable); its weights are unchanged."""


@dataclass(frozen=True)
class Generation:
    """One model turn as the engine produced it."""

    token_ids: list[int]  # sampled ids, the stop token (or EOS) included when it ended the turn
    logprobs: list[float]  # log-prob of each sampled id, same length as token_ids
    finish_reason: str  # "stop" (stop token id / EOS) or "length" (max_tokens)
    seconds: float  # wall-clock time of the request
    text: str = field(default="", compare=False)  # the server's decoding, for display only
    versions: list[int] = field(default_factory=list)  # policy version of each id (generate; chat: none)
    batch: float = 0.0  # mean requests in flight on the worker over this one, itself included (the pool's)
    engine_batch: float = 0.0  # the engine's mean batch over the passes that sampled it (0: not reported; vLLM)


class EngineClient:
    """Talks to one worker at `base_url`; share one instance per worker, close it when done.

    HTTP through one aiohttp session per client (opened on first use, on the loop that uses it):
    the gateway sends every turn of every trajectory through here, and aiohttp's client costs
    about a fifth of httpx's CPU per request (benchmarks/engine_client_cpu.py)."""

    def __init__(self, base_url: str, model: str = DEFAULT_MODEL, timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, load_timeout_s: float = 600.0, key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.load_timeout_s = load_timeout_s
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._headers = headers(key)  # the engine key: of this process's workers unless `key` is given
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the session's

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, opened on the running loop (again if the last one was closed or is another
        loop's: a session belongs to the loop it was opened on)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout(self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), json_serialize=_compact)
        return self._session

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=self.connect_timeout_s)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None,
                       timeout: float | None) -> tuple[int, bytes]:
        """One request: (status, body bytes); unreachable or timed out is `EngineError`."""
        extra = {} if timeout is None else {"timeout": self._timeout(timeout)}
        try:
            async with self._http().request(method, self.base_url + path, json=body, **extra) as response:
                return response.status, await response.read()
        except asyncio.TimeoutError as error:
            raise EngineError(f"{self.base_url}{path} timed out ({type(error).__name__})") from error
        except aiohttp.ClientError as error:
            raise EngineError(f"{self.base_url}{path} unreachable: {error!r}") from error

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """POST JSON and return the decoded answer, mapping every failure to our errors."""
        status, content = await self._request("POST", path, body, timeout)
        if status >= 500:
            raise EngineError(f"{self.base_url}{path} failed ({status}): {_error_message(content)}")
        if status >= 400:
            raise EngineRequestError(f"{self.base_url}{path} rejected the request ({status}): "
                                     f"{_error_message(content)}")
        try:
            return json.loads(content)
        except ValueError as error:
            raise EngineError(f"{self.base_url}{path} answered non-JSON: {content[:200]!r}") from error

    async def get_text(self, path: str, timeout: float | None = None) -> str:
        """GET `path` as text (e.g. /metrics); a status >= 400 is `EngineError`."""
        status, content = await self._request("GET", path, None, timeout)
        if status >= 400:
            raise EngineError(f"{self.base_url}{path} failed ({status}): {_error_message(content)}")
        return content.decode("utf-8", "replace")

    async def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, stop_token_ids: list[int] | None = None,
                       seed: int | None = None) -> Generation:
        """Continue `prompt_ids` by at most `max_tokens` sampled tokens (temperature 0: greedy)."""
        if not prompt_ids:
            raise InvalidArgument("prompt_ids must not be empty")
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "stop_token_ids": list(stop_token_ids or []), "logprobs": 0, "detokenize": False}
        if seed is not None:
            sampling["seed"] = seed
        body = {"model": self.model, "token_ids": list(prompt_ids), "sampling_params": sampling,
                "output_mode": "tokens"}
        started = time.perf_counter()
        choice = _only_choice(await self._post(GENERATE_PATH, body))
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = None if content is None else [entry.get("logprob") for entry in content]
        generation = _generation(choice, logprobs, time.perf_counter() - started, "")
        return replace(generation, versions=token_versions(choice.get("weight_versions"), len(generation.token_ids)))

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 1.0,
                   top_p: float = 1.0, seed: int | None = None) -> Generation:
        """One chat turn through the server's chat template (ids and log-probs as in generate)."""
        body = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "logprobs": True, "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        started = time.perf_counter()
        choice = _only_choice(await self._post("/v1/chat/completions", body))
        content = (choice.get("logprobs") or {}).get("content") or []
        text = (choice.get("message") or {}).get("content") or ""
        return _generation(choice, [entry.get("logprob") for entry in content],
                           time.perf_counter() - started, text)

    async def load_weights(self, path: str, version: int) -> float:
        """Swap in the safetensors weight set in directory `path` (as the worker sees it) as
        `version`, without draining running requests (see the module docstring); return the seconds
        it took."""
        started = time.perf_counter()
        answer = await self._swap(LOAD_METHOD, [str(path), str(int(version))], version, self.load_timeout_s)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results or not all(isinstance(r, dict) for r in results):
            raise EngineError(f"{self.base_url} answered the weight load with {answer!r}")
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise WeightSetError(f"{self.base_url} could not load {path}: {errors[0]}")
        if any(r.get("version") != version for r in results):
            raise EngineError(f"{self.base_url} did not confirm version {version}: {answer!r}")
        return time.perf_counter() - started

    async def receive_weights(self, version: int, timeout_s: float) -> list[Any]:
        """Receive `version` from the weights group (the trainer sends it meanwhile), swapped in as
        `load_weights` swaps; every rank's answer ({"version", ...} or {"error"})."""
        answer = await self._swap(RECEIVE_METHOD, [int(version)], version, timeout_s)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise EngineError(f"{self.base_url} answered {RECEIVE_METHOD} with {answer!r}")
        return results

    async def receive_colocated(self, descriptor: str, version: int, timeout_s: float) -> list[Any]:
        """Take `version` from the trainer's export buffer on the worker's GPU (`descriptor`:
        libra/weights/ipc.py), swapped in as `load_weights` swaps; every rank's answer."""
        answer = await self._swap(COLOCATED_METHOD, [descriptor, int(version)], version, timeout_s)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise EngineError(f"{self.base_url} answered {COLOCATED_METHOD} with {answer!r}")
        return results

    async def _swap(self, method: str, args: list[Any], version: int, timeout_s: float) -> Any:
        """Pause, run the weight `method` on every rank, label the weights `version` if every rank
        holds it, resume; the method's answer. Stays paused when the method raised."""
        await self._post(PAUSE_PATH, {})
        answer = await self._post("/collective_rpc", {"method": method, "args": args, "timeout": timeout_s},
                                  timeout=timeout_s + 30)
        results = answer.get("results") if isinstance(answer, dict) else None
        held = bool(results) and all(isinstance(r, dict) and "error" not in r and r.get("version") == version
                                     for r in results)
        if held:
            await self._post("/update_weight_version", {"new_version": str(int(version))})
        if held or await self.health():  # refused before any weight moved (a half-written set is unhealthy)
            await self._post("/resume", {})
        return answer

    async def policy_version(self) -> int:
        """The policy version the worker's weights carry (the same on every rank)."""
        answer = await self._post("/collective_rpc", {"method": VERSION_METHOD})
        results = answer.get("results") if isinstance(answer, dict) else None
        try:  # the dev endpoint turns non-container results into strings
            versions = {int(r) for r in results}
        except (TypeError, ValueError) as error:
            raise EngineError(f"{self.base_url} answered a bad version: {answer!r}") from error
        if len(versions) != 1:
            raise EngineError(f"{self.base_url} ranks disagree on the version: {answer!r}")
        return versions.pop()

    async def health(self) -> bool:
        """True when the server answers /health with 200 (its engine is alive)."""
        try:
            return (await self._request("GET", "/health", None, 5.0))[0] == 200
        except EngineError:
            return False

    async def models(self) -> list[str]:
        """The model names the server serves."""
        try:
            return [entry["id"] for entry in json.loads(await self.get_text("/v1/models"))["data"]]
        except (ValueError, KeyError, TypeError) as error:
            raise EngineError(f"{self.base_url}/v1/models failed: {error!r}") from error


def token_versions(spans: Any, count: int) -> list[int]:
    """The policy version of each of `count` output tokens, from the engine's `weight_versions`
    (contiguous spans [{"version": label, "start", "end"}] over the output, labels set by Libra)."""
    versions: list[int] = []
    for span in spans or []:
        try:
            version, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError) as error:
            raise EngineError(f"the worker labelled tokens {span!r}, not with a policy version; its weights are "
                              f"labelled at start-up and by every load (POST /update_weight_version)") from error
        if start != len(versions) or end < start:
            raise EngineError(f"the worker's weight_versions are not contiguous over the output: {spans!r}")
        versions.extend([version] * (end - start))
    if len(versions) != count:
        raise EngineError(f"the worker reported versions for {len(versions)} of {count} tokens ({spans!r}); "
                          f"is it started with --enable-scale-out (vLLM) or by hf_server?")
    return versions


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _error_message(content: bytes) -> str:
    text = content.decode("utf-8", "replace")
    try:
        return str(json.loads(text).get("error", {}).get("message") or text[:500])
    except (ValueError, AttributeError):
        return text[:500]


def _only_choice(answer: Any) -> dict[str, Any]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise EngineError(f"the worker answered without choices: {str(answer)[:300]}")
    return choices[0]


def _generation(choice: dict[str, Any], logprobs: list[Any] | None, seconds: float,
                text: str) -> Generation:
    """Check a choice is a finished, token-exact generation and build it."""
    token_ids = choice.get("token_ids")
    reason = choice.get("finish_reason")
    if reason not in FINISH_REASONS:  # e.g. "abort": the engine dropped the request
        raise EngineError(f"generation ended with finish_reason={reason!r}")
    if token_ids is None or logprobs is None or len(token_ids) != len(logprobs):
        raise EngineError(f"worker returned {len(token_ids or [])} token ids and "
                          f"{len(logprobs or [])} log-probs; are return_token_ids/logprobs supported?")
    if any(lp is None for lp in logprobs):
        raise EngineError("worker returned a token without its log-prob")
    batch = choice.get("decode_batch")  # the hf engine's (vLLM reports none; anything but a positive number: none)
    engine_batch = float(batch) if isinstance(batch, (int, float)) and math.isfinite(batch) and batch > 0 else 0.0
    return Generation([int(t) for t in token_ids], [float(lp) for lp in logprobs], reason,
                      seconds, text, engine_batch=engine_batch)
