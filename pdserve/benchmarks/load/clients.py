"""One rate's requests sent by several client processes (`pdserve bench --clients N`).

A client is one Python process on one event loop, and every streamed event costs it HTTP and JSON
parsing: near a hundred streams of fast tokens it runs at a whole core (`client_cpu` in the JSON
says so), and past that the figures — throughput, and the times it stamps on arrivals — are its
own limit, not the server's. With N processes the requests are dealt round-robin, each process
keeps its share of --max-concurrency, and all send at the run's common due times (from a start
instant shared by wall clock: they run on one machine). Records come back to the parent, which
summarizes them as one run."""

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from pdserve.benchmarks.load.client import Server, request_body, stream_request, stream_session
from pdserve.benchmarks.load.records import RequestRecord
from pdserve.benchmarks.load.workloads import Plan

START_AFTER_S = 1.0  # the processes start (spawn, imports) before the common start instant
JOIN_SLACK_S = 60.0  # past the requests' own timeout: a process that has not answered by then is stopped


async def send_all(session: aiohttp.ClientSession, server: Server, records: list[RequestRecord], plan: Plan,
                   concurrency: int | None, output_len: int, t0: float) -> None:
    """Each request at its due time (seconds after t0, a perf_counter instant) or, if it follows
    another (a session's next turn), think_s after that one ended, whichever is later; at most
    `concurrency` in flight (a request waiting for a slot is not timed: the wait is the client's)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    ended = [asyncio.Event() for _ in records]

    async def send(i: int) -> None:
        try:
            if (a := plan.after[i]) is not None:
                await ended[a].wait()
                await asyncio.sleep(plan.think_s)
            async with limit or contextlib.nullcontext():
                await stream_request(session, server, request_body(server, plan.prompts[i], output_len, plan.users[i]),
                                     records[i], t0)
        finally:
            ended[i].set()

    tasks = []
    try:
        for i in sorted(range(len(records)), key=plan.dues.__getitem__):
            await asyncio.sleep(max(0.0, t0 + plan.dues[i] - time.perf_counter()))
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class _Share:
    server: Server
    records: list[RequestRecord]
    plan: Plan
    concurrency: int | None
    output_len: int
    timeout_s: float


def _child(share: _Share, start_wall: float, counts, slot: int, conn) -> None:
    """One client process: its share of the requests from the common start; sends back (records, CPU s)."""
    async def run() -> None:
        async with stream_session(share.timeout_s) as session:
            await asyncio.sleep(max(0.0, start_wall - time.time()))
            t0 = time.perf_counter()
            watch = asyncio.create_task(_count(share.records, counts, slot))
            try:
                await send_all(session, share.server, share.records, share.plan, share.concurrency, share.output_len, t0)
            finally:
                watch.cancel()
                _publish(share.records, counts, slot)

    cpu0 = time.process_time()
    try:
        asyncio.run(run())
        conn.send((share.records, time.process_time() - cpu0))
    except BaseException as e:  # the parent reports it; nothing is lost silently
        conn.send(e if isinstance(e, Exception) else RuntimeError(repr(e)))
    finally:
        conn.close()


async def _count(records: list[RequestRecord], counts, slot: int) -> None:
    while True:
        _publish(records, counts, slot)
        await asyncio.sleep(0.5)


def _publish(records: list[RequestRecord], counts, slot: int) -> None:
    """This process's sent / done / failed into the shared counters the parent's progress line reads."""
    counts[3 * slot] = sum(r.start_s is not None for r in records)
    counts[3 * slot + 1] = sum(r.ok for r in records)
    counts[3 * slot + 2] = sum(r.finished and not r.ok for r in records)


class Clients:
    """N client processes for one run; `progress()` reads their counters while they run."""

    def __init__(self, n: int):
        self.n = n
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
        self.counts = self._ctx.Array("i", 3 * n, lock=False)

    def progress(self) -> tuple[int, int, int]:
        c = list(self.counts)
        return sum(c[0::3]), sum(c[1::3]), sum(c[2::3])

    async def run(self, server: Server, records: list[RequestRecord], plan: Plan,
                  concurrency: int | None, output_len: int, timeout_s: float) -> tuple[float, list[float]]:
        """Fill `records` (in place) -> (t0 as a perf_counter instant of this process, each process's CPU s).
        Raises if a process fails."""
        owners = plan.owners(self.n)
        shares, dealt = [], []
        for k in range(self.n):
            mine = [i for i in range(len(records)) if owners[i] == k]
            local = {i: j for j, i in enumerate(mine)}
            cap = None if not concurrency else concurrency // self.n + (k < concurrency % self.n)
            part = Plan([plan.prompts[i] for i in mine], [plan.dues[i] for i in mine],
                        [None if plan.after[i] is None else local[plan.after[i]] for i in mine],
                        [plan.users[i] for i in mine], plan.think_s)
            shares.append(_Share(server, [records[i] for i in mine], part, cap, output_len, timeout_s))
            dealt.append(mine)
        start_wall = time.time() + START_AFTER_S
        t0 = time.perf_counter() + START_AFTER_S
        procs, pipes = [], []
        for k, share in enumerate(shares):
            mine, theirs = self._ctx.Pipe(duplex=False)
            procs.append(self._ctx.Process(target=_child, args=(share, start_wall, self.counts, k, theirs), daemon=True))
            procs[-1].start()
            theirs.close()
            pipes.append(mine)
        # Every request ends within its timeout once sent; with a cap, they go in rounds.
        rounds = -(-len(records) // concurrency) if concurrency else 1
        # (a session's turns go one after another: each its own round)
        rounds += sum(a is not None for a in plan.after)
        deadline = time.monotonic() + START_AFTER_S + max(plan.dues, default=0.0) + timeout_s * rounds + JOIN_SLACK_S
        cpu: list[float] = []
        try:
            for k, pipe in enumerate(pipes):
                got = await asyncio.to_thread(_receive, pipe, deadline)
                if isinstance(got, Exception):
                    raise RuntimeError(f"bench client process {k + 1} of {self.n} failed: {got!r}") from got
                done, seconds = got
                for i, rec in zip(dealt[k], done):
                    records[i] = rec
                cpu.append(seconds)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return t0, cpu


def _receive(pipe, deadline: float):
    if not pipe.poll(max(0.0, deadline - time.monotonic())):
        return TimeoutError("no answer from the client process before its deadline")
    try:
        return pipe.recv()
    except EOFError:
        return RuntimeError("the client process ended without an answer (killed?)")
