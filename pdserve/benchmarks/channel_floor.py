"""The request hop on its own: a router's batched call to a worker and its answer, over the direct
channel (pdserve/channel/: the real frames, hello and both ends) against a Ray actor call to the
same worker process in the same run (the path before it, `router.channel: ray`).

    python -m pdserve.benchmarks.channel_floor                # 400 calls each, one 4096-token prompt each
    python -m pdserve.benchmarks.channel_floor --prompt 128 --json

The worker is a Ray actor answering as a prefill worker's `prefill` does (at once, one answer per
request), so what is measured is the hop: encoding, the transport, the worker's thread hand-off,
decoding — no engine. This process stands for the router (an asyncio loop; the channel over the
Unix socket, since both ends share the host). Per transport: the round trip p50 / p90 and this
process's CPU per call. Half the round trip is the hop to the worker on the path to a first token.
"""

import argparse
import asyncio
import datetime
import json
import os
import statistics
import time

import ray

from pdserve.channel.router_end import WorkerLink
from pdserve.channel.wire import PREFILL
from pdserve.channel.worker_end import ChannelServer
from pdserve.control import ray_start
from pdserve.messages import NewRequest, Request
from pdserve.protocol import SamplingParams

TOKEN = "channel-floor"


class Worker:
    """Answers `prefill` as a prefill worker does when it takes the request: at once, None each."""

    def __init__(self):
        self.channel = ChannelServer("floor-worker", TOKEN, lambda kind, items, router: self.prefill(items))

    def prefill(self, requests: list[NewRequest]) -> list[None]:
        return [None] * len(requests)

    def channel_address(self) -> dict:
        return self.channel.address(ray.util.get_node_ip_address())


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _run(worker, calls: int, prompt: int, period_s: float) -> list[dict]:
    request = [NewRequest(Request("cmpl-0", list(range(prompt)), SamplingParams(max_tokens=16)), handle=b"h" * 64)]

    async def locate():
        return await worker.channel_address.remote()

    link = WorkerLink("floor-router", "floor-worker", TOKEN, ray.util.get_node_ip_address(), locate,
                      lambda deltas: None, lambda worker, error: None)
    await link.open()
    rows = []
    for name, call in (("ray", lambda: worker.prefill.remote(request)), ("channel", lambda: link.call(PREFILL, request))):
        for _ in range(20):  # warm up
            await call()
        times, cpu0 = [], _cpu()
        for _ in range(calls):
            t0 = time.perf_counter()
            await call()
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(period_s)
        cpu = _cpu() - cpu0
        times.sort()
        rows.append({"transport": name, "calls": calls, "prompt_tokens": prompt,
                     "round_trip_p50_ms": round(1000 * statistics.median(times), 3),
                     "round_trip_p90_ms": round(1000 * times[int(0.9 * len(times))], 3),
                     "caller_cpu_per_call_ms": round(1000 * cpu / calls, 3)})
    link.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=4096, help="token ids in the request")
    ap.add_argument("--period-ms", type=float, default=5.0, help="pause between calls (an idle loop between)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ray_start.init(namespace="pdserve-channel-floor", include_dashboard=False, log_to_driver=False)
    try:
        worker = ray.remote(Worker).options(num_cpus=0, max_concurrency=4).remote()
        rows = asyncio.run(_run(worker, args.calls, args.prompt, args.period_ms / 1000))
    finally:
        ray.shutdown()
    ray_row = rows[0]
    for r in rows:
        r["vs_ray_p50"] = round(r["round_trip_p50_ms"] / ray_row["round_trip_p50_ms"], 3)
        r["vs_ray_cpu"] = round(r["caller_cpu_per_call_ms"] / ray_row["caller_cpu_per_call_ms"], 3)
    if args.json:
        print(json.dumps({"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "rows": rows}, indent=2))
        return
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
