"""The wire rules of the OpenAI-compatible endpoint (openai_gateway.py): what a request must hold.

Body checks (messages, prompt, sampling fields), the append-only rule of a trajectory's record (a
request repeats what was recorded and adds to it), reading a JSON body and the JSON error body
``{"error": {"message", "type", "code"}}``. The checks raise `HttpError` (400); none of this knows
the rollout service, the agent runner, Redis or tokenizers.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from libra.workloads.base import ToolStatus

HEADER = "X-Libra-Trajectory"
ROLES = ("system", "user", "assistant", "tool")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str):
        super().__init__(message)
        self.status, self.kind = status, kind


def bad_request(message: str) -> HttpError:
    return HttpError(400, message, "invalid_request_error")


def check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"messages[{index}].role must be one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise bad_request(f"messages[{index}].content must be a string (tool_calls and content parts are not "
                              "supported: put the call in the content)")
        if message.get("libra_tool_status", "success") not in [s.value for s in ToolStatus]:
            raise bad_request(f"messages[{index}].libra_tool_status must be success, failure or timeout")
    return messages


def new_messages(record: list[dict[str, str]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages after the record; 400 when the request does not repeat the record exactly."""
    if len(messages) <= len(record):
        raise bad_request(f"messages must repeat the trajectory's {len(record)} recorded messages and add at least one")
    for index, (seen, sent) in enumerate(zip(record, messages)):
        if seen["role"] != sent["role"] or seen["content"] != sent["content"]:
            raise bad_request(f"messages[{index}] differs from the trajectory's record (a trajectory is append-only; "
                              "send earlier messages and assistant replies exactly as returned)")
    added = messages[len(record):]
    if any(m["role"] == "assistant" for m in added):
        raise bad_request("new messages must not include assistant messages: the model writes those")
    return added


def new_prompt(prompt: Any, record_ids: list[int], record_text: str) -> str | list[int]:
    """What a `/v1/completions` prompt adds to the record: token ids past `record_ids`, or text past
    `record_text`; 400 when it does not extend them."""
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if len(prompt) <= len(record_ids) or prompt[:len(record_ids)] != record_ids:
            raise bad_request(f"prompt token ids must extend the trajectory's {len(record_ids)} recorded ids")
        return list(prompt[len(record_ids):])
    if isinstance(prompt, str) and prompt:
        if len(prompt) <= len(record_text) or not prompt.startswith(record_text):
            raise bad_request("prompt must extend the trajectory's text so far (the earlier prompt plus "
                              "each completion exactly as returned)")
        return prompt[len(record_text):]
    raise bad_request("prompt must be a non-empty string or a list of token ids (one prompt)")


def requested_max_tokens(body: dict[str, Any], temperature: float, top_p: float, max_new_tokens: int) -> int:
    """The turn's requested token budget (`max_new_tokens` when none is asked); 400 for what the
    endpoint does not serve: streaming, n > 1, or sampling other than the rollout config's."""
    if body.get("stream"):
        raise bad_request("stream is not supported")
    if body.get("n", 1) != 1:
        raise bad_request("n must be 1 (a GRPO group is several trajectories, each claimed on its own)")
    for name, ours in (("temperature", temperature), ("top_p", top_p)):
        if body.get(name) is not None and float(body[name]) != ours:
            raise bad_request(f"{name} must be {ours} (rollout.{name}: behaviour log-probs must match the "
                              "trainer's) or left out")
    asked = body.get("max_completion_tokens", body.get("max_tokens")) or max_new_tokens
    if not isinstance(asked, int) or asked < 1:
        raise bad_request("max_tokens must be a positive integer")
    return asked


async def read_json(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
    """The request's body as a JSON object ({} for an empty body when `allow_empty`)."""
    raw = await request.read()
    if not raw and allow_empty:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise bad_request(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
