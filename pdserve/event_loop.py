"""The event loops pdserve makes itself (a worker's channel loop): uvloop's where it is installed,
as Ray's async actors take it for the routers' loops, and asyncio's otherwise or where
RAY_USE_UVLOOP=0 (Ray's own switch, so one variable turns it off in every process for a comparison).

uvloop's transports, timers and socket reads are C: on the router, where every token is one write of
one SSE event, it is ~10 % fewer router CPU-seconds a token (docs/benchmarks.md)."""

import asyncio
import os


def uvloop_wanted() -> bool:
    return os.environ.get("RAY_USE_UVLOOP", "1").strip().lower() not in ("0", "false", "no", "off")


def new_event_loop() -> asyncio.AbstractEventLoop:
    if uvloop_wanted():
        try:
            import uvloop
        except ImportError:  # (a dependency: a hand-made environment may lack it)
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
