"""The engine key: only the rollout service that started a worker may call it.

```
 rollout service ── process_key() (random, in memory) ─┬─ LIBRA_ENGINE_KEY in the worker's environment
                                                        └─ EngineClient: Authorization: Bearer KEY
 vLLM server:  --middleware ...engine_auth.EngineKeyMiddleware (every path but /health)
 hf server:    libra.security.http.bearer_middleware(key, open_paths=("/health",))
```
vLLM's own `--api-key` guards only `/v1`…; its development endpoints (`/collective_rpc`, `/pause`,
`/sleep`, `/reset_prefix_cache`, …, on with `VLLM_SERVER_DEV_MODE=1`, which weight updates need)
would stay open, so the key is checked by this ASGI middleware on every path. The key is not the
run's token: holding the token (an operator, another service) does not reach a worker's weight
endpoints. It lives in the rollout process and its workers' environment, never in a file or on a
command line. A restarted rollout service makes a new key; its old workers died with it.

Runs in: the rollout gateway process (the key, the client's header) and each engine server process
(the middleware). Knows nothing of workloads or gRPC.
"""

from __future__ import annotations

import functools
import os
import secrets
from typing import Any

from libra.security.credentials import bearer_refusal

SERVED_MODEL_NAME = "policy"  # what every engine serves the policy as (vLLM's and hf_server): readiness asks for it
KEY_ENV = "LIBRA_ENGINE_KEY"
OPEN_PATHS = ("/health",)  # liveness only: says nothing, changes nothing


@functools.cache
def process_key() -> str:
    """This process's engine key (a new one per process)."""
    return secrets.token_urlsafe(32)


def headers(key: str | None = None) -> dict[str, str]:
    """The header that reaches an engine started by this process (or one holding `key`)."""
    return {"Authorization": f"Bearer {key or process_key()}"}


def key_from_environment() -> str:
    """The key an engine server was started with; refusing to serve without one."""
    key = os.environ.get(KEY_ENV, "")
    if len(key) < 16:
        raise SystemExit(f"{KEY_ENV} is not set (or too short): engine servers are started by the rollout "
                         f"service, which sets it; they do not serve without it")
    return key


class EngineKeyMiddleware:
    """ASGI middleware for vLLM's server (`--middleware`): 401 unless the request carries the key."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.key = key_from_environment()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        refusal = bearer_refusal(header, self.key)
        if not refusal:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": {"message": "engine key required", "type": "authentication_error", "code": 401}}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
