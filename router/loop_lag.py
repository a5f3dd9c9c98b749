"""How late the router's event loop wakes. A task asks to sleep TICK_S and records how much later
than that it woke: every stream on this router waits out such a pause (a garbage collection, a long
callback, a burst's admission) before its next token is written, so the histogram is what the
loop's own work costs the tokens it delivers — and its top bucket, the longest pause of a run."""

import asyncio
from collections.abc import Awaitable, Callable

TICK_S = 0.05  # 20 wake-ups a second: nothing beside the loop's work, fine enough for pauses of ms


async def watch(observe: Callable[[float], None], until_busy: Callable[[], Awaitable[None]] | None = None) -> None:
    """Forever: observe(seconds the loop woke late), every TICK_S. until_busy: awaited before each
    tick, returning once the router streams something (router/idle.py): an idle loop's pauses delay
    no token, and sampling them would wake an idle process 20 times a second."""
    loop = asyncio.get_running_loop()
    while True:
        if until_busy is not None:
            await until_busy()
        asked = loop.time() + TICK_S
        await asyncio.sleep(TICK_S)
        observe(max(0.0, loop.time() - asked))
