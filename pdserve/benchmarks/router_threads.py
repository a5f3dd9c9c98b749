"""Where a running router's CPU goes, by thread: each `ray::Router` process's threads' utime+stime
from /proc over a window, grouped by thread name (Ray's core-worker threads, its gRPC pollers, the
asyncio thread that serves HTTP and streams tokens: Ray names it ray::IDLE). Run beside a
`pdserve up`, idle or under a `pdserve bench`:

    python -m pdserve.benchmarks.router_threads --seconds 45 [--pid PID] [--json out.json]

Linux only (/proc). Sampling costs the router nothing: it reads its /proc files."""

import argparse
import json
import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def routers() -> list[int]:
    """The pids of this host's router processes (Ray titles an actor's process ray::<class>)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().split(b"\0", 1)[0].strip() == b"ray::Router":
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def measure(pid: int, seconds: float) -> dict:
    """The process's CPU over `seconds`, in all and by thread name (% of one core)."""
    before, t = thread_cpu(pid), time.monotonic()
    time.sleep(seconds)
    after, wall = thread_cpu(pid), time.monotonic() - t
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    total = sum(by_name.values())
    return {"pid": pid, "seconds": wall, "cpu_s": total, "core_pct": 100 * total / wall,
            "threads": {n: 100 * c / wall for n, c in sorted(by_name.items(), key=lambda x: -x[1]) if c > 0}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--pid", type=int, help="one router process (default: every ray::Router on this host)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    pids = [args.pid] if args.pid else routers()
    if not pids:
        raise SystemExit("no ray::Router process on this host")
    results = [measure(pid, args.seconds) for pid in pids]  # (one after another: a window each)
    for r in results:
        print(f"router pid {r['pid']}: {r['cpu_s']:.2f} CPU-s over {r['seconds']:.1f} s = "
              f"{r['core_pct']:.2f} % of a core")
        for name, pct in r["threads"].items():
            print(f"  {name:20s} {pct:6.2f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
