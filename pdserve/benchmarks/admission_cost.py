"""Admission cost on the router's loop: router CPU per admitted request, and how long a burst
waits for its first events, on CPU.

    python -m pdserve.benchmarks.admission_cost                        # bursts of 256 and 512, both prompt kinds
    python -m pdserve.benchmarks.admission_cost --bursts 512 --kinds ids --json out.json
    python -m pdserve.benchmarks.admission_cost --tree /path/to/other/checkout --tree .   # A/B in one run
    python -m pdserve.benchmarks.admission_cost --callgrind /tmp/cg --repeats 2   # instructions (valgrind), not µs
    python -m pdserve.benchmarks.admission_cost --profile /tmp/router.prof   # cProfile of the router's loop
                                                  # (ADMISSION_PROFILE_CPU=1: by CPU time, not wall)

With `--rate inf` and equal output lengths a whole batch of requests ends in one engine step and
their successors reach the router as one burst; each is parsed, validated and handed off on the
router's one event loop, so the last of a burst waits for all the others (issue 18). This measures
that cost alone. The router runs in a process of its own, as in a cluster: the real OpenAI app
(`build_app`), served by uvicorn (httptools; the event loop Ray gives an async actor: uvloop where
installed, else asyncio's), over the real `RouterCore`
and its `HandOff` batching, behind which one synthetic colocated replica stands in for the Ray
actor: it answers each batched hand-off at once, delivers every request's first token with the
answer and its last after `--step-ms` (an engine step), through `RouterCore.deliver`. Ray's own cost
(pickling, the actor call) is not in the figure; everything the router's code does is.

The client, in this process, opens C keep-alive connections, then sends C streaming
/v1/completions requests at once (a burst; `ids`: 256 token ids (`--prompt-len`), as `pdserve bench` sends; `text`:
~256 characters, tokenized off the loop), reads each until its end, and repeats. The router's CPU
comes from /proc/<pid>/task/*/schedstat (nanoseconds, every thread of the process; the loop
thread's alone as `loop µs`) over the measured bursts, divided by the requests: the router
process's own, whatever else shares the host; `sys %` is the kernel's share of it (/proc/<pid>/stat:
the sockets' reads and writes). `first event p50/p99` is from the burst's send to each stream's
first `data:` byte; `last` to the latest one's, the burst's dispatch span. On a shared host the
CPU figures move by ±20 % from run to run: compare trees in one run (`--tree`, `--rounds`), or
count instructions with `--callgrind`, which no other load moves (the router then runs ~50×
slower under valgrind, and its timings are valgrind's).
"""

import argparse
import asyncio
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

MODEL = "tiny-moe"  # a preset: the byte tokenizer, no files
MAX_MODEL_LEN = 8192  # room for a 4096-token prompt (--prompt-len)
PROMPT_TOKENS = 256  # --prompt-len sets it
_END = b"\n\r\n0\r\n\r\n"  # the last event's chunk, then the chunked body's terminator
_WORDS = ["the", "router", "stream", "token", "of", "and", "a", "burst", "engine", "step", "é", "\"quoted\""]


# -- the router (a process of its own) -------------------------------------------------------------


class _Remote:
    """`handle.<method>.remote(...)` as a Ray actor handle offers it, answered in this loop."""

    def __init__(self, fn):
        self.remote = fn


class SyntheticReplica:
    """Stands in for a colocated worker's actor handle (generate, abort, stats): every batch of
    requests is answered at once with their first token, and their last token follows a step later."""

    def __init__(self, name: str, step_s: float):
        self.name, self.step_s = name, step_s
        self.core = None  # the RouterCore it delivers to, set once built
        self.generate = _Remote(self._generate)
        self.abort = _Remote(lambda request_ids: None)
        self.stats = _Remote(self._stats)

    def _generate(self, requests: list, router: str) -> asyncio.Future:
        from pdserve.messages import RequestDelta

        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        # (A tree from before 2026-11-28 hands the request's fields loose; since, the request whole.)
        ids = [r.request.request_id if hasattr(r, "request") else r.request_id for r in requests]

        def step() -> None:
            answer.set_result([None] * len(requests))
            self.core.deliver([RequestDelta(rid, " the", [1]) for rid in ids])
            loop.call_later(self.step_s, self.core.deliver, [RequestDelta(rid, " end", [2], "length") for rid in ids])

        loop.call_soon(step)
        return answer

    async def _stats(self):
        from pdserve.messages import ReplicaStats

        return ReplicaStats(self.name, "colocated", 0, 0, 1 << 20, 1 << 20, 0, pid=os.getpid())


