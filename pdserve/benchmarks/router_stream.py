"""The router's own ceiling: streamed tokens per router CPU-second, at C concurrent streams.

    python -m pdserve.benchmarks.router_stream                 # --streams 128 512
    python -m pdserve.benchmarks.router_stream --streams 512 --max-tokens 512 --json
    python -m pdserve.benchmarks.router_stream --step-ms 10    # the source paced as a 10 ms decode step
    python -m pdserve.benchmarks.router_stream --routers 1 2 4 --workers 4 --clients 4   # router.replicas 1, 2, 4

The token source is synthetic on purpose. A real engine on this host would run out of CPU long
before the router does, and the figure would be the engine's; here one Ray actor, registered as a
colocated replica, makes one token per live request per step as fast as it can and streams them
through the real `RouterStreams` (pdserve/worker/router_streams.py) and the worker's real end of
the direct channel (ChannelServer), so everything from the worker's frame of a step's deltas to the
client's socket is the real path: the channel (`router.channel: direct`, a Unix socket on one
host; `--channel ray`: `Router.deliver` Ray calls), the router actor (pdserve.router.server.Router
over RouterCore), the OpenAI front end, uvicorn. The end-to-end
figure, with the real engine behind the router, is the serving benchmarks' (docs/benchmarks.md).

A client in a process of its own keeps C streaming /v1/completions requests open (a prompt of
--prompt-len token ids: 256 is `pdserve bench --input-len 256`'s, what a request's admission then
costs the router; ignore_eos, include_usage), each connection starting its next request as soon as one
ends, and counts tokens from each stream's usage chunk. The router's CPU time comes from
/proc/<pid>/stat over the measured run, so the figure is the router process's own, whatever else
shares the host. A router behind its source gets fewer, larger messages (RouterStreams holds what
a router has not taken yet, one delta per request): at its ceiling each stream wakes with several
tokens, and the `tokens/event` column says how many. With --step-ms the source steps at an
engine's pace instead; where the router keeps up, an event carries one token and the figure is the
router's cost per write.
"""

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import re
import time

import httpx
import ray

from pdserve.benchmarks.load import server_metrics
from pdserve.channel.worker_end import ChannelServer
from pdserve.config import ClusterConfig, ColocatedConfig, ModelConfig, RouterConfig
from pdserve.control import ray_start
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.messages import NewRequest, Refusal, ReplicaChange, ReplicaStats
from pdserve.worker.engine_loop import IDLE_S, EngineLoop
from pdserve.worker.inbox import Abort, Generate
from pdserve.worker.router_streams import HELD_S, RouterStreams

NAMESPACE = "pdserve-router-stream-bench"
# Token texts as a byte-level or BPE tokenizer would give them: mostly short words, now and then a
# character JSON must escape.
WORDS = [" the", " of", " stream", " and", "\n", " token", ",", " router", " \"a\"", " é"]


class SyntheticWorker:
    """What the router calls on a colocated replica (ready, stats, generate, abort), with a "step"
    that gives every live request its next token at once: no model, only the worker's streaming."""

    def __init__(self, name: str, namespace: str, max_ahead: int, step_s: float):
        self.name = name
        self.streams = RouterStreams(namespace)
        self.live: dict[str, list[int]] = {}  # request id -> [tokens made, tokens wanted]
        self.aborted = 0
        # As fast as it can (step_s 0), a step costs the source ~1 us a request, a real engine's
        # thousands of times more: it would finish every request before the router sent their
        # first tokens. So it stops `max_ahead` steps ahead of a router that has not taken its last
        # message. With step_s > 0 it steps at that pace, as an engine does, whatever the router does.
        self.max_ahead, self.step_s = max_ahead, step_s
        self._held_steps = 0
        self._next_step = 0.0
        self.loop = EngineLoop(self._step, self._take, f"{name}-engine")
        # The direct channel, as a real worker listens (EngineWorker._start_loop); no cluster token here.
        self.channel = ChannelServer(name, None, self._serve_channel, self.streams.router_gone,
                                     met=self.streams.router_back)
        self.streams.channel = self.channel

    def _serve_channel(self, kind: str, items: list, router: str):
        if kind == "abort":
            return self.abort(items)
        return self.generate(items, router)

    def channel_address(self) -> dict:
        return self.channel.address(ray.util.get_node_ip_address())

    def ready(self) -> bool:
        return self.loop.alive()

    def stats(self) -> ReplicaStats:
        return ReplicaStats(self.name, "colocated", len(self.live), 0, 1 << 20, 1 << 20, self.aborted,
                            pid=os.getpid())

    def generate(self, requests: list[NewRequest], router: str) -> list[Refusal | None]:
        for r in requests:
            self.loop.submit(Generate(r.request, router))
        return [None] * len(requests)

    def meet_router(self, router: str) -> None:
        self.streams.meet(router)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.loop.submit(Abort(rid))

    def _take(self, item) -> None:
        match item:
            case Generate():
                self.streams.add(item.request_id, item.router)
                self.live[item.request_id] = [0, item.request.params.max_tokens]
            case Abort() if self.streams.drop(item.request_id):
                self.live.pop(item.request_id, None)
                self.aborted += 1

    def _step(self) -> float | None:
        if not self.live:
            return self.streams.flush_nap(IDLE_S)
        now = time.monotonic()
        if now < self._next_step:  # paced: not yet
            return self.streams.flush_nap(self._next_step - now)
        if not self.step_s and self._held_steps >= self.max_ahead:
            if self.streams.flush():
                return HELD_S  # far enough ahead: until the router takes its message
            self._held_steps = 0
        self._next_step = now + self.step_s
        done = []
        for rid, state in self.live.items():
            n = state[0]
            state[0] = n + 1
            last = state[0] >= state[1]
            self.streams.output(RequestOutput(rid, [n % 256], WORDS[n % len(WORDS)], finished=last,
                                              finish_reason=FinishReason.LENGTH if last else None))
            if last:
                done.append(rid)
        for rid in done:
            del self.live[rid]
        self._held_steps = self._held_steps + 1 if self.streams.flush() else 0
        return None


