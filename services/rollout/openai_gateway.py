"""The OpenAI-compatible endpoint: an external agent harness drives trajectories through Libra.

```
 harness ── POST /v1/libra/trajectories/claim ──▶ a queued trajectory (id, prompt text)
    │        POST /v1/chat/completions  (X-Libra-Trajectory: ID, or body libra_trajectory_id)
    │          new messages ─▶ masked tokens ─▶ scheduler Route ▸ worker ▸ ReportTurn ─▶ assistant tokens
    │          (tool messages also ─▶ ReportToolReturn: the scheduler's tool:size:status signature)
    └─────── POST /v1/libra/trajectories/ID/finish {"reward": r} ─▶ completed stream ─▶ trainer
```
The trajectory is kept in token ids, as for the built-in runner: a request's messages must repeat
the trajectory's record (earlier messages and the assistant replies exactly as returned) and add
new ones at the end; only the new messages are tokenized (each message's content is its own
segment, ``add_special_tokens`` on the first only), and are masked out of the loss. Assistant
tokens are the engine's ids with their log-probs and policy versions. `/v1/completions` works the
same way over a prompt string (which must extend the record's text) or token ids (which must extend
the record's ids). Sampling uses the rollout config's temperature/top-p, so the behaviour log-probs
are the ones the trainer expects; a request asking for others is refused (400).

Every request carries the run's token as an OpenAI API key (``Authorization: Bearer TOKEN``;
RUN_DIR/token under `libra up`), else 401. Errors are JSON ``{"error": {"message", "type"}}``: 400
a malformed body or a history that does not extend the record, 404 an unknown (or already
finished) trajectory, 503 no worker could serve the turn. While the endpoint is on, the built-in
runner plays nothing: every queued trajectory waits for a claim. A claimed trajectory not finished
within `claim_timeout_s` is recorded FAILED (its group is then dropped by the trainer, like any
failed group). What a harness has sent is held in memory: after a rollout restart, unfinished
trajectories are queued again and must be claimed afresh.

This module owns the endpoint's lifecycle and the external trajectories (claim, turns, finish);
what a request body must hold and the error body are openai_protocol.py's. Model turns go through
the agent runner's `model_turn`, results through its `fill_result`, so an external trajectory is
recorded exactly as a built-in one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from typing import Any

from aiohttp import web

from libra import log as liblog
from libra.errors import InvalidArgument, LibraError, NotFound, Unavailable
from libra.security import installed
from libra.security.http import bearer_middleware
from libra.services.rollout.agent import TOOL_STATUS_PB, AgentRunner, Playback
from libra.services.rollout.openai_protocol import (HEADER, HttpError, bad_request, check_messages, error_response,
                                                    new_messages, new_prompt, read_json, requested_max_tokens)
from libra.v1 import common_pb2
from libra.workloads.base import ToolStatus

_log = liblog.get("libra.rollout.openai")
T = common_pb2
MAX_CLAIM_WAIT_S = 30.0


@dataclasses.dataclass
class ExternalTrajectory:
    """A trajectory an external harness is driving: its proto, token record and message record."""

    trajectory: common_pb2.Trajectory
    claimed_at: float
    mode: str = ""  # "chat" or "completions", fixed by the first request
    state: Playback | None = None
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    text: str = ""  # completions mode: the record as text
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def turns(self) -> int:
        return self.state.turns if self.state else 0


class OpenAIGateway:
    """The HTTP endpoint and the external trajectories it holds (one per rollout service)."""

    def __init__(self, service):
        self.service, self.cfg = service, service.cfg.openai_endpoint
        self.trajectories: dict[str, ExternalTrajectory] = {}
        self.port = 0
        self._site_runner: web.AppRunner | None = None

    @property
    def runner(self) -> AgentRunner:
        return self.service.runner

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> "OpenAIGateway":
        security = installed()  # the run's token is this endpoint's API key (none: tests in one process)
        guard = [bearer_middleware(security.token)] if security is not None and security.token else []
        app = web.Application(client_max_size=8 * 1024 * 1024, middlewares=[*guard, self._errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/libra/trajectories/claim", self.claim)
        app.router.add_get("/v1/libra/trajectories/{trajectory_id}", self.describe)
        app.router.add_post("/v1/libra/trajectories/{trajectory_id}/finish", self.finish)
        self._site_runner = web.AppRunner(app, access_log=None)
        await self._site_runner.setup()
        site = web.TCPSite(self._site_runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        _log.info("openai endpoint listening", host=self.cfg.host, port=self.port)
        return self

    async def run(self) -> None:
        """Fail claimed trajectories that overran claim_timeout_s (runs as long as the service)."""
        while True:
            await asyncio.sleep(min(5.0, self.cfg.claim_timeout_s / 4))
            now = time.monotonic()
            for tid, external in list(self.trajectories.items()):
                if now - external.claimed_at > self.cfg.claim_timeout_s and not external.lock.locked():
                    await self._complete(tid, external, 0.0, f"not finished within claim_timeout_s "
                                                            f"({self.cfg.claim_timeout_s}s)")

    async def close(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except HttpError as error:
            return error_response(error.status, str(error), error.kind)
        except NotFound as error:
            return error_response(404, str(error), "not_found_error")
        except InvalidArgument as error:
            return error_response(400, str(error), "invalid_request_error")
        except (Unavailable, asyncio.TimeoutError) as error:
            return error_response(503, f"no worker could serve the turn: {error}", "service_unavailable")
        except LibraError as error:
            return error_response(500, str(error), "server_error")

    # -- claiming --------------------------------------------------------------------------------
    async def claim(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        count, wait_s = body.get("count", 1), body.get("wait_s", 0.0)
        if not isinstance(count, int) or not 1 <= count <= 1024:
            raise bad_request("count must be an integer in 1..1024")
        if not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_CLAIM_WAIT_S:
            raise bad_request(f"wait_s must be a number in 0..{MAX_CLAIM_WAIT_S}")
        if self.runner is None:
            raise HttpError(503, "rollout is still starting", "service_unavailable")
        claimed, deadline = [], time.monotonic() + float(wait_s)
        while len(claimed) < count:
            remaining = deadline - time.monotonic()
            try:  # wait (up to wait_s) for the first one only; then take what is queued
                tid = (await asyncio.wait_for(self.service.queue.get(), remaining) if remaining > 0 and not claimed
                       else self.service.queue.get_nowait())
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            self.service.queued.discard(tid)
            described = await self._take(tid)
            if described is not None:
                claimed.append(described)
        return web.json_response({"trajectories": claimed})

    async def _take(self, tid: str) -> dict[str, Any] | None:
        if tid in self.trajectories:
            return None
        traj = await self.service.store.start_trajectory(tid)  # RUNNING, in one round trip; None if final
        if traj is None:
            return None
        traj.started_at = time.time()  # stored with the result, as the gateway's own runner does
        external = self.trajectories[tid] = ExternalTrajectory(traj, time.monotonic())
        try:
            prompt = self.runner.workload.prompt(int(traj.prompt_id))
        except InvalidArgument as error:  # a bad dataset row fails its trajectory; the claim goes on
            await self._complete(tid, external, 0.0, str(error))
            return None
        meta = {k: v for k, v in prompt.meta.items() if isinstance(v, (str, int, float, bool))}
        return {"trajectory_id": tid, "group_id": traj.group_id, "prompt_id": traj.prompt_id,
                "sample_index": traj.sample_index, "prompt": prompt.text, "meta": meta,
                "messages": [{"role": "user", "content": prompt.text}]}

    def _external(self, request: web.Request, body: dict[str, Any]) -> tuple[str, ExternalTrajectory]:
        tid = request.headers.get(HEADER) or body.get("libra_trajectory_id")
        if not tid or not isinstance(tid, str):
            raise bad_request(f"name the trajectory in the {HEADER} header or the libra_trajectory_id field "
                              "(claim one at POST /v1/libra/trajectories/claim)")
        external = self.trajectories.get(tid)
        if external is None:
            raise HttpError(404, f"trajectory {tid!r} is not being driven here (claim it first; a finished or "
                                 "timed-out trajectory takes no more turns)", "not_found_error")
        return tid, external

    # -- model turns -----------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tid, external = self._external(request, body)
        messages = check_messages(body)
        async with external.lock:
            if external.mode not in ("", "chat"):
                raise bad_request("this trajectory is driven through /v1/completions; keep using it")
            added = new_messages(external.messages, messages)
            segments = [(m["content"], m) for m in added]
            outcome, text = await self._turn(tid, external, segments, body)
            external.mode = "chat"
            external.messages.extend({"role": m["role"], "content": m["content"]} for m in added)
            external.messages.append({"role": "assistant", "content": text})
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": outcome.finish_reason}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": self.runner.tokenizer.convert_ids_to_tokens(i), "logprob": lp, "bytes": None,
                 "top_logprobs": []} for i, lp in zip(outcome.token_ids, outcome.logprobs)]}
        return web.json_response(self._answer("chat.completion", choice, external, outcome))

    async def completions(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tid, external = self._external(request, body)
        prompt = body.get("prompt")
        async with external.lock:
            if external.mode not in ("", "completions"):
                raise bad_request("this trajectory is driven through /v1/chat/completions; keep using it")
            segments = [(new_prompt(prompt, external.state.ids if external.state else [], external.text), None)]
            outcome, text = await self._turn(tid, external, segments, body)
            external.mode = "completions"
            external.text = prompt + text if isinstance(prompt, str) else external.text
        choice = {"index": 0, "text": text, "finish_reason": outcome.finish_reason, "logprobs": None}
        return web.json_response(self._answer("text_completion", choice, external, outcome))

    async def _turn(self, tid: str, external: ExternalTrajectory, segments: list, body: dict[str, Any]):
        """Append the new segments (masked), then one routed model turn; returns (outcome, its text)."""
        cfg = self.service.cfg
        asked = requested_max_tokens(body, cfg.temperature, cfg.top_p, cfg.max_new_tokens)
        if external.turns >= cfg.max_turns:
            raise bad_request(f"the trajectory has used its {cfg.max_turns} turns (rollout.max_turns); finish it")
        ids = self._tokenize(external, segments)
        total = (len(external.state.ids) if external.state else 0) + len(ids)
        budget = min(asked, cfg.max_new_tokens, cfg.max_total_tokens - total)
        if budget < 1:
            raise bad_request(f"the trajectory would exceed rollout.max_total_tokens ({cfg.max_total_tokens}); finish it")
        before = (external.state, len(external.state.ids), len(external.state.mask),
                  len(external.state.events)) if external.state else (None, 0, 0, 0)
        await self._append(external, ids, segments)
        try:
            outcome = await self.runner.model_turn(external.trajectory, external.state, external.turns, budget)
        except BaseException:  # the turn did not happen: the record stays as it was, the harness may retry
            state, length, masked, events = before
            if state is not None:
                del state.ids[length:], state.mask[masked:], state.logprobs[masked:], state.versions[masked:]
                del state.events[events:]
            external.state = state
            raise
        text = self.runner.tokenizer.decode(outcome.token_ids, skip_special_tokens=True)
        return outcome, text

    def _tokenize(self, external: ExternalTrajectory, segments: list) -> list[list[int]]:
        tokenizer, first = self.runner.tokenizer, external.state is None
        pieces = []
        for index, (content, _) in enumerate(segments):
            if isinstance(content, list):
                pieces.append(content)
            else:
                pieces.append(list(tokenizer(content, add_special_tokens=first and index == 0).input_ids))
        return pieces

    async def _append(self, external: ExternalTrajectory, pieces: list[list[int]], segments: list) -> None:
        if external.state is None:  # the first request's messages are the prompt
            prompt = [i for piece in pieces for i in piece]
            external.state = Playback(ids=prompt, prompt_length=len(prompt))
            return
        state, tid = external.state, external.trajectory.trajectory_id
        version = state.versions[-1] if state.versions else 0
        for piece, (_, message) in zip(pieces, segments):
            state.append(piece, False, None, version)
            if message is not None and message["role"] == "tool":
                status = ToolStatus(message.get("libra_tool_status", "success"))
                tool = str(message.get("name") or "tool")
                state.events.append(common_pb2.ToolEvent(turn=state.turns - 1, tool=tool, status=TOOL_STATUS_PB[status],
                                                         payload_tokens=len(piece)))
                await self.runner.router.tool_returned(tid, tool, TOOL_STATUS_PB[status], len(piece))

    def _answer(self, kind: str, choice: dict, external: ExternalTrajectory, outcome) -> dict[str, Any]:
        prompt_tokens = len(external.state.ids) - len(outcome.token_ids)
        return {"id": f"libra-{uuid.uuid4().hex[:16]}", "object": kind, "created": int(time.time()),
                "model": "policy",
                "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(outcome.token_ids),
                          "total_tokens": len(external.state.ids)},
                "libra": {"trajectory_id": external.trajectory.trajectory_id, "token_ids": outcome.token_ids,
                          "logprobs": outcome.logprobs, "policy_version": outcome.version,
                          "worker_id": outcome.worker_id, "turn": external.turns}}

    # -- finishing -------------------------------------------------------------------------------
    async def finish(self, request: web.Request) -> web.Response:
        tid = request.match_info["trajectory_id"]
        body = await read_json(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise bad_request("reward must be a finite number")
        error = body.get("error", "")
        if not isinstance(error, str):
            raise bad_request("error must be a string (set it to record the trajectory as FAILED)")
        external = self.trajectories.get(tid)
        if external is None:
            raise HttpError(404, f"trajectory {tid!r} is not being driven here (unknown, never claimed, or already "
                                 "finished)", "not_found_error")
        async with external.lock:
            if not error and external.turns == 0:
                raise bad_request("the trajectory has no model turn yet; finish it after at least one completion "
                                  "(or send an error to record it as FAILED)")
            traj = await self._complete(tid, external, float(reward), error)
        return web.json_response({"trajectory_id": tid, "status": T.TrajectoryStatus.Name(traj.status)[18:],
                                  "reward": traj.reward, "turns": traj.turns, "tokens": len(traj.token_ids)})

    async def _complete(self, tid: str, external: ExternalTrajectory, reward: float, error: str):
        """Record the trajectory as the built-in runner does: hash + completed stream, scheduler told."""
        if self.trajectories.pop(tid, None) is None:
            return external.trajectory
        traj = external.trajectory
        if external.state is not None:
            AgentRunner.fill_result(traj, external.state, reward, "external")
        if error or external.state is None:
            traj.status, traj.error, traj.finished_at = T.TRAJECTORY_STATUS_FAILED, error or "no model turn", time.time()
            self.service.counters["failed"] += 1
            _log.warning("external trajectory failed", trajectory_id=tid, error=traj.error)
        else:
            self.service.counters["completed"] += 1
            self.service.rewards.append(traj.reward)
        await self.service.store.complete_trajectory(traj)
        await self.runner.router.finished(tid, traj.prompt_id, sum(traj.loss_mask), traj.status)
        return traj

    # -- reading ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "libra"}]})

    async def describe(self, request: web.Request) -> web.Response:
        tid = request.match_info["trajectory_id"]
        external = self.trajectories.get(tid)
        if external is None:
            raise HttpError(404, f"trajectory {tid!r} is not being driven here", "not_found_error")
        state = external.state
        return web.json_response({"trajectory_id": tid, "turns": external.turns, "mode": external.mode,
                                  "token_ids": list(state.ids) if state else [],
                                  "prompt_length": state.prompt_length if state else 0,
                                  "loss_mask": list(state.mask) if state else []})
