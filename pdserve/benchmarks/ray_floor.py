"""The floor of the control plane's hops: what one Ray actor call costs a router, by itself.

    python -m pdserve.benchmarks.ray_floor                  # 400 messages each way, 20 ms apart
    python -m pdserve.benchmarks.ray_floor --batch 128 --json out.json

Issue 18 asks for a lone prompt's TTFT within 2 ms of the engine's prefill and for 50k streamed
tokens per router CPU-second at 128 streams. The design makes the control plane Ray actor calls: a
request reaches its worker in one (router -> worker), and its first token comes back in another
(worker -> router, one per engine step). This measures those two hops with nothing of pdserve in
them — an async actor standing for the router, a threaded actor standing for a worker, each call
carrying what pdserve's carries (a request of 4096 token ids; a step's deltas for --batch streams)
at an engine step's pace (--period-ms) — and, as the reference from the same run, the same
messages between the same two processes over a plain Unix socket (length-prefixed msgpack,
asyncio on the router side, a blocking socket on the worker's): what a channel outside Ray costs.

Per way and transport: the one-way latency (both ends stamp CLOCK_MONOTONIC: one host), p50 and
p90, and the router process's CPU per message (/proc/<pid>/stat over the run, every thread, less
its idle CPU measured first). Ray's other way, a streaming generator (one call whose yields are
the worker's per-step messages), is measured too.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import tempfile
import threading
import time

import msgpack
import ray

from pdserve.control import ray_start

PROMPT = list(range(4096))


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _deltas(batch: int) -> list[tuple]:
    # A step's RequestDelta-like tuples: request id, text, token ids, finish reason, error, logprobs.
    return [(f"cmpl-{i:032x}", " token", [1234], None, None, ()) for i in range(batch)]


def _frame(obj) -> bytes:
    data = msgpack.packb(obj)
    return struct.pack("!I", len(data)) + data


@ray.remote(max_concurrency=4)
class Worker:
    """Stands for a prefill/colocated/decode worker: takes requests, sends per-step messages."""

    def __init__(self, batch: int):
        self.deltas = _deltas(batch)
        self.arrivals: list[int] = []
        self.router = None
        self.sock: socket.socket | None = None

    def generate(self, sent_ns: int, requests) -> None:
        self.arrivals.append(time.monotonic_ns() - sent_ns)

    def take_arrivals(self) -> list[int]:
        out, self.arrivals = self.arrivals, []
        return out

    def set_router(self, router) -> None:
        self.router = router

    def deliver_calls(self, n: int, period_s: float) -> None:
        for _ in range(n):
            ray.get(self.router.deliver.remote(time.monotonic_ns(), self.deltas))  # one in flight, as RouterStreams
            time.sleep(period_s)

    def stream(self, n: int, period_s: float):
        for _ in range(n):
            yield time.monotonic_ns(), self.deltas
            time.sleep(period_s)

    # -- the same over a Unix socket ------------------------------------------------------------------

    def connect(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        f = self.sock.makefile("rb")
        while head := f.read(4):
            sent_ns, _ = msgpack.unpackb(f.read(struct.unpack("!I", head)[0]))
            self.arrivals.append(time.monotonic_ns() - sent_ns)

    def deliver_socket(self, n: int, period_s: float) -> None:
        for _ in range(n):
            self.sock.sendall(_frame([time.monotonic_ns(), self.deltas]))
            time.sleep(period_s)


@ray.remote
class Router:
    """Stands for the router: an async actor, its event loop taking deliveries."""

    def __init__(self):
        self.arrivals: list[int] = []
        self.writer = None

    def pid(self) -> int:
        return os.getpid()

    async def deliver(self, sent_ns: int, deltas) -> None:
        self.arrivals.append(time.monotonic_ns() - sent_ns)

    async def consume(self, worker, n: int, period_s: float) -> None:
        async for ref in worker.stream.options(num_returns="streaming").remote(n, period_s):
            sent_ns, _ = await ref
            self.arrivals.append(time.monotonic_ns() - sent_ns)

    async def send_calls(self, worker, n: int, period_s: float) -> None:
        for _ in range(n):
            worker.generate.remote(time.monotonic_ns(), [PROMPT])
            await asyncio.sleep(period_s)

    async def listen(self, path: str) -> None:
        accepted = asyncio.get_running_loop().create_future()

        async def on_client(reader, writer):
            self.writer = writer
            accepted.set_result(None)
            while True:
                try:
                    head = await reader.readexactly(4)
                except asyncio.IncompleteReadError:
                    return
                sent_ns, _ = msgpack.unpackb(await reader.readexactly(struct.unpack("!I", head)[0]))
                self.arrivals.append(time.monotonic_ns() - sent_ns)

        self.server = await asyncio.start_unix_server(on_client, path)
        self.accepted = accepted

    async def wait_accepted(self) -> None:
        await asyncio.wait_for(self.accepted, 30)

    async def send_socket(self, n: int, period_s: float) -> None:
        for _ in range(n):
            self.writer.write(_frame([time.monotonic_ns(), [PROMPT]]))
            await self.writer.drain()
            await asyncio.sleep(period_s)

    def take_arrivals(self) -> list[int]:
        out, self.arrivals = self.arrivals, []
        return out


def measure(n: int, period_s: float, batch: int) -> list[dict]:
    worker, router = Worker.remote(batch), Router.remote()
    pid = ray.get(router.pid.remote())
    ray.get(worker.set_router.remote(router))
    path = os.path.join(tempfile.mkdtemp(), "hop.sock")
    ray.get(router.listen.remote(path))
    ray.get(worker.connect.remote(path))
    ray.get(router.wait_accepted.remote())
    c0 = _cpu(pid)
    time.sleep(n * period_s)
    idle = (_cpu(pid) - c0) / (n * period_s)  # the router process's CPU per second doing nothing

    ways = [
        ("router -> worker", "Ray actor call", lambda: ray.get(router.send_calls.remote(worker, n, period_s)), worker),
        ("router -> worker", "Unix socket", lambda: ray.get(router.send_socket.remote(n, period_s)), worker),
        ("worker -> router", "Ray actor call", lambda: ray.get(worker.deliver_calls.remote(n, period_s)), router),
        ("worker -> router", "Ray streaming generator", lambda: ray.get(router.consume.remote(worker, n, period_s)), router),
        ("worker -> router", "Unix socket", lambda: ray.get(worker.deliver_socket.remote(n, period_s)), router),
    ]
    rows = []
    for way, transport, run, receiver in ways:
        run()  # warm: connections, first calls
        time.sleep(0.2)
        ray.get(receiver.take_arrivals.remote())
        c0, t0 = _cpu(pid), time.monotonic()
        run()
        time.sleep(0.2)  # the last arrivals
        wall, cpu = time.monotonic() - t0, _cpu(pid) - c0
        lat = sorted(x / 1e6 for x in ray.get(receiver.take_arrivals.remote()))
        rows.append({"way": way, "transport": transport, "messages": len(lat),
                     "p50_ms": round(statistics.median(lat), 3), "p90_ms": round(lat[int(0.9 * len(lat))], 3),
                     "router_cpu_ms_per_message": round(1e3 * max(0.0, cpu - idle * wall) / n, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=400, help="per way and transport")
    ap.add_argument("--period-ms", type=float, default=20.0, help="between messages: an engine step's pace")
    ap.add_argument("--batch", type=int, default=128, help="deltas per worker -> router message (streams)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    ray_start.init(include_dashboard=False, log_to_driver=False)
    rows = measure(a.messages, a.period_ms / 1e3, a.batch)
    print(f"{'way':17} {'transport':24} {'p50 ms':>7} {'p90 ms':>7} {'router CPU ms/msg':>18}")
    for r in rows:
        print(f"{r['way']:17} {r['transport']:24} {r['p50_ms']:7.3f} {r['p90_ms']:7.3f} {r['router_cpu_ms_per_message']:18.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
