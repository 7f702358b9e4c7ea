"""The token check of Libra's HTTP servers (aiohttp): the OpenAI-compatible endpoint (the run's
token, like an OpenAI API key) and the transformers engine (the rollout service's engine key).

A request without `Authorization: Bearer TOKEN` gets 401 with an OpenAI-style error body and the
reason; the comparison is constant-time (`bearer_refusal`). Paths in `open_paths` (a liveness
probe) pass without it.
"""

from __future__ import annotations

from typing import Any, Iterable

from libra.security.credentials import bearer_refusal


def bearer_middleware(token: str, open_paths: Iterable[str] = ()) -> Any:
    """An aiohttp middleware that requires `token` on every path but `open_paths`."""
    from aiohttp import web

    exempt = frozenset(open_paths)

    @web.middleware
    async def require_token(request: web.Request, handler):
        if request.path not in exempt:
            refusal = bearer_refusal(request.headers.get("Authorization"), token)
            if refusal:
                return web.json_response({"error": {"message": refusal, "type": "authentication_error",
                                                    "code": 401}}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return require_token
