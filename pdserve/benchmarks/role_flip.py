"""A role flip under load, timed as an operator sees it: `pdserve scale --role REPLICA=ROLE` on a
running `pdserve up` cluster while a steady Poisson load of streaming requests runs through the
OpenAI client, flipping a prefill replica to decode and back.

    python -m pdserve.benchmarks.role_flip CLUSTER.yaml --replica pdserve-prefill-1 --rate 4 \\
        --input-len 1024 --output-len 64 --json out.json

Prints, per flip, what the command itself says (the time from the command to serving in the new
role, and its drain / switch / KV-pair parts), and the TTFT p99 and the longest TTFT of the requests
sent while it ran against the steady window before the first flip (the reference, same run), and
the requests that failed. The cluster needs another replica of each role to stay serving (the
controller refuses to flip the only prefill or decode replica): 2 prefill + 1 decode, say.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import openai

from pdserve.benchmarks.load.steady import SteadyLoad, Window, numbers
from pdserve.benchmarks.up_process import UpProcess

FLIPPED = re.compile(r"flipped: (\S+) serves as (\S+) ([\d.]+) s after the command(.*)")


def summary(w: Window) -> dict:
    return {"sent": w.sent, "failed": w.failed, "ttft_p99_s": w.ttft_p99(), "ttft_max_s": w.ttft_max(),
            "errors": sorted(set(w.errors))[:3]}


def flip(address: str, replica: str, role: str, grace_s: float) -> tuple[float, float, str]:
    """(t0, t1, what the command printed) of `pdserve scale --role replica=role`."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "scale", "--role", f"{replica}={role}",
                        "--grace", str(grace_s), "--address", address], capture_output=True, text=True, timeout=300)
    t1 = time.monotonic()
    if r.returncode != 0:
        raise RuntimeError(f"`pdserve scale --role {replica}={role}` failed: {r.stderr.strip()[-500:]}")
    return t0, t1, r.stdout + r.stderr


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("--replica", default="pdserve-prefill-1", help="the prefill replica to flip to decode and back")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=1024, help="prompt words (about as many tokens)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steady-s", type=float, default=20.0, help="the reference window before the first flip")
    ap.add_argument("--settle-s", type=float, default=10.0, help="load between flips and after the last")
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--log", type=Path, default=Path("role-flip-up.log"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[role-flip] {msg}", file=sys.stderr, flush=True)

    up = UpProcess(a.config, a.log)
    try:
        url = up.wait_healthy(None, a.start_timeout, say)
        address = up.ray_address()
        model = openai.OpenAI(base_url=f"{url}/v1", api_key="-").models.list().data[0].id
        say(f"serving {model} at {url}; steady load {a.rate} req/s for {a.steady_s:.0f} s")
        load = SteadyLoad(url, a.rate, a.output_len, model=model, prompt=numbers(a.input_len))
        load.start()
        t_start = time.monotonic()
        time.sleep(a.steady_s)
        steady = summary(load.window(t_start, time.monotonic()))
        rows, name = [], a.replica
        for role in ("decode", "prefill"):
            t0, t1, said = flip(address, name, role, a.grace)
            m = FLIPPED.search(said)
            if m is None:
                raise RuntimeError(f"the flip did not say it was done: {said.strip()[-500:]}")
            name = m[2]
            time.sleep(a.settle_s)
            during = summary(load.window(t0, t1 + 1.0))
            rows.append({"flip": f"{m[1]} -> {m[2]}", "command_to_serving_s": float(m[3]), "parts": m[4].strip(),
                         "command_wall_s": t1 - t0, **during})
            say(f"{rows[-1]['flip']}: {m[3]} s after the command {m[4].strip()}")
        load.stop()
    finally:
        code, how = up.stop(60)
        say(f"cluster stopped ({how}, exit {code})")
    print(f"steady window: {steady['sent']} requests, TTFT p99 {steady['ttft_p99_s'] * 1e3:.0f} ms, "
          f"failed {steady['failed']}")
    print("| flip | command to serving | parts | requests during | failed | TTFT p99 during | ÷ steady p99 | longest TTFT |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['flip']} | {r['command_to_serving_s']:.2f} s | {r['parts']} | {r['sent']} | {r['failed']} | "
              f"{r['ttft_p99_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] / steady['ttft_p99_s']:.2f}× | "
              f"{r['ttft_max_s'] * 1e3:.0f} ms |")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "steady": steady,
                                      "flips": rows}, indent=1))


if __name__ == "__main__":
    main()