def serve(step_s: float, loop_kind: str) -> None:
    """The router: the real app over a RouterCore whose one replica is synthetic. Prints `READY <port>`,
    then serves until SIGTERM; SIGUSR1 starts a cProfile of the process's loop, SIGUSR2 writes it
    to the path in $ADMISSION_PROFILE."""
    import uvicorn

    from pdserve.messages import ReplicaChange
    from pdserve.router.http_api import build_app
    from pdserve.router.listen import bind_listener
    from pdserve.router.metrics import Metrics
    from pdserve.tokenizer import load_tokenizer

    try:
        from pdserve.router.core import RouterCore
    except ImportError:  # a tree from before the router's split (2026-11-28)
        from pdserve.router.ray_core import RayCore as RouterCore

    async def main() -> None:
        replica = SyntheticReplica("pdserve-colocated-0", step_s)
        metrics = Metrics("bench-router")
        core = RouterCore("bench-router", MODEL, MAX_MODEL_LEN, load_tokenizer(MODEL),
                       [ReplicaChange("colocated", replica.name, {replica.name: replica})], "kv-aware", metrics)
        replica.core = core
        core.stats[replica.name] = await replica.stats.remote()  # live: what refresh_stats would find
        sock = bind_listener("127.0.0.1", 0, "router.http_port")
        try:
            from pdserve.router.server import http_config  # the router's own, where the tree has it
        except ImportError:
            def http_config(app):  # what Router.start built before it
                return uvicorn.Config(app, log_level="warning", lifespan="off")
        server = uvicorn.Server(http_config(build_app(core, metrics)))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        _profile_on_signals(asyncio.get_running_loop())
        try:  # what Router.start does last, where the tree has it (pdserve/heap.py; router/ before)
            from pdserve.heap import settle
        except ImportError:
            try:
                from pdserve.router.heap import settle
            except ImportError:
                settle = None
        if settle is not None:
            settle()
        print(f"READY {sock.getsockname()[1]}", flush=True)
        await task

    if loop_kind == "uvloop":
        import uvloop  # as Ray runs an async actor's loop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _profile_on_signals(loop: asyncio.AbstractEventLoop) -> None:
    import cProfile

    # By CPU time if asked: on a shared host a wall-clock profile charges other processes' turns to
    # whatever ran before them.
    cpu = os.environ.get("ADMISSION_PROFILE_CPU")  # (the CPU clock costs more a call: small functions look dearer)
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9) if cpu else cProfile.Profile()
    loop.add_signal_handler(signal.SIGUSR1, profiler.enable)

    def dump() -> None:
        profiler.disable()
        profiler.dump_stats(os.environ["ADMISSION_PROFILE"])
        print("PROFILED", flush=True)

    loop.add_signal_handler(signal.SIGUSR2, dump)


# -- the client --------------------------------------------------------------------------------------


def _request(kind: str, rng: random.Random, max_tokens: int) -> bytes:
    if kind == "ids":
        prompt: str | list[int] = [rng.randrange(3, 256) for _ in range(PROMPT_TOKENS)]
    else:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < PROMPT_TOKENS:
            words.append(rng.choice(_WORDS))
        prompt = " ".join(words)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def _response(reader: asyncio.StreamReader, t0: float) -> tuple[float | None, bool]:
    """Read one response -> (seconds from t0 to its first event, whether it was a 200 stream without error)."""
    head = await reader.readuntil(b"\r\n\r\n")
    ok = head.startswith(b"HTTP/1.1 200")
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:  # an error answer: a body of known length
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        return None, False
    first, tail = None, b""
    while not tail.endswith(_END):
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the router closed a connection mid-response")
        if first is None and b"data: " in data:
            first = time.perf_counter() - t0
        ok = ok and b'"error"' not in data
        tail = (tail + data)[-16:]
    return first, ok and first is not None


