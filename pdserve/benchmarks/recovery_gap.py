"""What a user sees when a worker dies, on CPU: the time from a worker's SIGKILL to its replacement
serving, and the longest gap between two tokens of a stream that moved, against the longest gap of
the same streams undisturbed (the reference, measured in the same run).

    python -m pdserve.benchmarks.recovery_gap [--streams 16] [--max-tokens 160] [--cluster FILE]

It starts `pdserve up` (default: tiny-moe, 1 prefill + 1 decode, ports 0), runs the streams once
undisturbed, then again killing the decode worker once every stream is a quarter through, then
kills the prefill worker and times its replacement. Each killed run checks every stream's text
against the undisturbed one (greedy: they must be equal). Prints a table and one JSON line.
"""

import argparse
import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from pdserve.benchmarks.up_process import UpProcess


def pid_of(up: UpProcess, replica: str) -> int:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", up.ray_address()],
                         capture_output=True, text=True, timeout=120).stdout
    for line in out.splitlines():
        if line.startswith(f"{replica} (pid "):
            return int(line.split("(pid ", 1)[1].split(")", 1)[0])
    raise RuntimeError(f"{replica} not in `pdserve status`:\n{out}")


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, log: list) -> str:
    """One greedy stream; appends each event's arrival time to `log`."""
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                text.append(event["choices"][0]["text"])
                log.append(time.monotonic())
    return "".join(text)


async def run(url: str, prompts: list[str], max_tokens: int, kill=None) -> tuple[list[str], list[list[float]]]:
    """The streams at once -> (texts, each stream's event times). kill(): called once every stream
    has a quarter of its tokens."""
    logs: list[list[float]] = [[] for _ in prompts]
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(stream(client, url, p, max_tokens, log)) for p, log in zip(prompts, logs)]
        if kill is not None:
            while min(len(log) for log in logs) < max_tokens // 4:
                await asyncio.sleep(0.005)
            kill()
        texts = await asyncio.gather(*tasks)
    return texts, logs


def longest_gap(log: list[float]) -> float:
    return max(b - a for a, b in zip(log, log[1:]))


async def until_served(url: str, deadline_s: float = 300) -> float:
    """Seconds until a request is answered (it waits for a live replica itself, up to the router's
    replica_wait_s, so this also measures the replacement)."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        while time.monotonic() - t0 < deadline_s:
            r = await client.post(f"{url}/v1/completions",
                                  json={"model": "tiny-moe", "prompt": "probe", "max_tokens": 1})
            if r.status_code == 200:
                return time.monotonic() - t0
            await asyncio.sleep(0.05)
    raise RuntimeError("the replacement did not serve")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--cluster", type=Path, help="cluster.yaml (default: tiny-moe, 1 prefill + 1 decode, ports 0)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-recovery-"))
    path = args.cluster
    if path is None:
        path = tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": None}}))
    up = UpProcess(path, tmp / "pdserve-up.log")
    try:
        url = up.wait_healthy(None, 300, progress=lambda line: print(line, file=sys.stderr))
        prompts = [f"story {i}: once upon a time" for i in range(args.streams)]
        asyncio.run(run(url, prompts[:2], 8))  # warm up
        ref_texts, ref_logs = asyncio.run(run(url, prompts, args.max_tokens))
        ref_gaps = [longest_gap(log) for log in ref_logs]

        decode = pid_of(up, "pdserve-decode-0")
        killed_at = []
        texts, logs = asyncio.run(run(url, prompts, args.max_tokens,
                                      kill=lambda: (os.kill(decode, signal.SIGKILL), killed_at.append(time.monotonic()))))
        gaps = [longest_gap(log) for log in logs]
        # Each stream's first token after the kill came from the replacement (the streams moved there).
        resumed = [next(t for t in log if t > killed_at[0]) - killed_at[0] for log in logs]
        equal_decode = texts == ref_texts

        prefill = pid_of(up, "pdserve-prefill-0")
        os.kill(prefill, signal.SIGKILL)
        prefill_s = asyncio.run(until_served(url))
        texts2, _ = asyncio.run(run(url, prompts, args.max_tokens))
        equal_after = texts2 == ref_texts
    finally:
        code, _ = up.stop(60)
    gap = max(gaps)
    result = {
        "date": datetime.date.today().isoformat(), "streams": args.streams, "max_tokens": args.max_tokens,
        "undisturbed_longest_gap_ms": round(1000 * max(ref_gaps), 1),
        "moved_longest_gap_ms": round(1000 * gap, 1),
        "moved_gap_vs_undisturbed": round(gap / max(ref_gaps), 1),
        "moved_texts_equal": equal_decode,
        "decode_kill_to_streams_resumed_s": round(max(resumed), 2),  # the last stream's first token after the kill
        "prefill_kill_to_serving_s": round(prefill_s, 2),
        "texts_equal_after_both": equal_after, "up_exit": code,
    }
    print(f"{'what':<44}{'value':>12}")
    for k in ("undisturbed_longest_gap_ms", "moved_longest_gap_ms", "moved_gap_vs_undisturbed",
              "decode_kill_to_streams_resumed_s", "prefill_kill_to_serving_s", "moved_texts_equal", "texts_equal_after_both"):
        print(f"{k:<44}{str(result[k]):>12}")
    print(json.dumps(result))
    return 0 if equal_decode and equal_after else 1


if __name__ == "__main__":
    sys.exit(main())
