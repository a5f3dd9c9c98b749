"""Run a coroutine in its caller, at once, until it finishes or must wait.

A stream's direct write (http_stream's _DirectSSE) calls the ASGI `send` from plain code — the core's
`deliver` — where it cannot await. `send` waits only while the transport is paused (the client
reads slower than it is sent to); otherwise it finishes without ever suspending. So run it in the
caller, and only when it does suspend, hand the rest to a task (Python 3.12's eager tasks do this;
3.11 has none, and a Task costs more than the write it would carry)."""

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_now(coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run `coro` now; None when it finished without waiting (its result dropped, an exception it
    raised propagates here), else the task that finishes it."""
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coro, waiting_on))


async def _finish(coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
    """Resume `coro`, suspended on `waiting_on` (what it yielded: a future, or None for a bare yield),
    each time what it waits on is done, until it returns. The future's outcome is coro's to take:
    resumed, the coroutine reads the result or raises the exception itself."""
    try:
        while True:
            if waiting_on is None:
                await asyncio.sleep(0)
            elif not waiting_on.done():
                await asyncio.wait([waiting_on])
            try:
                waiting_on = coro.send(None)
            except StopIteration:
                return
    finally:
        coro.close()  # cancelled while it waits: it ends there (a no-op once it returned)