async def _burst(conns: list, requests: list[bytes]) -> tuple[list[float], int]:
    t0 = time.perf_counter()
    for (_, writer), req in zip(conns, requests):  # all sent before any answer is read
        writer.write(req)
    results = await asyncio.gather(*(_response(reader, t0) for reader, _ in conns))
    return [f for f, _ in results if f is not None], sum(not ok for _, ok in results)


def cpu_ns(pid: int) -> tuple[int, int]:
    """(every thread's, the main thread's) CPU time of a process so far, in ns (schedstat's first field)."""
    total = main = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += ns
        if int(task) == pid:
            main = ns
    return total, main


def user_sys_ticks(pid: int) -> tuple[int, int]:
    """User and system (kernel) CPU time of a process so far, in clock ticks (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def _measure(port: int, pid: int, kind: str, streams: int, repeats: int, max_tokens: int, seed: int,
                   profile: bool, callgrind: "Callgrind | None") -> dict:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(streams)]
    rng = random.Random(seed)
    try:
        await _burst(conns, [_request(kind, rng, max_tokens) for _ in range(streams)])  # warm-up
        bursts = [[_request(kind, rng, max_tokens) for _ in range(streams)] for _ in range(repeats)]
        firsts, lasts, failed = [], [], 0
        if profile:
            os.kill(pid, signal.SIGUSR1)
        if callgrind:
            callgrind.on(pid)
        cpu0, ticks0 = cpu_ns(pid), user_sys_ticks(pid)
        for requests in bursts:
            await asyncio.sleep(0.05)  # the router idle again: every burst starts alike
            got, bad = await _burst(conns, requests)
            firsts += got
            lasts.append(max(got, default=float("nan")))
            failed += bad
        cpu1, ticks1 = cpu_ns(pid), user_sys_ticks(pid)
        instructions = callgrind.off(pid) if callgrind else None
    finally:
        for _, writer in conns:
            writer.close()
    n = streams * repeats
    return {"kind": kind, "streams": streams, "requests": n, "failed": failed,
            "router_kinstr_per_request": round(instructions / 1e3 / n) if instructions else None,
            "router_cpu_us_per_request": round((cpu1[0] - cpu0[0]) / 1e3 / n, 1),
            "loop_cpu_us_per_request": round((cpu1[1] - cpu0[1]) / 1e3 / n, 1),
            # The kernel's share (the sockets' reads and writes): what no change to the router's code cuts.
            "sys_pct": round(100 * (ticks1[1] - ticks0[1]) / max(1, sum(ticks1) - sum(ticks0))),
            "first_event_p50_ms": round(1e3 * _pct(firsts, 50), 1),
            "first_event_p99_ms": round(1e3 * _pct(firsts, 99), 1),
            "last_first_event_ms": round(1e3 * _pct(lasts, 50), 1)}  # the median burst's span


class Callgrind:
    """The router under valgrind's callgrind, instrumented only while measured: the instructions it
    executes (every thread), a count that no other load on the host changes."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir).resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={self.out_dir}/callgrind.out.%p", f"--log-file={self.out_dir}/valgrind.%p.log"]

    def on(self, pid: int) -> None:
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)

    def off(self, pid: int) -> int:
        """Instructions since `on`: dumped (which zeroes the counts), then instrumentation off."""
        before = set(self.out_dir.glob(f"callgrind.out.{pid}*"))
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
        [dump] = set(self.out_dir.glob(f"callgrind.out.{pid}*")) - before
        for line in dump.read_text().splitlines():
            if line.startswith("totals:"):  # (a later part's `summary:` line can wrap around)
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {dump}")