# -- the client (a process of its own) ------------------------------------------------------------

_USAGE = re.compile(rb'"completion_tokens": ?(\d+)')
_END = b"\n\r\n0\r\n\r\n"  # the last event's chunk, then the chunked body's terminator


async def _one_connection(host: str, port: int, request: bytes, deadline: float, counts: list[int]) -> None:
    """Requests one after another on one keep-alive connection until `deadline`; counts[0] += tokens,
    counts[1] += requests, counts[2] += failures, counts[3] += events (every `data:` line)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.monotonic() < deadline:
            writer.write(request)
            tail, ok = b"", None
            while not tail.endswith(_END):
                data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the router closed the connection mid-response")
                ok = data.startswith(b"HTTP/1.1 200") if ok is None else ok
                counts[3] += data.count(b"data: ")
                tail = (tail + data)[-4096:]  # the usage chunk and the end are in the last bytes
            if not ok or b'"error"' in tail:
                counts[2] += 1
            match = _USAGE.findall(tail)
            counts[0] += int(match[-1]) if match else 0
            counts[1] += 1
    finally:
        writer.close()


async def _drive(url: str, streams: int, max_tokens: int, seconds: float, prompt_len: int) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny-moe", "prompt": list(range(1, prompt_len + 1)), "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    counts = [0, 0, 0, 0]
    t0 = time.monotonic()
    await asyncio.gather(*(_one_connection(host, int(port), request, t0 + seconds, counts)
                           for _ in range(streams)))
    return {"tokens": counts[0], "requests": counts[1], "failed": counts[2], "events": counts[3],
            "wall_s": time.monotonic() - t0}


def _client(url: str, streams: int, max_tokens: int, seconds: float, prompt_len: int, out) -> None:
    out.send(asyncio.run(_drive(url, streams, max_tokens, seconds, prompt_len)))


def drive(url: str, streams: int, max_tokens: int, seconds: float, clients: int = 1, prompt_len: int = 16) -> dict:
    """Run the client in processes of their own (the router's host has few cores: they must not
    share this one's GIL), the streams split over `clients` of them; returns their counts, added."""
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for i in range(clients):
        recv, send = ctx.Pipe(duplex=False)
        share = streams // clients + (i < streams % clients)
        procs.append(ctx.Process(target=_client, args=(url, share, max_tokens, seconds, prompt_len, send), daemon=True))
        pipes.append(recv)
        procs[-1].start()
    results = [r.recv() for r in pipes]
    for p in procs:
        p.join()
    total = {k: sum(r[k] for r in results) for k in ("tokens", "requests", "failed", "events")}
    return total | {"wall_s": max(r["wall_s"] for r in results)}


# -- the run ----------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(max_ahead: int, step_s: float, routers: int = 1, workers: int = 1,
          channel: str = "direct") -> tuple[list, str, list[int]]:
    """A local Ray, `workers` synthetic workers and `routers` real routers over them, sharing one
    port as `router.replicas` makes them -> (their handles, the URL, the routers' pids). Ray ends an
    actor once its creator's handles are gone: keep them. channel: `router.channel` (direct, ray)."""
    from pdserve.router.server import Router  # the router's process imports it too: here only for the class

    ray_start.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    names = [f"pdserve-colocated-{i}" for i in range(workers)]
    pool = [ray.remote(SyntheticWorker).options(name=n, num_cpus=0, max_concurrency=4).remote(
        n, NAMESPACE, max_ahead, step_s) for n in names]
    assert all(ray.get([w.ready.remote() for w in pool])), "a synthetic worker's loop did not start"
    cfg = ClusterConfig(model=ModelConfig(path="tiny-moe"), colocated=ColocatedConfig(replicas=workers),
                        router=RouterConfig(host="127.0.0.1", http_port=0, grpc_port=None, replicas=routers,
                                            channel=channel))
    colocated = [ReplicaChange("colocated", n, {n: w}) for n, w in zip(names, pool)]
    handles = [ray.remote(Router).options(name=f"pdserve-router-{i}", num_cpus=0).remote(
        f"pdserve-router-{i}", cfg, colocated, NAMESPACE) for i in range(routers)]
    shared = routers > 1  # as the controller starts them: the first claims a port, the others join it
    url = ray.get(handles[0].start.remote(shared))["http"]
    ray.get([h.start.remote(shared, int(url.rsplit(":", 1)[1])) for h in handles[1:]])
    pids = [ray.get(h.info.remote())["pid"] for h in handles]
    deadline = time.monotonic() + 30
    while not all(ray.get([h.__ray_call__.remote(lambda r: r.core.ready()) for h in handles])):  # first polls
        assert time.monotonic() < deadline, "a router never saw the synthetic worker"
        time.sleep(0.1)
    return [*pool, *handles], url, pids


