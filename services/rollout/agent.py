"""The agent runner: plays one trajectory of a workload, one model turn at a time, in token ids.

```
 Route ──▶ worker.generate(ids) ──▶ ReportTurn ──▶ parse_turn ─┬─ answer ──▶ reward, done
   ▲            │ EngineError                                   └─ tool ──▶ call_tool ──▶ ReportToolReturn
   └── retry on another worker (exclude the failed one)                       │ tool tokens (mask 0)
   └──────────────────────────────────────────────────────────────────────────┘
```
Token ids are kept end to end: generated ids are appended as the engine returned them; tool
results are tokenized once, as their own segment, and masked out of the loss. Never decode and
re-tokenize the context. The runner knows nothing about Redis; the caller stores the result.

Each generated id carries the policy version the engine reports for it (a weight update in the
middle of a turn splits the turn: engines/client.py); tool tokens carry the version of the turn's
last id. No engine version may be older than the one the worker had acknowledged when the turn was
routed: a worker that says so mislabels its weights, and the turn is retried elsewhere.

The workload is driven through one `Episode` per trajectory (`workload.episode(prompt_id,
sample_index, seed, budget)`), which sets each turn's token budget and is closed in any case.
A tool call that overruns `tool_timeout_s` (plus a grace second for the tool's own clean-up) is
recorded as TIMEOUT; a prompt that cannot be built (a bad dataset row) fails the trajectory.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from libra.errors import FailedPrecondition, Unavailable
from libra.routing.policy import NO_WORKER
from libra.services.rollout.config import RolloutConfig
from libra.v1 import common_pb2
from libra.workloads.base import Episode, FinalAnswer, Malformed, ToolCall, ToolResult, ToolStatus, TurnBudget, Workload

TOOL_STATUS_PB = {ToolStatus.SUCCESS: common_pb2.TOOL_STATUS_SUCCESS, ToolStatus.FAILURE: common_pb2.TOOL_STATUS_FAILURE,
                  ToolStatus.TIMEOUT: common_pb2.TOOL_STATUS_TIMEOUT}


class Router(Protocol):
    """The scheduler, seen from the runner (a gRPC client in production, a fake in tests)."""

    async def route(self, trajectory_id: str, prompt_id: str, turn: int, prompt_tokens: int,
                    max_new_tokens: int, exclude: list[str]) -> Any: ...
    async def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int, seconds: float,
                        failed: bool) -> None: ...
    async def tool_returned(self, trajectory_id: str, tool: str, status: int, payload_tokens: int) -> None: ...
    async def finished(self, trajectory_id: str, prompt_id: str, output_tokens: int, status: int) -> None: ...


@dataclass
class TurnOutcome:
    token_ids: list[int]
    logprobs: list[float]
    version: int  # the version of the turn's last id (the newest weights that produced any of it)
    worker_id: str
    bucket: str
    finish_reason: str
    seconds: float
    retries: int
    versions: list[int] = field(default_factory=list)  # the policy version of each id
    batch: float = 0.0  # mean requests in flight on the worker over the turn, itself included (0: unknown)
    gap: float = 0.0  # the trajectory's seconds since its previous turn outside tool calls (0: not measured)
    trajectory_id: str = ""  # the trajectory it is a turn of
    number: int = 0  # its place in the trajectory, 1 for the first (0: unknown)
    route_s: float = 0.0  # seconds waiting for the scheduler's decision (the last attempt's), in the gap
    engine_batch: float = 0.0  # the engine's mean batch over the passes that sampled the turn (0: not reported)


@dataclass
class Playback:
    """Mutable state of one trajectory being played."""

    ids: list[int]
    prompt_length: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    events: list[common_pb2.ToolEvent] = field(default_factory=list)
    turns: int = 0
    retries: int = 0
    generated: int = 0
    # the time between turns outside tool calls (routing, reports, records, the gateway's queue):
    # `mark` is the monotonic instant up to which the trajectory's time is accounted (0: not measured,
    # an external harness's turns), `gap` what has accrued since the last turn
    mark: float = 0.0
    gap: float = 0.0

    def append(self, ids: list[int], trained: bool, logprobs: list[float] | None, version: int | list[int]) -> None:
        """Append a segment; `version`: one per id (generated ids), or one for all (tool, harness tokens)."""
        versions = [version] * len(ids) if isinstance(version, int) else list(version)
        assert len(versions) == len(ids), "one policy version per token"
        self.ids.extend(ids)
        self.mask.extend([1 if trained else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions)


def turn_seed(seed: int, trajectory_id: str, turn: int) -> int:
    """Deterministic per (run seed, trajectory, turn) sampling seed."""
    digest = hashlib.blake2b(f"{seed}:{trajectory_id}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def episode_seed(seed: int, trajectory_id: str) -> int:
    """Deterministic per trajectory: a trajectory id names its group (hence its prompt) and sample."""
    return turn_seed(seed, trajectory_id, -1)


def token_versions(generation: Any, acknowledged: int) -> list[int]:
    """The policy version of each id of `generation` as its engine reported it, checked: one per id,
    none older than `acknowledged` (the version the worker held when the turn was routed)."""
    versions = list(generation.versions)
    if len(versions) != len(generation.token_ids) or not versions:
        raise Unavailable(f"the worker reported {len(versions)} policy versions for {len(generation.token_ids)} ids")
    if min(versions) < acknowledged:
        raise Unavailable(f"the worker stamped ids with v{min(versions)} after acknowledging v{acknowledged}: "
                          f"its weights are mislabelled")
    return versions


TOOL_GRACE_S = 1.0
"""Time a tool gets past `tool_timeout_s` to report its own TIMEOUT before the runner cuts it off."""


GenerateFn = Callable[[Any, list[int], int, int], Awaitable[Any]]


class AgentRunner:
    """Plays trajectories of one workload over routed workers."""

    def __init__(self, workload: Workload, tokenizer: Any, router: Router, generate: GenerateFn,
                 version_of: Callable[[str], int], config: RolloutConfig, stop_ids: list[int], seed: int):
        self.workload, self.tokenizer, self.router = workload, tokenizer, router
        self.generate, self.version_of = generate, version_of
        self.config, self.stop_ids, self.seed = config, stop_ids, seed
        self.on_turn: Callable[[TurnOutcome, int], Awaitable[None]] | None = None

    async def play(self, trajectory: common_pb2.Trajectory, taken_at: float | None = None) -> common_pb2.Trajectory:
        """Run the trajectory to an answer, a budget or the turn limit; fill in the result fields.
        `taken_at`: the monotonic instant a runner took it from the gateway's queue (the first turn's
        gap counts from there; its wait in the queue is not a gap but the runners' limit,
        `max_concurrent_trajectories`, which the simulator plays as such).
        Each turn is recorded (`on_turn`) with its gap; an answering turn after the reward, its gap
        then including the time from its reply to the trajectory's end."""
        trajectory.started_at = time.time()
        begun = time.monotonic() if taken_at is None else min(taken_at, time.monotonic())
        limits = TurnBudget(self.config.max_turns, self.config.max_new_tokens, self.config.max_total_tokens)
        episode = self.workload.episode(int(trajectory.prompt_id), trajectory.sample_index,
                                        episode_seed(self.seed, trajectory.trajectory_id), limits)
        try:
            ids = list(self.tokenizer(episode.prompt.text, add_special_tokens=True).input_ids)
            state = Playback(ids=ids, prompt_length=len(ids), mark=begun)
            answer, finish, last = None, "max_turns", None
            for turn in range(episode.budget.max_turns):
                budget = episode.max_new_tokens(turn, len(state.ids))
                if budget <= 0:
                    finish = "budget"
                    break
                outcome = await self.model_turn(trajectory, state, turn, budget, record=False)
                action = episode.parse_turn(self.tokenizer.decode(outcome.token_ids, skip_special_tokens=False))
                if isinstance(action, FinalAnswer):
                    answer, finish, last = action, "answer", outcome
                    break
                await self._record(outcome, state)
                await self._tool_turn(trajectory, state, turn, action, outcome.version, episode)
            try:
                reward = episode.reward(answer)
                if asyncio.iscoroutine(reward):  # workloads that score by running code (sandboxed tests)
                    reward = await reward
            finally:  # the answer's record (also when scoring failed), its gap with the tail (parse, reward)
                if last is not None:
                    if state.mark:
                        last.gap += time.monotonic() - state.mark
                    await self._record(last, state)
        finally:
            await episode.close()
        return self.fill_result(trajectory, state, reward, finish)

    async def model_turn(self, trajectory, state: Playback, turn: int, budget: int,
                         record: bool = True) -> TurnOutcome:
        """One routed model turn of at most `budget` tokens on `state`'s ids, retried on another worker
        when one is unavailable; the tokens are appended to `state` (trained), the scheduler told and,
        with `record`, the turn recorded (`on_turn`). `play` and the OpenAI gateway (an external
        harness's turns) both generate through it."""
        exclude: list[str] = []
        for attempt in range(self.config.turn_retries + 1):
            asked = time.monotonic()
            decision = await self._route(trajectory, turn, len(state.ids), budget, exclude)
            started = time.monotonic()
            try:  # a worker this gateway does not know (any more) is Unavailable too: retried elsewhere
                acknowledged = self.version_of(decision.worker_id)
                generation = await self.generate(decision, state.ids, budget,
                                                 turn_seed(self.seed, trajectory.trajectory_id, turn))
                versions = token_versions(generation, acknowledged)
            except Unavailable:
                await self.router.turn_done(trajectory.trajectory_id, decision.worker_id, 0,
                                            time.monotonic() - started, True)
                exclude.append(decision.worker_id)
                state.retries += 1
                continue
            seconds = time.monotonic() - started
            gap = state.gap + (started - state.mark) if state.mark else 0.0
            state.mark, state.gap = (started + seconds, 0.0) if state.mark else (0.0, 0.0)
            await self.router.turn_done(trajectory.trajectory_id, decision.worker_id, len(generation.token_ids),
                                        seconds, False)
            outcome = TurnOutcome(list(generation.token_ids), list(generation.logprobs), versions[-1],
                                  decision.worker_id, decision.bucket, generation.finish_reason, seconds, attempt,
                                  versions, generation.batch, gap, trajectory.trajectory_id, turn + 1,
                                  started - asked, generation.engine_batch)
            state.append(outcome.token_ids, True, outcome.logprobs, versions)
            state.turns += 1
            state.generated += len(outcome.token_ids)
            if record:
                await self._record(outcome, state)
            return outcome
        raise Unavailable(f"turn {turn} of {trajectory.trajectory_id} failed on {len(exclude)} workers: {exclude}")

    async def _record(self, outcome: TurnOutcome, state: Playback) -> None:
        if self.on_turn is not None:
            await self.on_turn(outcome, len(state.ids))

    async def _route(self, trajectory, turn: int, prompt_tokens: int, budget: int, exclude: list[str]):
        """The scheduler's decision; while no worker serves at all (a plan is restarting them), ask
        again with backoff for up to `no_worker_wait_s` instead of failing the trajectory."""
        deadline, pause = time.monotonic() + self.config.no_worker_wait_s, 0.2
        while True:
            try:
                return await self.router.route(trajectory.trajectory_id, trajectory.prompt_id, turn, prompt_tokens,
                                               budget, exclude)
            except FailedPrecondition as error:
                if NO_WORKER not in str(error) or exclude or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)

    async def _tool_turn(self, trajectory, state: Playback, turn: int, action, version: int,
                         episode: Episode) -> None:
        started = time.monotonic()
        if state.mark:
            state.gap += started - state.mark
        if isinstance(action, ToolCall):
            timeout_s = self.config.tool_timeout_s
            try:
                result = await asyncio.wait_for(episode.call_tool(action, timeout_s), timeout_s + TOOL_GRACE_S)
            except asyncio.TimeoutError:
                result = ToolResult(tool=action.tool, status=ToolStatus.TIMEOUT, payload="timed out")
        else:
            reason = action.reason if isinstance(action, Malformed) else "unrecognised turn"
            result = ToolResult(tool="format", status=ToolStatus.FAILURE, payload=reason)
        tool_ids = list(self.tokenizer(episode.render_tool_result(result), add_special_tokens=False).input_ids)
        state.append(tool_ids, False, None, version)
        status = TOOL_STATUS_PB[ToolStatus(result.status)]
        state.events.append(common_pb2.ToolEvent(turn=turn, tool=result.tool, status=status,
                                                 payload_tokens=len(tool_ids), seconds=time.monotonic() - started))
        if state.mark:
            state.mark = started + state.events[-1].seconds
        await self.router.tool_returned(trajectory.trajectory_id, result.tool, status, len(tool_ids))

    @staticmethod
    def fill_result(trajectory, state: Playback, reward: float, finish: str) -> common_pb2.Trajectory:
        """Write the played `state`, `reward` and `finish` reason into `trajectory`, marked COMPLETED."""
        trajectory.prompt_length = state.prompt_length
        del trajectory.token_ids[:], trajectory.loss_mask[:], trajectory.logprobs[:], trajectory.versions[:]
        del trajectory.tool_events[:]
        trajectory.token_ids.extend(state.ids)
        trajectory.loss_mask.extend(state.mask)
        trajectory.logprobs.extend(state.logprobs)
        trajectory.versions.extend(state.versions)
        trajectory.tool_events.extend(state.events)
        trajectory.reward, trajectory.turns, trajectory.finish_reason = reward, state.turns, finish
        trajectory.finished_at = time.time()
        trajectory.status = common_pb2.TRAJECTORY_STATUS_COMPLETED
        return trajectory
