"""What a full garbage collection costs a router's event loop: before the direct channel a router
imported the workers' modules (torch, the engine: Ray loads an actor's class where its handle is
used, and routers preloaded them), after it imports neither. Each case in a fresh process.

    python -m pdserve.benchmarks.router_heap            # --json for the rows

Per case: the objects the collector tracks, and the pause of a full collection (gc.collect(),
the median of 5) before and after `pdserve.heap.settle` (gc.freeze: what lives for the process's
life is walked no more). A router process settles once it has started (router/server.py)."""

import argparse
import json
import subprocess
import sys

PROBE = """
import gc, json, sys, time
import pdserve.router.server, pdserve.router.grpc_server  # what a router imports
for m in sys.argv[1:]:
    __import__(m)
def pause():
    t = []
    for _ in range(5):
        t0 = time.perf_counter(); gc.collect(); t.append(time.perf_counter() - t0)
    return sorted(t)[2]
row = {"torch": "torch" in sys.modules, "objects": len(gc.get_objects()), "full_gc_ms": round(1000 * pause(), 3)}
from pdserve import heap
heap.settle()
row |= {"frozen": gc.get_freeze_count(), "objects_after_settle": len(gc.get_objects()),
        "full_gc_after_settle_ms": round(1000 * pause(), 3)}
print(json.dumps(row))
"""

BEFORE = ["pdserve.prefill.worker", "pdserve.decode.worker", "pdserve.worker.colocated"]  # the old preload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for case, modules in (("before: the workers' modules imported", BEFORE), ("after: router only", [])):
        out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, check=True)
        rows.append({"case": case, **json.loads(out.stdout.strip().splitlines()[-1])})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