def start_router(tree: str, step_ms: float, loop_kind: str, profile: str | None,
                 callgrind: Callgrind | None = None) -> tuple[subprocess.Popen, int]:
    """The router process serving from `tree` (a checkout: its pdserve and router/ are measured);
    this file runs there as a script, so an older checkout without it is measured all the same."""
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    if profile:
        env["ADMISSION_PROFILE"] = profile
    wrapper = callgrind.command() if callgrind else []
    proc = subprocess.Popen([*wrapper, sys.executable, os.path.abspath(__file__), "--serve", "--step-ms",
                             str(step_ms), "--loop", loop_kind], env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the router from {tree} did not start (it printed {line!r})")
    return proc, int(line.split()[1])


def stop_router(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_tree(tree: str, args) -> list[dict]:
    callgrind = Callgrind(args.callgrind) if args.callgrind else None
    proc, port = start_router(tree, args.step_ms, args.loop, args.profile, callgrind)
    rows = []
    try:
        for kind in args.kinds:
            for streams in args.bursts:
                profile = bool(args.profile) and (kind, streams) == (args.kinds[0], args.bursts[-1])
                row = _run_loop(_measure(port, proc.pid, kind, streams, args.repeats, args.max_tokens,
                                         args.seed, profile, callgrind))
                rows.append({"tree": tree} | row)
                if profile:
                    os.kill(proc.pid, signal.SIGUSR2)
                    while proc.stdout.readline().strip() != "PROFILED":
                        pass
    finally:
        stop_router(proc)
    return rows


def _run_loop(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _ray_loop() -> str:
    import importlib.util

    return "uvloop" if importlib.util.find_spec("uvloop") and os.environ.get("RAY_USE_UVLOOP", "1") not in ("0", "false") else "asyncio"


def _default_tree() -> str:
    import pdserve  # the checkout (or installed tree) this process imports

    return str(Path(pdserve.__file__).resolve().parent.parent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, nargs="+", default=[256, 512], help="concurrent requests per burst")
    ap.add_argument("--kinds", nargs="+", choices=["ids", "text"], default=["ids", "text"],
                    help="prompts: token ids, or text the router tokenizes")
    ap.add_argument("--repeats", type=int, default=5, help="measured bursts of each size (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=2, help="tokens per request: the first and the last")
    ap.add_argument("--step-ms", type=float, default=20.0, help="from a request's first token to its last")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default=_ray_loop(),
                    help="the router's event loop (default: the one Ray gives an async actor here: uvloop if "
                         "installed, which pdserve does not require, else asyncio's)")
    ap.add_argument("--tree", action="append", help="a checkout to serve the router from, one run each, in "
                    "this order (default: this one); give two for before/after in one run")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every tree, interleaved")
    ap.add_argument("--profile", help="write a cProfile of the router over the first kind's largest burst here")
    ap.add_argument("--callgrind", metavar="DIR", help="run the router under valgrind's callgrind (its files "
                    "here) and count its instructions per request: the figure a shared host does not move "
                    "(the timings are then valgrind's)")
    ap.add_argument("--json", help="write the rows here as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=256,
                    help="token ids (or characters) per prompt; 4096: a lone long prompt's share of the router")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the router process
    args = ap.parse_args()
    global PROMPT_TOKENS
    PROMPT_TOKENS = args.prompt_len
    if args.serve:
        return serve(args.step_ms / 1e3, args.loop)
    trees = args.tree or [_default_tree()]
    rows = [row for _ in range(args.rounds) for tree in trees for row in run_tree(tree, args)]
    counted = any(r["router_kinstr_per_request"] for r in rows)
    print(f"{'tree':<28} {'prompt':>6} {'burst':>6} {'router µs/req':>14} {'loop µs/req':>12} {'sys %':>6} "
          + (f"{'router kinstr/req':>18} " if counted else "")
          + f"{'first event p50':>16} {'p99':>8} {'last':>8} {'failed':>7}")
    for r in rows:
        print(f"{r['tree'][-28:]:<28} {r['kind']:>6} {r['streams']:>6} {r['router_cpu_us_per_request']:>14} "
              f"{r['loop_cpu_us_per_request']:>12} {r['sys_pct']:>6} "
              + (f"{r['router_kinstr_per_request']:>18} " if counted else "")
              + f"{r['first_event_p50_ms']:>13} ms {r['first_event_p99_ms']:>5} ms "
              f"{r['last_first_event_ms']:>5} ms {r['failed']:>7}")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
