"""Calls from the trainer to rollout that wait out a restarting rollout instead of failing.

gRPC's retry policy (libra.rpc) covers a few seconds; a rollout gateway that was killed takes
longer to come back (its workers load the weights first) and answers UNAVAILABLE while it starts.
The trainer has nothing else to do meanwhile (no new trajectories come), so it waits: the same
request, with the same request id (a replay if the first attempt got through), with backoff, up
to PATIENCE_S. Past that the call fails and so does the trainer (its supervisor decides).
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

import grpc

from libra import log as liblog
from libra.rpc import Backoff

_log = liblog.get("libra.trainer")
T = TypeVar("T")
PATIENCE_S = 900.0
WAIT_OUT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def patient(call: Callable[[], Awaitable[T]], what: str, patience_s: float = PATIENCE_S) -> T:
    """`call()` until it succeeds, waiting out UNAVAILABLE and DEADLINE_EXCEEDED (backoff up to 10 s
    between tries); other errors, and the last one after `patience_s`, are raised."""
    backoff = Backoff(first_s=0.5, max_s=10.0, give_up_s=patience_s)
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() not in WAIT_OUT:
                raise
            if backoff.tries in (0, 5) or backoff.tries % 30 == 0:
                _log.warning("waiting for a peer to come back", call=what, code=error.code().name,
                             tries=backoff.tries + 1)
            try:
                await backoff.wait(what)
            except TimeoutError:
                raise error from None