def measure(url: str, pids: list[int], streams: int, max_tokens: int, seconds: float, clients: int,
            channel: str = "direct", prompt_len: int = 16) -> dict:
    drive(url, streams, 16, 1.0, clients, prompt_len)  # warm up: connections, the routers' first requests
    before = _scrape(url)
    cpu0 = sum(map(cpu_seconds, pids))
    res = drive(url, streams, max_tokens, seconds, clients, prompt_len)
    cpu = sum(map(cpu_seconds, pids)) - cpu0  # every router's
    # How late the router's loop woke over the run (its loop-lag histogram; one router: with several
    # the two scrapes may reach different ones, and then there is no figure).
    lag = server_metrics.means_ms(before, _scrape(url))
    return {"channel": channel, "routers": len(pids), "streams": streams, "max_tokens": max_tokens, "prompt_len": prompt_len, "requests": res["requests"], "failed": res["failed"],
            "tokens": res["tokens"], "wall_s": round(res["wall_s"], 2),
            # Events with output (not the usage chunk, not [DONE]): how many tokens one carried.
            "tokens_per_event": round(res["tokens"] / max(1, res["events"] - 2 * res["requests"]), 2),
            "tokens_per_s": round(res["tokens"] / res["wall_s"]),
            "router_cpu_pct": round(100 * cpu / res["wall_s"], 1),
            "tokens_per_router_cpu_s": round(res["tokens"] / cpu) if cpu else None,
            "loop_lag_p99_ms": lag.get("loop_lag p99<="), "loop_lag_max_ms": lag.get("loop_lag max<=")}


def _scrape(url: str) -> server_metrics.Scrape | None:
    try:
        return server_metrics.parse(httpx.get(f"{url}/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[128, 512], help="concurrent streams, one run each")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    ap.add_argument("--prompt-len", type=int, default=16,
                    help="prompt token ids per request (256: `pdserve bench --input-len 256`'s admission cost)")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of each measured run")
    ap.add_argument("--max-ahead", type=int, default=64,
                    help="steps the source runs ahead of a router that has not taken its last message")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="a step every this many ms, like an engine, whatever the router does (0: as fast as it can)")
    ap.add_argument("--routers", type=int, nargs="+", default=[1],
                    help="routers sharing the port (router.replicas), one run of every --streams each")
    ap.add_argument("--workers", type=int, default=1, help="synthetic workers (colocated replicas) behind the routers")
    ap.add_argument("--clients", type=int, default=1,
                    help="client processes the streams are split over (several routers outrun one client)")
    ap.add_argument("--channel", nargs="+", default=["direct"], choices=["direct", "ray"],
                    help="how tokens reach the router (router.channel), one run of everything each: "
                         "`--channel direct ray` gives Ray's figure as the same run's reference")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    rows = []
    for channel in args.channel:
        for n in args.routers:
            try:
                # (the actors are held: they live while it runs)
                _actors, url, pids = start(args.max_ahead, args.step_ms / 1000, n, args.workers, channel)
                rows += [measure(url, pids, c, args.max_tokens, args.seconds, args.clients, channel, args.prompt_len)
                         for c in args.streams]
            finally:
                ray.shutdown()
    if args.json:
        print(json.dumps({"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "rows": rows},
                         indent=2))
        return
    print(f"{'channel':>7} {'routers':>7} {'streams':>8} {'tokens/s':>10} {'router CPU %':>13} {'tokens/router CPU-s':>20} {'tokens/event':>13} "
          f"{'failed':>7} {'loop lag p99<= / max<= ms':>26}")
    for r in rows:
        print(f"{r['channel']:>7} {r['routers']:>7} {r['streams']:>8} {r['tokens_per_s']:>10} {r['router_cpu_pct']:>13} "
              f"{r['tokens_per_router_cpu_s']:>20} {r['tokens_per_event']:>13} {r['failed']:>7} "
              f"{str(r['loop_lag_p99_ms']) + ' / ' + str(r['loop_lag_max_ms']):>26}")


if __name__ == "__main__":
    main()
